"""HTML rendering: Jinja2 with autoescape on, charts as inline SVG built here."""

from __future__ import annotations

import math
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup, escape

import pipeline.verdict.figures as figures


TEMPLATE_DIR = Path(__file__).parent
DECISION_CLASS = {"GO": "go", "NO-GO": "nogo", "INCONCLUSIVE": "inconclusive", "UNINFORMATIVE": "uninformative",
                  "UNRELIABLE": "uninformative"}
MAX_SHOWN_CHARS = 4000  # a 1 MB model output would drown the page; the JSONL has it whole


def clip(text) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + f" … [{len(text) - MAX_SHOWN_CHARS} more characters]"


def _num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _compact(value: float) -> str:
    """900000 -> '900k', 1250000 -> '1.25M', 7000 -> '7.0k', 950 -> '950'."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.0f}"


def matrix_columns(verdict: dict) -> list[tuple[str, str]]:
    """The counted suites, as (kind, suite) in the order the matrix and forest show them: right/wrong
    suites, then perplexity suites, then the judge; a suite counted for any variant gets a column."""
    variants = verdict["variants"].values()
    plain = sorted({s for v in variants for s, d in v["suites"].items() if d["counted"]})
    ppl = sorted({s for v in variants for s, d in (v.get("perplexity") or {}).items() if d["counted"]})
    judge = [("judge", "judge")] if any((v.get("judge") or {}).get("counted") for v in variants) else []
    return [("suite", s) for s in plain] + [("perplexity", s) for s in ppl] + judge


def matrix_cell(variant: dict, kind: str, suite: str) -> dict | None:
    """One cell: the change in the suite's own unit, its interval, the recovery, the margin, the decision, and
    the interval as harm (worse is positive) over the margin, for the forest plot."""
    if kind == "suite":
        s = variant["suites"].get(suite)
        if not s or not s["counted"]:
            return None
        return {"change": f"{figures.points(s['delta'])} pts",
                "interval": f"[{figures.points(s['ci_low'])}, {figures.points(s['ci_high'])}]",
                "recovery": figures.share(s.get("recovery")), "margin": f"{figures.points(-s['margin'])} pts",
                "decision": s["decision"], "n": f"{s['n']} items",
                "harm": (-s["delta"], -s["ci_high"], -s["ci_low"]), "margin_value": s["margin"]}
    if kind == "perplexity":
        s = (variant.get("perplexity") or {}).get(suite)
        if not s or not s["counted"]:
            return None
        return {"change": figures.relative(s["change"]),
                "interval": f"[{figures.relative(s['ci_low'])}, {figures.relative(s['ci_high'])}]",
                "recovery": figures.share(s.get("recovery")), "margin": figures.relative(s["margin"]),
                "decision": s["decision"], "n": f"{s['n']} docs",
                "harm": (s["change"], s["ci_low"], s["ci_high"]), "margin_value": s["margin"]}
    j = variant.get("judge")
    if not j or not j["counted"]:
        return None
    s = j["summary"]
    return {"change": f"win {figures.share(s['win_rate'])}",
            "interval": f"[{figures.share(s['ci_low'])}, {figures.share(s['ci_high'])}]", "recovery": None,
            "margin": f"≥ {figures.share(0.5 - j['margin'])}", "decision": j["decision"], "n": f"{s['n']} pairs",
            "harm": (0.5 - s["win_rate"], 0.5 - s["ci_high"], 0.5 - s["ci_low"]), "margin_value": j["margin"]}


SERVING_ENGINES = ("vllm", "lmdeploy")  # the engines a variant is deployed on; hf runs everything in-process


def served_by(serving, variant: str) -> list[dict]:
    """Where the variant is served, one of three states per serving engine: shown (the run that showed it),
    refused (the engine's error, one line), not tried (the command to try, with the variant's folder)."""
    if not isinstance(serving, dict):
        return []
    rows = []
    for engine in SERVING_ENGINES:
        e = serving.get(engine)
        if not isinstance(e, dict):
            continue
        how = str(e.get("how") or "").replace("DIR", f"models/{variant}")
        status = e.get("status") or ("shown" if e.get("serves") else "not shown")
        if e.get("serves"):
            state, evidence = "shown", e.get("evidence")
            detail = how + (f"; evidence: {evidence}" if evidence else "")
        elif status in ("refused", "cannot"):
            state, detail = "refused", how.split("; ")[0]
        else:
            state = "not tried"
            detail = how.split("try: ", 1)[1] if "try: " in how else how
        rows.append({"engine": engine, "state": state, "detail": detail})
    return rows


def first_screen(verdict: dict, base: dict, human_size) -> dict:
    """What the first screen shows: per variant its decision, what it rests on and why in a few words, a cell
    per counted suite, recovery, size, KL / top-1, where it is served, speed and capacity (or the command that
    measures them); the suites shown but not counted."""
    columns = matrix_columns(verdict)
    speed = verdict.get("speed") or {}
    rows = []
    for name, v in verdict["variants"].items():
        quant, kl, row = v.get("quant") or {}, v.get("kl"), speed.get(name)
        size = quant.get("size_bytes")
        base_size = base.get("size_bytes") or quant.get("base_size_bytes")
        speed_text, capacity_text = None, ""
        if row:
            rate = row.get("batch1_tokens_per_s")
            cmp = v.get("speed") or {}
            speed_text = f"{row['engine']}: " + (f"{figures.rate(rate)} tok/s at batch 1" if rate else "measured") + (
                f", {figures.ratio(cmp['ratio'])} base" if cmp.get("comparable") else "")
            cap = row.get("capacity") or {}
            parts = []
            if _num(cap.get("goodput_tok_s_per_gpu")):
                parts.append(f"goodput {_compact(cap['goodput_tok_s_per_gpu'])} tok/s/GPU")
            if _num(cap.get("kv_cache_tokens")):
                parts.append(f"KV cache {_compact(cap['kv_cache_tokens'])} tokens")
            if _num(cap.get("max_context_batch1")):
                parts.append(f"context {_compact(cap['max_context_batch1'])} at batch 1")
            capacity_text = " · ".join(parts) if parts else "capacity not measured"
        recovery = v.get("recovery") or {}
        rows.append({
            "name": name, "scheme": quant.get("scheme"), "decision": v["decision"], "why": v.get("why") or "",
            "coverage": (v.get("coverage") or {}).get("line") or "", "next_steps": v.get("next_steps") or [],
            "recovery": (figures.share(recovery["accuracy"]), len(recovery.get("suites") or []))
            if recovery.get("accuracy") is not None else None,
            "cells": {f"{kind}:{suite}": matrix_cell(v, kind, suite) for kind, suite in columns},
            "size": human_size(size) if size else None,
            "size_share": f"{figures.share(size / base_size)} of base" if size and base_size else None,
            "kl": (figures.kl(kl["kl_mean"]), figures.share(kl["top1_agreement"])) if kl else None,
            "served": served_by(v.get("serving"), name), "speed": speed_text, "capacity": capacity_text,
            # the variant's own bench (the base's, when missing too, heads the column once)
            "speed_commands": [c for c in v.get("speed_commands") or [] if c.startswith("quantize bench models/")
                               and not c.startswith("quantize bench models/base")],
        })
    base_bench = sorted({c for v in verdict["variants"].values() for c in v.get("speed_commands") or []
                         if c.startswith("quantize bench models/base")})
    return {"columns": columns, "rows": rows, "not_counted": _not_counted(verdict), "base_bench": base_bench,
            "forest": forest_plot(columns, rows), "forest_narrow": forest_plot_narrow(columns, rows)}


def _not_counted(verdict: dict) -> list[tuple[str, str]]:
    """(suite, why) of every suite shown but not counted for some variant, the first reason given for each."""
    not_counted = []
    for v in verdict["variants"].values():
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
    return sorted(seen.items())


def _forest_marks(columns: list[tuple[str, str]], rows: list[dict]) -> tuple[list, list, float, float]:
    """Every counted suite of every variant as (variant, suite, cell), its interval as harm over its margin,
    and the axis range. A zero margin (allowed for right/wrong suites and the judge) has its boundary at 0, not
    on the red line: such a row is drawn in hundredths (points, percent), and its label gives its margin."""
    marks = [(r["name"], suite, r["cells"][f"{kind}:{suite}"]) for r in rows for kind, suite in columns
             if r["cells"].get(f"{kind}:{suite}")]
    scaled = [tuple(v / (c["margin_value"] if c["margin_value"] > 0 else 0.01) for v in c["harm"]) for *_, c in marks]
    if not marks:
        return marks, scaled, 0.0, 1.0
    lo = max(-3.0, min(-0.5, min(s[1] for s in scaled)) - 0.1)
    hi = min(6.0, max(1.5, max(s[2] for s in scaled)) + 0.1)
    return marks, scaled, lo, hi


def _svg_open(width: int, height: int, element_id: str, label: str, css_class: str) -> str:
    """An SVG that scales to the width it is given (viewBox), never wider than drawn."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
            f'height="{height}" preserveAspectRatio="xMinYMin meet" role="img" id="{element_id}" '
            f'class="{css_class}" style="max-width: {width}px" aria-label="{escape(label)}">')


def forest_plot(columns: list[tuple[str, str]], rows: list[dict]) -> Markup:
    """Every counted suite of every variant: its interval against its own margin. Each interval is drawn
    as harm (worse to the right: a drop in accuracy, a rise in perplexity, a win rate under 50%) divided by
    its suite's margin, so every margin sits on the one red line at 1; the labels give the suite's own units."""
    marks, scaled, lo, hi = _forest_marks(columns, rows)
    if not marks:
        return Markup("")
    width, left, right, row_h, top = 960, 190, 330, 13, 16
    scale = (width - left - right) / (hi - lo)
    x = lambda v: left + (min(max(v, lo), hi) - lo) * scale  # noqa: E731
    height = top + row_h * len(marks) + 26
    parts = [_svg_open(width, height, "forest", "Forest plot: each counted suite against its own margin", "chart wide"),
             f'<text x="{left - 8}" y="12" text-anchor="end" class="lbl muted-svg">variant · suite</text>',
             f'<text x="{width - right + 10}" y="12" class="lbl muted-svg">change [95% interval] / margin</text>',
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
    axis_y = height - 8
    for tick in _ticks_margin(lo, hi):
        label = "margin" if tick == 1 else "0" if tick == 0 else f"{tick:g}×"
        parts.append(f'<text x="{x(tick):.1f}" y="{axis_y}" text-anchor="middle" class="tick">{label}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def forest_plot_narrow(columns: list[tuple[str, str]], rows: list[dict]) -> Markup:
    """The same forest for a phone's width: each suite's label on its own line above its interval."""
    marks, scaled, lo, hi = _forest_marks(columns, rows)
    if not marks:
        return Markup("")
    width, pad, row_h, top = 360, 10, 44, 8
    scale = (width - 2 * pad) / (hi - lo)
    x = lambda v: pad + (min(max(v, lo), hi) - lo) * scale  # noqa: E731
    height = top + row_h * len(marks) + 22
    parts = [_svg_open(width, height, "forest-narrow", "Forest plot: each counted suite against its own margin",
                       "chart narrow"),
             f'<line x1="{x(0):.1f}" y1="{top}" x2="{x(0):.1f}" y2="{height - 20}" class="zero"/>',
             f'<line x1="{x(1):.1f}" y1="{top}" x2="{x(1):.1f}" y2="{height - 20}" class="margin"/>']
    for i, ((name, suite, c), (h, low, high)) in enumerate(zip(marks, scaled)):
        y = top + i * row_h
        cls = DECISION_CLASS.get(c["decision"], "inconclusive")
        parts.append(f'<text x="{pad}" y="{y + 11}" class="lbl">{escape(name)} · {escape(suite)} · '
                     f'{escape(c["decision"])}</text>')
        parts.append(f'<text x="{pad}" y="{y + 24}" class="tick">{escape(c["change"])} {escape(c["interval"])} / '
                     f'{escape(c["margin"])}</text>')
        parts.append(f'<line x1="{x(low):.1f}" y1="{y + 34}" x2="{x(high):.1f}" y2="{y + 34}" class="ci {cls}"/>')
        parts.append(f'<circle cx="{x(h):.1f}" cy="{y + 34}" r="4" class="pt {cls}"/>')
    for tick in _ticks_margin(lo, hi):
        label = "margin" if tick == 1 else "0" if tick == 0 else f"{tick:g}×"
        parts.append(f'<text x="{x(tick):.1f}" y="{height - 6}" text-anchor="middle" class="tick">{label}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _ticks_margin(lo: float, hi: float) -> list[float]:
    step = 0.5 if hi - lo <= 4 else 1.0
    start = math.ceil(lo / step) * step
    return [round(start + i * step, 4) for i in range(int((hi - start) / step + 1e-9) + 1)]


def toc(verdict: dict, sections: list[tuple[str, str]]) -> dict:
    """The table of contents: the page's sections, each variant's decision and each suite (its rows in the
    suite or perplexity table, else its line in the coverage table)."""
    suites = []
    for v in verdict["variants"].values():
        for name in (v.get("coverage") or {}).get("suites") or {}:
            if name not in suites:
                suites.append(name)
    return {"sections": sections, "variants": list(verdict["variants"]), "suites": suites}


def render_html(*, verdict: dict, results: dict, params, calib: dict | None, base: dict, human_size) -> str:
    env = Environment(loader=FileSystemLoader(TEMPLATE_DIR), autoescape=select_autoescape(["html"]))
    env.filters.update(share=figures.share, points=figures.points, relative=figures.relative, ppl=figures.perplexity,
                       kl=figures.kl, seconds=figures.seconds, ms=figures.ms, ratio=figures.ratio, rate=figures.rate,
                       clip=clip, size=lambda b: human_size(b) if b else figures.MISSING)
    rows = sorted((s for v in verdict["variants"].values() for s in v["suites"].values()),
                  key=lambda s: s["suite"])
    screen = first_screen(verdict, base, human_size)
    perplexity_rows = sorted((s for v in verdict["variants"].values() for s in (v.get("perplexity") or {}).values()),
                             key=lambda s: s["suite"])
    perplexity_suites = {s["suite"] for s in perplexity_rows}
    from pipeline.report.charts import latency_chart, throughput_chart
    from pipeline.report.tables import document_rows, item_rows

    items_by_suite = item_rows({m: {s: i for s, i in suites.items() if s not in perplexity_suites}
                                for m, suites in results.items()})
    speed = verdict.get("speed") or {}
    charts = {"throughput": throughput_chart(speed), "ttft": latency_chart(speed, "ttft_ms", "time to first token"),
              "tpot": latency_chart(speed, "tpot_ms_stats", "time per output token")}
    sections = [("coverage", "What each decision rests on"), ("decisions", "Each decision in full"),
                ("suites", "Accuracy suites"), ("perplexity", "Perplexity"), ("long-context", "Long context"),
                ("engines", "Engines"),
                ("flipped", "Flipped items"), ("items", "Every item"), ("judge", "Judge"), ("kl", "Drift (KL)"),
                ("speed", "Serving speed"), ("serving", "Where served"), ("size", "Size"),
                ("calibration", "Calibration data"), ("environment", "Environment")]
    lines = engine_lines(verdict)
    shown = {"suites": bool(rows), "perplexity": bool(perplexity_rows), "long-context": bool(verdict.get("long_context")),
             "engines": bool(lines)}
    sections = [(anchor, title) for anchor, title in sections if shown.get(anchor, True)]
    return env.get_template("template.html").render(
        verdict=verdict, rows=rows, screen=screen, items_by_suite=items_by_suite, charts=charts,
        perplexity_rows=perplexity_rows, documents_by_suite=document_rows(results, perplexity_suites),
        calib=calib, base=base, params=params.model_dump(mode="json"), decision_class=DECISION_CLASS,
        toc=toc(verdict, sections), serving_engines=SERVING_ENGINES, engine_lines=lines,
        **_suite_anchors(verdict, rows, perplexity_rows),
    )


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


def _suite_anchors(verdict: dict, rows: list[dict], perplexity_rows: list[dict]) -> dict:
    """Where the table of contents' link to each suite lands (#suite-<name>): the suite's first row in the suite
    or perplexity table, else (a suite not run, not applicable or not configured) its first line in the
    coverage table."""
    first = {}
    for s in [*rows, *perplexity_rows]:
        first.setdefault(s["suite"], (s["variant"], s["suite"]))
    coverage = {}
    for name, v in verdict["variants"].items():
        for suite in (v.get("coverage") or {}).get("suites") or {}:
            if suite not in first:
                coverage.setdefault(suite, (name, suite))
    return {"first_of_suite": set(first.values()), "coverage_anchors": set(coverage.values())}
