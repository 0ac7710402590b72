"""A model card's evaluation section: which engine scored both models and at what precision, the per-suite table
(every suite the base ran, accuracy beside perplexity, each with its data, the items scored, both figures, the change
with its 95% interval, the recovery and the decision; then the Average recovery over the counted accuracy suites),
the decision with each counted suite's sentence, what the fix bought, and the drift from the base.

Every figure is verdict.json's; a recovery is given for a higher-is-better score only (this model's accuracy over the
base's); perplexity, where lower is better, is given as its rise with its interval and the margin it was judged
against. What the decision counted, is NO-GO or not settled on and rests on is pipeline/verdict/facts.py's. A run on
made-up weights gets no table: its scores mean nothing. Nothing here reads a file.
"""

from __future__ import annotations

import re

import pipeline.verdict.figures as figures
from pipeline import engines
from pipeline.report.card_header import data_of
from pipeline.report.card_text import md, names, suite_name
import pipeline.verdict.facts as facts
from pipeline.verdict.coverage import NOT_APPLICABLE, NOT_CONFIGURED, NOT_COUNTED, NOT_RUN
from pipeline.verdict.headline import GO_INCOMPLETE, INCONCLUSIVE, NO_GO, label

RECOVERY_DEFINED = ("Recovery: this model's accuracy over the base's (100% is no loss), for accuracy only; the Average "
                    "is over the counted accuracy suites. Perplexity, where lower is better, is given as its rise "
                    "against the base, with its 95% interval and the margin it was judged against (GO when the whole "
                    "interval lies below the margin).")
# the decision as a card's reader reads it: the tool's own label for a GO on fewer suites than the base ran, in words
CARD_LABELS = {GO_INCOMPLETE: "GO on the suites it was decided on, not on every suite the base ran"}


def card_label(entry: dict) -> str:
    """The decision in a card's words (pipeline/verdict/headline.py's label, "GO, incomplete" said in full)."""
    return CARD_LABELS.get(label(entry), label(entry))


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
            in_process = ((entry.get("serving") or {}).get(engine) or {})  # pipeline/checkpoints/serving.py
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
            f"{figures.points(d['ci_high'])}] | {figures.points(-d['margin'])} pts | {figures.share(d.get('recovery'))} "
            f"| {md(decision)} |")


def _perplexity_row(suite: str, d: dict, data: str, decision: str) -> str:
    tokens = f" ({d['tokens']:,} tokens)" if d.get("tokens") else ""
    return (f"| {md(suite)} | {md(data)} (perplexity, lower is better) | {d['n']} documents{tokens} | "
            f"{figures.perplexity(d['base_ppl'])} | {figures.perplexity(d['variant_ppl'])} | "
            f"{figures.relative(d['change'])} [{figures.relative(d['ci_low'])}, {figures.relative(d['ci_high'])}] | "
            f"{figures.relative(d['margin'])} | – | {md(decision)} |")


def _judge_row(judge: dict, decision: str) -> str:
    s = judge["summary"]
    pairs = f"{s.get('n')} pair{'s' if s.get('n') != 1 else ''}"
    return (f"| judge | held-out prompts, this model's answer against the base's (win rate) | {pairs} | "
            f"50.0% | {figures.share(s['win_rate'])} | [{figures.share(s['ci_low'])}, {figures.share(s['ci_high'])}] "
            f"| | – | {md(decision)} |")


def _decision_cell(d: dict | None, state: dict) -> str:
    if state.get("state") == NOT_COUNTED:
        return f"not counted: {state.get('why') or 'shown for information'}"
    return str((d or {}).get("decision") or state.get("decision") or state.get("label") or "")


def evaluation_table(entry: dict, verdict: dict, tasks: dict[str, str]) -> list[str]:
    """Every suite the base ran (and the judge), accuracy first, then perplexity, then the judge; the Average row."""
    lines = ["| suite | data | scored | base | this model | change [95% interval] | margin | recovery | decision |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    coverage = facts.coverage_states(entry)
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
            lines.append(f"| {md(suite)} | {md(data)} | – | {base_figure} | – | | | | {md(why)} |")
    judge = entry.get("judge") or {}
    if judge.get("summary") and judge["summary"].get("win_rate") is not None:
        lines.append(_judge_row(judge, _decision_cell(judge, coverage.get("judge") or {})))
    recovery = entry.get("recovery") or {}
    if recovery.get("accuracy") is not None:
        over = recovery.get("suites") or []
        lines.append(f"| **Average** | accuracy over {md(names(over))} | | {figures.share(recovery.get('base_mean'))} | "
                     f"{figures.share(recovery.get('variant_mean'))} | | | **{figures.share(recovery['accuracy'])}** | |")
    else:
        lines.append("| **Average** | accuracy | | – | – | | | – | no accuracy suite counted |")
    return lines


def recovery_phrase(entry: dict) -> str:
    """"it recovers 98.2% of the base's accuracy on average over 3 suites (math, code and vqa)"; without an accuracy
    average, how much its perplexity rises on the counted perplexity suites and against which margin."""
    recovery = entry.get("recovery") or {}
    if recovery.get("accuracy") is not None:
        over = recovery.get("suites") or []
        return (f"it recovers {figures.share(recovery['accuracy'])} of the base's accuracy on average over {len(over)} "
                f"suite{'s' if len(over) != 1 else ''} ({names(over)})")
    return perplexity_phrase(entry) or "it has no figure against the base (no suite was counted)"


def perplexity_phrase(entry: dict) -> str | None:
    """"its perplexity rises by +2.7% to +5.8% on 4 perplexity suites (upper 95% bounds +3.5% to +8.1%, against a
    margin of +10.0%)", None when no perplexity suite was counted."""
    counted = [d for _, _, d in facts.counted_entries(entry, facts.PERPLEXITY)]
    if not counted:
        return None

    def spread(values):
        low, high = min(values), max(values)
        return figures.relative(low) if low == high else f"{figures.relative(low)} to {figures.relative(high)}"

    n = len(counted)
    return (f"its perplexity rises by {spread([d['change'] for d in counted])} on {n} perplexity "
            f"suite{'s' if n != 1 else ''} (upper 95% bound{'s' if n != 1 else ''} "
            f"{spread([d['ci_high'] for d in counted])}, against a margin of {spread([d['margin'] for d in counted])})")


# ---------------------------------------------------------------- the decision

def rests_on(entry: dict) -> str:
    """What the decision rests on, in plain words: "decided on ppl-book, ppl-chat, ppl-code and ppl-math; math and code
    not run on this model; the judge shown, not counted" (pipeline/verdict/facts.py)."""
    return facts.rests_on(entry, suite_name, {NOT_COUNTED: "shown for information, not counted"})


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
    lines = [f"**{md(card_label(entry))}**: {md(rests_on(entry))}.", ""]
    sentences = [d.get("sentence") if d.get("available") else unbounded_count_left_out(d.get("sentence") or "")
                 for _, _, d in facts.counted_entries(entry, facts.ACCURACY, facts.PERPLEXITY)]
    sentences += [judge.get("sentence") for _, _, judge in facts.counted_entries(entry, facts.JUDGE)]
    lines += [f"- {md(s)}" for s in sentences if s]
    fix = _fix(entry, verdict)
    return lines + (["", *fix] if fix else [])


UNBOUNDED = re.compile(r" \(about \d+ paired (?:documents|items)[^)]*would (?:likely )?settle it\)")


def unbounded_count_left_out(sentence: str) -> str:
    """A suite's sentence without "(about 2093 paired documents would likely settle it)": a verdict that records the
    suite's size says "cannot be settled on this suite (164 documents)" instead when it has fewer; one that predates
    that record gives a count that may exceed the suite, so a card leaves it out (the limitations say it did not
    settle)."""
    return UNBOUNDED.sub("", sentence)


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
    """{kind: suites} of what a NO-GO is NO-GO on: accuracy, perplexity, the judge, speed (facts.nogo_by_kind)."""
    return facts.nogo_by_kind(entry)


def unsettled(entry: dict) -> list[str]:
    """The counted suites whose evidence settles nothing (neither GO nor NO-GO), the judge named as "the judge"."""
    return [suite_name(s) for s in facts.not_settled_on(entry)]
