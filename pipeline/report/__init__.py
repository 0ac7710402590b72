"""`quantize report`: results/** -> reports/verdict.json (CI gate, dvc metrics) + reports/index.html.

The page is one self-contained file: inline CSS, inline SVG, no script needed, no network
request of any kind. Every model output and calibration text goes through Jinja's autoescape.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline import verdict as stats
from pipeline.checkpoints import config_json
from pipeline.errors import UserError
from pipeline.outputs import human_size, write_pair
from pipeline.formats import quant_json, results as result_files
from pipeline.report import inputs
from pipeline.report.capacity import capacity_line
from pipeline.report.next_steps import next_steps, why_in_brief
from pipeline.params import Params

log = logging.getLogger(__name__)

PACKAGES = ["torch", "transformers", "llmcompressor", "compressed-tensors", "lm-eval", "dvc"]


def collect(results_dir: Path, suites: list[str], models: list[str] | None = None) -> dict[str, dict[str, dict[str, dict]]]:
    """{variant: {suite: {item id: result line}}} for every results/<variant>/<suite>.jsonl of a suite
    in params.yaml (judge.jsonl and other stages' files sit beside them); with `models`, only their folders."""
    found: dict[str, dict] = {}
    for path in sorted(results_dir.glob("*/*.jsonl")):
        if path.stem in suites and (models is None or path.parent.name in models):
            found.setdefault(path.parent.name, {})[path.stem] = result_files.read_lines(path)
    if "base" not in found:
        raise UserError(f"{results_dir}/base: no base results; run `quantize eval models/base --suite S` first")
    return found


def not_applicable(results_dir: Path, suites: list[str], models: list[str] | None = None) -> dict[str, dict[str, str]]:
    """{model: {suite: reason}} for suites the evaluation declared not applicable (e.g. VQA on a
    text-only model): shown as n/a, never scored as 0 %."""
    found: dict[str, dict[str, str]] = {}
    for path in sorted(results_dir.glob("*/*.json")):
        if path.stem in suites and (models is None or path.parent.name in models):
            summary = result_files.read_summary(path) or {}
            if summary.get("status") == "not applicable":
                found.setdefault(path.parent.name, {})[path.stem] = summary.get("reason", "not applicable")
    return found


def _git_revision() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def environment() -> dict:
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

    def summary(self) -> str:
        overall = ", ".join(f"{v}: {d['decision']}" for v, d in self.verdict["variants"].items())
        return f"report: wrote {self.html} and {self.verdict_json} ({overall or 'no variants'})"


def build_verdict(results: dict, params: Params, models_dir: Path, results_dir: Path) -> dict:
    p = params.verdict
    n_a = not_applicable(results_dir, list(params.suites), ["base", *params.variants])
    speeds = _speed_rows(results_dir, results)
    flagged = unsandboxed_results(results_dir, results)
    variants = {}
    for variant, suites in results.items():
        if variant == "base":
            continue
        skipped = {**n_a.get("base", {}), **n_a.get(variant, {})}
        suite_verdicts = [
            stats.compare_suite(results["base"][suite], items, variant=variant, suite=suite,
                                margin=p.margin_for(suite), confidence=p.confidence, iterations=p.bootstrap,
                                seed=p.seed, floor_ceiling=p.floor_ceiling)
            for suite, items in sorted(suites.items())
            if suite in results["base"] and suite not in skipped and not is_perplexity(results["base"][suite])
        ]
        unsandboxed = {v.suite: [m for m in ("base", variant) if f"{m}/{v.suite}" in flagged] for v in suite_verdicts}
        for v in suite_verdicts:
            if unsandboxed[v.suite]:
                v.reasons.insert(0, _unsandboxed_reason(unsandboxed[v.suite], v.suite))
        perplexity = {
            suite: stats.compare_perplexity(results["base"][suite], items, variant=variant, suite=suite,
                                            margin=p.perplexity_margin_for(suite), confidence=p.confidence)
            for suite, items in sorted(suites.items())
            if suite in results["base"] and suite not in skipped and is_perplexity(results["base"][suite])
        }
        judged = _judge_verdict(results_dir / variant / "judge.json", params)
        extra = [(suite, v.decision) for suite, v in perplexity.items() if v.counted]
        if judged and judged["counted"]:
            extra.append(("judge", judged["decision"]))
        speed = _speed_verdict(speeds, variant, p)
        if speed and speed.get("counted"):
            extra.append(("speed at batch 1", stats.NO_GO))  # speed can stop a variant, never pass one
        decision, reasons = stats.overall(suite_verdicts, extra)
        for suite in sorted(suites):  # a result run without isolation that no suite comparison above shows
            if f"{variant}/{suite}" in flagged and suite not in unsandboxed:
                reasons.insert(0, _unsandboxed_reason([variant], suite))
        if speed and speed.get("counted"):
            reasons.append(f"slower than the base at batch 1: {speed['reason']}")
        steps = next_steps(variant, suite_verdicts, perplexity, judged, results_dir, params)
        variants[variant] = {
            "decision": decision,
            "why": why_in_brief(decision, suite_verdicts, perplexity, judged, speed, steps),
            "reasons": reasons,
            "next_steps": steps,
            "suites": {v.suite: {**v.to_dict(), "unsandboxed": unsandboxed[v.suite]} for v in suite_verdicts},
            "perplexity": {suite: v.to_dict() for suite, v in perplexity.items()},
            "not_applicable": skipped,
            "judge": judged,
            "quant": quant_json.read_quant_json(models_dir / variant / "quant.json"),
            "kl": _read_json(results_dir / variant / "kl.json"),
            "speed": speed,
            "serving": _serving(models_dir / variant),
            # "GO, 1.5x tokens/s, 2x KV capacity" (pipeline/report/capacity.py)
            "capacity_line": capacity_line(decision, speeds.get(variant), speeds.get("base")),
        }
    base_suites = {s: _suite_score(items) | ({"unsandboxed": True} if f"base/{s}" in flagged else {})
                   for s, items in results.get("base", {}).items()}
    return {
        **({"unsandboxed": flagged} if flagged else {}),  # every result whose model-written code ran without isolation
        "variants": variants,
        "base": {"suites": base_suites},
        "long_context": _long_context_tables(results_dir, results),
        "method_comparisons": _method_comparisons(results, models_dir, p.confidence),
        "speed": speeds,
        "params_sha256": params.digest(),
    }


def unsandboxed_results(results_dir: Path, results: dict) -> list[str]:
    """`model/suite` of every result whose model-written code ran outside the bubblewrap sandbox (written
    under suites.<suite>.allow_unsandboxed): a line with `isolated: false`, or a summary naming another sandbox."""
    flagged = []
    for model, suites in results.items():
        for suite, items in suites.items():
            method = (result_files.read_summary(results_dir / model / f"{suite}.json") or {}).get("sandbox")
            if any(line.get("isolated") is False for line in items.values()) or method not in (None, "bwrap"):
                flagged.append(f"{model}/{suite}")
    return sorted(flagged)


def _unsandboxed_reason(models: list[str], suite: str) -> str:
    return (f"UNSANDBOXED: the model-written code of {' and '.join(models)} ran without bubblewrap "
            f"(suites.{suite}.allow_unsandboxed: true): it could read this machine's files and fake its own pass; "
            "install bubblewrap and rerun the eval")


def is_perplexity(items: dict[str, dict]) -> bool:
    """A perplexity suite's lines carry each document's log-likelihood and token count."""
    return bool(items) and all("loglikelihood" in item and "n_tokens" in item for item in items.values())


def _method_comparisons(results: dict, models_dir: Path, confidence: float) -> list[dict]:
    """Each method against those it declares in COMPARED_WITH (pipeline/methods/: AWQ against round-to-nearest, the
    contrast of the AWQ paper, Lin et al. 2023), variants at the same group size, on every perplexity suite both
    ran: the variant's perplexity relative to the other's, paired per document. Shown, not counted: the verdict
    compares each variant with the base."""
    from pipeline import methods

    quant = {name: quant_json.read_quant_json(models_dir / name / "quant.json") or {}
             for name in results if name != "base"}
    rows = []
    for method, other, why in methods.comparisons():
        for variant, q in quant.items():
            for against, r in quant.items():
                if q.get("method") != method or r.get("method") != other or q.get("group_size") != r.get("group_size"):
                    continue
                for suite in sorted(set(results[variant]) & set(results[against])):
                    if not (is_perplexity(results[variant][suite]) and is_perplexity(results[against][suite])):
                        continue
                    c = stats.compare_perplexity(results[against][suite], results[variant][suite], variant=variant,
                                                 suite=suite, margin=1.0, confidence=confidence)
                    if not c.counted:
                        continue
                    better = variant if c.ci_high < 0 else against if c.ci_low > 0 else None
                    rows.append({"variant": variant, "against": against, "method": method, "against_method": other,
                                 "why": why, "suite": suite, "n": c.n, "variant_ppl": c.variant_ppl,
                                 "against_ppl": c.base_ppl, "change": c.change, "ci_low": c.ci_low,
                                 "ci_high": c.ci_high, "better": better, "group_size": q.get("group_size")})
    return rows


def _judge_verdict(path: Path, params: Params) -> dict | None:
    """The judge's win rate tested against 0.5 - margin; counted only when the judge is reliable."""

    summary = _read_json(path)
    if summary is None:
        return None
    margin, min_consistency = params.verdict.margins.judge, params.judge.min_consistency
    decision = stats.decide_judge(summary, margin, min_consistency)
    counted = decision != stats.UNRELIABLE and summary.get("mode", "pairwise") == "pairwise" and bool(summary.get("n"))
    return {"decision": decision, "counted": counted, "margin": margin,
            "sentence": stats.judge_sentence(summary, decision, margin, min_consistency),
            "reasons": stats.explain_judge(summary, decision, margin, min_consistency), "summary": summary}


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


def _speed_rows(results_dir: Path, results: dict) -> dict:
    """{model: speed row} for every model with a results/<model>/bench.json (`quantize bench`)."""

    rows = {}
    for model in sorted(results, key=lambda name: name != "base"):  # base first
        summary = _read_json(results_dir / model / "bench.json")
        if summary:
            rows[model] = speed_row(summary)
    return rows


def _speed_verdict(speeds: dict, variant: str, p) -> dict | None:
    """The variant's batch-1 speed against the base's; counted (as NO-GO) only when
    verdict.nogo_if_slower_at_batch1 is set, it is slower by more than verdict.speed_tolerance, and
    it was measured on verdict.speed_engine, the engine the variant will be deployed on."""

    if variant not in speeds:
        return None
    comparison = stats.compare_speed(speeds.get("base"), speeds[variant], p.speed_tolerance, p.speed_engine)
    comparison["counted"] = bool(p.nogo_if_slower_at_batch1 and comparison["slower"]
                                 and comparison.get("deployment_engine"))
    return comparison


def _long_context_tables(results_dir: Path, results: dict) -> dict:
    """Per model, the long-context suite's accuracy by length and needle depth, and what was skipped."""
    tables = {}
    for model in results:
        summary = result_files.read_summary(results_dir / model / "long_context.json") or {}
        if summary.get("long_context"):
            tables[model] = summary["long_context"]
    return tables


def _suite_score(items: dict) -> dict:
    n = len(items)
    if is_perplexity(items):  # perplexity over all the suite's tokens
        tokens = sum(i["n_tokens"] for i in items.values())
        return {"n": n, "perplexity": math.exp(-sum(i["loglikelihood"] for i in items.values()) / tokens) if tokens else None}
    return {"n": n, "score": sum(i["score"] for i in items.values()) / n if n else None}


def _metrics(verdict: dict) -> dict:
    """Flat numbers for `dvc metrics show`."""
    flat = {}
    for variant, data in verdict["variants"].items():
        flat[variant] = {"go": data["decision"] == stats.GO}
        for suite, s in data["suites"].items():
            flat[variant][suite] = {"score": s["variant_score"], "delta": s["delta"],
                                    "ci_low": s["ci_low"], "ci_high": s["ci_high"]}
        for suite, s in data.get("perplexity", {}).items():
            flat[variant][suite] = {"perplexity": s["variant_ppl"], "change": s["change"],
                                    "ci_low": s["ci_low"], "ci_high": s["ci_high"]}
    return flat


def run(results_dir: Path | str, out_dir: Path | str, params: Params, *, models_dir: Path | str = "models",
        calib_stats: Path | str | None = None) -> ReportResult:
    from pipeline.report.render import render_html

    results_dir, out_dir, models_dir = Path(results_dir), Path(out_dir), Path(models_dir)
    models, ignored = inputs.result_folders(results_dir, ["base", *params.variants])
    for folder, why in ignored.items():
        log.warning(f"report: ignoring {results_dir / folder}: {why}")
    results = collect(results_dir, list(params.suites), models)
    verdict = build_verdict(results, params, models_dir, results_dir)
    if ignored:
        verdict["ignored_results"] = {str(results_dir / folder): why for folder, why in ignored.items()}
    verdict["metrics"] = _metrics(verdict)
    verdict["environment"] = environment()
    base_quant = {"size_bytes": _dir_size_or_none(models_dir / "base")}
    calib = _read_json(Path(calib_stats)) if calib_stats else None
    html = render_html(verdict=verdict, results=results, params=params, calib=calib, base=base_quant,
                       human_size=human_size)
    # one unit, swapped in by one rename: a CI gate reading verdict.json and a reviewer reading index.html
    # see one decision, whenever the stage is killed
    try:
        write_pair(out_dir, {"index.html": html,
                             "verdict.json": json.dumps(verdict, indent=2, sort_keys=False, default=str) + "\n"},
                   "report", {"results": results_dir, "models": models_dir, "calibration stats": calib_stats})
    except (NotADirectoryError, FileExistsError, IsADirectoryError, PermissionError) as exc:
        raise UserError(f"{out_dir}: cannot write the report there ({exc.strerror}: {exc.filename}); "
                        "pass --out a writable directory") from None
    return ReportResult(out_dir / "index.html", out_dir / "verdict.json", verdict)


def _dir_size_or_none(path: Path) -> int | None:
    from pipeline.outputs import dir_size

    return dir_size(path) if path.exists() else None


def failing(verdict: dict, fail_on: str | None) -> list[str]:
    """Variants whose decision trips the gate: 'no-go' fails on NO-GO, 'inconclusive' on anything but GO."""
    if not fail_on:
        return []
    bad = {"no-go": {stats.NO_GO}, "inconclusive": {stats.NO_GO, stats.INCONCLUSIVE}}[fail_on]
    return [v for v, d in verdict["variants"].items() if d["decision"] in bad]


def speed_row(summary: dict) -> dict:
    """The figures the report's speed table and charts show, from one bench.json."""
    fixed = summary["workloads"]["fixed"]
    batch1 = fixed["levels"][0]
    info = summary.get("engine_info") or {"engine": summary["engine"]}
    roof = summary.get("roofline") or {}
    return {
        "engine": summary["engine"], "engine_version": info.get("version"), "engine_settings": info.get("settings"),
        "tensor_parallel_size": int(info.get("tensor_parallel_size") or 1), "kv_cache_dtype": info.get("kv_cache_dtype"),
        "device": summary["device"], "date": summary.get("date"),
        "input_len": summary["input_len"], "output_len": summary["output_len"],
        "batch1_concurrency": batch1["concurrency"],
        "batch1_tokens_per_s": 1000 / batch1["tpot_ms"] if batch1.get("tpot_ms") else None,
        "batch1_ttft_ms": batch1["ttft_p50_ms"],
        "tokens_per_s": {str(l["concurrency"]): l["output_tokens_per_s"] for l in fixed["levels"]},
        "levels": [{k: l.get(k) for k in ("concurrency", "output_tokens_per_s", "ttft_ms", "tpot_ms_stats", "itl_ms",
                                          "e2el_ms", "goodput_requests_per_s", "requests_per_s")}
                   for l in fixed["levels"]],
        "rates": [{k: l.get(k) for k in ("request_rate", "output_tokens_per_s", "ttft_ms", "tpot_ms_stats",
                                         "goodput_requests_per_s", "requests_per_s")}
                  for l in fixed.get("rates") or []],
        "memory_bytes": max((l.get("memory_bytes") or 0) for l in fixed["levels"]) or None,
        "capacity": _capacity(summary.get("capacity")),
        "roofline_fraction": roof.get("fraction_of_bound"),
        "roofline_tokens_per_s": roof.get("bound_tokens_per_s"),
    }


CAPACITY_FIELDS = ("kv_cache_tokens", "max_context_batch1", "weight_bytes", "goodput_tok_s_per_gpu")


def _capacity(found) -> dict | None:
    """bench.json's `capacity` (when the bench measured it): the numeric fields the first screen shows,
    anything else left out; None when absent or holding none of them."""
    if not isinstance(found, dict):
        return None
    kept = {k: found[k] for k in CAPACITY_FIELDS
            if isinstance(found.get(k), (int, float)) and not isinstance(found.get(k), bool) and math.isfinite(found[k])}
    if isinstance(found.get("slo"), dict):
        kept["slo"] = {str(k): v for k, v in found["slo"].items() if isinstance(v, (int, float, str))}
    return kept or None
