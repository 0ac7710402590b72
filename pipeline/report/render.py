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


def _num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _compact(value: float) -> str:
    """900000 -> '900k', 1250000 -> '1.25M', 7000 -> '7.0k', 950 -> '950'."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.0f}"


def _pts(value: float) -> str:
    return f"{value * 100:+.1f}"


def matrix_columns(verdict: dict) -> list[tuple[str, str]]:
    """The counted suites, as (kind, suite) in the order the matrix and forest show them: right/wrong
    suites, then perplexity suites, then the judge; a suite counted for any variant gets a column."""
    variants = verdict["variants"].values()
    plain = sorted({s for v in variants for s, d in v["suites"].items() if d["counted"]})
    ppl = sorted({s for v in variants for s, d in (v.get("perplexity") or {}).items() if d["counted"]})
    judge = [("judge", "judge")] if any((v.get("judge") or {}).get("counted") for v in variants) else []
    return [("suite", s) for s in plain] + [("perplexity", s) for s in ppl] + judge


def matrix_cell(variant: dict, kind: str, suite: str) -> dict | None:
    """One cell: the change in the suite's own unit, its interval, the margin, the decision, and the
    interval as harm (worse is positive) over the margin, for the forest plot."""
    if kind == "suite":
        s = variant["suites"].get(suite)
        if not s or not s["counted"]:
            return None
        return {"change": f"{_pts(s['delta'])} pts", "interval": f"[{_pts(s['ci_low'])}, {_pts(s['ci_high'])}]",
                "margin": f"−{s['margin'] * 100:.1f} pts", "decision": s["decision"], "n": f"{s['n']} items",
                "harm": (-s["delta"], -s["ci_high"], -s["ci_low"]), "margin_value": s["margin"]}
    if kind == "perplexity":
        s = (variant.get("perplexity") or {}).get(suite)
        if not s or not s["counted"]:
            return None
        return {"change": f"{s['change'] * 100:+.1f}%", "interval": f"[{_pts(s['ci_low'])}, {_pts(s['ci_high'])}]%",
                "margin": f"+{s['margin'] * 100:.0f}%", "decision": s["decision"], "n": f"{s['n']} docs",
                "harm": (s["change"], s["ci_low"], s["ci_high"]), "margin_value": s["margin"]}
    j = variant.get("judge")
    if not j or not j["counted"]:
        return None
    s = j["summary"]
    return {"change": f"win {s['win_rate']:.2f}", "interval": f"[{s['ci_low']:.2f}, {s['ci_high']:.2f}]",
            "margin": f"≥ {0.5 - j['margin']:.2f}", "decision": j["decision"], "n": f"{s['n']} pairs",
            "harm": (0.5 - s["win_rate"], 0.5 - s["ci_high"], 0.5 - s["ci_low"]), "margin_value": j["margin"]}


def served_by(serving) -> list[dict]:
    """quant.json's `serving` read as {engine: {serves, how}}; entries of another shape are skipped."""
    if not isinstance(serving, dict):
        return []
    return [{"engine": engine, "serves": bool(e.get("serves")), "how": str(e.get("how") or "")}
            for engine, e in serving.items() if isinstance(e, dict) and "serves" in e]


def first_screen(verdict: dict, base: dict, human_size) -> dict:
    """What the first screen shows: per variant its decision, why in a few words, a cell per counted
    suite, size, KL / top-1, where it is served, speed and capacity; the suites shown but not counted."""
    columns = matrix_columns(verdict)
    speed = verdict.get("speed") or {}
    rows = []
    for name, v in verdict["variants"].items():
        quant, kl, row = v.get("quant") or {}, v.get("kl"), speed.get(name)
        size = quant.get("size_bytes")
        base_size = base.get("size_bytes") or quant.get("base_size_bytes")
        speed_text, capacity_text = "not measured", ""
        if row:
            rate = row.get("batch1_tokens_per_s")
            cmp = v.get("speed") or {}
            speed_text = f"{row['engine']}: " + (f"{rate:.0f} tok/s at batch 1" if rate else "measured") + (
                f", {cmp['ratio']:.2f}× base" if cmp.get("comparable") else "")
            cap = row.get("capacity") or {}
            parts = []
            if _num(cap.get("goodput_tok_s_per_gpu")):
                parts.append(f"goodput {_compact(cap['goodput_tok_s_per_gpu'])} tok/s/GPU")
            if _num(cap.get("kv_cache_tokens")):
                parts.append(f"KV cache {_compact(cap['kv_cache_tokens'])} tokens")
            if _num(cap.get("max_context_batch1")):
                parts.append(f"context {_compact(cap['max_context_batch1'])} at batch 1")
            capacity_text = " · ".join(parts) if parts else "capacity not measured"
        rows.append({
            "name": name, "scheme": quant.get("scheme"), "decision": v["decision"], "why": v.get("why") or "",
            "next_steps": v.get("next_steps") or [],
            "cells": {f"{kind}:{suite}": matrix_cell(v, kind, suite) for kind, suite in columns},
            "size": human_size(size) if size else None,
            "size_share": f"{100 * size / base_size:.0f}% of base" if size and base_size else None,
            "kl": (f"{kl['kl_mean']:.3f}", f"{kl['top1_agreement'] * 100:.1f}%") if kl else None,
            "served": served_by(v.get("serving")), "speed": speed_text, "capacity": capacity_text,
        })
    not_counted = []
    for name, v in verdict["variants"].items():
        for suite, s in v["suites"].items():
            if not s["counted"]:
                not_counted.append((suite, "base at the floor or ceiling" if s["decision"] == "UNINFORMATIVE"
                                    else "no paired items"))
        for suite, s in (v.get("perplexity") or {}).items():
            if not s["counted"]:
                not_counted.append((suite, "too few documents"))
        j = v.get("judge")
        if j and not j["counted"]:
            not_counted.append(("judge", "unreliable" if j["decision"] == "UNRELIABLE" else "no pair judged"
                                if not j["summary"].get("n") else "reference mode"))
        for suite in v.get("not_applicable") or {}:
            not_counted.append((suite, "not applicable"))
    seen = {}
    for suite, why in not_counted:
        seen.setdefault(suite, why)
    return {"columns": columns, "rows": rows, "not_counted": sorted(seen.items()),
            "forest": forest_plot(columns, rows)}


def forest_plot(columns: list[tuple[str, str]], rows: list[dict]) -> Markup:
    """Every counted suite of every variant: its interval against its own margin. Each interval is drawn
    as harm (worse to the right: a drop in accuracy, a rise in perplexity, a win rate under 0.5) divided by
    its suite's margin, so every margin sits on the one red line at 1; the labels give the suite's own units."""
    marks = [(r["name"], suite, r["cells"][f"{kind}:{suite}"]) for r in rows for kind, suite in columns
             if r["cells"].get(f"{kind}:{suite}")]
    if not marks:
        return Markup("")
    width, left, right, row_h, top = 1180, 200, 330, 15, 18
    # a zero margin (allowed for right/wrong suites and the judge) has its boundary at 0, not on the red line:
    # such a row is drawn in hundredths (points, percent), and its label gives its margin
    scaled = [tuple(v / (c["margin_value"] if c["margin_value"] > 0 else 0.01) for v in c["harm"]) for *_, c in marks]
    lo = max(-3.0, min(-0.5, min(s[1] for s in scaled)) - 0.1)
    hi = min(6.0, max(1.5, max(s[2] for s in scaled)) + 0.1)
    scale = (width - left - right) / (hi - lo)
    x = lambda v: left + (min(max(v, lo), hi) - lo) * scale  # noqa: E731
    height = top + row_h * len(marks) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" id="forest" '
             f'aria-label="Forest plot: each counted suite against its own margin">',
             f'<text x="{left - 8}" y="12" text-anchor="end" class="lbl muted-svg">variant · suite</text>',
             f'<text x="{width - right + 10}" y="12" class="lbl muted-svg">change [95 % interval] / margin</text>',
             f'<line x1="{x(0):.1f}" y1="{top - 6}" x2="{x(0):.1f}" y2="{height - 26}" class="zero"/>',
             f'<line x1="{x(1):.1f}" y1="{top - 6}" x2="{x(1):.1f}" y2="{height - 26}" class="margin"/>']
    previous = None
    for i, ((name, suite, c), (h, low, high)) in enumerate(zip(marks, scaled)):
        y = top + i * row_h + 6
        if previous is not None and name != previous:
            parts.append(f'<line x1="10" x2="{width - 10}" y1="{y - row_h / 2:.1f}" y2="{y - row_h / 2:.1f}" class="grid"/>')
        previous = name
        cls = DECISION_CLASS.get(c["decision"], "inconclusive")
        parts.append(f'<text x="{left - 8}" y="{y + 4}" text-anchor="end" class="lbl">{escape(name)} · {escape(suite)}</text>')
        parts.append(f'<line x1="{x(low):.1f}" y1="{y}" x2="{x(high):.1f}" y2="{y}" class="ci {cls}"/>')
        parts.append(f'<circle cx="{x(h):.1f}" cy="{y}" r="4" class="pt {cls}"/>')
        parts.append(f'<text x="{width - right + 10}" y="{y + 4}" class="lbl">{escape(c["change"])} '
                     f'{escape(c["interval"])} / {escape(c["margin"])} · {escape(c["decision"])}</text>')
    axis_y = height - 12
    for tick in _ticks_margin(lo, hi):
        label = "margin" if tick == 1 else "0" if tick == 0 else f"{tick:g}×"
        parts.append(f'<text x="{x(tick):.1f}" y="{axis_y}" text-anchor="middle" class="tick">{label}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _ticks_margin(lo: float, hi: float) -> list[float]:
    step = 0.5 if hi - lo <= 4 else 1.0
    start = math.ceil(lo / step) * step
    return [round(start + i * step, 4) for i in range(int((hi - start) / step + 1e-9) + 1)]


def render_html(*, verdict: dict, results: dict, params, calib: dict | None, base: dict, human_size) -> str:
    env = Environment(loader=FileSystemLoader(TEMPLATE_DIR), autoescape=select_autoescape(["html"]))
    env.filters.update(pct=pct, pts=signed_pts, clip=clip, size=lambda b: human_size(b) if b else "–")
    env.filters.update(ppl=lambda v: "–" if v is None or math.isnan(v) else f"{v:.3f}",
                       rel=lambda v: "–" if v is None or math.isnan(v) else f"{v * 100:+.1f}%")
    rows = [s for v in verdict["variants"].values() for s in v["suites"].values()]
    screen = first_screen(verdict, base, human_size)
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
        verdict=verdict, rows=rows, screen=screen, items_by_suite=items_by_suite, charts=charts,
        perplexity_rows=perplexity_rows, documents_by_suite=document_rows(results, perplexity_suites),
        calib=calib, base=base, params=params.model_dump(mode="json"), decision_class=DECISION_CLASS,
    )
