"""One number format per kind of figure, for every sentence the verdict writes and every figure the page shows.

    share        a score, a recovery, an agreement or a win rate           45.0%   (1 decimal)
    points       a change in accuracy, its interval, its margin           +1.23   (percentage points, 2 decimals)
    relative     a relative change (perplexity), its interval, its margin +2.7%   (1 decimal)
    perplexity   a perplexity                                              12.345  (3 decimals)
    kl           a KL divergence, nats per token                          0.0560  (4 decimals)
    seconds      a duration in seconds                                     125 s   (whole seconds)
    ms           a latency                                                 6.3 ms  (1 decimal)
    ratio        a variant's figure over the base's                        1.5×    (2 significant digits)
    rate         tokens per second                                         1,234   (whole)

A missing figure (None, NaN) is an en dash.
"""

from __future__ import annotations

import math

MISSING = "–"


def _missing(value) -> bool:
    return value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)


def share(value) -> str:
    """0.45 -> '45.0%'."""
    return MISSING if _missing(value) else f"{value * 100:.1f}%"


def points(value) -> str:
    """A change in accuracy (a fraction) as signed percentage points: -0.0312 -> '-3.12'."""
    return MISSING if _missing(value) else f"{value * 100:+.2f}"


def relative(value) -> str:
    """A relative change: 0.027 -> '+2.7%'."""
    return MISSING if _missing(value) else f"{value * 100:+.1f}%"


def perplexity(value) -> str:
    return MISSING if _missing(value) else f"{value:.3f}"


def kl(value) -> str:
    return MISSING if _missing(value) else f"{value:.4f}"


def seconds(value) -> str:
    return MISSING if _missing(value) else f"{value:,.0f} s"


def ms(value) -> str:
    return MISSING if _missing(value) else f"{value:,.1f} ms"


def ratio(value) -> str:
    """1.534 -> '1.5×', 2 -> '2.0×', 0.786 -> '0.79×', 12.3 -> '12×'."""
    if _missing(value):
        return MISSING
    decimals = max(0, 1 - math.floor(math.log10(abs(value)))) if value else 1
    return f"{value:.{decimals}f}×"


def rate(value) -> str:
    return MISSING if _missing(value) else f"{value:,.0f}"
