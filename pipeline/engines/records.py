"""What this process's engines cost and met, for the stage log: kept apart from the registry
(pipeline/engines/__init__.py re-exports them) so that the engine modules it lists can record into them."""

from __future__ import annotations

# Every engine this process made, with what making it cost: a model load (hf, lmdeploy), a server start
# (vllm), or an attach to a server an earlier stage of the run started (vllm, shared: seconds near 0).
# Stages write the sum as `engine_start_s` in their outputs; the CLI adds it to QUANTIZE_STAGE_LOG.
STARTS: list[dict] = []
# Every wait on a server that held none of this process's outstanding requests, as the lost-request watchdog ended it
# ({"server", "idle_s", "requests", "at"}), and per server the most of this process's requests in flight there at
# once (pipeline/engines/inflight.py). Stages write both in QUANTIZE_STAGE_LOG.
STALLS: list[dict] = []
PEAK_IN_FLIGHT: dict[str, int] = {}


def engine_start_seconds(since: int = 0) -> float:
    """Seconds spent making engines, from the `since`-th on (len(STARTS) when a stage began)."""
    return round(sum(s["seconds"] for s in STARTS[since:]), 2)
