"""What the page says about deploying each variant, every state in words that show and print (never only in a
tooltip): where it is served (shown with its run, refused with the engine's error, not tried with the command),
its speed (measured, refused on the deployment engine with the engine's error, not tried with the command; a model
benched with images names the load each figure is from: "text only, c=1", "1 image"), and its own memory (its
weights and its KV pool; never the device's total, which counts every server up at the time).
"""

from __future__ import annotations

import math

import pipeline.verdict.figures as figures
from pipeline.engines import ENGINES, capability

# the engines a variant is deployed on (their EngineSpec says so); hf runs everything in-process
SERVING_ENGINES = tuple(name for name, spec in ENGINES.items() if spec.deployed)
REFUSED = ("refused", "cannot")  # serving statuses of an engine that cannot serve the variant


def _num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def compact(value: float) -> str:
    """900000 -> '900k', 1250000 -> '1.25M', 7000 -> '7.0k', 950 -> '950'."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.0f}"


def _head(text: str) -> str:
    """An engine's error up to its first semicolon: what it refuses, without how to get round it."""
    return text.split("; ")[0]


def served_by(serving, variant: str) -> list[dict]:
    """Where the variant is served, one of three states per serving engine: shown (the run that showed it),
    refused (the engine's error, one line), not tried (the command to try, with the variant's folder); `brief`
    is what the first screen shows of it (the evidence's file, the error's head, the first command)."""
    if not isinstance(serving, dict):
        return []
    rows = []
    for engine in SERVING_ENGINES:
        e = serving.get(engine)
        if not isinstance(e, dict):
            continue
        how = str(e.get("how") or "").replace("DIR", f"models/{variant}")
        status = e.get("status") or ("shown" if e.get("serves") else "not shown")
        if e.get("serves"):
            evidence = str(e.get("evidence") or "")
            brief = ", ".join(part.rsplit("/", 1)[-1] for part in evidence.split(", ")) if evidence else how  # the files
            state, detail = "shown", how + (f"; evidence: {evidence}" if evidence else "")
        elif status in REFUSED:  # the error's summary on the first screen, the whole error in the serving table
            state, detail = "refused", _head(how)
            brief = detail.split(": ")[0]
        else:  # the first command on the first screen, every command in the serving table
            state = "not tried"
            detail = how.split("try: ", 1)[1] if "try: " in how else how
            brief = detail.split(" (or ")[0].split(", then ")[0] + (", then …" if ", then " in detail else "")
        rows.append({"engine": engine, "state": state, "detail": detail, "brief": brief})
    return rows


def memory(row: dict, human_size) -> str:
    """The model's own memory on its engine: weights + its KV pool (bench.json's capacity), or an in-process
    engine's own figure; what is missing, said."""
    cap = row.get("capacity") or {}
    weights, pool = cap.get("weight_bytes"), cap.get("kv_cache_bytes")
    if _num(weights) and _num(pool):
        return f"memory {human_size(weights + pool)}: weights {human_size(weights)} + KV pool {human_size(pool)}"
    if _num(weights):
        return f"weights {human_size(weights)}; KV pool not recorded"
    if not capability(str(row.get("engine")), "starts_server") and _num(row.get("memory_bytes")):
        return f"memory {human_size(row['memory_bytes'])} (the {row.get('engine')} process's peak)"
    return "memory of this model not recorded (a server's device total counts every model up)"


def _vs_base(value, base_value) -> str:
    return f" ({figures.ratio(value / base_value)} base)" if _num(value) and _num(base_value) and base_value else ""


def _load_line(load: dict, base_load: dict | None) -> str:
    """One load of a bench with images on the first screen, short: "1 image (1,369 tokens each): TTFT 84.0 ms at c=1,
    891 in the KV pool (1.8× base)", the text-only load its KV figure only (its speed leads the cell); the table of
    loads in the speed section has every figure of each (KV tokens per request, decode rates, goodput)."""
    head = str(load["label"])
    if load.get("images_per_request"):
        each = load.get("image_tokens_per_image")
        head += f" ({each:,} tokens each)" if isinstance(each, int) else f" ({compact(each)} tokens each)" if _num(each) else ""
    parts = []
    if load.get("images_per_request") and _num(load.get("batch1_ttft_ms")):
        parts.append(f"TTFT {figures.ms(load['batch1_ttft_ms'])} at c={load['batch1_concurrency']}")
    if _num(load.get("requests_in_kv_pool")):
        parts.append(f"{compact(load['requests_in_kv_pool'])} in the KV pool"
                     + _vs_base(load["requests_in_kv_pool"], (base_load or {}).get("requests_in_kv_pool")))
    elif _num(load.get("kv_tokens_per_request")):  # no pool reported (an in-process engine): what one request holds
        parts.append(f"{compact(load['kv_tokens_per_request'])} KV tokens a request")
    return head + (": " + ", ".join(parts) if parts else "")


def _measured(row: dict, base_row: dict | None, comparison: dict, human_size) -> dict:
    """A measured speed: batch-1 decode (against the base's, or why not), goodput, KV cache and context, memory; a
    bench with images names the load of each figure and adds a line per load."""
    rate = row.get("batch1_tokens_per_s")
    text = f"{row['engine']}: " + (f"{figures.rate(rate)} tok/s at batch 1" if _num(rate) else "measured")
    if row.get("batch1_load"):
        text += f" ({row['batch1_load']})"
    if comparison.get("comparable"):
        text += f" ({figures.ratio(comparison['ratio'])} base)"
    same = base_row is not None and all(base_row.get(k) == row.get(k) for k in ("engine", "device"))
    cap, base_cap = row.get("capacity") or {}, ((base_row or {}).get("capacity") or {}) if same else {}
    more = [] if comparison.get("comparable") or not comparison.get("reason") else [f"vs base: {comparison['reason']}"]
    text_only = f" ({row['loads'][0]['label']})" if row.get("loads") else ""
    for key, words in (("goodput_tok_s_per_gpu", "goodput {} tok/s/GPU" + text_only), ("kv_cache_tokens", "KV cache {} tokens")):
        if _num(cap.get(key)):
            more.append(words.format(compact(cap[key])) + _vs_base(cap[key], base_cap.get(key)))
    if _num(cap.get("max_context_batch1")):
        more.append(f"context {compact(cap['max_context_batch1'])} at batch 1")
    base_loads = {load.get("name"): load for load in ((base_row or {}).get("loads") or [])} if same else {}
    more += [_load_line(load, base_loads.get(load.get("name"))) for load in row.get("loads") or []]
    return {"state": "measured", "text": text, "more": [*more, memory(row, human_size)], "commands": []}


def speed_state(variant: str, entry: dict, speed: dict, speed_engine: str | None, human_size) -> dict:
    """The variant's speed in one of three states: measured (its figures), refused (the deployment engine
    cannot serve it: the engine's error), not tried (the commands that measure it)."""
    row = speed.get(variant)
    if row:
        return _measured(row, speed.get("base"), entry.get("speed") or {}, human_size)
    refusal = next((e for e in served_by(entry.get("serving"), variant)
                    if e["state"] == "refused" and e["engine"] == speed_engine), None)
    if refusal:
        return {"state": "refused", "text": f"{speed_engine}: refused", "more": [refusal["detail"]], "commands": []}
    commands = [c for c in entry.get("speed_commands") or [] if c.startswith("quantize bench models/")
                and not c.startswith("quantize bench models/base")]  # the base's heads the column, once
    return {"state": "not tried", "text": "not tried: run" if commands else "not tried", "more": [],
            "commands": commands}
