"""Which engine scored each suite, whether base and variant were scored alike, and what that means for
comparing the scores with another engine's.

A suite's verdict pairs the base's and the variant's items; the pairing means something only when both were
scored by the same engine under the same engine defects (pipeline/engines/vllm_defects.py: a known vLLM
defect, avoided or not). A suite whose two sides differ is shown and not counted (`unpaired_why`). Each
suite's engine and the defects it met are listed for the report (`engine_notes`): a defect that was avoided
leaves the scores comparable with the hf engine's; one that was not makes them comparable only within the
run (base against variant on the same engine), which the note says.
"""

from __future__ import annotations


def _side(summary: dict | None) -> tuple[str | None, tuple]:
    s = summary or {}
    return s.get("engine"), tuple(sorted((d["key"], bool(d.get("avoided"))) for d in s.get("engine_defects") or []))


def _words(side: tuple[str | None, tuple]) -> str:
    engine, defects = side
    found = [f"{key} {'avoided' if avoided else 'not avoided'}" for key, avoided in defects]
    return f"{engine}" + (f" ({', '.join(found)})" if found else "")


def unpaired_why(summaries: dict[str, dict[str, dict]], variant: str, suite: str) -> str | None:
    """Why base and variant were not scored alike on `suite`, else None (also when a summary predates the
    engine record: nothing to compare)."""
    base, other = (_side(summaries.get(model, {}).get(suite)) for model in ("base", variant))
    if base[0] is None or other[0] is None or base == other:
        return None
    return (f"NOT PAIRED: the base was scored on {_words(base)}, {variant} on {_words(other)}: the change would mix "
            "the engines' differences into the variant's; rerun both on one engine (engine.name, "
            "engine.defect_workarounds), then `quantize report`")


def engine_notes(summaries: dict[str, dict[str, dict]], suites: list[str]) -> list[dict]:
    """Per suite, the engines that scored it and every known engine defect it met: what it is, whether every
    model avoided it, and whether the suite's scores are therefore comparable with the hf engine's."""
    notes = []
    for suite in suites:
        scored = {model: by_suite[suite] for model, by_suite in summaries.items()
                  if (by_suite.get(suite) or {}).get("engine")
                  and by_suite[suite].get("status") not in ("not applicable", "not run")}  # scored: items behind it
        if not scored:
            continue
        defects: dict[str, dict] = {}
        for model, summary in sorted(scored.items()):
            for d in summary.get("engine_defects") or []:
                entry = defects.setdefault(d["key"], {k: d.get(k) for k in ("key", "what", "when", "avoided_by",
                                                                             "upstream", "evidence")} | {"models": {}})
                entry["models"][model] = bool(d.get("avoided"))
        for entry in defects.values():
            entry["avoided"] = all(entry["models"].values())
        engines = sorted({s["engine"] for s in scored.values()})
        alike = all(len(set(e["models"].values())) == 1 for e in defects.values())  # each defect: all avoided, or none
        notes.append({"suite": suite, "engines": engines, "models": sorted(scored), "defects": list(defects.values()),
                      "paired": len(engines) == 1 and alike,
                      "comparable_with_hf": all(e["avoided"] for e in defects.values())})
    return notes
