"""Per-item results joined across models with pandas: one row per (suite, item), every model's answer beside
the base's, and which items flipped between right and wrong. What the report's item tables show."""

from __future__ import annotations

COLUMNS = ["model", "suite", "id", "prompt", "target", "output", "correct", "score"]


def items_frame(results: dict[str, dict[str, dict[str, dict]]]):
    """Long format: one row per model x suite x item, from {model: {suite: {id: result line}}}."""
    import pandas as pd

    rows = [{"model": model, "suite": suite, "id": item_id, **{k: line.get(k) for k in COLUMNS[3:]}, "line": line}
            for model, suites in results.items() for suite, items in suites.items()
            for item_id, line in items.items()]
    return pd.DataFrame(rows, columns=COLUMNS + ["line"])


def item_rows(results: dict[str, dict[str, dict[str, dict]]]) -> dict[str, list[dict]]:
    """Per suite, in the base's item order: {id, prompt, target, base (its line), variants {name: line or
    None}, flipped (a variant's right/wrong differs from the base's)}."""
    frame = items_frame(results)
    variants = [m for m in results if m != "base"]
    by_suite: dict[str, list[dict]] = {}
    base_rows = frame[frame["model"] == "base"]
    for suite, base in base_rows.groupby("suite", sort=False):
        joined = base.set_index("id")[["prompt", "target", "correct", "line"]]
        others = frame[(frame["suite"] == suite) & (frame["model"] != "base")]
        wide = others.pivot(index="id", columns="model", values="line").reindex(index=joined.index, columns=variants)
        correct = others.pivot(index="id", columns="model", values="correct").reindex(index=joined.index,
                                                                                     columns=variants)
        base_correct = joined["correct"].astype(bool)
        flipped = correct.notna() & correct.ne(base_correct, axis=0)
        rows = []
        for item_id, base_item in joined.iterrows():
            lines = {v: (wide.at[item_id, v] if isinstance(wide.at[item_id, v], dict) else None) for v in variants}
            rows.append({"id": item_id, "prompt": base_item["prompt"], "target": base_item["target"],
                         "base": base_item["line"], "variants": lines, "flipped": bool(flipped.loc[item_id].any())})
        by_suite[suite] = rows
    return by_suite
