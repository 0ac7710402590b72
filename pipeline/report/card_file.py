"""One variant's model card as a file (`quantize card VARIANT_DIR`): OUT/<variant>/README.md, written from a
verdict.json (the report's, or one a CI run kept): the very card the report stage writes into reports/cards/<variant>/ from the same
verdict (pipeline/report/model_card.py), with the base's source.json and the calibration summary beside it.

`--repo-id ORG/NAME` names the Hub repository the card is published in: it is the card's title, first sentence and
model-index name, and its usage snippets load it; without it the card is a local record that says so, its snippets
loading models/<variant>. What the publisher should check before uploading (a variant that is not a plain GO, a
licence or base repository the base's source does not state, no repository id) is printed after the path, never
written on the card.

Refused with one message naming the file and the fix, and nothing written: a verdict that is missing or was not
written by `quantize report`, a folder that is no variant (no quant.json) or one the verdict did not decide, a
variant built again since the verdict (its quant.json is not the one the verdict holds), and a repository id that is
not one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import UserError
from pipeline.formats import quant_json
from pipeline.formats.source_json import read_source_json
from pipeline.outputs import atomic_dir, fingerprints_of
from pipeline.report import inputs
from pipeline.settings.params import Params

STAGE = "card"
IDENTITY = ("method", "scheme", "size_bytes", "calibration")  # what says two quant.json are of one build


@dataclass
class CardResult:
    path: Path
    label: str
    checks: list[str] = field(default_factory=list)  # what to check before publishing it

    def summary(self) -> str:
        return "\n".join([f"card: wrote {self.path} ({self.label})",
                          *(f"  before publishing: {check}" for check in self.checks)])


def read_verdict(path: Path) -> dict:
    """verdict.json as `quantize report` writes it (its variants at least), or a UserError naming the file and the fix."""
    if not path.is_file():
        raise UserError(f"{path}: no verdict there; run `dvc repro` or `quantize report` first (or pass --verdict the "
                        "verdict.json a report wrote)")
    try:
        verdict = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not JSON ({exc}); rerun `quantize report`") from None
    if not isinstance(verdict, dict) or not isinstance(verdict.get("variants"), dict):
        raise UserError(f"{path}: not a verdict written by `quantize report` (no variants); rerun `quantize report`")
    return verdict


def _decided_variant(variant_dir: Path, verdict: dict, verdict_path: Path) -> str:
    """The variant's name (its folder's), once the folder is a variant the verdict decided, of the build it decided."""
    from pipeline.report.model_card import decided

    if not variant_dir.is_dir():
        raise UserError(f"{variant_dir}: no such folder; pass a variant's folder, e.g. models/<variant>")
    name, names = variant_dir.name, decided(verdict)
    quant = quant_json.read_quant_json(variant_dir)
    if quant is None:
        raise UserError(f"{variant_dir / quant_json.NAME}: missing, so {variant_dir} is no variant `quantize` built "
                        f"(the base has no card); pass one of: {', '.join(f'models/{n}' for n in names) or 'none'}")
    if name not in names:
        why = (f"it holds {name} without deciding it ({verdict['variants'][name].get('state') or 'no decision'})"
               if name in verdict["variants"] else f"it decides {', '.join(names) or 'no variant'}, not {name}")
        raise UserError(f"{verdict_path}: {why}; run `dvc repro` (or `quantize eval {variant_dir}` for each suite, then "
                        "`quantize report`), then `quantize card` again")
    held = verdict["variants"][name].get("quant") or {}
    changed = [key for key in IDENTITY if key in held and held.get(key) != quant.get(key)]
    if changed:
        raise UserError(f"{variant_dir / quant_json.NAME}: not the build {verdict_path} decided ({', '.join(changed)} "
                        f"differ): {name} was built again since; run `quantize report` (or `dvc repro`), then "
                        "`quantize card` again")
    return name


def run(variant_dir: Path | str, verdict_path: Path | str, out: Path | str, params: Params, *,
        calib_stats: Path | str | None = None, repo_id: str | None = None) -> CardResult:
    """Writes OUT/<variant>/README.md for the variant in `variant_dir`, from the verdict at `verdict_path`, the base's
    source.json (params model.base_dir) and the calibration summary `calib_stats`; `repo_id`: the Hub repository the
    card is published in."""
    from pipeline.report.card_text import valid_repo_id
    from pipeline.report.model_card import README, model_card, publishing_checks, run_settings
    from pipeline.verdict.headline import label

    if repo_id is not None and not valid_repo_id(repo_id):
        raise UserError(f"--repo-id {repo_id}: not a Hub repository id; pass ORG/NAME (letters, digits, '-', '_' and "
                        "'.', e.g. --repo-id my-org/awq-w4a16)")
    variant_dir, verdict_path, out = Path(variant_dir), Path(verdict_path), Path(out)
    read = {"verdict": verdict_path, "variant": variant_dir, "base source": params.model.base_dir / "source.json",
            "calibration stats": calib_stats}
    started = fingerprints_of(read)  # before they are read: one changed by the end is refused (outputs.atomic_dir)
    verdict = read_verdict(verdict_path)
    name = _decided_variant(variant_dir, verdict, verdict_path)
    calib = inputs.read_json(Path(calib_stats)) if calib_stats and Path(calib_stats).is_file() else None
    source = read_source_json(params.model.base_dir)
    try:
        card = model_card(name, verdict, source=source, calib=calib,
                          tasks={suite: s.task for suite, s in params.suites.items()},
                          speed_engine=params.verdict.speed_engine, repo_id=repo_id, run=run_settings(verdict, params))
        checks = publishing_checks(name, verdict, source, repo_id)
    except (LookupError, TypeError, AttributeError, ValueError) as exc:
        raise UserError(f"{verdict_path}: variants.{name} is not as `quantize report` writes it ({type(exc).__name__}: "
                        f"{exc}); rerun `quantize report`") from None
    with atomic_dir(out / name, STAGE, read, started=started) as tmp:
        (tmp / README).write_text(card.content, encoding="utf-8")
    return CardResult(out / name / README, label(verdict["variants"][name]), checks)
