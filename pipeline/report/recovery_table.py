"""Recovery as published quantized-model cards give it (Red Hat / Neural Magic): per accuracy suite the base's
score and each variant's with its recovery (variant / base), and an Average row over the counted accuracy suites
(verdict.json's variants.<v>.recovery); a variant without an average says why in its cell."""

from __future__ import annotations

import pipeline.verdict.facts as facts
import pipeline.verdict.figures as figures
from pipeline.report.screen import recovery_note
from pipeline.verdict.headline import ordered


def recovery_table(verdict: dict) -> dict:
    """{variants, rows: [{suite, base, cells: {variant: text}}], average: {variant: text}, base_average}, over the accuracy
    suites counted for any variant; a variant without an average gets the visible reason instead."""
    variants = verdict.get("variants") or {}
    names = [n for n in ordered(variants) if "suites" in variants[n]]
    suites = sorted({s for n in names for s, _, _ in facts.counted_entries(variants[n], facts.ACCURACY)})
    rows = []
    for suite in suites:
        cells, base = {}, None
        for name in names:
            d = facts.counted_part(variants[name], facts.ACCURACY, suite)
            if d:
                base = d.get("base_score")
                cells[name] = f"{figures.share(d.get('variant_score'))} ({figures.share(d.get('recovery'))})"
            else:
                cells[name] = "not counted"
        rows.append({"suite": suite, "base": figures.share(base), "cells": cells})
    average = {}
    for name in names:
        recovery = variants[name].get("recovery") or {}
        average[name] = (f"{figures.share(recovery.get('variant_mean'))} ({figures.share(recovery['accuracy'])})"
                         if recovery.get("accuracy") is not None else _none(variants[name]))
    over = {tuple((variants[n].get("recovery") or {}).get("suites") or ()) for n in names}
    means = [(variants[n].get("recovery") or {}).get("base_mean") for n in names]
    base_average = figures.share(means[0]) if len(over) == 1 and means and means[0] is not None else "–"
    return {"variants": names, "rows": rows, "average": average, "base_average": base_average}


def _none(entry: dict) -> str:
    note = recovery_note(entry)
    return f"{note['text']}: {note['note']}"
