"""Inline SVG charts: no script, no network, every label escaped.

`throughput_chart`: output tokens/s against max concurrency (log axis), one line per model.
`latency_chart`: one metric's median, p90 and p99 (TTFT or TPOT) per model and concurrency: a bar from
the median to p99 with a tick at p90, on a log axis in milliseconds.
`sensitivity_chart`: beside a NO-GO and its fix, the share of the variant's KL each of its most costly groups
removes when restored, the groups the fix keeps in 8 bits highlighted; drawn 360 px wide, read on a phone.
"""

from __future__ import annotations

import math

from markupsafe import Markup, escape

SERIES = 6  # colours s0..s5 in the template's CSS, reused in order


def _svg_open(width: int, height: int, element_id: str, label: str) -> str:
    """An SVG that scales down to the width it is given (viewBox), never wider than drawn."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
            f'preserveAspectRatio="xMinYMin meet" role="img" aria-label="{escape(label)}" class="chart" '
            f'id="{element_id}" style="max-width: {width}px">')


def _log_ticks(lo: float, hi: float) -> list[float]:
    ticks, value = [], 10 ** math.floor(math.log10(lo))
    while value <= hi * 1.0001:
        for step in (1, 2, 5):
            if lo <= value * step <= hi * 1.0001:
                ticks.append(value * step)
        value *= 10
    return ticks


def _fmt(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def throughput_chart(speed: dict[str, dict]) -> Markup:
    """speed: {model: speed row (pipeline.stages.report.speed_row)}."""
    series = {name: [(l["concurrency"], l["output_tokens_per_s"]) for l in row.get("levels") or []
                     if l.get("output_tokens_per_s")] for name, row in speed.items()}
    series = {name: points for name, points in series.items() if points}
    if not series:
        return Markup("")
    width, height, left, right, top, bottom = 640, 300, 70, 150, 15, 40
    xs = sorted({c for points in series.values() for c, _ in points})
    y_max = max(v for points in series.values() for _, v in points) * 1.08
    x_lo, x_hi = math.log2(xs[0]), math.log2(xs[-1]) if xs[-1] > xs[0] else math.log2(xs[0]) + 1
    x = lambda c: left + (math.log2(c) - x_lo) / (x_hi - x_lo) * (width - left - right)  # noqa: E731
    y = lambda v: top + (1 - v / y_max) * (height - top - bottom)  # noqa: E731
    parts = [_svg_open(width, height, "throughput-chart", "Output tokens per second against concurrency")]
    for tick in _nice_ticks(y_max):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" class="grid"/>'
                     f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end" class="tick">{tick:,.0f}</text>')
    for c in xs:
        parts.append(f'<text x="{x(c):.1f}" y="{height - bottom + 16}" text-anchor="middle" class="tick">{c}</text>')
    parts.append(f'<text x="{(left + width - right) / 2:.0f}" y="{height - 6}" text-anchor="middle" class="lbl">'
                 f'requests in flight (max concurrency)</text>')
    parts.append(f'<text x="14" y="{(top + height - bottom) / 2:.0f}" transform="rotate(-90 14 '
                 f'{(top + height - bottom) / 2:.0f})" text-anchor="middle" class="lbl">output tokens/s</text>')
    for i, (name, points) in enumerate(series.items()):
        cls = f"s{i % SERIES}"
        path = " ".join(f"{x(c):.1f},{y(v):.1f}" for c, v in points)
        parts.append(f'<polyline points="{path}" class="line {cls}"/>')
        parts += [f'<circle cx="{x(c):.1f}" cy="{y(v):.1f}" r="3.5" class="pt {cls}"/>' for c, v in points]
        ly = top + 14 + 18 * i
        parts.append(f'<line x1="{width - right + 12}" x2="{width - right + 32}" y1="{ly - 4}" y2="{ly - 4}" '
                     f'class="line {cls}"/><text x="{width - right + 38}" y="{ly}" class="lbl">{escape(name)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _nice_ticks(top: float) -> list[float]:
    raw = top / 5
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [step * i for i in range(int(top / step) + 1)]


def latency_chart(speed: dict[str, dict], metric: str, title: str) -> Markup:
    """metric: 'ttft_ms' or 'tpot_ms_stats' (per level: {mean, median, p90, p99} in ms)."""
    rows = [(name, l["concurrency"], l[metric]) for name, row in speed.items() for l in row.get("levels") or []
            if l.get(metric) and l[metric].get("median")]
    if not rows:
        return Markup("")
    width, left, right, row_h, top = 640, 130, 20, 18, 10
    height = top + row_h * len(rows) + 40
    lo = min(r[2]["median"] for r in rows) / 1.3
    hi = max(r[2]["p99"] for r in rows) * 1.3
    scale = (width - left - right) / (math.log10(hi) - math.log10(lo))
    x = lambda v: left + (math.log10(max(v, lo)) - math.log10(lo)) * scale  # noqa: E731
    names = list(speed)
    parts = [_svg_open(width, height, f"{metric}-chart", title)]
    for tick in _log_ticks(lo, hi):
        parts.append(f'<line x1="{x(tick):.1f}" x2="{x(tick):.1f}" y1="{top}" y2="{height - 30}" class="grid"/>'
                     f'<text x="{x(tick):.1f}" y="{height - 16}" text-anchor="middle" class="tick">{_fmt(tick)}</text>')
    parts.append(f'<text x="{(left + width) / 2:.0f}" y="{height - 2}" text-anchor="middle" class="lbl">'
                 f'{escape(title)}: median to p99 (tick: p90), ms, log scale</text>')
    for i, (name, concurrency, stats) in enumerate(rows):
        yy = top + 10 + i * row_h
        cls = f"s{names.index(name) % SERIES}"
        parts.append(f'<text x="{left - 8}" y="{yy + 4}" text-anchor="end" class="tick">{escape(name)} @{concurrency}'
                     f'</text>')
        # the figures themselves are in the latency table under the charts, not in a tooltip
        parts.append(f'<line x1="{x(stats["median"]):.1f}" x2="{x(stats["p99"]):.1f}" y1="{yy}" y2="{yy}" '
                     f'class="range {cls}"/>')
        parts.append(f'<circle cx="{x(stats["median"]):.1f}" cy="{yy}" r="3.5" class="pt {cls}"/>')
        parts.append(f'<line x1="{x(stats["p90"]):.1f}" x2="{x(stats["p90"]):.1f}" y1="{yy - 5}" y2="{yy + 5}" '
                     f'class="range {cls}"/>')
    parts.append("</svg>")
    return Markup("".join(parts))


def _short(name: str, limit: int = 20) -> str:
    """A group's name without the usual prefixes, its end kept: model.layers.23.self_attn.qkv_proj ->
    23.attn.qkv_proj."""
    for prefix in ("model.language_model.layers.", "model.layers.", "language_model.model.layers.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    name = name.replace(".self_attn.", ".attn.")
    return name if len(name) <= limit else "…" + name[-(limit - 1):]


def sensitivity_chart(fix: dict | None, element_id: str) -> Markup:
    """fix: verdict.json's variants.<V>.fix; a bar per group of its `ranking` (most KL removed first), the share of
    V's KL restoring that group removes, kept groups highlighted and labelled."""
    rows = [row for row in (fix or {}).get("ranking") or [] if row.get("share_removed") is not None]
    if not rows:
        return Markup("")
    width, left, right, row_h, top = 360, 128, 40, 17, 6
    height = top + row_h * len(rows) + 34
    high = max(max(r["share_removed"] for r in rows), 1e-9)
    scale = (width - left - right) / high
    kept = sum(r["kept"] for r in rows)
    shown = f"the first {len(rows)} of {fix.get('ranked_groups') or len(rows)} groups"
    parts = [_svg_open(width, height, element_id, f"Share of the variant's KL each group removes when restored, "
                                                   f"{shown}; {kept} kept in 8 bits")]
    for i, row in enumerate(rows):
        y = top + i * row_h
        cls = "kept" if row["kept"] else "bar"
        w = max(row["share_removed"], 0.0) * scale
        parts.append(f'<text x="{left - 6}" y="{y + 12}" text-anchor="end" class="tick{" kept-label" if row["kept"] else ""}">'
                     f'{escape(_short(row["name"]))}</text>')
        parts.append(f'<rect x="{left}" y="{y + 3}" width="{w:.1f}" height="{row_h - 5}" class="{cls}"/>')
        parts.append(f'<text x="{left + w + 4:.1f}" y="{y + 12}" class="tick">{row["share_removed"] * 100:.0f}%</text>')
    legend = top + row_h * len(rows) + 14
    parts.append(f'<rect x="{left}" y="{legend - 9}" width="10" height="10" class="kept"/><text x="{left + 14}" '
                 f'y="{legend}" class="tick">kept in 8 bits</text><rect x="{left + 104}" y="{legend - 9}" width="10" '
                 f'height="10" class="bar"/><text x="{left + 118}" y="{legend}" class="tick">4 bits</text>')
    parts.append(f'<text x="4" y="{legend + 16}" class="tick">share of the KL that restoring the group removes</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
