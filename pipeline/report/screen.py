"""The first screen: per variant its decision and what it rests on, a cell per counted suite, size, drift (and, for a
model with a vision tower, the tower's state), where it is served and its speed, and beside a NO-GO its fix (what it
bought, the layers kept in 8 bits, the sensitivity chart) or the command that builds one; the suites shown but not
counted; the forest plot."""

from __future__ import annotations

import pipeline.verdict.figures as figures
from pipeline.report.charts import sensitivity_chart
from pipeline.report.deploy import served_by, speed_state
from pipeline.report.forest import forest_plot, forest_plot_narrow
from pipeline.report.labels import DECISION_CLASS, LABEL_CLASS
import pipeline.verdict.facts as facts
from pipeline.verdict.coverage import LABELS, NOT_APPLICABLE, NOT_COUNTED
from pipeline.verdict.headline import label, ordered, rests


def matrix_columns(verdict: dict) -> list[tuple[str, str]]:
    """The counted suites, as (kind, suite) in the order the matrix and forest show them: right/wrong
    suites, then perplexity suites, then the judge; a suite counted for any variant gets a column."""
    counted = {(kind, suite) for v in verdict["variants"].values() for suite, kind, _ in facts.counted_entries(v)}
    plain = sorted(s for kind, s in counted if kind == facts.ACCURACY)
    ppl = sorted(s for kind, s in counted if kind == facts.PERPLEXITY)
    judge = [("judge", "judge")] if (facts.JUDGE, facts.JUDGE) in counted else []
    return [("suite", s) for s in plain] + [("perplexity", s) for s in ppl] + judge


def matrix_cell(variant: dict, kind: str, suite: str) -> dict | None:
    """One cell: the change in the suite's own unit, its interval, the recovery, the margin, the decision, and
    the interval as harm (worse is positive) over the margin, for the forest plot."""
    if kind == "suite":
        if not (s := facts.counted_part(variant, facts.ACCURACY, suite)):
            return None
        return {"change": f"{figures.points(s['delta'])} pts",
                "interval": f"[{figures.points(s['ci_low'])}, {figures.points(s['ci_high'])}]",
                "recovery": figures.share(s.get("recovery")), "margin": f"{figures.points(-s['margin'])} pts",
                "decision": s["decision"], "n": f"{s['n']} items",
                "harm": (-s["delta"], -s["ci_high"], -s["ci_low"]), "margin_value": s["margin"]}
    if kind == "perplexity":
        if not (s := facts.counted_part(variant, facts.PERPLEXITY, suite)):
            return None
        return {"change": figures.relative(s["change"]),
                "interval": f"[{figures.relative(s['ci_low'])}, {figures.relative(s['ci_high'])}]",
                "recovery": figures.share(s.get("recovery")), "margin": figures.relative(s["margin"]),
                "decision": s["decision"], "n": f"{s['n']} docs",
                "harm": (s["change"], s["ci_low"], s["ci_high"]), "margin_value": s["margin"]}
    if not (j := facts.counted_part(variant, facts.JUDGE, facts.JUDGE)):
        return None
    s = j["summary"]
    return {"change": f"win {figures.share(s['win_rate'])}",
            "interval": f"[{figures.share(s['ci_low'])}, {figures.share(s['ci_high'])}]", "recovery": None,
            "margin": f"≥ {figures.share(0.5 - j['margin'])}", "decision": j["decision"], "n": f"{s['n']} pairs",
            "harm": (0.5 - s["win_rate"], 0.5 - s["ci_high"], 0.5 - s["ci_low"]), "margin_value": j["margin"]}


def cell_note(variant: dict, suite: str) -> str:
    """What a matrix cell says when the variant's decision does not count the suite: the state and the verdict's
    own why (coverage.suites.<suite> of verdict.json), up to its first semicolon."""
    entry = facts.coverage_states(variant).get(suite) or {}
    state = entry.get("label") or entry.get("state") or "not decided"
    why = str(entry.get("why") or "").split("; ")[0]
    return f"{state}: {why}" if why else str(state)


DTYPE_NAMES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F8_E4M3": "fp8 (e4m3)", "F8_E5M2": "fp8 (e5m2)"}


def vision_tower(quant: dict | None) -> dict | None:
    """The variant's vision tower as quantize's checks found it (quant.json's verify.vision): `bit-identical` (every
    tensor the base's, bit for bit: kept in the dtype it is stored in) or `changed` (which differ), with the words the
    page and the model card give; None for a model without one (nothing to say)."""
    vision = ((quant or {}).get("verify") or {}).get("vision")
    if not isinstance(vision, dict) or not vision.get("vision_tensors"):
        return None
    n, changed = vision["vision_tensors"], [str(name) for name in vision.get("mismatched") or []]
    dtypes = " / ".join(DTYPE_NAMES.get(str(d), str(d).lower()) for d in vision.get("dtypes") or [])
    if not changed:
        kept = f"kept in {dtypes}" if dtypes else "kept as the base's"
        return {"state": "bit-identical", "text": f"vision tower {kept}: {n} tensors bit-identical to the base's"}
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return {"state": "changed", "text": f"vision tower changed: {len(changed)} of {n} tensors differ from the base's ({shown})"}


def recovery_note(variant: dict) -> dict:
    """The average recovery as model cards give it (over the counted accuracy suites), or why there is none: the
    accuracy suites the base ran that the decision does not count, by state ("math, code not run"); the verdict's
    why for each is in its cell, the not-counted line and the coverage table."""
    recovery = variant.get("recovery") or {}
    if recovery.get("accuracy") is not None:
        n = len(recovery.get("suites") or [])
        return {"text": f"recovery {figures.share(recovery['accuracy'])}",
                "note": f"average over {n} accuracy suite{'s' if n != 1 else ''} ({', '.join(recovery['suites'])})"}
    perplexity = variant.get("perplexity") or {}
    missing = {state: [s for s in suites if s not in perplexity] for state, suites in facts.missing(variant).items()}
    why = "; ".join(f"{', '.join(names)} {LABELS.get(state, str(state))}" for state, names in missing.items() if names)
    return {"text": "no recovery average", "note": f"no accuracy suite counted: {why}" if why else "no accuracy suite ran"}


def _row(name: str, v: dict, columns: list, speed: dict, base: dict, human_size, speed_engine: str | None) -> dict:
    quant, kl = v.get("quant") or {}, v.get("kl")
    size, base_size = quant.get("size_bytes"), base.get("size_bytes") or quant.get("base_size_bytes")
    shown, suites = label(v), facts.coverage_states(v)
    return {
        "name": name, "scheme": quant.get("scheme"), "decision": v.get("decision"), "label": shown,
        "class": LABEL_CLASS.get(shown) or DECISION_CLASS.get(shown, "uninformative"), "why": v.get("why") or "",
        # what it rests on, led by its label ("GO, incomplete on 4 perplexity suites; math, code not run")
        "coverage": f"{shown} {rests(v)}" if suites else shown, "rests": rests(v), "next_steps": v.get("next_steps") or [],
        "recovery": recovery_note(v),
        "cells": {f"{kind}:{suite}": matrix_cell(v, kind, suite) for kind, suite in columns},
        "notes": {f"{kind}:{suite}": cell_note(v, suite) for kind, suite in columns},
        "size": human_size(size) if size else None,
        "size_share": f"{figures.share(size / base_size)} of base" if size and base_size else None,
        "kl": (figures.kl(kl["kl_mean"]), figures.share(kl["top1_agreement"])) if kl else None,
        "vision": vision_tower(quant),
        "served": served_by(v.get("serving"), name), "speed": speed_state(name, v, speed, speed_engine, human_size),
        # beside a NO-GO its fix (verdict.json's variants.<v>.fix: pipeline/verdict/fix.py), its kept layers and chart
        "fix": v.get("fix"), "fix_of": v.get("fix_of"), "fix_chart": sensitivity_chart(v.get("fix"), f"fix-chart-{name}"),
    }


def first_screen(verdict: dict, base: dict, human_size, speed_engine: str | None = None) -> dict:
    """What the first screen shows: per variant (GO first, then INCONCLUSIVE, then NO-GO) its decision as labelled
    ("GO, incomplete" for a GO that rests on fewer suites than the base ran), what it rests on and why in a few
    words, a cell per counted suite (or why not counted), recovery, size, KL / top-1, where it is served, speed
    and capacity (or the command that measures them); the suites shown but not counted, with the verdict's why."""
    columns = matrix_columns(verdict)
    speed = verdict.get("speed") or {}
    variants = verdict["variants"]
    rows = [_row(name, variants[name], columns, speed, base, human_size, speed_engine) for name in ordered(variants)]
    base_bench = sorted({c for v in variants.values() for c in v.get("speed_commands") or []
                         if c.startswith("quantize bench models/base")})
    return {"columns": columns, "rows": rows, "not_counted": not_counted(verdict), "base_bench": base_bench,
            "forest": forest_plot(columns, rows), "forest_narrow": forest_plot_narrow(columns, rows)}


def not_counted(verdict: dict) -> list[dict]:
    """Every suite shown but not counted (or not applicable) for some variant, with the verdict's own why
    (coverage.suites.<suite>.why): {suite, why, variants}, variants with the same why named together."""
    found: dict[tuple[str, str], list[str]] = {}
    for name in ordered(verdict["variants"]):
        for suite, why in facts.whys(verdict["variants"][name], NOT_COUNTED, NOT_APPLICABLE).items():
            found.setdefault((suite, why), []).append(name)
    return [{"suite": suite, "why": why, "variants": names} for (suite, why), names in sorted(found.items())]
