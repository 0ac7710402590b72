"""HTML rendering: Jinja2 with autoescape on, charts as inline SVG built here."""

from __future__ import annotations

import math

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup, escape

from pipeline.report import TEMPLATE_DIR

DECISION_CLASS = {"GO": "go", "NO-GO": "nogo", "INCONCLUSIVE": "inconclusive", "UNINFORMATIVE": "uninformative",
                  "UNRELIABLE": "uninformative"}
MAX_SHOWN_CHARS = 4000  # a 1 MB model output would drown the page; the JSONL has it whole


def clip(text) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + f" … [{len(text) - MAX_SHOWN_CHARS} more characters]"


def pct(value) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * 100:.1f}%"


def signed_pts(value) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * 100:+.1f}"


def forest_plot(rows: list[dict]) -> Markup:
    """One row per variant x suite: the paired delta's interval against minus the margin."""
    if not rows:
        return Markup("")
    width, left, right, row_h = 640, 190, 30, 28
    lows = [r["ci_low"] for r in rows if not math.isnan(r["ci_low"])] + [-r["margin"] for r in rows] + [0]
    highs = [r["ci_high"] for r in rows if not math.isnan(r["ci_high"])] + [0]
    lo, hi = min(lows) - 0.02, max(highs) + 0.02
    scale = (width - left - right) / (hi - lo)
    x = lambda v: left + (v - lo) * scale  # noqa: E731
    height = row_h * len(rows) + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="Forest plot of paired deltas against margins">',
             f'<line x1="{x(0):.1f}" y1="10" x2="{x(0):.1f}" y2="{height - 25}" class="zero"/>']
    for i, r in enumerate(rows):
        y = 20 + i * row_h
        label = escape(f"{r['variant']} · {r['suite']}")
        parts.append(f'<text x="{left - 8}" y="{y + 4}" text-anchor="end" class="lbl">{label}</text>')
        parts.append(f'<line x1="{x(-r["margin"]):.1f}" y1="{y - 10}" x2="{x(-r["margin"]):.1f}" y2="{y + 10}" class="margin"/>')
        if not math.isnan(r["ci_low"]):
            cls = DECISION_CLASS.get(r["decision"], "inconclusive")
            parts.append(f'<line x1="{x(r["ci_low"]):.1f}" y1="{y}" x2="{x(r["ci_high"]):.1f}" y2="{y}" class="ci {cls}"/>')
            parts.append(f'<circle cx="{x(r["delta"]):.1f}" cy="{y}" r="4" class="pt {cls}"/>')
    axis_y = height - 12
    for tick in _ticks(lo, hi):
        parts.append(f'<text x="{x(tick):.1f}" y="{axis_y}" text-anchor="middle" class="tick">{tick * 100:+.0f}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _ticks(lo: float, hi: float) -> list[float]:
    step = 0.05 if hi - lo < 0.4 else 0.1
    start = math.ceil(lo / step) * step
    return [round(start + i * step, 4) for i in range(int((hi - start) / step) + 1)]


def render_html(*, verdict: dict, results: dict, params, calib: dict | None, base: dict, human_size) -> str:
    env = Environment(loader=FileSystemLoader(TEMPLATE_DIR), autoescape=select_autoescape(["html"]))
    env.filters.update(pct=pct, pts=signed_pts, clip=clip, size=lambda b: human_size(b) if b else "–")
    env.filters.update(ppl=lambda v: "–" if v is None or math.isnan(v) else f"{v:.3f}",
                       rel=lambda v: "–" if v is None or math.isnan(v) else f"{v * 100:+.1f}%")
    rows = [s for v in verdict["variants"].values() for s in v["suites"].values()]
    perplexity_rows = [s for v in verdict["variants"].values() for s in v.get("perplexity", {}).values()]
    perplexity_suites = {s["suite"] for s in perplexity_rows}
    items_by_suite = _item_rows({m: {s: i for s, i in suites.items() if s not in perplexity_suites}
                                 for m, suites in results.items()})
    return env.get_template("template.html").render(
        verdict=verdict, rows=rows, forest=forest_plot(rows), items_by_suite=items_by_suite,
        perplexity_rows=perplexity_rows, documents_by_suite=_document_rows(results, perplexity_suites),
        calib=calib, base=base, params=params.model_dump(mode="json"), decision_class=DECISION_CLASS,
    )


def _document_rows(results: dict, suites: set[str]) -> dict[str, list[dict]]:
    """Per perplexity suite, one row per document: its tokens and each model's perplexity on it."""
    by_suite: dict[str, list[dict]] = {}
    for suite in sorted(suites):
        rows = []
        for doc_id, base_doc in results.get("base", {}).get(suite, {}).items():
            models = {m: results[m].get(suite, {}).get(doc_id) for m in results}
            rows.append({"id": doc_id, "tokens": base_doc["n_tokens"], "text": base_doc.get("prompt", ""),
                         "ppl": {m: (math.exp(-d["loglikelihood"] / d["n_tokens"]) if d and d["n_tokens"] else None)
                                 for m, d in models.items()}})
        by_suite[suite] = rows
    return by_suite


def _item_rows(results: dict) -> dict[str, list[dict]]:
    """Per suite, one row per item: the target and every model's output side by side."""
    by_suite: dict[str, list[dict]] = {}
    variants = [v for v in results if v != "base"]
    for suite, base_items in results.get("base", {}).items():
        rows = []
        for item_id, base_item in base_items.items():
            outputs = {v: results[v].get(suite, {}).get(item_id) for v in variants}
            flags = [("flip" if (o and o["correct"] != base_item["correct"]) else "same") for o in outputs.values() if o]
            rows.append({"id": item_id, "prompt": base_item["prompt"], "target": base_item["target"],
                         "base": base_item, "variants": outputs,
                         "flipped": "flip" in flags})
        by_suite[suite] = rows
    return by_suite
