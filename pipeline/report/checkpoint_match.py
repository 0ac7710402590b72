"""Whether each model's results were scored on the checkpoint now in its folder: quant.json (written by the quantize
stage), every <suite>.json (written by eval), kl.json and judge.json record the weights' fingerprint (pipeline/checkpoints/fingerprint.py:
weights_fingerprint); the report compares them with the folder's before it decides anything, and refuses a model whose
folder was swapped (another variant's build in its place) or whose weights were replaced after the results, rather
than show one checkpoint's scores beside another's build. A folder without weights (a copy of what the report reads)
and results written before the fingerprint was recorded are not checked."""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoints.fingerprint import weights_fingerprint
from pipeline.errors import UserError


def _short(fingerprint: str) -> str:
    return fingerprint.split(":", 1)[-1][:12]


def recorded(results_dir: Path, models_dir: Path, model: str, summaries: dict, quant: dict | None,
             measured: dict[str, dict] | None = None) -> list[tuple[Path, str]]:
    """(file, fingerprint) of each record of what `model` was built or scored as: quant.json, every <suite>.json, and
    `measured` ({file name: summary}: kl.json, judge.json)."""
    found = [(models_dir / model / "quant.json", quant["checkpoint"])] if quant and quant.get("checkpoint") else []
    found += [(results_dir / model / f"{suite}.json", summary["checkpoint"]) for suite, summary in summaries.items()
              if isinstance(summary, dict) and summary.get("checkpoint")]
    found += [(results_dir / model / name, summary["checkpoint"]) for name, summary in (measured or {}).items()
              if isinstance(summary, dict) and summary.get("checkpoint")]
    return found


def check(results_dir: Path, models_dir: Path, models: list[str], summaries: dict, quant: dict,
          measured: dict[str, dict] | None = None) -> None:
    """A UserError naming the first model whose folder holds weights other than those its records name. measured:
    {file name: {model: summary}} of the other summaries that record it (kl.json, judge.json)."""
    for model in models:
        records = recorded(results_dir, models_dir, model, summaries.get(model, {}), quant.get(model),
                           {name: by_model[model] for name, by_model in (measured or {}).items() if model in by_model})
        if not records:
            continue
        now = weights_fingerprint(models_dir / model)
        if now is None:
            continue
        other = [(path, fingerprint) for path, fingerprint in records if fingerprint != now]
        if not other:
            continue
        built = next((fp for path, fp in records if path.name == "quant.json"), None)
        shown = "; ".join(f"{path} records {_short(fp)}" for path, fp in other[:3]) + \
            (f" and {len(other) - 3} more" if len(other) > 3 else "")
        if built is not None and built != now:
            why = (f"its weights were changed after the quantize stage wrote them ({shown}; the folder holds "
                   f"{_short(now)})")
            fix = f"build it again (`dvc repro`, or `quantize variant {model}`), then evaluate it"
        else:
            why = (f"its results were scored on another checkpoint than the one in the folder now ({shown}; the folder "
                   f"holds {_short(now)}): the folder was replaced, or the results copied from another run")
            folder = models_dir / model
            fix = f"evaluate it again (`dvc repro`, or `quantize eval {folder}` per suite)"
        raise UserError(f"{models_dir / model}: {why}; the report would show one checkpoint's scores beside another's "
                        f"build, so none is written: {fix}, then run `quantize report`")
