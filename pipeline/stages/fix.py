"""`quantize fix VARIANT`: a NO-GO W4A16 variant's fix, built the way every variant is (the fix stage of dvc.yaml,
one per W4A16 variant it lists).

It reads VARIANT's ranking, results/VARIANT/sensitivity.json: its quantized groups ranked by the KL each one costs,
which the rank stage measures for every W4A16 variant in the pass that measures its KL (`quantize kl --rank`,
pipeline/stages/kl.py), fix or no fix: so adding or removing a fix reruns no stage of VARIANT's own. It builds
models/VARIANT-mixed with the quantize stage (pipeline/stages/quantize.py: plan, calibrate, save, verify, quant.json)
and the `mixed` method (pipeline/methods/mixed.py), whose base method and W4A16 settings are VARIANT's own
(params.yaml `variants.VARIANT`: group size, symmetry, batch, AWQ's n_grid and search, GPTQ's actorder ...), its most
costly groups kept in W8A16 within params.yaml `fix.max_bits` bits per weight.

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
    ranking: Path  # results/<variant>/sensitivity.json, what it was built from
    figures: dict  # variant, fix, the ranking's figures, the fix's quant.json figures, seconds

    def summary(self) -> str:
        f = self.figures
        ratio = f" ({f['size_ratio']:.2f}x the size of {f['variant']})" if f.get("size_ratio") else ""
        return (f"fix: wrote {self.out} from {self.ranking}: {f['groups_in_8_bits']} of {f['groups_total']} groups in "
                f"8 bits, {f['bits_per_weight']:.2f} bits per weight{ratio}; first {f['first_group']} (restoring it "
                f"removes {f['first_share']:.0%} of the KL) in {f['seconds']:.0f} s")


def paths(variant: str, models_dir: Path | str = "models", results_dir: Path | str = "results") -> dict[str, Path]:
    """What the fix of `variant` reads and writes: the variant's checkpoint, its ranking, the fix's checkpoint."""
    return {"variant": Path(models_dir) / variant, "ranking": Path(results_dir) / variant / SENSITIVITY_FILE,
            "out": Path(models_dir) / fixes.fix_name(variant)}


def check_inputs(variant: str, base_dir: Path | str, holdout: Path | str, models_dir: Path | str = "models",
                 results_dir: Path | str = "results") -> None:
    """Before any work: both checkpoints whole, the variant's ranking and the held-out conversations there."""
    from pipeline.checkpoints import headers
    from pipeline.formats.sensitivity import read_sensitivity

    where = paths(variant, models_dir, results_dir)
    if not where["variant"].is_dir():
        raise UserError(f"{where['variant']}: not built; run `quantize variant {variant}` (or `dvc repro`) first")
    for model_dir in (where["variant"], Path(base_dir)):
        headers.check(model_dir)
    if not where["ranking"].is_file():
        raise UserError(f"{where['ranking']}: no ranking of {variant}'s groups to build its fix from; run `quantize kl "
                        f"{where['variant']} --rank` first (dvc.yaml's rank stage), then this again")
    read_sensitivity(where["ranking"])  # a ranking as `quantize kl --rank` writes it, else refused naming the file
    if not Path(holdout).is_file():
        raise UserError(f"{holdout}: no held-out conversations for the fix's per-layer error check; run `quantize "
                        "calib` first")


def run(variant: str, params, *, calib: Path | str, build, base_dir: Path | str | None = None,
        models_dir: Path | str = "models", results_dir: Path | str = "results") -> FixResult:
    """Build models/<variant>-mixed from results/<variant>/sensitivity.json. params: the whole params.yaml (the
    variant's section, `fix`); calib: the calibration blocks (calib.jsonl); build: the quantize stage's `run`, handed
    in by the command that composes them (a stage imports no other stage: `quantize fix` in pipeline/cli/quantize.py);
    base_dir defaults to params.yaml's model.base_dir."""
    from pipeline import methods
    from pipeline.formats.quant_json import read_quant_json
    from pipeline.formats.sensitivity import read_sensitivity
    from pipeline.outputs import Stopwatch

    settings = fixes.variant_settings(params, variant)
    where = paths(variant, models_dir, results_dir)
    base_dir = Path(base_dir or params.model.base_dir)
    watch = Stopwatch()
    ranking = read_sensitivity(where["ranking"])
    mixed = methods.method("mixed")  # the fix's method, as the registry names it
    print(f"fix {variant}: {where['out']}: {settings.method} as {variant} was built, the first groups of "
          f"{where['ranking']} in 8 bits within {params.fix.max_bits:g} bits per weight (quantize mixed)", flush=True)
    built = build(base_dir, where["out"], Path(calib),
                  mixed.for_variant(settings, params.fix.max_bits, where["ranking"]),
                  method_options={"base_settings": settings})
    info, before = built.info, read_quant_json(where["variant"]) or {}
    first = ranking["groups"][0]
    figures = {"variant": variant, "fix": where["out"].name, "max_bits": params.fix.max_bits,
               "groups_in_8_bits": info["groups_in_8_bits"], "groups_total": info["groups_total"],
               "bits_per_weight": info["bits_per_weight"], "size_bytes": info["size_bytes"],
               "size_ratio": info["size_bytes"] / before["size_bytes"] if before.get("size_bytes") else None,
               "first_group": first["name"], "first_share": first["share_removed"],
               "quantize_seconds": info["seconds"]["total"], "seconds": watch.seconds}
    return FixResult(where["out"], where["ranking"], figures)
