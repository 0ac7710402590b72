"""HTML rendering: Jinja2 with autoescape on, charts as inline SVG built here."""

from __future__ import annotations

from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape

import pipeline.verdict.facts as facts
import pipeline.verdict.figures as figures
from pipeline.verdict.coverage import NOT_CONFIGURED
from pipeline.report.recovery_table import recovery_table
from pipeline.report.deploy import SERVING_ENGINES, memory
from pipeline.report.labels import DECISION_CLASS, LABEL_CLASS
from pipeline.report.printable import printable
from pipeline.report.screen import first_screen
from pipeline.verdict.decision import TABLES_KEY
from pipeline.verdict.headline import headline, label

TEMPLATE_DIR = Path(__file__).parent
MAX_SHOWN_CHARS = 4000  # a 1 MB model output would drown the page; the JSONL has it whole


def clip(text) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + f" … [{len(text) - MAX_SHOWN_CHARS} more characters]"


def toc(verdict: dict, sections: list[tuple[str, str]]) -> dict:
    """The table of contents: the page's sections, each variant's decision and each suite of the run (its rows in
    the suite or perplexity table, else its line in the coverage table); the shipped suites params.yaml does not
    name are in the coverage table, not here (they would grow the first screen with every suite evals/ ships)."""
    suites = []
    for v in verdict["variants"].values():
        for name, entry in facts.coverage_states(v).items():
            if name not in suites and entry.get("state") != NOT_CONFIGURED:
                suites.append(name)
    return {"sections": sections, "variants": list(verdict["variants"]), "suites": suites}


def render_html(*, verdict: dict, results: dict, params, calib: dict | None, base: dict, human_size) -> str:
    env = Environment(loader=FileSystemLoader(TEMPLATE_DIR), autoescape=select_autoescape(["html"]))
    env.filters.update(share=figures.share, points=figures.points, relative=figures.relative, ppl=figures.perplexity,
                       kl=figures.kl, seconds=figures.seconds, ms=figures.ms, ratio=figures.ratio, rate=figures.rate,
                       clip=clip, size=lambda b: human_size(b) if b else figures.MISSING)
    screen = first_screen(verdict, base, human_size, params.verdict.speed_engine)  # every variant verdict.json names
    view = reviewer_view(verdict, base, human_size)
    verdict = decided_only(verdict)  # the sections below the first screen: each decided variant in full
    rows = sorted((s for v in verdict["variants"].values() for s in v["suites"].values()), key=lambda s: s["suite"])
    perplexity_rows = sorted((s for v in verdict["variants"].values() for s in (v.get("perplexity") or {}).values()),
                             key=lambda s: s["suite"])
    perplexity_suites = {s["suite"] for s in perplexity_rows}
    from pipeline.report.charts import latency_chart, sensitivity_chart, throughput_chart
    from pipeline.report.tables import document_rows, item_rows

    items_by_suite = item_rows({m: {s: i for s, i in suites.items() if s not in perplexity_suites}
                                for m, suites in results.items()})
    speed = verdict.get("speed") or {}
    charts = {"throughput": throughput_chart(speed), "ttft": latency_chart(speed, "ttft_ms", "time to first token"),
              "tpot": latency_chart(speed, "tpot_ms_stats", "time per output token")}
    fix_charts = {name: sensitivity_chart(v.get("fix"), f"fix-chart-detail-{name}") for name, v in verdict["variants"].items()}
    sections = [("coverage", "What each decision rests on"), ("decisions", "Each decision in full"),
                ("suites", "Accuracy suites"), ("perplexity", "Perplexity"), ("long-context", "Long context"),
                ("budgets", "Token budgets"), ("difficulty", "Accuracy by difficulty"), ("engines", "Engines"),
                ("flipped", "Flipped items"), ("items", "Every item"), ("judge", "Judge"), ("kl", "Drift (KL)"),
                ("speed", "Serving speed"), ("serving", "Where served"), ("size", "Size"),
                ("calibration", "Calibration data"), ("environment", "Environment")]
    lines = engine_lines(verdict)
    budgets = budget_rows(verdict)
    shown = {"suites": bool(rows), "perplexity": bool(perplexity_rows), "long-context": bool(verdict.get(TABLES_KEY)),
             "difficulty": bool(verdict.get("difficulty")), "engines": bool(lines), "budgets": bool(budgets)}
    sections = [(anchor, title) for anchor, title in sections if shown.get(anchor, True)]
    page = env.get_template("template.html").render(
        verdict=verdict, rows=rows, screen=screen, items_by_suite=items_by_suite, charts=charts,
        perplexity_rows=perplexity_rows, documents_by_suite=document_rows(results, perplexity_suites),
        calib=calib, base=base, params=params.model_dump(mode="json"), decision_class=DECISION_CLASS,
        label=label, label_class=LABEL_CLASS, chart_captions=CHART_CAPTIONS,
        results_read=bool(results),
        flipped_total=sum(bool(it["flipped"]) for items in items_by_suite.values() for it in items),
        toc=toc(verdict, sections), serving_engines=SERVING_ENGINES, engine_lines=lines, fix_charts=fix_charts,
        budget_rows=budgets, retrieval_tables=verdict.get(TABLES_KEY) or {},
        **_suite_anchors(verdict, rows, perplexity_rows), **view,
    )
    return printable(page)  # whatever the results hold: no control character but newline and tab


CHART_CAPTIONS = {  # every chart of the speed section, captioned (the forest's caption is in the template)
    "throughput": "Output tokens/s against requests in flight (max concurrency), a line per model: higher serves more.",
    "ttft": "Time to first token per model and concurrency: a bar from the median to p99, a tick at p90 (ms, log scale).",
    "tpot": "Time per output token per model and concurrency: a bar from the median to p99, a tick at p90 (ms, log scale)."}
PRINT_MAX_ROWS = 200  # a collapsed section of more rows is not printed; the page says so and names the file


def decided_only(verdict: dict) -> dict:
    """The verdict with only the variants it decided (each with its suites and coverage): any other entry
    verdict.json may hold (a variant not built, not evaluated) is on the first screen with its own label, and
    has nothing to show in the sections that give a decision in full."""
    decided = {name: v for name, v in verdict["variants"].items()
               if isinstance(v.get("suites"), dict) and isinstance(v.get("coverage"), dict)}
    return {**verdict, "variants": decided}


def reviewer_view(verdict: dict, base: dict, human_size) -> dict:
    """What the page shows beyond verdict.json's own figures: the headline (verdict.json's, or made from the
    verdict of an older report), the model-card recovery table, each model's own memory, the base's size, and the
    rows a collapsed section may hold and still print."""
    speed = verdict.get("speed") or {}
    quant = [v.get("quant") or {} for v in verdict["variants"].values()]
    return {"headline": verdict.get("headline") or headline(verdict), "recovery_table": recovery_table(verdict),
            "memory": {model: memory(row, human_size) for model, row in speed.items()},
            "base_size": base.get("size_bytes") or next((q["base_size_bytes"] for q in quant if q.get("base_size_bytes")), None),
            "print_max_rows": PRINT_MAX_ROWS}


def engine_lines(verdict: dict) -> list[dict]:
    """The report's Engines section: suites that met no engine defect grouped by the engines that scored them,
    then each suite that met one, on its own line (verdict.json's `engines`, pipeline/verdict/engines.py)."""
    grouped: dict[tuple, list[str]] = {}
    lines = []
    every = sorted({model for note in verdict.get("engines") or [] for model in note["models"]})
    for note in verdict.get("engines") or []:
        models = "every model" if note["models"] == every else ", ".join(note["models"])
        if note["defects"]:
            lines.append({"suites": [note["suite"]], "engines": note["engines"], "models": models,
                          "paired": note["paired"], "defects": note["defects"]})
        else:
            grouped.setdefault((tuple(note["engines"]), models, note["paired"]), []).append(note["suite"])
    return [{"suites": suites, "engines": list(engines), "models": models, "paired": paired, "defects": []}
            for (engines, models, paired), suites in grouped.items()] + lines


def budget_rows(verdict: dict) -> list[dict]:
    """The report's Token budgets section: per suite whose answers were generated thinking (or cut inside a
    reasoning), each model's answers, those cut inside the reasoning and inside the answer, and why the suite is not
    counted when its budget is too small for the base (verdict.json's `budgets`; pipeline/verdict/budget.py). A suite
    no model thinks on is left out: its answers cut at the cap are marked in the item tables."""
    return [{"suite": suite, **entry} for suite, entry in (verdict.get("budgets") or {}).items()
            if entry.get("too_small") or any(m["thinking"] or m["reasoning"] for m in entry["models"].values())]


def _suite_anchors(verdict: dict, rows: list[dict], perplexity_rows: list[dict]) -> dict:
    """Where the table of contents' link to each suite lands (#suite-<name>): the suite's first row in the suite
    or perplexity table, else (a suite not run, not applicable or not configured) its first line in the
    coverage table."""
    first = {}
    for s in [*rows, *perplexity_rows]:
        first.setdefault(s["suite"], (s["variant"], s["suite"]))
    coverage = {}
    for name, v in verdict["variants"].items():
        for suite in facts.coverage_states(v):
            if suite not in first:
                coverage.setdefault(suite, (name, suite))
    return {"first_of_suite": set(first.values()), "coverage_anchors": set(coverage.values())}
