"""The first screen: per variant its decision and what it rests on, a cell per counted suite, size, drift,
where it is served and its speed; the suites shown but not counted; the forest plot."""

from __future__ import annotations

import math

import pipeline.verdict.figures as figures
from pipeline.report.forest import forest_plot, forest_plot_narrow


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

