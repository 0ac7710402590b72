"""The fix loop's names, in one place. `quantize fix V` (pipeline/stages/fix.py) builds `V-mixed` for a W4A16
variant V of params.yaml (method awq, gptq or rtn: the `mixed` method's bases, pipeline/methods/mixed.py): V's own
settings with its most sensitive groups kept in 8 bits. V-mixed is no params.yaml variant, yet it is evaluated and
decided like one: dvc.yaml's fix stage lists V (its foreach), the kl and evaluate stages list V-mixed (checked at
load: pipeline/settings/checks.py), the report reads results/V-mixed, and V-mixed runs the suites V runs
(`suites.<name>.models` naming V covers V-mixed too, unless it names V-mixed itself).
"""

from __future__ import annotations

from pipeline.errors import UserError

SUFFIX = "-mixed"


def fix_methods() -> tuple[str, ...]:
    """The methods a fix takes: the W4A16 methods the `mixed` method starts from."""
    from pipeline import methods

    return tuple(methods.method("mixed").BASES)


def fix_name(variant: str) -> str:
    """The variant `quantize fix` builds for `variant`: models/<variant>-mixed."""
    return f"{variant}{SUFFIX}"


def fixable(params) -> list[str]:
    """The variants of params.yaml a fix takes (W4A16: awq, gptq, rtn), in its order."""
    return [name for name, v in params.variants.items() if v.method in fix_methods()]


def models(params) -> list[str]:
    """Every model a run decides: base, the variants of params.yaml, and the fix of each variant params.yaml
    `fix.variants` names."""
    return ["base", *params.variants, *(fix_name(v) for v in params.fix.variants if fix_name(v) not in params.variants)]


def runs_on(listed: list[str] | None, model: str) -> bool:
    """Whether a suite whose `models` is `listed` (None: every model) runs on `model`: a fix (V-mixed) runs what V
    runs unless it is named itself. By the name alone: the evaluate stage reads no `variants` key for it."""
    if listed is None or model in listed:
        return True
    return model.endswith(SUFFIX) and model.removesuffix(SUFFIX) in listed


def variant_settings(params, variant: str):
    """The params.yaml section of the W4A16 variant to fix; any other is refused, naming the methods a fix takes."""
    if variant not in params.variants:
        names = fixable(params)
        raise UserError(f"params.yaml: variants.{variant}: no such variant; a fix takes a W4A16 variant of "
                        f"params.yaml (method {', '.join(fix_methods())}): {', '.join(names) or 'none defined'}")
    settings = params.variants[variant]
    if settings.method not in fix_methods():
        names = fixable(params)
        raise UserError(f"params.yaml: variants.{variant} is a {settings.method} variant; a fix keeps groups of a W4A16 "
                        f"variant in 8 bits, so it takes method {', '.join(fix_methods())}: "
                        f"{', '.join(names) or 'none in params.yaml'}")
    return settings  # (a variant of params.yaml named like its fix: refused at load, when dvc.yaml's fix stage lists it)
