"""The forest plot of the first screen: every counted suite of every variant, its interval against its own
margin, as inline SVG (a wide one, and a narrow one for a phone's width)."""

from __future__ import annotations

import math

from markupsafe import Markup, escape

from pipeline.report.labels import DECISION_CLASS


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

