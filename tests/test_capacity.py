"""What a variant buys, read from the serving engine's own start-up log (pipeline/engines/capacity.py),
and the report's one line per variant (pipeline/verdict/speed.py)."""

import pytest

from pipeline.engines.capacity import capacity, parse_vllm_log
from pipeline.verdict.speed import capacity_line

# vLLM 0.24's wording (gpu_model_runner / gpu_worker / kv_cache_utils), two ranks under TP 2, after a
# first start whose figures must not be read (a log appended to by a restart)
LOG = """$ vllm serve models/base --port 1
(EngineCore_DP0 pid=7) INFO 11-30 10:00:01 [gpu_model_runner.py:2602] Model loading took 9.9000 GiB and 30.1 seconds
(EngineCore_DP0 pid=7) INFO 11-30 10:00:09 [kv_cache_utils.py:1087] GPU KV cache size: 99 tokens
$ vllm serve models/base --port 2
(Worker_TP0 pid=11) INFO 12-01 10:00:01 [gpu_model_runner.py:2602] Model loading took 8.7812 GiB memory and 12.52 seconds
(Worker_TP1 pid=12) INFO 12-01 10:00:01 [gpu_model_runner.py:2602] Model loading took 8.7813 GiB memory and 12.61 seconds
(Worker_TP0 pid=11) INFO 12-01 10:00:09 [gpu_worker.py:298] Available KV cache memory: 101.25 GiB
(Worker_TP1 pid=12) INFO 12-01 10:00:09 [gpu_worker.py:298] Available KV cache memory: 101.24 GiB
(EngineCore_DP0 pid=7) INFO 12-01 10:00:10 [kv_cache_utils.py:1087] GPU KV cache size: 5,308,416 tokens
(EngineCore_DP0 pid=7) INFO 12-01 10:00:10 [kv_cache_utils.py:1091] Maximum concurrency for 131,072 tokens per request: 40.50x
"""


def test_the_last_start_of_a_vllm_log_is_read_per_gpu():
    figures = parse_vllm_log(LOG)
    assert figures["kv_cache_tokens"] == 5_308_416
    assert figures["weight_bytes"] == int(8.7813 * 2**30)  # one line per rank: the larger
    assert figures["kv_cache_bytes"] == int(101.24 * 2**30)
    assert figures["max_model_len"] == 131_072 and figures["max_concurrency_at_max_model_len"] == 40.5


def test_newer_vllm_prints_size_and_concurrency_on_one_line():
    figures = parse_vllm_log("INFO [kv_cache_utils.py:2239] GPU KV cache size: 1,234,560 tokens, Maximum concurrency "
                             "for 4,096 tokens per request: 301.41x\n")
    assert figures == {"kv_cache_tokens": 1_234_560, "max_model_len": 4096, "max_concurrency_at_max_model_len": 301.41}


def test_a_garbled_start_up_line_is_not_a_figure_and_not_a_crash():
    garbled = ("Model loading took 1.2.3 GiB and 4 seconds\nAvailable KV cache memory: . GiB\n"
               "GPU KV cache size: , tokens\nGPU KV cache size: " + "9" * 5000 + " tokens\n"
               "Maximum concurrency for 4,0,96 tokens per request: 1e400x\n")
    assert parse_vllm_log(garbled) == {}
    assert parse_vllm_log(garbled + "GPU KV cache size: 2,512,384 tokens\n") == {"kv_cache_tokens": 2_512_384}


def test_capacity_takes_the_engine_figures_and_goodput_per_gpu():
    levels = [{"goodput_requests_per_s": 2.0, "output_tokens_mean": 256.0},
              {"goodput_requests_per_s": 10.0, "output_tokens_mean": 256.0},
              {"goodput_requests_per_s": None, "output_tokens_mean": 256.0}]
    cap = capacity(parse_vllm_log(LOG), levels=levels, slo={"ttft_ms": 200.0, "tpot_ms": None},
                   tensor_parallel_size=2, model_window=131_072, checkpoint_weight_bytes=1,
                   settings={"gpu_memory_utilization": 0.9})
    assert cap["kv_cache_tokens"] == 5_308_416 and cap["max_context_batch1"] == 131_072  # the window binds
    assert cap["goodput_tok_s_per_gpu"] == 2560 / 2 and cap["slo"] == {"ttft_ms": 200.0}
    assert cap["weight_bytes"] == int(8.7813 * 2**30) and cap["source"]["weight_bytes"] == "engine log"
    small = capacity({"kv_cache_tokens": 50_000}, levels=[], slo={}, tensor_parallel_size=1, model_window=131_072,
                     checkpoint_weight_bytes=123)
    assert small["max_context_batch1"] == 50_000  # the KV pool binds
    assert small["goodput_tok_s_per_gpu"] is None and small["slo"] is None  # no SLO: no goodput
    assert small["weight_bytes"] == 123 and small["source"]["weight_bytes"] == "checkpoint size"


def row(tokens_per_s, goodput=None, kv=None, engine="vllm"):
    return {"engine": engine, "device": "NVIDIA H200", "tokens_per_s": {"1": tokens_per_s / 50, "64": tokens_per_s},
            "capacity": {"goodput_tok_s_per_gpu": goodput, "kv_cache_tokens": kv}}


@pytest.mark.parametrize("variant, base, line", [
    (row(11640, goodput=3000, kv=1_000_000), row(8492, goodput=2000, kv=500_000), "GO, 1.5× tokens/s, 2.0× KV capacity"),
    (row(11640, kv=1_000_000), row(8492, kv=500_000), "GO, 1.4× tokens/s, 2.0× KV capacity"),  # no SLO: peak tokens/s
    (row(5811, engine="lmdeploy"), row(8492), "GO"),  # benched on another engine: no ratio
])
def test_the_capacity_line(variant, base, line):
    assert capacity_line("GO", variant, base) == line


def test_without_a_bench_the_line_is_the_decision():
    assert capacity_line("NO-GO", None, row(1)) == "NO-GO"


def test_what_a_server_sharing_the_gpu_would_hold_alone():
    """A server at 0.22 of a 141 GB GPU with a 9 GiB pool of 230k tokens: everything but the pool stays, the
    pool grows to what 0.9 leaves."""
    from pipeline.engines.capacity import tokens_at_fraction

    device, pool, tokens = 141 * 10**9, 9 * 2**30, 230_000
    figures = {"kv_cache_bytes": pool, "kv_cache_tokens": tokens}
    alone = tokens_at_fraction(figures, 0.9, 0.22, device)
    assert alone == round((0.9 * device - (0.22 * device - pool)) * tokens / pool)
    assert tokens_at_fraction(figures, 0.22, 0.22, device) == tokens
    assert tokens_at_fraction(figures, 0.9, None, device) is None  # the fraction unknown: not guessed
