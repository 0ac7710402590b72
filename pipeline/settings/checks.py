"""params.yaml checked against the other files it must agree with: dvc.yaml (the eval matrices and
foreach lists repeat params' names), the base checkpoint (group size vs layer widths), and its own
cross-references (margins and suites' models name suites and variants that exist).

Called by pipeline.settings.params.load once the file has validated; `params` is a pipeline.settings.params.Params.
"""

from __future__ import annotations

from pathlib import Path

from pipeline import safe_yaml
from pipeline.errors import UserError, cut
from pipeline.settings import fixes
from pipeline.settings.errors import kind_of

DEFAULT_PARAMS = Path("params.yaml")


# keys of earlier params.yaml layouts and where they went: refused with that, never taken silently
MOVED_KEYS = {
    ("verdict", "default_margin"): "verdict.margins.accuracy",
    ("verdict", "perplexity_margin"): "verdict.margins.perplexity",
    ("verdict", "perplexity_margins"): "verdict.margins.suites",
    ("verdict", "kl_sequences"): "kl.sequences",
    ("verdict", "kl_max_tokens"): "kl.max_tokens",
    ("judge", "margin"): "verdict.margins.judge",
}


def check_moved_keys(raw: dict, path: Path, lines: dict[tuple, int]) -> None:
    """A key an earlier layout of params.yaml had: one message saying where it went."""
    for (section, key), new in MOVED_KEYS.items():
        if isinstance(raw.get(section), dict) and key in raw[section]:
            line = lines.get((section, key))
            raise UserError(f"{path}{f':{line}' if line else ''}: {section}.{key}: this setting moved: write it as "
                            f"{new} (same meaning and value)")


def check_margins_name_suites(params, path: Path, lines: dict[tuple, int]) -> None:
    """A margin for a suite params.yaml does not define is a typo that would leave the default in force."""
    for suite in params.verdict.margins.suites:
        if suite not in params.suites:
            line = lines.get(("verdict", "margins", "suites", suite))
            raise UserError(f"{path}{f':{line}' if line else ''}: verdict.margins.suites.{suite}: no such suite "
                            f"(defined: {', '.join(params.suites) or 'none'}); fix the name or remove it")


def check_suite_models(params, path: Path | str = DEFAULT_PARAMS) -> None:
    """`suites.<name>.models` names base and variants that exist (or a W4A16 variant's fix, V-mixed: it runs what V
    runs unless named itself), base among them (the pairing needs it)."""
    known = fixes.models(params)
    for name, suite in params.suites.items():
        if suite.models is None:
            continue
        unknown = [m for m in suite.models if m not in known]
        if unknown:
            raise UserError(f"{path}: suites.{name}.models: {unknown} not among base, the variants and their fixes "
                            f"({', '.join(known)}); fix the names or drop them")
        if "base" not in suite.models:
            raise UserError(f"{path}: suites.{name}.models: must include base (every variant is compared with it)")


def check_against_dvc(params, dvc_file: Path) -> None:
    """DVC's foreach and matrix take lists only, so dvc.yaml repeats the variant and suite names: keep them in
    step. The evaluate stage (`quantize eval models/${item}`, one per model) lists base and every variant and
    every suite's results; a stage with a `matrix` of `model` x `suite` (`quantize eval ... --suite`, an
    earlier layout) must, with the others, run each suite on exactly the models params.yaml names for it
    (`suites.<name>.models`, else base and every variant). The fix stage (`quantize fix ${item}`) lists W4A16
    variants of params.yaml; each one's fix (V-mixed) is then a model of the run, which the kl and evaluate
    stages list."""
    if not dvc_file.exists():
        return
    data, lines = safe_yaml.load(dvc_file, "a dvc.yaml")
    stages = _dvc_stages(dvc_file, data, lines)
    models = ["base", *params.variants, *_check_fix_stages(params, dvc_file, stages)]
    for name, stage in stages.items():  # a stage run on some variants only names them (judge in the CPU demo)
        listed_variants = stage.get("foreach") if isinstance(stage, dict) else None
        if isinstance(listed_variants, list) and not runs_command(stage, "fix"):
            unknown = [v for v in listed_variants if not isinstance(v, str) or v not in models]  # bench runs on base too
            if unknown:
                raise UserError(f"{dvc_file}: stages.{name}.foreach lists {unknown}, which params.yaml does not "
                                f"define as base or variants, nor dvc.yaml's fix stage builds ({', '.join(models)}); "
                                "remove them")
    per_model = {name: stage for name, stage in stages.items() if evaluates_every_suite(stage)}
    for name, stage in per_model.items():
        _check_per_model_stage(params, dvc_file, name, stage, models)
    matrices = {name: stage["matrix"] for name, stage in stages.items()
                if isinstance(stage, dict) and isinstance(stage.get("matrix"), dict)
                and {"model", "suite"} & set(stage["matrix"])}
    if not matrices:
        return
    listed: dict[str, set[str]] = {}
    where: dict[str, list[str]] = {}
    for name, matrix in matrices.items():
        for key in ("model", "suite"):
            names = matrix.get(key)
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise UserError(f"{dvc_file}: stages.{name}.matrix.{key} lists {cut(str(names), 200)}; give a list of "
                                f"{'model dir names (base and variants)' if key == 'model' else 'suite names'}")
        for suite in matrix["suite"]:
            listed.setdefault(suite, set()).update(matrix["model"])
            where.setdefault(suite, []).append(f"stages.{name}.matrix")
    for suite in sorted(set(listed) - set(params.suites)):
        raise UserError(f"{dvc_file}: {', '.join(where[suite])} lists suite {suite!r}, which params.yaml does not "
                        f"define (suites: {', '.join(params.suites) or 'none'}); remove it or add it under suites")
    for suite, settings in params.suites.items():
        expected = [model for model in models if fixes.runs_on(settings.models, model)]
        if listed.get(suite, set()) != set(expected):
            stage = where.get(suite, ["stages.evaluate.matrix"])[0]
            raise UserError(
                f"{dvc_file}: suite {suite!r} runs on {sorted(listed.get(suite, set()))} in the eval matrices, but "
                f"params.yaml asks for {expected}; set {stage}.model to [{', '.join(expected)}] "
                "(a matrix runs every model on every suite it lists: suites run on different models go in separate stages)"
            )


def runs_command(stage, subcommand: str) -> bool:
    """A `foreach` stage whose command is `quantize <subcommand> ...`."""
    do = stage.get("do") if isinstance(stage, dict) else None
    cmd = do.get("cmd") if isinstance(do, dict) else None
    return "foreach" in stage and isinstance(cmd, str) and cmd.split()[:2] == ["quantize", subcommand]


def evaluates_every_suite(stage) -> bool:
    """A `foreach` stage whose command is `quantize eval models/${item}` without --suite: every suite of
    params.yaml on each model it lists (the evaluate stage)."""
    return runs_command(stage, "eval") and isinstance(stage.get("foreach"), list) and "--suite" not in stage["do"]["cmd"].split()


def fix_items(stages: dict) -> list[str]:
    """The variants dvc.yaml's fix stages (`quantize fix ${item}`) list, in order."""
    return [item for stage in stages.values() if isinstance(stage, dict) and runs_command(stage, "fix")
            and isinstance(stage.get("foreach"), list) for item in stage["foreach"]]


def ranks(stage) -> bool:
    """A `foreach` stage whose command is `quantize kl models/${item} --rank` (the rank stage)."""
    return runs_command(stage, "kl") and "--rank" in stage["do"]["cmd"].split()


def _check_fix_stages(params, dvc_file: Path, stages: dict) -> list[str]:
    """Each variant a fix stage lists is a W4A16 variant of params.yaml whose fix (V-mixed) no params.yaml variant
    is named after and whose ranking (results/V/sensitivity.json) a rank stage measures (`quantize kl --rank`), and
    each fix is in the kl and evaluate stages' lists; returns the fixes (V-mixed)."""
    fixable, built = fixes.fixable(params), []
    ranked = [item for stage in stages.values() if isinstance(stage, dict) and ranks(stage)
              and isinstance(stage.get("foreach"), list) for item in stage["foreach"]]
    for name, stage in stages.items():
        if not runs_command(stage, "fix"):
            continue
        listed = stage.get("foreach")
        if not isinstance(listed, list):
            raise UserError(f"{dvc_file}: stages.{name}.foreach: give a list of the W4A16 variants to fix, e.g. "
                            f"[{', '.join(fixable[:1]) or 'rtn-w4a16'}]")
        for item in listed:
            if not isinstance(item, str) or item not in fixable:
                what = (f"a {params.variants[item].method} variant" if isinstance(item, str) and item in params.variants
                        else "no variant of params.yaml")
                raise UserError(f"{dvc_file}: stages.{name}.foreach lists {item!r}, {what}; a fix takes a W4A16 "
                                f"variant (method {', '.join(fixes.fix_methods())}): {', '.join(fixable) or 'none in params.yaml'}")
            if fixes.fix_name(item) in params.variants:
                raise UserError(f"{dvc_file}: stages.{name}.foreach lists {item}, whose fix {fixes.fix_name(item)} is "
                                "also a variant of params.yaml; rename that variant or drop the fix")
            if item not in ranked:
                raise UserError(f"{dvc_file}: stages.{name}.foreach lists {item}, whose groups no stage ranks (the fix "
                                f"reads results/{item}/sensitivity.json): list {item} in the rank stage, `cmd: quantize "
                                "kl models/${item} --rank` (and take it out of the plain kl stage's list)")
        built += [fixes.fix_name(item) for item in listed if fixes.fix_name(item) not in built]
    named = list(params.fix.variants)
    if sorted(fix_items(stages)) != sorted(named):
        raise UserError(f"{dvc_file}: the fix stage lists [{', '.join(fix_items(stages))}] and params.yaml fix.variants "
                        f"[{', '.join(named)}]: they name the same variants (`quantize profile --fix VARIANT` and "
                        "`--unfix VARIANT` edit both); make them agree")
    for name, stage in stages.items():
        if (runs_command(stage, "kl") and not ranks(stage)) or evaluates_every_suite(stage):
            listed = stage.get("foreach") if isinstance(stage.get("foreach"), list) else []
            missing = [model for model in built if model not in listed]
            if missing:
                raise UserError(f"{dvc_file}: stages.{name}.foreach does not list {', '.join(missing)}, which the fix "
                                f"stage builds; list it there (an explicit list; `quantize profile --fix VARIANT` adds "
                                "a fix to every list) so it is measured and decided like every variant")
    return built


def _check_per_model_stage(params, dvc_file: Path, name: str, stage: dict, models: list[str]) -> None:
    """The evaluate stage runs on base, every variant and every fix, and lists each suite's results as its outs
    (the suites a model does not run are recorded as not run, so every model has every file)."""
    listed = stage["foreach"]
    if sorted(map(str, listed)) != sorted(models):
        raise UserError(f"{dvc_file}: stages.{name}.foreach lists {listed}; it evaluates every model: write "
                        f"[{', '.join(models)}] (base, the variants of params.yaml and the fixes of the fix stage)")
    outs = stage["do"].get("outs") or []
    paths = {next(iter(o)) if isinstance(o, dict) and o else o for o in outs}
    found = {Path(str(path)).stem for path in paths if str(path).startswith("results/${item}/")}
    missing = [suite for suite in params.suites if f"results/${{item}}/{suite}.jsonl" not in paths
               or f"results/${{item}}/{suite}.json" not in paths]
    if missing:
        raise UserError(f"{dvc_file}: stages.{name}.do.outs: no results/${{item}}/<suite>.jsonl and .json for "
                        f"{', '.join(missing)}; add both (persist: true; the .json with cache: false) for every suite "
                        "of params.yaml")
    stale = sorted(found - set(params.suites))
    if stale:
        raise UserError(f"{dvc_file}: stages.{name}.do.outs lists results of {', '.join(stale)}, which params.yaml "
                        f"does not define (suites: {', '.join(params.suites) or 'none'}); remove them")


def _dvc_stages(dvc_file: Path, data, lines: dict[tuple, int]) -> dict:
    """dvc.yaml's stages; a shape DVC would not run (stages or a stage not a mapping, a matrix not a
    mapping of lists, a foreach neither a list nor a mapping) is refused with its line and the fix."""
    def at(*key) -> str:
        line = lines.get(tuple(str(k) for k in key))
        return f"{dvc_file}:{line}" if line else str(dvc_file)

    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{dvc_file}:1: the top level is {kind_of(data)}; a dvc.yaml is a mapping holding `stages:`")
    stages = data.get("stages")
    if stages is None:
        return {}
    if not isinstance(stages, dict):
        raise UserError(f"{at('stages')}: stages: is {kind_of(stages)}; it must map each stage's name to its cmd, deps "
                        "and outs, as in the project's dvc.yaml")
    for name, stage in stages.items():
        if not isinstance(stage, dict):
            raise UserError(f"{at('stages', name)}: stages.{name}: is {kind_of(stage)}; a stage is a mapping (cmd, deps, "
                            "outs; or foreach/matrix with do)")
        matrix = stage.get("matrix")
        if "matrix" in stage and not (isinstance(matrix, dict) and matrix):
            raise UserError(f"{at('stages', name, 'matrix')}: stages.{name}.matrix: is {kind_of(matrix)}; DVC's matrix "
                            "maps each name to its list of values, e.g. `model: [base, awq-w4a16]` and `suite: [math]`")
        for key, values in (matrix or {}).items():
            if not (isinstance(values, list) or (isinstance(values, str) and values.startswith("${"))):
                raise UserError(f"{at('stages', name, 'matrix', key)}: stages.{name}.matrix.{key}: is {kind_of(values)}; "
                                "give a list of values (or a ${...} reference to one in params.yaml)")
        foreach = stage.get("foreach")
        if "foreach" in stage and not (isinstance(foreach, (list, dict)) or (isinstance(foreach, str) and foreach.startswith("${"))):
            raise UserError(f"{at('stages', name, 'foreach')}: stages.{name}.foreach: is {kind_of(foreach)}; give a list, "
                            "a mapping, or a ${...} reference to one in params.yaml")
    return stages


def check_against_model(params, path: Path | str = DEFAULT_PARAMS, lines: dict[tuple, int] | None = None) -> None:
    """Checks that need the base checkpoint (group size vs layer widths), when it exists and its config.json
    reads (a broken checkpoint is the stage's to refuse, with its own message)."""
    from pipeline.checkpoints import checkpoint, config_json
    from pipeline.methods.int4 import group_size_problem

    if not config_json.present(params.model.base_dir):
        return
    try:
        config = checkpoint.open(params.model.base_dir).config
    except UserError:  # the stage that reads the checkpoint names the problem and the fix
        return
    if config_json.hidden_size(config) is None:
        return
    for name, variant in params.variants.items():
        if getattr(variant, "group_size", "auto") != "auto":  # the int4 methods (pipeline/methods/int4.py)
            try:
                problem = group_size_problem(config, variant.group_size, params.model.base_dir)
            except (KeyError, TypeError, AttributeError, ValueError, ZeroDivisionError):
                return
            if problem:
                line = (lines or {}).get(("variants", name, "group_size"))
                raise UserError(f"{path}{f':{line}' if line else ''}: variants.{name}.group_size: {problem}")
