"""HTML rendering: Jinja2 with autoescape on, charts as inline SVG built here."""

from __future__ import annotations

import math
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup, escape


TEMPLATE_DIR = Path(__file__).parent
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
    perplexity_rows = [s for v in verdict["variants"].values() for s in (v.get("perplexity") or {}).values()]
    perplexity_suites = {s["suite"] for s in perplexity_rows}
    from pipeline.report.charts import latency_chart, throughput_chart
    from pipeline.report.tables import document_rows, item_rows

    items_by_suite = item_rows({m: {s: i for s, i in suites.items() if s not in perplexity_suites}
                                for m, suites in results.items()})
    speed = verdict.get("speed") or {}
    charts = {"throughput": throughput_chart(speed), "ttft": latency_chart(speed, "ttft_ms", "time to first token"),
              "tpot": latency_chart(speed, "tpot_ms_stats", "time per output token")}
    return env.get_template("template.html").render(
        verdict=verdict, rows=rows, forest=forest_plot(rows), items_by_suite=items_by_suite, charts=charts,
        perplexity_rows=perplexity_rows, documents_by_suite=document_rows(results, perplexity_suites),
        calib=calib, base=base, params=params.model_dump(mode="json"), decision_class=DECISION_CLASS,
    )
