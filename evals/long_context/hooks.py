"""The long-context suite's hooks (its YAML's metadata.suite.hooks; pipeline/settings/suites.py finds them): what
only the model knows (its context length, its tokenizer's characters per token on the haystack) goes to the task as
lm-eval metadata, the options params.yaml may set are checked, and the result lines are summarized per length and
depth, with the lengths skipped as beyond the context.
"""

from __future__ import annotations

import importlib.util
import re
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

SUITE_DIR = Path(__file__).resolve().parent
ID = re.compile(r"^(?P<kind>[a-z]+)-(?P<length>\d+)-d(?P<depth>\d+)-(?P<repeat>\d+)$")


@lru_cache(maxsize=1)
def suite():
    """evals/long_context/utils.py, the one place the ladder and the generator live."""
    spec = importlib.util.spec_from_file_location("long_context_suite", SUITE_DIR / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chars_per_token(model_dir: Path | str, sample_chars: int = 40_000) -> float:
    """The model tokenizer's characters per token on the haystack, so nominal lengths are its tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = suite().haystack_text()[:sample_chars]
    return round(len(text) / len(tokenizer(text, add_special_tokens=False)["input_ids"]), 3)


def context_limits(model_dir: Path | str, engine=None) -> list[list]:
    """[[tokens, what], ...]: every bound on one prompt's length, the model's window first, then what the
    engine serving it holds: its max_model_len and its KV cache (vLLM's own start-up figures:
    pipeline/engines/capacity.py). A length past the smallest is skipped, with that bound as the reason."""
    from pipeline.checkpoints import checkpoint

    limits = []
    if (positions := checkpoint.open(model_dir).max_positions) is not None:
        limits.append([positions, "the model's context"])
    if engine is not None:
        figures = engine.capacity() if hasattr(engine, "capacity") else {}
        settings = getattr(engine, "settings", None)  # its params section (vllm: pipeline/engines/vllm.py)
        served = figures.get("max_model_len") or getattr(settings, "max_model_len", None)
        if served:
            limits.append([int(served), "the engine's max_model_len"])
        if figures.get("kv_cache_tokens"):
            fraction = getattr(settings, "gpu_memory_utilization", None)
            at = f" at gpu_memory_utilization {fraction:g}" if fraction else ""
            limits.append([int(figures["kv_cache_tokens"]), f"the engine's KV cache{at}"])
    return limits


def task_metadata(model_dir: Path | str, engine=None, **overrides) -> dict:
    """What evaluate.py passes as TaskManager(metadata=...) for this suite; overrides (lengths,
    depths, kinds, repeats) replace the YAML's ladder; engine: the server that will answer (its
    max_model_len and KV cache bound the lengths too)."""
    metadata = {"chars_per_token": chars_per_token(model_dir), **overrides}
    limits = context_limits(model_dir, engine)
    if limits:
        metadata["max_context"] = min(n for n, _ in limits)
        metadata["context_limits"] = limits
    return metadata


MAX_TOKENS = 20_000_000  # all items together: every one is generated in memory


def options_problem(options: dict) -> str | None:
    """What is wrong with the suite's options (params.yaml suites.<name>.options: the ladder of utils.py), else None."""
    allowed = {"lengths", "depths", "kinds", "repeats"}
    for key in options:
        if key not in allowed:
            return f"{key}: unknown option; use {', '.join(sorted(allowed))}"
    lengths, depths = options.get("lengths", list(suite().LENGTHS)), options.get("depths", list(suite().DEPTHS))
    kinds, repeats = options.get("kinds", list(suite().KINDS)), options.get("repeats", suite().REPEATS)
    whole = lambda v, lo, hi: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi  # noqa: E731
    if not isinstance(lengths, list) or not 1 <= len(lengths) <= 32 or not all(whole(n, 64, 1 << 20) for n in lengths):
        return "lengths: give a list of 1 to 32 token counts between 64 and 1048576, e.g. [1024, 2048]"
    if not isinstance(depths, list) or not 1 <= len(depths) <= 101 or not all(whole(d, 0, 100) for d in depths):
        return "depths: give a list of needle depths in % (whole numbers 0-100), e.g. [0, 50, 100]"
    if not isinstance(kinds, list) or not kinds or not set(kinds) <= set(suite().KINDS):
        return f"kinds: give a list of {' and/or '.join(suite().KINDS)}"
    if not whole(repeats, 1, 1000):
        return "repeats: give a whole number from 1 to 1000"
    total = sum(lengths) * len(depths) * len(kinds) * repeats
    if total > MAX_TOKENS:
        return (f"the ladder holds {total:,} prompt tokens in all, over the limit of {MAX_TOKENS:,}; "
                "use fewer lengths, depths or repeats")
    return None


def _lengths(metadata: dict) -> list[int]:
    return [int(n) for n in metadata.get("lengths") or suite().LENGTHS]


def not_applicable(metadata: dict) -> str | None:
    """Why the suite cannot run on this model (no length of the ladder fits its context), else None.
    metadata: the task's YAML metadata updated with task_metadata(model_dir)."""
    lengths = _lengths(metadata)
    if suite().fitting_lengths(lengths, metadata.get("max_context"))[0]:
        return None
    return (f"context of {metadata.get('max_context')} tokens is below the shortest length of the ladder "
            f"{lengths} (plus room for the answer)")


def skipped_lengths(lengths, max_context: int | None, limits: list | None = None) -> list[dict]:
    """One entry per length the suite leaves out for this model (and engine), with the reason: the
    tightest bound it passes (context_limits)."""
    _, skipped = suite().fitting_lengths(lengths, max_context)
    limits = sorted(limits or [[max_context, "the model's context"]])
    out = []
    for n in skipped:
        needed = round(n * suite().SLACK) + suite().ANSWER_ROOM
        bound, what = next(([b, w] for b, w in limits if needed > b), limits[0])
        out.append({"length": n, "reason": f"beyond {what}: needs ~{needed} tokens, has {bound}"})
    return out


def skip_beyond_context(docs: list[dict], max_tokens: int | None) -> tuple[list[dict], list[dict]]:
    """(kept, skipped) docs by their nominal length, for callers that hold generated items."""
    kept_lengths, _ = suite().fitting_lengths(sorted({d["nominal_tokens"] for d in docs}), max_tokens)
    kept = [d for d in docs if d["nominal_tokens"] in kept_lengths]
    return kept, [d for d in docs if d["nominal_tokens"] not in kept_lengths]


def _mean_table(groups: dict) -> dict:
    return {key: {"n": len(scores), "score": sum(scores) / len(scores)} for key, scores in groups.items()}


def by_length_and_depth(result_lines: list[dict]) -> dict[str, dict[str, dict]]:
    """{"1024": {"d0": {"n": 8, "score": 0.75}, ...}, ...}: mean score per length and needle depth."""
    table: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in result_lines:
        match = ID.match(line["id"])
        if match is None:
            raise ValueError(f"id {line['id'][:80]!r} is not kind-length-dDEPTH-repeat, so its length and needle "
                             "depth are unknown")
        table[int(match["length"])][int(match["depth"])].append(float(line["score"]))
    return {str(length): {f"d{depth}": cell for depth, cell in sorted(_mean_table(depths).items())}
            for length, depths in sorted(table.items())}


def by_kind(result_lines: list[dict]) -> dict[str, dict]:
    groups: dict[str, list[float]] = defaultdict(list)
    for line in result_lines:
        groups[line["id"].split("-", 1)[0]].append(float(line["score"]))
    return _mean_table(groups)


def summarize(result_lines: list[dict], metadata: dict) -> dict:
    """The suite's extra summary: scores per length x depth and per kind, and the skipped lengths.
    metadata: as for not_applicable."""
    lengths, max_context = _lengths(metadata), metadata.get("max_context")
    return {
        "max_context": max_context,
        "lengths_run": suite().fitting_lengths(lengths, max_context)[0],
        "lengths_skipped": skipped_lengths(lengths, max_context, metadata.get("context_limits")),
        "context_limits": metadata.get("context_limits"),
        "by_length_and_depth": by_length_and_depth(result_lines),
        "by_kind": by_kind(result_lines),
    }


def table_from_lines(result_lines: list[dict]) -> dict:
    """The table's figures the lines determine (the report recomputes them from results/<model>/<suite>.jsonl)."""
    return {"by_length_and_depth": by_length_and_depth(result_lines)}
