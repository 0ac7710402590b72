"""Beyond the decision: why it was reached, in a few words (`why_in_brief`, the reviewer's first screen),
and for each counted suite left INCONCLUSIVE what to run to settle it and about how long that takes
(`next_steps`, from the speed its results were produced at: each model's <suite>.json). No step asks for more
items than the suite has (`suite_size`: what `quantize eval` recorded of it): such a suite "cannot be settled on
this suite (164 items)", and the step says what could settle it instead. A suite sampled k times per item may also be
settled by more samples per item on the same items (`samples_steps`), where the spread of its per-item changes is
mostly sampling noise."""

from __future__ import annotations

import pipeline.verdict.facts as facts
from pipeline.settings.params import Params
from pipeline.verdict.intervals import GO, INCONCLUSIVE, NO_GO, beyond_suite, cannot_settle
from pipeline.verdict.figures import share
from pipeline.verdict.judge import UNRELIABLE, min_judged_pairs_for_go


def why_in_brief(decision: str, parts: dict) -> str:
    """The decision's reason in a few words, for the first screen (the full sentences stay in the suites'
    details, verdict.json and `quantize show-verdict`); `parts`: the entry's suites, perplexity, judge and speed as
    verdict.json holds them, read through pipeline/verdict/facts.py."""
    if facts.counted_entries(parts, facts.SPEED):
        return "slower than the base at batch 1 on the deployment engine"
    counted = facts.counted(parts)
    if not counted:
        return "nothing counted: every suite at the floor or ceiling, or empty"
    no_go, open_ = facts.nogo_on(parts), facts.not_settled_on(parts)
    if decision == NO_GO:
        text = f"beyond the margin on {', '.join(no_go)}"
        return text + (f"; {', '.join(open_)} open" if open_ else "")
    if decision == GO:
        return f"within the margin on all {len(counted)} counted suites" if len(counted) > 1 else \
            f"within the margin on {counted[0][0]}, the one counted suite"
    return f"not settled on {', '.join(open_)}" + (f"; {len(counted) - len(open_)} within the margin"
                                                   if len(counted) > len(open_) else "")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(10, round(seconds, -1)):.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _stage_seconds(summary: dict | None, items: int) -> float | None:
    """About how long `quantize eval` of `items` items of a suite takes for a model, from the speed its
    last run recorded (its results/<model>/<suite>.json: the stage's seconds, of which scoring
    generate_seconds over n items; the rest is the stage's start)."""
    summary = summary or {}
    n, total, scoring = summary.get("n"), summary.get("seconds"), summary.get("generate_seconds")
    if not isinstance(n, int) or n <= 0 or not isinstance(total, (int, float)) or total <= 0:
        return None
    scoring = scoring if isinstance(scoring, (int, float)) and 0 < scoring <= total else total
    return (total - scoring) + scoring / n * items


def suite_size(summaries: dict[str, dict[str, dict]], variant: str, suite: str) -> int | None:
    """The items (or documents) the suite has, as `quantize eval` recorded it for the base and the variant
    (<suite>.json's `available`: lm-eval's count before the limit); the smaller when they differ, None when neither
    recorded it."""
    found = [(summaries.get(model, {}).get(suite) or {}).get("available") for model in ("base", variant)]
    found = [n for n in found if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return min(found) if found else None


def _unsettleable(suite: str, now: int, needed: int, unit: str, available: int) -> dict:
    """The step of an open suite that settling would take more items than it has: no command, what would decide it."""
    return {"suite": suite, "now": now, "needed": None, "available": available, "unit": unit, "commands": [],
            "seconds": None, "duration": None, "counted": True,
            "text": f"{suite}: {now} {unit} did not settle it, and {cannot_settle(available, unit)}: about {needed} "
                    f"would be needed; a wider margin (verdict.margins.suites.{suite}) or a larger suite would decide it"}


SAMPLES_FIELD = "samples"  # params.yaml's suites.<suite> field for the samples per item (k)


def samples_steps(variant: str, suite_verdicts: list, summaries: dict[str, dict[str, dict]]) -> list[dict]:
    """For each counted INCONCLUSIVE suite sampled k times per item whose comparison more samples per item would
    likely settle (pipeline/verdict/samples.py): how many, where to set it, and about how long it takes (the suite's
    generation time grows with the samples)."""
    steps = []
    for v in suite_verdicts:
        if not (v.counted and v.decision == INCONCLUSIVE and v.samples_to_settle and v.samples_per_item > 1):
            continue
        scale = v.samples_to_settle / v.samples_per_item
        times = [_stage_seconds(summaries.get(model, {}).get(v.suite), v.n * scale) for model in ("base", variant)]
        seconds = sum(times) if all(t is not None for t in times) else None
        text = (f"{v.suite}: {v.samples_per_item} samples per item did not settle it; about {v.samples_to_settle} on "
                f"the same {v.n} items would: set suites.{v.suite}.{SAMPLES_FIELD}: {v.samples_to_settle} in "
                "params.yaml and run `dvc repro`")
        text += (f", about {_duration(seconds)} at the speed these results were produced" if seconds is not None
                 else "; no timing recorded to estimate how long")
        steps.append({"suite": v.suite, "now": v.samples_per_item, "needed": v.samples_to_settle,
                      "unit": "samples per item", "commands": [], "seconds": round(seconds, 1) if seconds else None,
                      "duration": _duration(seconds) if seconds is not None else None, "text": text, "counted": True})
    return steps


def next_steps(variant: str, suite_verdicts: list, perplexity: dict, judged: dict | None,
               summaries: dict[str, dict[str, dict]], params: Params) -> list[dict]:
    """For each counted suite left INCONCLUSIVE: what to run to settle it (how many items or documents,
    the commands) and about how long that takes at the speed its results were produced."""
    steps = []
    wanted = [(v.suite, v.n, v.items_to_settle or (v.min_items_for_go if v.min_items_for_go and v.n < v.min_items_for_go
                                                  else None), "items", v.available)
              for v in suite_verdicts if v.counted and v.decision == INCONCLUSIVE]
    wanted += [(suite, v.n, v.documents_to_settle, "documents", v.available)
               for suite, v in perplexity.items() if v.counted and v.decision == INCONCLUSIVE]
    for suite, now, needed, unit, available in wanted:
        if not needed or needed <= now:
            continue
        if beyond_suite(needed, available):
            steps.append(_unsettleable(suite, now, needed, unit, available))
            continue
        times = [_stage_seconds(summaries.get(model, {}).get(suite), needed) for model in ("base", variant)]
        seconds = sum(times) if all(t is not None for t in times) else None
        commands = [f"quantize eval models/{model} --suite {suite} --limit {needed}" for model in ("base", variant)]
        text = (f"{suite}: {now} {unit} did not settle it; about {needed} would: set suites.{suite}.limit: {needed} "
                f"in params.yaml and run `dvc repro` (or `{commands[0]}` and `{commands[1]}`, then `quantize report`)")
        text += (f", about {_duration(seconds)} at the speed these results were produced" if seconds is not None
                 else "; no timing recorded to estimate how long")
        options = getattr(params.suites.get(suite), "options", None) or {}
        if str(options.get("data", "")).endswith("holdout.jsonl") and needed > params.calib.holdout:
            text += (f"; the held-out conversations number {params.calib.holdout} (calib.holdout): raise it to at "
                     f"least {needed} and rerun `quantize calib` first")
        steps.append({"suite": suite, "now": now, "needed": needed, "unit": unit, "commands": commands,
                      "seconds": round(seconds, 1) if seconds is not None else None,
                      "duration": _duration(seconds) if seconds is not None else None, "text": text, "counted": True})
    steps += samples_steps(variant, suite_verdicts, summaries)
    stronger = "(judge.backend: vllm or openai with a stronger model), not more prompts"
    judge_counted = bool(facts.counted_entries({"judge": judged}, facts.JUDGE))
    if judged and judged["decision"] == UNRELIABLE:
        summary = judged["summary"]
        steps.append({"suite": "judge", "now": summary.get("n") or 0, "needed": None, "unit": "judged pairs",
                      "commands": [], "seconds": None, "duration": None, "counted": judge_counted,
                      "text": f"judge: unreliable: it gave the same verdict with the answers swapped in "
                              f"{share(summary.get('consistency') or 0)} of pairs; a stronger judge is needed {stronger}"})
    if judged and judged["decision"] == INCONCLUSIVE and judged["summary"].get("mode", "pairwise") == "pairwise":
        summary = judged["summary"]
        if not summary.get("n"):
            steps.append({"suite": "judge", "now": 0, "needed": None, "unit": "judged pairs", "commands": [],
                          "seconds": None, "duration": None, "counted": judge_counted,
                          "text": f"judge: no pair was judged; a judge that answers in the required format is needed "
                                  f"{stronger}"})
        else:
            fewest = min_judged_pairs_for_go(judged["margin"], params.verdict.confidence) or 0
            needed = max(fewest, 2 * summary["n"])
            prompts = summary["n"] + (summary.get("unjudged") or 0)
            took = summary.get("seconds")
            seconds = took / prompts * needed if isinstance(took, (int, float)) and prompts else None
            command = f"quantize judge models/{variant} --limit {needed}"
            text = f"judge: {summary['n']} judged pairs did not settle it; try about {needed}: `{command}`"
            text += f", about {_duration(seconds)} at the speed of the last run" if seconds else ""
            steps.append({"suite": "judge", "now": summary["n"], "needed": needed, "unit": "judged pairs",
                          "commands": [command], "seconds": round(seconds, 1) if seconds else None,
                          "duration": _duration(seconds) if seconds else None, "text": text,
                          "counted": judge_counted})
    return steps
