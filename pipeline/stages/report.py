"""`quantize report`: results/** -> reports/verdict.json (CI gate, dvc metrics) + reports/index.html + a model card per
decided variant, reports/cards/<variant>/README.md.

The stage reads and checks its inputs (`read_evidence`; pipeline/report/inputs.py), has the verdict decided
(pipeline/verdict/: every rule and statistic), and renders it (pipeline/report/render.py, and the cards:
pipeline/report/model_card.py); no decision is taken here. The page is one self-contained file: inline CSS, inline SVG, no script needed, no network
request of any kind. Every model output and calibration text goes through Jinja's autoescape.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints import checkpoint, config_json
from pipeline.errors import UserError
from pipeline.formats import quant_json, results as result_files
from pipeline.formats.source_json import read_source_json
from pipeline.formats.sensitivity import NAME as SENSITIVITY_FILE
from pipeline.formats.sensitivity import read_sensitivity
from pipeline.outputs import human_size
from pipeline.report.publish import write_pair
from pipeline.settings import fixes, lm_eval_tasks
from pipeline.settings import suites as registry
from pipeline.settings.params import Params
from pipeline.report import checkpoint_match, inputs
from pipeline.verdict.decision import Evidence, decide, metrics
from pipeline.verdict.headline import with_headline

log = logging.getLogger(__name__)

CARDS = "cards"  # reports/cards/<variant>/README.md
PACKAGES = ["torch", "transformers", "llmcompressor", "compressed-tensors", "lm-eval", "dvc"]


def collect(results_dir: Path, suites: list[str], models: list[str] | None = None) -> dict[str, dict[str, dict[str, dict]]]:
    """{variant: {suite: {item id: result line}}} for every results/<variant>/<suite>.jsonl of a suite
    in params.yaml (judge.jsonl and other stages' files sit beside them); with `models`, only their folders."""
    found: dict[str, dict] = {}
    for path in sorted(results_dir.glob("*/*.jsonl")):
        if path.stem in suites and (models is None or path.parent.name in models):
            if (result_files.read_summary(path.with_suffix(".json")) or {}).get("status") == "not run":
                continue  # suites.<suite>.models leaves this model out: as if absent
            found.setdefault(path.parent.name, {})[path.stem] = result_files.read_lines(path)
    if "base" not in found:
        raise UserError(f"{results_dir}/base: no base results; run `quantize eval models/base --suite S` first")
    return found


def _git_revision() -> str | None:
    """The pipeline's own revision (its source's git checkout, wherever the project is), None when installed
    from a package."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[2])
        return (done.stdout.strip() or None) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _pipeline_repository() -> str | None:
    """Where a reader fetches this pipeline: the package's Project-URL named Repository or Source, if it declares one."""
    from importlib import metadata

    try:
        urls = metadata.metadata("glm-quant-pipeline").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        return None
    found = dict(url.split(", ", 1) for url in urls if ", " in url)
    return next((found[k] for k in ("Repository", "Source", "Homepage") if k in found), None)


def this_environment() -> dict:
    from importlib import metadata

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    import os

    dvc_lock = Path("dvc.lock")
    return {
        "packages": versions,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "processor": platform.processor() or platform.machine(),
        "git_revision": _git_revision(),
        "pipeline_repository": _pipeline_repository(),
        "dvc_lock_sha256": hashlib.sha256(dvc_lock.read_bytes()).hexdigest()[:16] if dvc_lock.is_file() else None,
        "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _read_json(path: Path) -> dict | None:
    """A stage's JSON summary checked for what the report uses of it (by its name), or None when absent."""
    return inputs.read_json(path)


@dataclass
class ReportResult:
    html: Path
    verdict_json: Path
    verdict: dict

    cards: list[Path]

    def summary(self) -> str:
        overall = ", ".join([*(f"{d['variant']}: {d['label']}" for d in self.verdict.get("decisions") or []),
                             *(f"{v}: {m['state']}" for v, m in (self.verdict.get("variants_without_results") or {}).items())])
        cards = f", {len(self.cards)} model card{'s' if len(self.cards) != 1 else ''} in {self.html.parent / CARDS}"
        return f"report: wrote {self.html} and {self.verdict_json}{cards if self.cards else ''} ({overall or 'no variants'})"


def read_evidence(results_dir: Path, models_dir: Path, params: Params, models: list[str]) -> Evidence:
    """Every file the verdict is decided from, each checked as it is read (a broken one is a UserError
    naming it): the result lines and <suite>.json summaries of `models` (base, the variants of params.yaml and
    their fixes), and per model its judge.json and kl.json (each checked against, and the judge's figures
    recomputed from, the .jsonl lines beside it), bench.json, quant.json and where it is served; for a W4A16
    variant whose fix has results, the ranking the fix was built from (sensitivity.json)."""
    results = collect(results_dir, list(params.suites), models)
    # a shipped suite with its own table is read where params.yaml leaves it out too: its table is still shown
    tabled = {s.name: s for s in registry.shipped().values() if s.kind == "retrieval-table" and s.name not in params.suites}
    # what each suite's YAML declares (pipeline/settings/suites.py), or a plain lm-eval task's says (lm_eval_tasks.py)
    declared = lm_eval_tasks.of_params(params.suites) | tabled
    summaries: dict[str, dict[str, dict]] = {}
    for model in models:
        for suite in [*params.suites, *tabled]:
            summary = result_files.read_summary(results_dir / model / f"{suite}.json")
            if summary is not None:
                summaries.setdefault(model, {})[suite] = summary
    kinds = {name: suite.kind for name, suite in declared.items()}
    evidence = Evidence(results=results, kinds=kinds)  # how each suite is compared: its declared kind
    inputs.lines_of_their_kind(results_dir, results, evidence.perplexity)
    inputs.tables_from_lines(results_dir, results, summaries, declared)
    inputs.suite_summaries_from_lines(results_dir, results, summaries, evidence.perplexity)
    variants = [name for name in results if name != "base"]
    return Evidence(
        results=results, summaries=summaries, kinds=kinds,
        judge={v: found for v in variants if (found := inputs.read_judge(results_dir / v / "judge.json", params))},
        kl={v: found for v in variants if (found := inputs.read_kl(results_dir / v / "kl.json", params)) is not None},
        bench={m: found for m in results if (found := _read_json(results_dir / m / "bench.json"))},
        quant={v: quant_json.read_quant_json(models_dir / v / "quant.json") for v in variants},
        serving={v: _serving(models_dir / v) for v in variants},
        built={v: config_json.present(models_dir / v) for v in params.variants},
        sensitivity={v: read_sensitivity(ranking) for v in fixes.fixable(params)
                     if fixes.fix_name(v) in variants and (ranking := results_dir / v / SENSITIVITY_FILE).is_file()})


def _serving(model_dir: Path) -> dict | None:
    """Where the variant is served: read off its config.json against the runs recorded now (a run recorded after
    the variant was built counts), else its quant.json's record."""
    from pipeline.checkpoints.serving import serving_support

    try:
        if config_json.present(model_dir):
            return serving_support(model_dir)
        return (quant_json.read_quant_json(model_dir / "quant.json") or {}).get("serving")
    except (UserError, ValueError, OSError, AttributeError, TypeError):  # an unreadable config: the table says so, the report stands
        return None


def run(results_dir: Path | str, out_dir: Path | str, params: Params, *, models_dir: Path | str = "models",
        calib_stats: Path | str | None = None, environment: dict | None = None) -> ReportResult:
    """`environment`: where the results were produced, when not here (a report re-rendered from a stored copy of
    another machine's run: benchmarks/report_bundle.py)."""
    from pipeline.report.printable import printable
    from pipeline.report.render import render_html

    results_dir, out_dir, models_dir = Path(results_dir), Path(out_dir), Path(models_dir)
    models, ignored = inputs.result_folders(results_dir, fixes.models(params))
    for folder, why in ignored.items():
        log.warning(printable(f"report: ignoring {results_dir / folder}: {why}"))  # a folder named in any bytes
    evidence = read_evidence(results_dir, models_dir, params, models)
    checkpoint_match.check(results_dir, models_dir, list(evidence.results), evidence.summaries, evidence.quant,
                           {"kl.json": evidence.kl, "judge.json": evidence.judge})
    if not [name for name in evidence.results if name != "base"]:
        raise UserError(_nothing_to_decide(results_dir, params, models, ignored))
    verdict = with_headline(decide(evidence, params), config_json.base_facts(_base_config(models_dir)),
                            params.verdict.floor_ceiling)
    if ignored:
        verdict["ignored_results"] = {str(results_dir / folder): why for folder, why in ignored.items()}
    verdict["metrics"] = metrics(verdict)
    verdict["environment"] = environment or this_environment()
    base_quant = {"size_bytes": _dir_size_or_none(models_dir / "base")}
    calib = _read_json(Path(calib_stats)) if calib_stats else None
    html = render_html(verdict=verdict, results=evidence.results, params=params, calib=calib, base=base_quant,
                       human_size=human_size)
    cards = card_files(verdict, params, read_source_json(models_dir / "base"), calib)
    # one unit, swapped in by one rename: a CI gate reading verdict.json, a reviewer reading index.html and a team
    # publishing a card see one decision, whenever the stage is killed (the verdict's link is made last)
    try:
        write_pair(out_dir, {"index.html": html, **cards,
                             "verdict.json": json.dumps(verdict, indent=2, sort_keys=False, default=str) + "\n"},
                   "report", {"results": results_dir, "models": models_dir, "calibration stats": calib_stats})
    except (NotADirectoryError, FileExistsError, IsADirectoryError, PermissionError) as exc:
        raise UserError(f"{out_dir}: cannot write the report there ({exc.strerror}: {exc.filename}); "
                        "pass --out a writable directory") from None
    return ReportResult(out_dir / "index.html", out_dir / "verdict.json", verdict, [out_dir / name for name in cards])


def card_files(verdict: dict, params: Params, source: dict | None, calib: dict | None) -> dict[str, str]:
    """{cards/<variant>/README.md: its model card} for every variant the verdict decided (pipeline/report/model_card.py),
    from the base's source.json and the calibration summary the page shows; the usage snippets name your-org/<variant>
    (`quantize card --repo-id` writes one with the repository it is published in)."""
    from pipeline.report.model_card import README, model_cards, run_settings

    cards = model_cards(verdict, source=source, calib=calib, tasks={name: s.task for name, s in params.suites.items()},
                        speed_engine=params.verdict.speed_engine, run=run_settings(verdict, params))
    return {f"{CARDS}/{name}/{README}": text for name, text in cards.items()}


def _base_config(models_dir: Path) -> dict | None:
    """The base's config.json (its vocabulary, and whether a run made its weights up), or None without one."""
    try:
        return checkpoint.base_config(models_dir)
    except (UserError, ValueError, OSError) as exc:
        log.warning(f"report: not read for the synthetic-base check: {exc}")
        return None


def _nothing_to_decide(results_dir: Path, params: Params, models: list[str], ignored: dict[str, str]) -> str:
    """Why no variant can be decided: which folders were read and which ignored (and why), and what to run."""
    named = ", ".join(params.variants) or "none"
    read = [f"{results_dir / m} (no <suite>.jsonl of a suite in params.yaml)" for m in models if m != "base"]
    text = f"{results_dir}: no variant to decide: params.yaml names {named}, and results/ holds no results of any of them"
    if read:
        text += "; read: " + "; ".join(read)
    if ignored:
        text += "; ignored: " + "; ".join(f"{results_dir / folder}: {why}" for folder, why in ignored.items())
    return (text + "; run `quantize eval models/<variant> --suite S` for a variant of params.yaml (or `dvc repro`), "
            "then `quantize report`; no report was written")


def _dir_size_or_none(path: Path) -> int | None:
    """The checkpoint's size on disk, or None where its weights are not there (a copy of what the report reads,
    as benchmarks/report_bundle.py keeps: the variants' quant.json then give the base's size they measured)."""
    from pipeline.outputs import dir_size

    has_weights = path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin")))
    return dir_size(path) if has_weights else None
