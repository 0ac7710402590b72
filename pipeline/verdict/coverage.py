"""What a variant's decision rests on: for every suite of params.yaml (and every suite the product ships that
params.yaml leaves out), and for the judge, one state, never silence:

    decided         counted: its GO / NO-GO / INCONCLUSIVE is part of the variant's decision
    not counted     shown, not counted: the base at the floor or ceiling, its answers cut inside the reasoning
                    by a token budget too small for it, too few paired items or documents, an unreliable judge (why)
    not run         no results for the variant or the base (the params.yaml key that left it out, e.g.
                    suites.math.models, or the command that runs it)
    not applicable  the evaluation said so (why, e.g. a text-only model and the VQA suite)
    not configured  a suite the product ships that params.yaml does not name (the key to add)

A variant's coverage is complete when every suite the base ran (with results, applicable) is decided for it;
`quantize report --fail-on incomplete` fails a variant whose decision rests on fewer (pipeline/verdict/decision.py),
and a variant of params.yaml with no results at all: not built (no checkpoint) or not evaluated
(`variants_without_results`).
"""

from __future__ import annotations

from pipeline.settings import fixes
from pipeline.settings import suites as registry
from pipeline.settings.params import Params
from pipeline.verdict.budget import BUDGET_TOO_SMALL
from pipeline.verdict.judge import UNRELIABLE

DECIDED, NOT_COUNTED, NOT_RUN, NOT_APPLICABLE, NOT_CONFIGURED = (
    "decided", "not counted", "not run", "not applicable", "not configured")
STATES = (DECIDED, NOT_COUNTED, NOT_RUN, NOT_APPLICABLE, NOT_CONFIGURED)
LABELS = {DECIDED: "decided", NOT_COUNTED: "shown, not counted", NOT_RUN: "not run",
          NOT_APPLICABLE: "not applicable", NOT_CONFIGURED: "not configured"}

KIND_NAMES = {"accuracy": ("accuracy suite", "accuracy suites"), "perplexity": ("perplexity suite", "perplexity suites")}


def _not_run(suite: str, variant: str, params: Params, results: dict) -> dict:
    """Why the base or the variant has no results for a configured suite: the key that left it out, or the
    command that runs it."""
    listed = params.suites[suite].models
    for model in ("base", variant):
        if suite in results.get(model, {}):
            continue
        if not fixes.runs_on(listed, model):  # a fix (V-mixed) runs what V runs
            return {"state": NOT_RUN, "key": f"suites.{suite}.models",
                    "why": f"suites.{suite}.models ({', '.join(listed) or 'none'}) leaves out {model}"}
        return {"state": NOT_RUN, "key": None,
                "why": f"no results/{model}/{suite}.jsonl: run `quantize eval models/{model} --suite {suite}` "
                       "(or `dvc repro`), then `quantize report`"}
    return {"state": NOT_RUN, "key": None, "why": "no results"}  # not reached: a suite with both results is compared


def not_applicable_why(skipped: dict[str, str | None]) -> str:
    """Why a suite is not applicable, from each model's reason ({model: reason}): said once when the reasons agree
    (a reason that opens with its model's folder name, "base: text-only model ...", compared without it), else per
    model, each named once."""
    reasons = {model: reason.removeprefix(f"{model}: ") for model, reason in skipped.items() if reason}
    if len(set(reasons.values())) == 1:
        return next(iter(reasons.values()))
    return "; ".join(f"{model}: {reason}" for model, reason in reasons.items())


def suite_coverage(variant: str, decision: str, params: Params, results: dict, not_applicable: dict[str, dict[str, str]],
                   suite_verdicts: list, perplexity: dict, judged: dict | None) -> dict:
    """variants.<variant>.coverage of verdict.json: each suite's state (and kind, decision, why, key), the suites
    the decision rests on, those the base ran, whether the two agree (`complete`), and the first screen's line."""
    paired = {v.suite: v for v in suite_verdicts}
    suites: dict[str, dict] = {}
    for suite in params.suites:
        skipped = {model: not_applicable.get(model, {}).get(suite) for model in ("base", variant)}
        if any(skipped.values()):
            why = not_applicable_why(skipped)
            suites[suite] = {"state": NOT_APPLICABLE, "why": why}
        elif suite in paired or suite in perplexity:
            v = paired.get(suite) or perplexity[suite]
            kind = "accuracy" if suite in paired else "perplexity"
            entry = {"state": DECIDED if v.counted else NOT_COUNTED, "kind": kind, "decision": v.decision}
            if not v.counted:
                entry["why"] = _not_counted_why(v, kind)
            suites[suite] = entry
        else:
            suites[suite] = _not_run(suite, variant, params, results)
    suites["judge"] = _judge_coverage(variant, judged)
    configured_tasks = {s.task for s in params.suites.values()}
    for task, shipped in registry.shipped().items():  # the suites the product ships (evals/), by their YAMLs
        name = shipped.name
        if task not in configured_tasks and name not in suites:
            suites[name] = {"state": NOT_CONFIGURED, "key": f"suites.{name}",
                            "why": f"params.yaml has no suite running {task}: add suites.{name} (task: {task}) and "
                                   "its results to the outs of dvc.yaml's evaluate stage (the gpu profile runs every shipped suite)"}
    for entry in suites.values():
        entry["label"] = LABELS[entry["state"]]
    base_ran = [s for s in params.suites if s in results.get("base", {}) and not not_applicable.get("base", {}).get(s)]
    decided = [s for s, e in suites.items() if e["state"] == DECIDED]
    return {"line": coverage_line(decision, suites), "decided": decided, "base_ran": base_ran,
            "complete": all(suites[s]["state"] == DECIDED for s in base_ran), "suites": suites}


def _not_counted_why(v, kind: str) -> str:
    if v.reasons and v.reasons[0].startswith(("NOT PAIRED", BUDGET_TOO_SMALL)):
        return v.reasons[0]
    if kind == "perplexity":
        return v.reasons[-1] if v.reasons else "too few paired documents for an interval"
    floor = [r for r in v.reasons if "at the floor" in r or "at the ceiling" in r]
    if floor:
        return floor[0].split(": this suite")[0]
    return v.reasons[0] if v.reasons else "no paired items"


def _judge_coverage(variant: str, judged: dict | None) -> dict:
    if judged is None:
        return {"state": NOT_RUN, "key": None,
                "why": f"no results/{variant}/judge.json: run `quantize judge models/{variant}`, then `quantize report`"}
    if judged["counted"]:
        return {"state": DECIDED, "kind": "judge", "decision": judged["decision"]}
    summary = judged["summary"]
    why = ("unreliable: the judge contradicts itself with the answers swapped" if judged["decision"] == UNRELIABLE
           else "reference mode informs, never decides" if summary.get("mode") == "reference"
           else "no pair was judged")
    return {"state": NOT_COUNTED, "kind": "judge", "decision": judged["decision"], "why": why}


def coverage_line(decision: str, suites: dict[str, dict]) -> str:
    """E.g. 'GO on 4 perplexity suites; math, code not run; 2 suites not configured'."""
    decided = [(name, e) for name, e in suites.items() if e["state"] == DECIDED]
    parts = []
    for kind, (one, many) in KIND_NAMES.items():
        count = sum(e.get("kind") == kind for _, e in decided)
        if count:
            parts.append(f"{count} {one if count == 1 else many}")
    if any(e.get("kind") == "judge" for _, e in decided):
        parts.append("the judge")
    rests = (", ".join(parts[:-1]) + " and " + parts[-1]) if len(parts) > 1 else parts[0] if parts else None
    line = [f"{decision} on {rests}" if rests else f"{decision}: nothing decided"]
    for state in (NOT_RUN, NOT_COUNTED, NOT_APPLICABLE, NOT_CONFIGURED):
        names = [name for name, e in suites.items() if e["state"] == state]
        if state == NOT_CONFIGURED and len(names) > 1:  # the first screen's line stays short: a count (each suite
            names = [f"{len(names)} suites"]              # is named with its params key in its entry below)
        if names:
            line.append(f"{', '.join(names)} {LABELS[state]}")
    return "; ".join(line)


NOT_BUILT, NOT_EVALUATED = "not built", "not evaluated"


def variants_without_results(variants: list[str], evaluated: list[str], built: dict[str, bool]) -> dict[str, dict]:
    """verdict.json's `variants_without_results`: each variant of params.yaml that has no result of a suite of
    params.yaml, so no decision: its state (not built: no checkpoint in models/; not evaluated), why, and the
    commands that give it one."""
    missing = {}
    for variant in variants:
        if variant in evaluated:
            continue
        evaluate = [f"quantize eval models/{variant}", "quantize report"]
        if built.get(variant):
            missing[variant] = {"state": NOT_EVALUATED, "commands": evaluate,
                                "why": f"models/{variant} is built but no suite of params.yaml was run on it (dvc repro "
                                       "evaluates the models its evaluate stage lists in dvc.yaml: add it there)"}
        else:
            missing[variant] = {"state": NOT_BUILT, "commands": [f"quantize variant {variant}", *evaluate],
                                "why": f"no checkpoint in models/{variant} and no results: the variant was never built"}
    return missing
