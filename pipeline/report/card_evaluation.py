"""A model card's evaluation section: which engine scored both models and at what precision, the per-suite table
(every suite the base ran, accuracy beside perplexity, each with its data, the items scored, both figures, the change
with its 95% interval, the recovery and the decision; then the Average recovery over the counted accuracy suites),
the decision with each counted suite's sentence, what the fix bought, and the drift from the base.

Every figure is verdict.json's; a recovery is named by what it divides (this model's accuracy over the base's; the
base's perplexity over this model's). A run on made-up weights gets no table: its scores mean nothing. Nothing here
reads a file.
"""

from __future__ import annotations

import pipeline.verdict.figures as figures
from pipeline import engines
from pipeline.report.card_header import data_of
from pipeline.report.card_text import md, names
from pipeline.verdict.coverage import DECIDED, NOT_APPLICABLE, NOT_CONFIGURED, NOT_COUNTED, NOT_RUN
from pipeline.verdict.headline import GO, INCONCLUSIVE, NO_GO, label

RECOVERY_DEFINED = ("Recovery: this model's accuracy over the base's; for perplexity, where lower is better, the base's "
                    "perplexity over this model's; 100% is no loss either way. The Average is over the counted "
                    "accuracy suites.")


# ---------------------------------------------------------------- which engine, at what precision

def scored_by(name: str, verdict: dict) -> list[str]:
    """The engines that scored this variant's suites (verdict.json's `engines`, per suite, from each suite's summary;
    a verdict whose summaries predate that record has none: the run's params.yaml then names it)."""
    return sorted({e for row in verdict.get("engines") or [] if name in (row.get("models") or [])
                   for e in row.get("engines") or []})


def how_scored(name: str, entry: dict, verdict: dict, source: dict | None, run: dict | None) -> str:
    """"Scored with transformers, in process, in float32 on x86_64, 2 CPUs, this model and the base alike: ..."."""
    used = scored_by(name, verdict) or ([run["engine"]] if (run or {}).get("engine") else [])
    if not used:
        return "The engine that scored it was not recorded with this verdict."
    machine = (verdict.get("environment") or {}).get("machine")
    parts = []
    for engine in used:
        dtype = (run or {}).get("dtype") if (run or {}).get("engine") == engine else None  # params.yaml's, for its engine
        if engine not in engines.ENGINES:
            parts.append(engines.shown_as(engine))
        elif engines.capability(engine, "starts_server"):
            parts.append(f"{engines.shown_as(engine)}, serving each model in its own format"
                         + (f" in {dtype}" if dtype else ""))
        else:
            in_process = ((entry.get("serving") or {}).get("hf") or {})  # pipeline/checkpoints/serving.py
            precision = in_process.get("precision") or "weights decompressed at load"
            at = f"in {dtype}" if dtype else "in the engine's dtype (not recorded with this verdict)"
            base_dtype = (source or {}).get("dtype")
            parts.append(f"{engines.shown_as(engine)}, in process, {at}: the base's "
                         f"{base_dtype + ' ' if base_dtype else ''}weights as stored, this model's {precision}")
    return (f"Scored with {'; and '.join(parts)}" + (f", on {md(machine)}" if machine else "")
            + ". Both models were scored alike, item by item on the same items: each suite's decision comes from "
            "the 95% interval of the paired change against the suite's margin (GO within it, NO-GO beyond it, "
            "INCONCLUSIVE across it).")


# ---------------------------------------------------------------- the table

def _accuracy_row(suite: str, d: dict, data: str, decision: str) -> str:
    return (f"| {md(suite)} | {md(data)} (accuracy) | {d['n']} items | {figures.share(d['base_score'])} | "
            f"{figures.share(d['variant_score'])} | {figures.points(d['delta'])} pts [{figures.points(d['ci_low'])}, "
            f"{figures.points(d['ci_high'])}] | {figures.share(d.get('recovery'))} | {md(decision)} |")


def _perplexity_row(suite: str, d: dict, data: str, decision: str) -> str:
    tokens = f" ({d['tokens']:,} tokens)" if d.get("tokens") else ""
    return (f"| {md(suite)} | {md(data)} (perplexity, lower is better) | {d['n']} documents{tokens} | "
            f"{figures.perplexity(d['base_ppl'])} | {figures.perplexity(d['variant_ppl'])} | "
            f"{figures.relative(d['change'])} [{figures.relative(d['ci_low'])}, {figures.relative(d['ci_high'])}] | "
            f"{figures.share(d.get('recovery'))} | {md(decision)} |")


def _judge_row(judge: dict, decision: str) -> str:
    s = judge["summary"]
    pairs = f"{s.get('n')} pair{'s' if s.get('n') != 1 else ''}"
    return (f"| judge | held-out prompts, this model's answer against the base's (win rate) | {pairs} | "
            f"50.0% | {figures.share(s['win_rate'])} | [{figures.share(s['ci_low'])}, {figures.share(s['ci_high'])}] "
            f"| – | {md(decision)} |")


def _decision_cell(d: dict | None, state: dict) -> str:
    if state.get("state") == NOT_COUNTED:
        return f"not counted: {state.get('why') or 'shown only'}"
    return str((d or {}).get("decision") or state.get("decision") or state.get("label") or "")


def evaluation_table(entry: dict, verdict: dict, tasks: dict[str, str]) -> list[str]:
    """Every suite the base ran (and the judge), accuracy first, then perplexity, then the judge; the Average row."""
    lines = ["| suite | data | scored | base | this model | change [95% interval] | recovery | decision |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    coverage = (entry.get("coverage") or {}).get("suites") or {}
    base_suites = (verdict.get("base") or {}).get("suites") or {}
    accuracy, perplexity = entry.get("suites") or {}, entry.get("perplexity") or {}
    shown = [s for s in coverage if s != "judge" and coverage[s].get("state") != NOT_CONFIGURED]
    is_perplexity = {s: s in perplexity or coverage[s].get("kind") == "perplexity"
                     or (base_suites.get(s) or {}).get("perplexity") is not None for s in shown}
    for suite in sorted(shown, key=lambda s: (is_perplexity[s], s not in accuracy and s not in perplexity)):
        state = coverage.get(suite) or {}
        data = data_of(suite, tasks)[1]
        if suite in accuracy:
            lines.append(_accuracy_row(suite, accuracy[suite], data, _decision_cell(accuracy[suite], state)))
        elif suite in perplexity:
            lines.append(_perplexity_row(suite, perplexity[suite], data, _decision_cell(perplexity[suite], state)))
        elif state.get("state") in (NOT_RUN, NOT_APPLICABLE):
            base = base_suites.get(suite) or {}
            base_figure = (figures.perplexity(base["perplexity"]) if base.get("perplexity") is not None
                           else figures.share(base.get("score")))
            why = ("not run on this model" if state["state"] == NOT_RUN else
                   f"not applicable: {md(state.get('why') or '')}")
            lines.append(f"| {md(suite)} | {md(data)} | – | {base_figure} | – | | | {md(why)} |")
    judge = entry.get("judge") or {}
    if judge.get("summary") and judge["summary"].get("win_rate") is not None:
        lines.append(_judge_row(judge, _decision_cell(judge, coverage.get("judge") or {})))
    recovery = entry.get("recovery") or {}
    if recovery.get("accuracy") is not None:
        over = recovery.get("suites") or []
        lines.append(f"| **Average** | accuracy over {md(names(over))} | | {figures.share(recovery.get('base_mean'))} | "
                     f"{figures.share(recovery.get('variant_mean'))} | | **{figures.share(recovery['accuracy'])}** | |")
    else:
        lines.append("| **Average** | accuracy | | – | – | | – | no accuracy suite counted |")
    return lines


def recovery_phrase(entry: dict) -> str:
    """"recovers 98.2% of the base's accuracy on average over 3 suites (math, code and vqa)", or, without an accuracy
    average, what the perplexity suites recover."""
    recovery = entry.get("recovery") or {}
    if recovery.get("accuracy") is not None:
        over = recovery.get("suites") or []
        return (f"recovers {figures.share(recovery['accuracy'])} of the base's accuracy on average over {len(over)} "
                f"suite{'s' if len(over) != 1 else ''} ({names(over)})")
    per_suite = [d["recovery"] for d in (entry.get("perplexity") or {}).values()
                 if d.get("counted") and d.get("recovery") is not None]
    if not per_suite:
        return "has no recovery figure (no suite was counted)"
    low, high = min(per_suite), max(per_suite)
    spread = figures.share(low) if low == high else f"{figures.share(low)} to {figures.share(high)}"
    return (f"recovers {spread} of the base's perplexity score (the base's perplexity over this model's) on "
            f"{len(per_suite)} perplexity suite{'s' if len(per_suite) != 1 else ''}, with no accuracy suite counted")


# ---------------------------------------------------------------- the decision

def rests_on(entry: dict) -> str:
    """What the decision rests on, in plain words: "decided on ppl-book, ppl-chat, ppl-code and ppl-math; math and code
    not run on this model; the judge not counted"."""
    coverage = (entry.get("coverage") or {}).get("suites") or {}
    by_state: dict[str, list[str]] = {}
    for suite, state in coverage.items():
        by_state.setdefault(state.get("state"), []).append("the judge" if suite == "judge" else suite)
    parts = [f"decided on {names(by_state[DECIDED])}" if by_state.get(DECIDED) else "nothing decided"]
    for state, words in ((NOT_RUN, "not run on this model"), (NOT_COUNTED, "shown, not counted"),
                         (NOT_APPLICABLE, "not applicable")):
        if by_state.get(state):
            parts.append(f"{names(by_state[state])} {words}")
    return "; ".join(parts)


def outcome(entry: dict) -> str:
    """What a decided entry is, in a clause: "GO", "INCONCLUSIVE: the evidence settles neither way on ppl-book",
    "NO-GO: beyond the margin on ppl-chat"."""
    shown = label(entry)
    if shown == INCONCLUSIVE and unsettled(entry):
        return f"{shown}: the evidence settles neither way on {names(unsettled(entry))}"
    if shown == NO_GO and still_nogo(entry):
        return f"{shown}: beyond the margin on {names([s for found in still_nogo(entry).values() for s in found])}"
    return shown


def _fix(entry: dict, verdict: dict) -> list[str]:
    fix, fix_of = entry.get("fix") or {}, entry.get("fix_of")
    lines = []
    if fix.get("state") == "built":
        details = ([f"{fix['bits_per_weight']:.2f} bits per weight"] if fix.get("bits_per_weight") is not None else [])
        details += [f"{figures.ratio(fix['size_ratio'])} this model's size"] if fix.get("size_ratio") else []
        bought = (f"keeps {fix.get('groups_in_8_bits')} of {fix.get('groups_total')} groups in 8 bits"
                  + (f" ({', '.join(details)})" if details else ""))
        fixed = (verdict.get("variants") or {}).get(fix.get("variant"))
        decided = outcome(fixed) if fixed else str(fix.get("label") or fix.get("decision"))
        lines.append(f"Its fix, {md(fix.get('variant'))}, {bought} and is {md(decided)}.")
    if fix_of:
        lines.append(f"It is the fix of {md(fix_of)}, a NO-GO W4A16 variant: the same quantization with the groups "
                     "that cost it most kept in 8 bits.")
    return lines


def decision(entry: dict, verdict: dict) -> list[str]:
    """The decision, what it rests on, each counted suite's sentence (the verdict's), and the fix."""
    lines = [f"**{md(label(entry))}**: {md(rests_on(entry))}.", ""]
    sentences = [d.get("sentence") for part in ("suites", "perplexity") for d in (entry.get(part) or {}).values()
                 if d.get("counted")]
    judge = entry.get("judge") or {}
    if judge.get("counted"):
        sentences.append(judge.get("sentence"))
    lines += [f"- {md(s)}" for s in sentences if s]
    fix = _fix(entry, verdict)
    return lines + (["", *fix] if fix else [])


def drift(entry: dict) -> list[str]:
    kl = entry.get("kl")
    if not kl:
        return []
    return [f"Drift from the base: KL {figures.kl(kl['kl_mean'])} nats per token (p99 {figures.kl(kl.get('kl_p99'))}), "
            f"top-1 agreement {figures.share(kl['top1_agreement'])}"
            + (f", on {kl['tokens']:,} tokens of {kl.get('sequences')} held-out conversations"
               if isinstance(kl.get("tokens"), int) else "") + "."]


def evaluation(name: str, entry: dict, verdict: dict, *, tasks: dict[str, str], source: dict | None,
               run: dict | None) -> list[str]:
    """The evaluation section's lines (under its heading)."""
    synthetic = verdict.get("synthetic")
    if synthetic:
        return [f"No evaluation figures: {md(synthetic_why(synthetic))}, so no score of this model against it means "
                "anything."]
    lines = [how_scored(name, entry, verdict, source, run), "", *evaluation_table(entry, verdict, tasks), "",
             RECOVERY_DEFINED, "", "### Decision", "", *decision(entry, verdict)]
    more = drift(entry)
    return lines + (["", *more] if more else [])


def synthetic_why(synthetic: dict) -> str:
    """Why a run's accuracy figures mean nothing, without the run's own notes: "the base's weights were made up by the
    run, and it scores at chance everywhere"."""
    short = str(synthetic.get("short") or "the base's scores mean nothing")
    both = synthetic.get("made_up") and synthetic.get("at_chance")
    return short + (", and it scores at chance everywhere" if both else "")


def still_nogo(entry: dict) -> dict[str, list[str]]:
    """{kind: suites} of what a NO-GO is NO-GO on: accuracy, perplexity, the judge, speed."""
    found: dict[str, list[str]] = {}
    for part, kind in (("suites", "accuracy"), ("perplexity", "perplexity")):
        for suite, d in sorted((entry.get(part) or {}).items()):
            if d.get("counted") and d.get("decision") == NO_GO:
                found.setdefault(kind, []).append(suite)
    if (entry.get("judge") or {}).get("counted") and entry["judge"].get("decision") == NO_GO:
        found["judge"] = ["judge"]
    if (entry.get("speed") or {}).get("counted"):
        found["speed"] = ["speed at batch 1"]
    return found


def unsettled(entry: dict) -> list[str]:
    """The counted suites whose evidence settles nothing (neither GO nor NO-GO)."""
    return [suite for part in ("suites", "perplexity") for suite, d in sorted((entry.get(part) or {}).items())
            if d.get("counted") and d.get("decision") not in (GO, NO_GO)] + (
        ["the judge"] if (entry.get("judge") or {}).get("counted") and entry["judge"].get("decision") not in (GO, NO_GO)
        else [])

