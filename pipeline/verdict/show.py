"""`quantize show-verdict`: the verdict of the last report (reports/verdict.json) as lines for a terminal: what to
ship first, then per variant (GO first) what its decision rests on, each suite's and the judge's sentence, what to
run to settle an open suite, and its fix (pipeline/verdict/fix.py); a KeyError or TypeError means the file is not a
verdict `quantize report` wrote."""

from __future__ import annotations


def verdict_lines(verdict: dict) -> list[str]:
    lines = [verdict["headline"]] if verdict.get("headline") else []  # what to ship, first
    rests_on = {d["variant"]: d["rests_on"] for d in verdict.get("decisions") or []}  # "GO, incomplete on ...", GO first
    for name, v in sorted(verdict["variants"].items(), key=lambda item: list(rests_on).index(item[0])
                          if item[0] in rests_on else len(rests_on)):
        # the decision and what it rests on (a verdict.json before coverage existed: the decision alone)
        lines.append(f"{name}: {rests_on.get(name) or (v.get('coverage') or {}).get('line') or v['decision']}")
        for suite, s in v["suites"].items():
            lines.append("  " + (s.get("sentence") or (
                f"{suite}: base {s['base_score']:.1%} -> {s['variant_score']:.1%} "
                f"(change {s['delta'] * 100:+.1f} pts, interval [{s['ci_low'] * 100:+.1f}, "
                f"{s['ci_high'] * 100:+.1f}], margin -{s['margin'] * 100:.1f}): {s['decision']}")))
        for suite, s in (v.get("perplexity") or {}).items():
            lines.append("  " + (s.get("sentence") or (
                f"{suite}: perplexity {s['base_ppl']:.3f} -> {s['variant_ppl']:.3f} "
                f"(change {s['change']:+.1%}, interval [{s['ci_low']:+.1%}, {s['ci_high']:+.1%}], "
                f"margin +{s['margin']:.1%}): {s['decision']}")))
        if (v.get("judge") or {}).get("sentence"):
            lines.append(f"  {v['judge']['sentence']}")
        lines += [f"  to settle {step['text']}" for step in v.get("next_steps") or []]
        fix = v.get("fix") or {}
        if fix.get("line") and fix.get("state") != "not built":  # the offer of one: pipeline/profiles/fix.py offers
            kept = ", ".join(g["name"] for g in fix.get("kept") or [])
            lines.append(f"  fix {fix['variant']}: {fix['line']}" + (f"; kept in 8 bits: {kept}" if kept else ""))
    for name, missing in (verdict.get("variants_without_results") or {}).items():  # no decision: named, with what to run
        lines.append(f"{name}: {missing['state']}: {missing['why']}; run {', then '.join(missing['commands'])}")
    return lines
