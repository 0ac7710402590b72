"""A base whose accuracy figures mean nothing: weights the run made up (a random model built to time the
pipeline, marked in its config.json: `synthetic_weights`, pipeline/checkpoints/config_json.py) or a base at chance
everywhere. verdict.json's `synthetic` says which and
why, and the report opens with it ("timing only: these accuracy figures mean nothing"); the headline then ships
nothing, whatever the paired tests say.

At chance everywhere: at least one perplexity suite, every perplexity suite at or above CHANCE_SHARE of the
vocabulary (a uniform guess over V tokens has perplexity V; a trained model, however small, is orders of
magnitude below), and every right/wrong suite the base ran at or below the floor (verdict.floor_ceiling).
"""

from __future__ import annotations

import math

from pipeline.verdict import figures

CHANCE_SHARE = 0.5  # a base perplexity at or above half the vocabulary is a guess, not a language model


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def at_chance(base_suites: dict, vocab_size: int | None, floor: float) -> str | None:
    """Why the base's scores are at chance on every suite it ran (verdict.json's base.suites), else None."""
    perplexity = {s: d["perplexity"] for s, d in base_suites.items() if _number((d or {}).get("perplexity"))}
    accuracy = {s: d["score"] for s, d in base_suites.items() if _number((d or {}).get("score"))}
    if not perplexity or not _number(vocab_size) or vocab_size < 2:
        return None
    if any(p < CHANCE_SHARE * vocab_size for p in perplexity.values()) or any(s > floor for s in accuracy.values()):
        return None
    worst = min(perplexity, key=perplexity.get)
    text = (f"the base model scores at chance everywhere: perplexity {perplexity[worst]:,.0f} on {worst} (its lowest) "
            f"with a {vocab_size:,}-token vocabulary, where guessing gives {vocab_size:,}")
    if accuracy:
        text += f"; {', '.join(f'{s} {figures.share(v)}' for s, v in sorted(accuracy.items()))}"
    return text


def synthetic(base_suites: dict, base: dict | None, floor: float) -> dict | None:
    """verdict.json's `synthetic`: {short, why, made_up, at_chance} when the base's accuracy figures mean nothing,
    else None. `base`: what its config.json says ({vocab_size, synthetic_weights}: config_json.base_facts)."""
    base = base or {}
    vocab, made_up = base.get("vocab_size"), base.get("synthetic_weights")
    chance = at_chance(base_suites, vocab if _number(vocab) else None, floor)
    if not made_up and not chance:
        return None
    reasons = ([f"the base's weights were made up by the run ({made_up})"] if made_up else []) + ([chance] if chance else [])
    short = "the base's weights were made up by the run" if made_up else "the base scores at chance everywhere"
    return {"short": short, "why": "; ".join(reasons), "made_up": bool(made_up), "at_chance": bool(chance)}
