"""A NO-GO comes with its fix: verdict.json's variants.<V>.fix for each W4A16 variant V of params.yaml.

V's fix, V-mixed (`quantize fix V`: V's own settings with the groups that cost it most kept in 8 bits, the
`mixed` method; its name: pipeline/settings/fixes.py), is decided like any variant (its own entry in `variants`,
with `fix_of: V`). Beside V the verdict sets what the fix bought:

    variant, decision, label     V-mixed and its decision ("GO, incomplete" when it rests on fewer suites), why
    still_nogo_on                the suites (and the judge) V-mixed is still NO-GO on
    groups_in_8_bits, groups_total, bits_per_weight, max_bits    from V-mixed's quant.json
    size_ratio                   V-mixed's checkpoint size over V's (their quant.json)
    kept                         the groups kept in 8 bits: name, layer, share of V's KL restoring it removes
    ranking                      the first RANKING_SHOWN groups of results/V/sensitivity.json, and whether kept
    line                         "NO-GO; keeping 6 of 60 groups in 8 bits (4.40 bits per weight, 1.10x the size)
                                 gives GO" / "... still NO-GO on ppl-chat"; a GO V: the fix is not needed

A NO-GO V without a fix gets the offer instead (state "not built": the commands that build and decide it).
Nothing here reads a file: quant.json and sensitivity.json come in the evidence (pipeline/report/inputs.py, the
report stage read them with their own readers).
"""

from __future__ import annotations

from pipeline.settings import fixes
import pipeline.verdict.facts as facts
from pipeline.verdict.headline import SHIPPABLE, label
from pipeline.verdict.intervals import GO, NO_GO

RANKING_SHOWN = 12  # the groups the report's chart draws
NOT_BUILT = "not built"


def attach_fixes(variants: dict, quant: dict, sensitivity: dict, params) -> None:
    """Adds `fix` to each W4A16 variant's entry (its fix's figures, or for a NO-GO without one the offer) and
    `fix_of` to each fix's."""
    for name in fixes.fixable(params):
        if name not in variants:
            continue
        fixed = fixes.fix_name(name)
        if fixed in variants:
            variants[name]["fix"] = fix_entry(variants[name], fixed, variants[fixed], quant.get(name),
                                              quant.get(fixed), sensitivity.get(name))
            variants[fixed]["fix_of"] = name
        elif variants[name].get("decision") == NO_GO:
            variants[name]["fix"] = offer(name)


def offer(variant: str) -> dict:
    """What builds and decides the fix of a NO-GO W4A16 variant that has none."""
    fixed = fixes.fix_name(variant)
    commands = [f"quantize profile --fix {variant}", "dvc repro"]
    return {"variant": fixed, "state": NOT_BUILT, "commands": commands,
            "line": f"NO-GO; no fix built: `{commands[0]}` adds its stage to dvc.yaml (the groups that cost it most "
                    f"kept in 8 bits, within fix.max_bits bits per weight), then `{commands[1]}` builds and decides "
                    f"{fixed}"}


def still_nogo_on(entry: dict) -> list[str]:
    """The counted suites (and the judge, and speed) an entry's decision is NO-GO on (facts.nogo_on)."""
    return facts.nogo_on(entry)


def fix_entry(variant: dict, fixed: str, fix: dict, quant: dict | None, fixed_quant: dict | None,
              ranking: dict | None) -> dict:
    """variants.<V>.fix: what keeping V's most costly groups in 8 bits bought (module docstring)."""
    fq = fixed_quant or {}
    groups = fq.get("groups") or []
    kept_names = [g["name"] for g in groups if g.get("scheme") == "W8A16"]
    measured = {g["name"]: g for g in (ranking or {}).get("groups") or []}
    layers = {g["name"]: g.get("layer") for g in groups}
    kept = [{"name": name, "layer": (measured.get(name) or {}).get("layer", layers.get(name)),
             "share_removed": (measured.get(name) or {}).get("share_removed")} for name in kept_names]
    shown = [{"name": g["name"], "layer": g.get("layer"), "kind": g.get("kind"), "share_removed": g["share_removed"],
              "kept": g["name"] in kept_names} for g in ((ranking or {}).get("groups") or [])[:RANKING_SHOWN]]
    size, fixed_size = (quant or {}).get("size_bytes"), fq.get("size_bytes")
    entry = {"variant": fixed, "state": "built", "decision": fix.get("decision"), "label": label(fix),
             "why": fix.get("why") or "", "still_nogo_on": still_nogo_on(fix), "groups_in_8_bits": fq.get("groups_in_8_bits"),
             "groups_total": fq.get("groups_total"), "bits_per_weight": fq.get("bits_per_weight"),
             "max_bits": fq.get("max_bits"), "size_ratio": fixed_size / size if size and fixed_size else None,
             "kept": kept, "ranking": shown, "ranked_groups": len((ranking or {}).get("groups") or []) or None}
    entry["line"] = fix_line(variant, entry)
    return entry


def _bought(entry: dict) -> str:
    """"keeping 6 of 60 groups in 8 bits (4.40 bits per weight, 1.10x the size)", or the fix's name without its
    quant.json."""
    if entry.get("groups_in_8_bits") is None or not entry.get("groups_total"):
        return f"its fix {entry['variant']}"
    figures = [f"{entry['bits_per_weight']:.2f} bits per weight"] if entry.get("bits_per_weight") is not None else []
    figures += [f"{entry['size_ratio']:.2f}x the size"] if entry.get("size_ratio") else []
    return (f"keeping {entry['groups_in_8_bits']} of {entry['groups_total']} groups in 8 bits"
            + (f" ({', '.join(figures)})" if figures else ""))


def fix_line(variant: dict, entry: dict) -> str:
    """The fix in one line, led by the variant's own label."""
    own, fixed = label(variant), entry["label"]
    if variant.get("decision") == GO:
        return f"{own} as it is: the fix is not needed ({entry['variant']}: {_bought(entry)}, {fixed})"
    if fixed in SHIPPABLE:
        return f"{own}; {_bought(entry)} gives {fixed}"
    if entry["decision"] == NO_GO:
        on = ", ".join(entry["still_nogo_on"]) or "what it counted"
        return f"{own}; {_bought(entry)} {'still ' if variant.get('decision') == NO_GO else 'is '}NO-GO on {on}"
    return f"{own}; {_bought(entry)} leaves it {fixed}" + (f" ({entry['why']})" if entry["why"] else "")
