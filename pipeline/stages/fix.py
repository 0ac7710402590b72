"""`quantize fix VARIANT`: a NO-GO W4A16 variant's fix, built the way every variant is (the fix stage of dvc.yaml,
one per W4A16 variant it lists).

1. The measure: `quantize kl --rank` (pipeline/stages/kl.py) on models/VARIANT against the base, on the held-out
   conversations params.yaml `kl` names: VARIANT's KL (results/VARIANT/kl.json and kl.jsonl, as the kl stage writes
   them for every other variant) and, in the same pass, its quantized groups ranked by the KL each one costs
   (results/VARIANT/sensitivity.json). The loads and forward passes are the KL's; the ranking adds one backward
   pass per batch. So dvc.yaml's kl stage does not list VARIANT: this stage measures it.
2. The fix: models/VARIANT-mixed, built by the quantize stage (pipeline/stages/quantize.py: plan, calibrate, save,
   verify, quant.json) with the `mixed` method (pipeline/methods/mixed.py), whose base method and W4A16 settings are
   VARIANT's own (params.yaml `variants.VARIANT`: group size, symmetry, batch, AWQ's n_grid and search, GPTQ's
   actorder ...), its most sensitive groups kept in W8A16 within params.yaml `fix.max_bits` bits per weight.

VARIANT-mixed is then measured (`quantize kl`), evaluated (`quantize eval`) and decided like any variant; the
verdict sets it beside VARIANT (pipeline/verdict/fix.py). Its name: pipeline/settings/fixes.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError
from pipeline.formats.sensitivity import NAME as SENSITIVITY_FILE
from pipeline.settings import fixes


@dataclass
class FixResult:
    out: Path  # models/<variant>-mixed
    ranking: Path  # results/<variant>/sensitivity.json (beside kl.json, written in the same pass)
    figures: dict  # variant, fix, the ranking's figures, the fix's quant.json figures, seconds

    def summary(self) -> str:
        f = self.figures
        ratio = f" ({f['size_ratio']:.2f}x the size of {f['variant']})" if f.get("size_ratio") else ""
        return (f"fix: wrote {self.ranking.with_name('kl.json')}, {self.ranking.name} and {self.out}: {f['groups_in_8_bits']} of "
                f"{f['groups_total']} groups in 8 bits, {f['bits_per_weight']:.2f} bits per weight{ratio}; first "
                f"{f['first_group']} (restoring it removes {f['first_share']:.0%} of the KL; ranking it added "
                f"{f['sensitivity_seconds']:.1f} s to the KL's pass) in {f['seconds']:.0f} s")


def paths(variant: str, models_dir: Path | str = "models", results_dir: Path | str = "results") -> dict[str, Path]:
    """What the fix of `variant` reads and writes: the variant's checkpoint, its KL and ranking, the fix's
    checkpoint."""
    return {"variant": Path(models_dir) / variant, "kl": Path(results_dir) / variant / "kl.json",
            "ranking": Path(results_dir) / variant / SENSITIVITY_FILE, "out": Path(models_dir) / fixes.fix_name(variant)}


def check_inputs(variant: str, base_dir: Path | str, holdout: Path | str, models_dir: Path | str = "models") -> None:
    """Before any work: both checkpoints whole, the held-out conversations there."""
    from pipeline.checkpoints import headers

    variant_dir = paths(variant, models_dir)["variant"]
    if not variant_dir.is_dir():
        raise UserError(f"{variant_dir}: not built; run `quantize variant {variant}` (or `dvc repro`) first")
    for model_dir in (variant_dir, Path(base_dir)):
        headers.check(model_dir)
    if not Path(holdout).is_file():
        raise UserError(f"{holdout}: no held-out conversations to rank the groups on; run `quantize calib` first")


def run(variant: str, params, *, calib: Path | str, measure, build, base_dir: Path | str | None = None,
        holdout: Path | str | None = None, models_dir: Path | str = "models",
        results_dir: Path | str = "results") -> FixResult:
    """Measure models/<variant> (its KL, its groups ranked, one pass), then build models/<variant>-mixed. params: the whole params.yaml (the
    variant's section, `fix`, `kl`, `engine`); calib: the calibration blocks (calib.jsonl); measure and build: the
    kl stage's and the quantize stage's `run`, handed in by the command that composes them (a stage imports no
    other stage: `quantize fix` in pipeline/cli/quantize.py); base_dir and holdout default to params.yaml's
    model.base_dir and calib.out/holdout.jsonl."""
    from pipeline import methods
    from pipeline.formats.quant_json import read_quant_json
    from pipeline.outputs import Stopwatch

    settings = fixes.variant_settings(params, variant)
    where = paths(variant, models_dir, results_dir)
    base_dir = Path(base_dir or params.model.base_dir)
    holdout = Path(holdout or params.calib.out / "holdout.jsonl")
    watch = Stopwatch()
    print(f"fix {variant}, 1 of 2: its KL to the base, and in the same pass its quantized groups ranked by the KL "
          f"each one costs (quantize kl --rank)", flush=True)
    mixed = methods.method("mixed")  # the fix's method, as the registry names it
    measured = measure(base_dir, where["variant"], holdout, where["kl"], params.kl, params.engine, rank=True)
    print(measured.summary(), flush=True)
    print(f"fix {variant}, 2 of 2: {where['out']}: {settings.method} as {variant} was built, the first groups in 8 bits "
          f"within {params.fix.max_bits:g} bits per weight (quantize mixed)", flush=True)
    built = build(base_dir, where["out"], Path(calib),
                         mixed.for_variant(settings, params.fix.max_bits, where["ranking"]),
                         method_options={"base_settings": settings})
    info, before = built.info, read_quant_json(where["variant"]) or {}
    first = measured.ranking["groups"][0]
    figures = {"variant": variant, "fix": where["out"].name, "max_bits": params.fix.max_bits,
               "groups_in_8_bits": info["groups_in_8_bits"], "groups_total": info["groups_total"],
               "bits_per_weight": info["bits_per_weight"], "size_bytes": info["size_bytes"],
               "size_ratio": info["size_bytes"] / before["size_bytes"] if before.get("size_bytes") else None,
               "first_group": first["name"], "first_share": first["share_removed"],
               "sensitivity_seconds": measured.ranking["seconds"], "quantize_seconds": info["seconds"]["total"],
               "seconds": watch.seconds}
    return FixResult(where["out"], where["ranking"], figures)
