"""The decision per variant: every counted suite, the judge and (when it may) speed, read into GO / NO-GO /
INCONCLUSIVE (`overall`), with why, what it rests on (coverage), recovery, what to run next and everything the
report shows beside it (`decide`), and the CI gate on it (`failing`: no-go, inconclusive or incomplete).

The evidence comes in already read and checked (`Evidence`: the report stage reads the files,
pipeline/report/inputs.py); nothing here opens a file, so every rule is tested on plain data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.settings.params import Params
import pipeline.verdict.facts as facts
from pipeline.verdict.budget import budget_table, budget_why
from pipeline.verdict.coverage import suite_coverage, variants_without_results
from pipeline.verdict.engines import engine_notes, unpaired_why
from pipeline.verdict.fix import attach_fixes
from pipeline.verdict.headline import label
from pipeline.verdict.intervals import GO, INCONCLUSIVE, NO_GO
from pipeline.verdict.drift import kl_figures
from pipeline.verdict.judge import judge_verdict, pairwise_figures, reference_figures
from pipeline.verdict.next_steps import next_steps, suite_size, why_in_brief
from pipeline.verdict.paired import SuiteVerdict, compare_suite
from pipeline.verdict.perplexity import compare_perplexity
from pipeline.verdict.recovery import average_recovery
from pipeline.verdict.samples import sampled_figures
from pipeline.verdict.speed import capacity_line, speed_row, speed_verdict


# verdict.json's key of the tables of the suites whose YAML declares kind retrieval-table, per model (until issue 65:
# `long_context`, the name of the first such suite)
TABLES_KEY = "retrieval_tables"


@dataclass
class Evidence:
    """What a verdict is decided from, per model (base, the variants of params.yaml and their fixes), as read from
    results/<model>/ and models/<model>/; a file that is absent is absent here."""

    results: dict[str, dict[str, dict[str, dict]]]  # {model: {suite: {item id: result line}}}
    summaries: dict[str, dict[str, dict]] = field(default_factory=dict)  # {model: {suite: <suite>.json}}
    judge: dict[str, dict] = field(default_factory=dict)  # {variant: judge.json}
    kl: dict[str, dict] = field(default_factory=dict)  # {variant: kl.json}
    bench: dict[str, dict] = field(default_factory=dict)  # {model: bench.json}
    quant: dict[str, dict | None] = field(default_factory=dict)  # {variant: quant.json}
    serving: dict[str, dict | None] = field(default_factory=dict)  # {variant: where it is served}
    built: dict[str, bool] = field(default_factory=dict)  # {variant of params.yaml: its checkpoint is in models/}
    sensitivity: dict[str, dict] = field(default_factory=dict)  # {W4A16 variant with a fix: its sensitivity.json}
    # {suite: its kind} as its YAML declares it (pipeline/settings/suites.py KINDS): perplexity, paired per document;
    # any other, paired per item. A suite missing here is a task no YAML describes: its lines say (`kind_of`)
    kinds: dict[str, str] = field(default_factory=dict)

    def kind_of(self, suite: str) -> str | None:
        """The suite's declared kind; for a task no YAML describes, perplexity when its lines are documents."""
        if suite in self.kinds:
            return self.kinds[suite]
        lines = [items.get(suite) for items in self.results.values() if items.get(suite)]
        return "perplexity" if lines and all(is_perplexity(items) for items in lines) else None

    def perplexity(self, suite: str) -> bool:
        return self.kind_of(suite) == "perplexity"


def summary_figures(name: str, summary: dict, lines: list[dict], params: Params) -> tuple[dict, tuple[str, ...]]:
    """The figures a stage's summary states (judge.json, kl.json), recomputed from its lines (judge.jsonl, kl.jsonl),
    and those of them the summary's own values are not comparable with: a pairwise judge's interval at another
    confidence than params.yaml's verdict.confidence (recomputed at this one), a reference judge's bootstrap interval
    (judge.json does not record its resamples and seed). The report checks the summary against them and shows the
    judge's figures from here, kl.json's own once they agree (pipeline/report/inputs.py)."""
    p = params.verdict
    if name == "kl.json":
        return kl_figures(lines), ()
    if summary.get("mode", "pairwise") != "pairwise":
        return reference_figures(lines, iterations=p.bootstrap, confidence=p.confidence, seed=p.seed), ("ci_low", "ci_high")
    figures = pairwise_figures(lines, any("control" in line for line in lines), confidence=p.confidence)
    return {**figures, "confidence": p.confidence}, () if summary.get("confidence", p.confidence) == p.confidence else (
        "ci_low", "ci_high", "confidence")


def overall(suite_verdicts: list[SuiteVerdict], perplexity: dict | None = None, judged: dict | None = None,
            speed: dict | None = None) -> tuple[str, list[str]]:
    """NO-GO if anything counted is NO-GO (a right/wrong or perplexity suite, a reliable judge, speed at batch 1),
    GO if all of it is GO, else INCONCLUSIVE: what was counted, NO-GO on and not settled on as facts.py reads them."""
    parts = _parts(suite_verdicts, perplexity or {}, judged, speed)
    counted = facts.counted(parts)
    if not counted:
        return INCONCLUSIVE, ["nothing counted: every suite was uninformative or empty"]
    if no_go := facts.nogo_on(parts):
        return NO_GO, [f"NO-GO on {', '.join(no_go)}"]
    if open_ := facts.not_settled_on(parts):
        return INCONCLUSIVE, [f"not settled on {', '.join(open_)}"]
    return GO, [f"GO on everything counted ({', '.join(name for name, _, _ in counted)})"]


def is_perplexity(items: dict[str, dict]) -> bool:
    """Whether a suite's lines are documents (each's log-likelihood and token count): read only for a task no YAML
    describes (`Evidence.kind_of`); a suite's declared kind decides how it is compared."""
    return bool(items) and all("loglikelihood" in item and "n_tokens" in item for item in items.values())


def not_applicable(summaries: dict[str, dict[str, dict]], suites: list[str]) -> dict[str, dict[str, str]]:
    """{model: {suite: reason}} for suites the evaluation declared not applicable (e.g. VQA on a
    text-only model): shown as n/a, never scored as 0 %."""
    found: dict[str, dict[str, str]] = {}
    for model, by_suite in summaries.items():
        for suite in sorted(by_suite):
            summary = by_suite[suite] or {}
            if suite in suites and summary.get("status") == "not applicable":
                found.setdefault(model, {})[suite] = summary.get("reason", "not applicable")
    return found


def unsandboxed_results(results: dict, summaries: dict[str, dict[str, dict]]) -> list[str]:
    """`model/suite` of every result whose model-written code ran outside the bubblewrap sandbox (written
    under suites.<suite>.allow_unsandboxed): a line with `isolated: false`, or a summary naming another sandbox."""
    flagged = []
    for model, suites in results.items():
        for suite, items in suites.items():
            method = (summaries.get(model, {}).get(suite) or {}).get("sandbox")
            if any(line.get("isolated") is False for line in items.values()) or method not in (None, "bwrap"):
                flagged.append(f"{model}/{suite}")
    return sorted(flagged)


def _unsandboxed_reason(models: list[str], suite: str) -> str:
    return (f"UNSANDBOXED: the model-written code of {' and '.join(models)} ran without bubblewrap "
            f"(suites.{suite}.allow_unsandboxed: true): it could read this machine's files and fake its own pass; "
            "install bubblewrap and rerun the eval")


def decide(evidence: Evidence, params: Params) -> dict:
    """The verdict of every variant in `evidence.results` against the base: what verdict.json holds
    (the report adds where it came from: ignored folders, metrics, the environment)."""
    results, p = evidence.results, params.verdict
    speeds = {model: speed_row(evidence.bench[model])
              for model in sorted(results, key=lambda name: name != "base") if evidence.bench.get(model)}  # base first
    flagged = unsandboxed_results(results, evidence.summaries)
    variants = {variant: _decide_variant(variant, evidence, params, speeds, flagged)
                for variant in results if variant != "base"}
    attach_fixes(variants, evidence.quant, evidence.sensitivity, params)  # each W4A16 variant beside its fix
    base_suites = {s: suite_score(items, evidence.perplexity(s)) | ({"unsandboxed": True} if f"base/{s}" in flagged else {})
                   for s, items in results.get("base", {}).items()}
    return {
        **({"unsandboxed": flagged} if flagged else {}),  # every result whose model-written code ran without isolation
        "variants": variants,
        "base": {"suites": base_suites},
        TABLES_KEY: retrieval_tables(results, evidence.summaries, evidence.kinds),
        # the generated visual suites' tables by difficulty, where any was scored (none: no key, as before them)
        **({"difficulty": tables} if (tables := difficulty_tables(results, evidence.summaries)) else {}),
        "engines": engine_notes(evidence.summaries, list(params.suites)),
        "budgets": budget_table(results, p.max_cut_share),  # per suite and model: answers cut at the token budget, and where
        "method_comparisons": method_comparisons(results, evidence.quant, p.confidence, evidence.perplexity),
        "speed": speeds,
        "params_sha256": params.digest(),
        # variants of params.yaml with no result: named, never left out in silence (--fail-on incomplete fails them)
        "variants_without_results": variants_without_results(list(params.variants), list(variants), evidence.built),
    }


def retrieval_tables(results: dict, summaries: dict[str, dict[str, dict]], kinds: dict[str, str]) -> dict:
    """Per model, the table of its retrieval-table suite (the kind its YAML declares, `kinds`; whatever the suite's
    name): its `table` in <suite>.json, the accuracy by length and needle depth, and what was skipped."""
    tables = {}
    for model in results:
        found = [summary["table"] for suite, summary in summaries.get(model, {}).items()
                 if kinds.get(suite) == "retrieval-table" and (summary.get("table") or {}).get("by_length_and_depth")
                 is not None]
        if found:
            tables[model] = found[0]
    return tables


def difficulty_tables(results: dict, summaries: dict[str, dict[str, dict]]) -> dict:
    """Per suite whose table is by difficulty (the generated visual suites: evals/visual/common.py), its axis and per
    model the accuracy of each bin: {suite: {"axis": "font_px", "bins": [...], "models": {model: {bin: {"n", "score"}}}}}, base first,
    so the report shows where a variant starts to fail."""
    tables: dict[str, dict] = {}
    for model in sorted(results, key=lambda m: m != "base"):
        for suite, summary in sorted(summaries.get(model, {}).items()):
            table = (summary.get("table") or {}).get("by_difficulty")
            if table:
                entry = tables.setdefault(suite, {"axis": table["axis"], "bins": [], "models": {}})
                entry["models"][model] = table["bins"]
                entry["bins"] += [b for b in table["bins"] if b not in entry["bins"]]
    return tables


def _parts(suite_verdicts: list, perplexity: dict, judged: dict | None, speed: dict | None) -> dict:
    """The entry's suites, perplexity suites, judge and speed as verdict.json holds them (what facts.py reads)."""
    return {"suites": {v.suite: v.to_dict() for v in suite_verdicts},
            "perplexity": {suite: v.to_dict() for suite, v in perplexity.items()}, "judge": judged, "speed": speed}


def _shown_not_counted(suite_verdicts: list, perplexity: dict, evidence: Evidence, variant: str,
                       max_cut_share: float) -> None:
    """Suites compared that are shown, not counted, first of their reasons: scored on different engines; the base cut
    inside its reasoning by the token budget (the budget was scored, not the model)."""
    for v in [*suite_verdicts, *perplexity.values()]:
        if why := unpaired_why(evidence.summaries, variant, v.suite):
            v.counted = False
            v.reasons.insert(0, why)
    for v in suite_verdicts:
        if why := budget_why(evidence.results["base"][v.suite], v.suite, max_cut_share):
            v.counted = False
            v.reasons.insert(0, why)
            v.sentence = f"{v.suite}: not counted, {why}. {v.sentence}"


def _decide_variant(variant: str, evidence: Evidence, params: Params, speeds: dict, flagged: list[str]) -> dict:
    """verdict.json's variants.<variant>: each suite, the judge and speed against the base, the decision, why,
    what it rests on, recovery, what to run next, and what the report shows beside it."""
    results, p = evidence.results, params.verdict
    suites = results[variant]
    n_a = not_applicable(evidence.summaries, list(params.suites))
    n_a = {"base": n_a.get("base", {}), variant: n_a.get(variant, {})}
    skipped = {**n_a["base"], **n_a[variant]}
    compared = [suite for suite in sorted(suites) if suite in results["base"] and suite not in skipped]
    suite_verdicts = [compare_suite(results["base"][suite], suites[suite], variant=variant, suite=suite,
                                    margin=p.margin_for(suite), confidence=p.confidence, iterations=p.bootstrap,
                                    seed=p.seed, floor_ceiling=p.floor_ceiling,
                                    available=suite_size(evidence.summaries, variant, suite))
                      for suite in compared if not evidence.perplexity(suite)]
    unsandboxed = {v.suite: [m for m in ("base", variant) if f"{m}/{v.suite}" in flagged] for v in suite_verdicts}
    for v in suite_verdicts:
        if unsandboxed[v.suite]:
            v.reasons.insert(0, _unsandboxed_reason(unsandboxed[v.suite], v.suite))
    perplexity = {suite: compare_perplexity(results["base"][suite], suites[suite], variant=variant, suite=suite,
                                            margin=p.perplexity_margin_for(suite), confidence=p.confidence,
                                            available=suite_size(evidence.summaries, variant, suite))
                  for suite in compared if evidence.perplexity(suite)}
    _shown_not_counted(suite_verdicts, perplexity, evidence, variant, p.max_cut_share)
    judged = judge_verdict(evidence.judge.get(variant), params)
    speed = speed_verdict(speeds, variant, p)  # speed can stop a variant, never pass one
    decision, reasons = overall(suite_verdicts, perplexity, judged, speed)
    for suite in sorted(suites):  # a result run without isolation that no suite comparison above shows
        if f"{variant}/{suite}" in flagged and suite not in unsandboxed:
            reasons.insert(0, _unsandboxed_reason([variant], suite))
    if facts.counted_entries({"speed": speed}, facts.SPEED):
        reasons.append(f"slower than the base at batch 1: {speed['reason']}")
    steps = next_steps(variant, suite_verdicts, perplexity, judged, evidence.summaries, params)
    return {
        "decision": decision,
        "why": why_in_brief(decision, _parts(suite_verdicts, perplexity, judged, speed)),
        "coverage": suite_coverage(variant, decision, params, results, n_a, suite_verdicts, perplexity, judged),
        "recovery": average_recovery(suite_verdicts),
        "reasons": reasons,
        "next_steps": steps,
        "suites": {v.suite: {**v.to_dict(), "unsandboxed": unsandboxed[v.suite]} for v in suite_verdicts},
        "perplexity": {suite: v.to_dict() for suite, v in perplexity.items()},
        "not_applicable": skipped,
        "judge": judged,
        "quant": evidence.quant.get(variant),
        "kl": evidence.kl.get(variant),
        "speed": speed,
        **({} if variant in speeds and "base" in speeds else {"speed_commands": speed_commands(variant, speeds, p)}),
        "serving": evidence.serving.get(variant),
        # "GO, 1.5× tokens/s, 2.0× KV capacity" (pipeline/verdict/speed.py)
        "capacity_line": capacity_line(decision, speeds.get(variant), speeds.get("base")),
    }


def method_comparisons(results: dict, quant: dict[str, dict | None], confidence: float, perplexity) -> list[dict]:
    """Each method against those it declares in COMPARED_WITH (pipeline/methods/: AWQ against round-to-nearest,
    the contrast of the AWQ paper, Lin et al. 2023), variants at the same group size, on every perplexity suite
    both ran: the variant's perplexity relative to the other's, paired per document. Shown, not counted: the
    verdict compares each variant with the base. `perplexity(suite)`: whether the suite is a perplexity suite."""
    from pipeline import methods

    quant = {name: quant.get(name) or {} for name in results if name != "base"}
    rows = []
    for method, other, why in methods.comparisons():
        for variant, q in quant.items():
            for against, r in quant.items():
                if q.get("method") != method or r.get("method") != other or q.get("group_size") != r.get("group_size"):
                    continue
                rows += _compared(results, variant, against, confidence, perplexity,
                                  {"method": method, "against_method": other, "why": why,
                                   "group_size": q.get("group_size")})
    return rows


def _compared(results: dict, variant: str, against: str, confidence: float, perplexity, row: dict) -> list[dict]:
    rows = []
    for suite in sorted(set(results[variant]) & set(results[against])):
        if not perplexity(suite):
            continue
        c = compare_perplexity(results[against][suite], results[variant][suite], variant=variant, suite=suite,
                               margin=1.0, confidence=confidence)
        if not c.counted:
            continue
        better = variant if c.ci_high < 0 else against if c.ci_low > 0 else None
        rows.append({"variant": variant, "against": against, **row, "suite": suite, "n": c.n,
                     "variant_ppl": c.variant_ppl, "against_ppl": c.base_ppl, "change": c.change,
                     "ci_low": c.ci_low, "ci_high": c.ci_high, "better": better})
    return rows


def suite_score(items: dict, perplexity: bool) -> dict:
    """A model's score on one suite: mean score over its items (avg@k where sampled k times per item, with pass@k),
    or, a perplexity suite's, perplexity over all its tokens."""
    n = len(items)
    if perplexity:
        tokens = sum(i["n_tokens"] for i in items.values())
        return {"n": n, "perplexity": math.exp(-sum(i["loglikelihood"] for i in items.values()) / tokens) if tokens else None}
    return {"n": n, "score": sum(i["score"] for i in items.values()) / n if n else None, **(sampled_figures(items) or {})}


def speed_commands(variant: str, speeds: dict, p) -> list[str]:
    """What measures the speed the verdict lacks: `quantize bench` of the base and the variant (whichever has no
    bench.json), on the deployment engine when verdict.speed_engine names it, then the report again."""
    engine = f" --engine {p.speed_engine}" if p.speed_engine else ""
    return [f"quantize bench models/{model}{engine}" for model in ("base", variant) if model not in speeds] + \
        ["quantize report"]


FAIL_ON = ("no-go", "inconclusive", "incomplete")  # each fails what the one before it does, and more


def failing(verdict: dict, fail_on: str | None) -> dict[str, str]:
    """{variant: why} for each variant that trips the gate: 'no-go' fails a NO-GO; 'inconclusive' also an
    INCONCLUSIVE (anything but GO); 'incomplete' also a GO whose decision rests on fewer suites than the base ran,
    and a variant of params.yaml without results (not built, not evaluated).

    A W4A16 variant and its fix (V-mixed, `fix_of: V`) are gated as one: what ships for V is V, or V-mixed in its
    place. The pair passes when either passes the gate (a NO-GO V whose fix passes: ship the fix, `passed_by_fix`
    says so); when neither does it fails under V's name, the fix's reason beside V's. A fix whose variant is not in
    the verdict is gated on its own."""
    if not fail_on:
        return {}
    variants = verdict["variants"]
    failed = {}
    for name, v in variants.items():
        if v.get("fix_of") in variants:
            continue  # gated with the variant it fixes
        reason = _gate_reason(v, fail_on)
        fixed = _built_fix(v, variants)
        if reason and fixed:
            fix_reason = _gate_reason(variants[fixed], fail_on)
            if fix_reason is None:
                continue
            reason = f"{reason}; its fix {fixed}: {fix_reason}"
        if reason:
            failed[name] = reason
    if fail_on == "incomplete":
        for name, missing in (verdict.get("variants_without_results") or {}).items():
            failed[name] = f"{missing['state']}: {missing['why']}; run {', then '.join(missing['commands'])}"
    return failed


def passed_by_fix(verdict: dict, fail_on: str | None) -> dict[str, str]:
    """{variant: fix} for each variant that fails the gate alone and passes it through its fix."""
    if not fail_on:
        return {}
    variants = verdict["variants"]
    return {name: fixed for name, v in variants.items()
            if (fixed := _built_fix(v, variants)) and _gate_reason(v, fail_on)
            and _gate_reason(variants[fixed], fail_on) is None}


def fix_gate_lines(verdict: dict, fail_on: str | None) -> list[str]:
    """What the gate says of each variant that passes through its fix: "ship the fix in its place" only for a fix
    that is GO (facts.ships); a fix that passes the gate without being GO (an INCONCLUSIVE under --fail-on no-go, a
    GO on fewer suites than the base ran) is said to pass, and that nothing of the pair is to ship yet."""
    variants, lines = verdict["variants"], []
    for name, fixed in passed_by_fix(verdict, fail_on).items():
        own, fix = label(variants[name]), variants[fixed]
        if facts.ships(fix):
            lines.append(f"gate: {name} is {own}; its fix {fixed} is GO and passes --fail-on {fail_on} in its place: "
                         f"ship {fixed}")
        else:
            lines.append(f"gate: {name} is {own}; its fix {fixed} passes --fail-on {fail_on} but is {label(fix)}, "
                         f"not GO: ship neither yet")
    return lines


def _built_fix(entry: dict, variants: dict) -> str | None:
    """The name of the variant's fix when it was built and decided (in the verdict), else None."""
    fixed = (entry.get("fix") or {}).get("variant")
    return fixed if fixed in variants and variants[fixed].get("fix_of") is not None else None


def _gate_reason(v: dict, fail_on: str) -> str | None:
    """Why one decided variant trips the gate `fail_on`, or None."""
    if v["decision"] == NO_GO or (v["decision"] == INCONCLUSIVE and fail_on != "no-go"):
        return v["decision"]
    if fail_on == "incomplete" and not facts.complete(v):
        return f"{v['decision']}, incomplete: {facts.incomplete_why(v)}"
    return None


def metrics(verdict: dict) -> dict:
    """Flat numbers for `dvc metrics show`."""
    flat = {}
    for variant, data in verdict["variants"].items():
        flat[variant] = {"go": data["decision"] == GO}
        for suite, s in data["suites"].items():
            flat[variant][suite] = {"score": s["variant_score"], "delta": s["delta"],
                                    "ci_low": s["ci_low"], "ci_high": s["ci_high"]}
        for suite, s in data.get("perplexity", {}).items():
            flat[variant][suite] = {"perplexity": s["variant_ppl"], "change": s["change"],
                                    "ci_low": s["ci_low"], "ci_high": s["ci_high"]}
    return flat
