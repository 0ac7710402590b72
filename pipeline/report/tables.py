"""Per-item results joined across models with pandas: one row per (suite, item), every model's answer beside
the base's, and which items flipped between right and wrong. What the report's item tables show."""

from __future__ import annotations

import math

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


def document_rows(results: dict[str, dict[str, dict[str, dict]]], suites: set[str]) -> dict[str, list[dict]]:
    """Per perplexity suite, in the base's document order: {id, tokens, text, ppl {model: perplexity on
    that document, or None where the model lacks it}}: each document's log-likelihood joined across models."""
    import pandas as pd

    by_suite: dict[str, list[dict]] = {}
    for suite in sorted(suites):
        frame = pd.DataFrame([{"model": model, "id": doc_id, "loglikelihood": line.get("loglikelihood"),
                               "n_tokens": line.get("n_tokens"), "text": line.get("prompt", "")}
                              for model, by_suite_items in results.items()
                              for doc_id, line in by_suite_items.get(suite, {}).items()],
                             columns=["model", "id", "loglikelihood", "n_tokens", "text"])
        base = frame[frame["model"] == "base"].set_index("id")
        if base.empty:
            by_suite[suite] = []
            continue
        frame["ppl"] = (-frame["loglikelihood"] / frame["n_tokens"].where(frame["n_tokens"] > 0)).map(
            lambda x: None if pd.isna(x) else math.exp(x))
        wide = frame.pivot(index="id", columns="model", values="ppl").reindex(index=base.index, columns=list(results))
        by_suite[suite] = [
            {"id": doc_id, "tokens": int(row["n_tokens"]), "text": row["text"],
             "ppl": {m: (None if pd.isna(wide.at[doc_id, m]) else float(wide.at[doc_id, m])) for m in results}}
            for doc_id, row in base.iterrows()]
    return by_suite
