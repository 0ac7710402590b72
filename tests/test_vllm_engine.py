"""The vLLM engine and the OpenAI engine's token-id path, on the CPU.

vLLM itself needs a CUDA machine (benchmarks/gpu_vllm.py runs the real server on the H200). Here the
same code talks to tests/openai_server.py: a real HTTP server speaking vLLM's /v1/completions
(token-id prompts, return_token_ids, prompt_logprobs, streaming) backed by a real tiny transformers
model, started as a child process through the same command line as `vllm serve`. So the engine's
process handling (start, health check, log, stop, a start that fails) and the promise that
switching engine changes no token are tested here; vLLM's own kernels are not.
"""

import json
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import TINY_PARAMS, read_jsonl, write_params
from openai_server import CompletionsServer
from pipeline.cli.app import app
from pipeline.engines import GenRequest
from pipeline.engines.vllm import Settings
from pipeline.errors import UserError

SERVER = [sys.executable, str(Path(__file__).with_name("openai_server.py"))]
PROMPTS = ["What is 2 + 3?", "Name a colour.", "Where is my order 12345?"]


def vllm_settings(tmp_path, **engine) -> dict:
    settings = json.loads(json.dumps(TINY_PARAMS))
    settings["engine"].update(name="vllm", server_command=SERVER, start_timeout=120,
                              server_args=["--record", str(tmp_path / "argv.json")], **engine)
    return settings


def hf_answers(model_dir, prompts, max_new_tokens=12):
    from pipeline.engines import hf as hf_engine
    from pipeline.engines.hf import HFEngine

    engine = HFEngine(model_dir, hf_engine.Settings(batch_size=4))
    requests = [GenRequest(engine.apply_chat_template([{"role": "user", "content": p}]), max_new_tokens) for p in prompts]
    return requests, engine.generate(requests)


def test_token_prompts_give_the_hf_engines_very_outputs(tiny_llama):
    from clients import openai_client

    requests, expected = hf_answers(tiny_llama, PROMPTS)
    with CompletionsServer(str(tiny_llama), "served") as server:
        engine = openai_client(tiny_llama, base_url=server.base_url, model="served", prompt_format="tokens",
                              params_section="engine")
        assert engine.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]) == requests[0].prompt
        got = engine.generate(requests)
        sent = [r["body"]["prompt"] for r in server.requests]
    assert [c.text for c in got] == [c.text for c in expected]
    assert all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in sent)  # token ids, not text
    assert sorted(sent) == sorted(engine.encode(r.prompt) for r in requests)


def test_vllm_engine_starts_checks_and_stops_its_server_and_evaluates_like_hf(tmp_path, tiny_llama, monkeypatch):
    """`quantize eval --engine vllm`: the server is started with vLLM's flags from params.yaml, its
    log lands beside the results, the items and outputs equal the hf engine's, the server is gone after."""
    write_params(tmp_path, vllm_settings(tmp_path, tensor_parallel_size=2, max_model_len=512,
                                         gpu_memory_utilization=0.5, enable_prefix_caching=False,
                                         max_num_batched_tokens=2048, max_num_seqs=16))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    via_vllm = runner.invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--out", "v"])
    assert via_vllm.exit_code == 0, via_vllm.output
    hf = runner.invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--out", "h", "--engine", "hf"])
    assert hf.exit_code == 0, hf.output

    strip = lambda lines: [{k: l[k] for k in ("id", "prompt", "output", "correct")} for l in lines]  # noqa: E731
    assert strip(read_jsonl(tmp_path / "v" / "math.jsonl")) == strip(read_jsonl(tmp_path / "h" / "math.jsonl"))
    summary = json.loads((tmp_path / "v" / "math.json").read_text())
    assert summary["engine"] == "vllm"
    argv = json.loads((tmp_path / "argv.json").read_text())
    flags = argv
    for flag, value in (("--tensor-parallel-size", "2"), ("--max-model-len", "512"), ("--gpu-memory-utilization", "0.5"),
                        ("--max-num-batched-tokens", "2048"), ("--max-num-seqs", "16"), ("--kv-cache-dtype", "auto"),
                        ("--generation-config", "vllm")):
        assert flags[flags.index(flag) + 1] == value, flag
    assert "--no-enable-prefix-caching" in flags and argv[0] == str(tiny_llama)
    log = (tmp_path / "v" / "math.vllm.log").read_text()
    assert "--served-model-name" in log and "listening on" in log


def test_a_server_that_fails_to_start_is_a_clear_error_with_its_log(tmp_path, tiny_llama, monkeypatch):
    settings = vllm_settings(tmp_path)
    settings["engine"]["server_args"] = ["--fail-start"]
    write_params(tmp_path, settings)
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    result = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--out", "v"])
    assert result.exit_code == 2, result.output
    assert "vLLM server exited with code 3 while starting" in result.output
    assert "a scripted start failure" in result.output and "math.vllm.log" in result.output
    assert time.monotonic() - started < 60 and not (tmp_path / "v" / "math.jsonl").exists()


def test_a_server_that_dies_mid_run_stops_the_stage_instead_of_scoring_empty_answers(tmp_path, tiny_llama,
                                                                                     monkeypatch):
    """Seen on the H200: vLLM's engine died at its first request and every later one was refused; those
    requests must not be scored as wrong answers."""
    settings = vllm_settings(tmp_path)
    settings["engine"]["server_args"] = ["--die-after", "2"]
    write_params(tmp_path, settings)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--out", "v"])
    assert result.exit_code == 2, result.output
    assert "the vLLM server died (exit code 4)" in result.output and "a scripted crash" in result.output
    assert not (tmp_path / "v" / "math.jsonl").exists()


def test_an_fp8_kv_cache_is_served_in_bfloat16(tmp_path):
    from pipeline.engines.vllm import server_args

    path = tmp_path / "fp8"
    path.mkdir()
    path.joinpath("config.json").write_text(json.dumps({"quantization_config": {"kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": "attn_head"}}}))
    args = server_args(path, 8000, Settings(kv_cache_dtype="checkpoint"))
    assert args[args.index("--dtype") + 1] == "bfloat16"  # a float16 checkpoint would crash vLLM's FP8 attention
    with pytest.raises(UserError, match="float16 with an FP8 KV cache"):
        server_args(path, 8000, Settings(kv_cache_dtype="checkpoint", dtype="float16"))
    plain = server_args(path, 8000, Settings(kv_cache_dtype="auto", dtype="float16"))
    assert plain[plain.index("--dtype") + 1] == "float16"


def test_a_missing_vllm_command_says_how_to_install_it(tmp_path, tiny_llama):
    from pipeline.engines.vllm import VLLMEngine

    engine = VLLMEngine(tiny_llama, Settings(server_command=["no-such-vllm-binary", "serve"], share_server=False),
                        log_path=tmp_path / "log")
    with pytest.raises(UserError, match=r"not found; install it \(pip install -e '.\[vllm\]'\)"):
        engine.start()  # the server starts when something first needs it


def test_vllm_log_likelihoods_equal_a_forward_pass(tmp_path, tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.engines.vllm import VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    pairs = [(tokenizer("The cat sat on")["input_ids"], tokenizer(" the mat", add_special_tokens=False)["input_ids"]),
             (tokenizer("Order")["input_ids"], tokenizer(" 12345 shipped today", add_special_tokens=False)["input_ids"])]
    engine = VLLMEngine(tiny_llama, Settings(server_command=SERVER, start_timeout=120, share_server=False),
                        log_path=tmp_path / "server.log")
    try:
        got = engine.token_logprobs(pairs)
    finally:
        engine.close()
    for (context, continuation), (total, greedy) in zip(pairs, got):
        ids = torch.tensor([context + continuation])
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        picks = [logprobs[len(context) + i - 1, t] for i, t in enumerate(continuation)]
        argmax = [int(logprobs[len(context) + i - 1].argmax()) == t for i, t in enumerate(continuation)]
        assert total == pytest.approx(float(sum(picks)), abs=1e-4) and greedy == all(argmax)


def test_kv_cache_dtype_checkpoint_serves_fp8_kv_scales_in_fp8(tmp_path, tiny_llama):
    from pipeline.engines.vllm import resolve_kv_cache_dtype, server_args

    def checkpoint(name, quantization):  # config.json as `quantize fp8` / `quantize awq` write it
        path = tmp_path / name
        path.mkdir()
        path.joinpath("config.json").write_text(json.dumps({"quantization_config": quantization}))
        return path

    fp8 = checkpoint("fp8", {"quant_method": "compressed-tensors", "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": "attn_head", "symmetric": True, "dynamic": False}})
    awq = checkpoint("awq", {"quant_method": "compressed-tensors", "kv_cache_scheme": None})
    assert resolve_kv_cache_dtype("checkpoint", fp8) == "fp8"  # its per-head scales are served
    assert resolve_kv_cache_dtype("checkpoint", awq) == "auto"
    assert resolve_kv_cache_dtype("checkpoint", tiny_llama) == "auto"
    assert resolve_kv_cache_dtype("bfloat16", fp8) == "bfloat16"  # the user's choice wins
    args = server_args(fp8, 8000, Settings(kv_cache_dtype="checkpoint"))
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"


def test_a_slow_drip_answer_is_cut_at_the_total_deadline(tiny_llama):
    """One byte every 50 ms: httpx's idle timeout never fires; the total deadline does."""
    from clients import openai_client

    with CompletionsServer(str(tiny_llama), "served") as server:
        server.fault = ("drip", 0.05)
        engine = openai_client(tiny_llama, base_url=server.base_url, model="served", prompt_format="tokens",
                              timeout=1.5, retries=0)
        started = time.monotonic()
        [completion] = engine.generate([GenRequest("hello", 4)])
        elapsed = time.monotonic() - started
    assert completion.error and "within 1.5 s" in completion.error and completion.text == ""
    assert elapsed < 4


def test_an_oversized_answer_is_dropped_unread(tiny_llama):
    from clients import openai_client

    with CompletionsServer(str(tiny_llama), "served") as server:
        server.fault = ("huge", 4 << 20)
        engine = openai_client(tiny_llama, base_url=server.base_url, model="served", prompt_format="tokens",
                              max_response_bytes=1 << 20, retries=0)
        [completion] = engine.generate([GenRequest("hello", 4)])
    assert completion.error and "larger than 1048576 bytes" in completion.error


def test_bench_through_a_server_sweeps_concurrency_and_request_rates(tmp_path, tiny_llama, monkeypatch):
    from test_bench import write_holdout

    settings = vllm_settings(tmp_path)
    settings["engine"]["server_args"] += ["--decode-step", "0.01"]  # tokens apart in time, as a GPU decodes them
    settings["bench"] = {"request_rates": [20.0], "rate_seconds": 0.5, "slo": {"ttft_ms": 60000, "tpot_ms": 60000}}
    write_params(tmp_path, settings)
    holdout = write_holdout(tmp_path / "holdout.jsonl")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", str(tiny_llama), "--concurrency", "1,2", "--input-len", "16",
                                      "--output-len", "6", "--holdout", str(holdout), "--out", "r/bench.json"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "r" / "bench.json").read_text())
    assert summary["engine"] == "vllm" and summary["engine_info"]["version"] == "0.0-test"
    fixed = summary["workloads"]["fixed"]
    assert [l["concurrency"] for l in fixed["levels"]] == [1, 2] and len(fixed["rates"]) == 1
    for level in fixed["levels"] + fixed["rates"]:
        assert level["failed"] == 0 and level["output_tokens_mean"] == 6  # ignore_eos: exactly output_len each
        for key in ("ttft_ms", "tpot_ms_stats", "itl_ms", "e2el_ms"):
            stats = level[key]
            assert 0 < stats["median"] <= stats["p90"] <= stats["p99"]
        assert level["goodput_requests_per_s"] == pytest.approx(level["requests_per_s"])  # generous SLOs: all good
    assert fixed["rates"][0]["requests"] == 10  # 20 req/s for 0.5 s, at least 8
    assert summary["roofline"]["bound_tokens_per_s"] > 0
    assert (tmp_path / "r" / "bench.vllm.log").exists()
    # what the variant buys, from the server's own start-up lines (the test server logs vLLM 0.24's wording
    # for a pretend 1 GiB device at gpu_memory_utilization 0.9 and this model's float32 weights)
    cap = summary["capacity"]
    weights = sum(t.numel() * 4 for t in __import__("conftest").read_tensors(tiny_llama).values())
    log = (tmp_path / "r" / "bench.vllm.log").read_text()
    logged = int(log.split("GPU KV cache size: ")[1].split(" tokens")[0].replace(",", ""))
    assert cap["kv_cache_tokens"] == logged > 0 and cap["source"]["kv_cache_tokens"] == "engine log"
    assert cap["weight_bytes"] == pytest.approx(weights, abs=2**30 * 0.00005)  # logged as GiB to 4 decimals
    assert cap["max_context_batch1"] == min(logged, 512)  # the tiny model's window: 512 positions
    assert cap["slo"] == {"ttft_ms": 60000, "tpot_ms": 60000}
    best = max(l["goodput_requests_per_s"] * l["output_tokens_mean"] for l in fixed["levels"] + fixed["rates"])
    assert cap["goodput_tok_s_per_gpu"] == pytest.approx(best)
    assert summary["engine_start_s"] > 0


def test_request_rates_need_a_server_engine(tmp_path, tiny_llama, monkeypatch):
    write_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", str(tiny_llama), "--request-rates", "2", "--engine", "hf"])
    assert result.exit_code == 2 and "need a server engine" in result.output


def test_an_unknown_engine_lists_the_choices(tmp_path, tiny_llama, monkeypatch):
    write_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--engine", "tgi"])
    assert result.exit_code == 2 and "--engine 'tgi': use hf, vllm, lmdeploy or openai" in result.output


def test_every_variant_records_which_engines_serve_it_only_from_recorded_runs(tiny_variants, tiny_llama, tmp_path):
    """quant.json, the report and `quantize export` say the same thing: a Llama was never served on the GPU
    machine, so nothing claims it is; each "not shown" gives the command to try."""
    from pipeline.checkpoints.serving import serving_support

    fp8 = json.loads((tiny_variants["fp8-w8a8"] / "quant.json").read_text())["serving"]
    awq = json.loads((tiny_variants["awq-w4a16"] / "quant.json").read_text())["serving"]
    for record, engine in ((fp8, "vllm"), (awq, "vllm"), (awq, "lmdeploy"), (serving_support(tiny_llama), "vllm")):
        assert record[engine]["serves"] is False and record[engine]["status"] == "not shown"
        assert "try:" in record[engine]["how"]
    assert "vllm serve DIR --kv-cache-dtype fp8" in fp8["vllm"]["how"] and "per-head" in fp8["vllm"]["how"]
    assert fp8["lmdeploy"]["status"] == "cannot" and "one scale per tensor" in fp8["lmdeploy"]["how"]
    result = CliRunner().invoke(app, ["export", str(tiny_variants["fp8-w8a8"]), "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and fp8["lmdeploy"]["how"] in " ".join(result.output.split())
    assert not (tmp_path / "x").exists()


def test_a_planned_kv_pool_is_the_memory_share_less_the_weights_and_the_rest(tmp_path, tiny_llama, monkeypatch):
    """engine.kv_cache_memory: planned: `--kv-cache-memory-bytes` = gpu_memory_utilization x the GPU's memory
    - the checkpoint's weights (every shard, this GPU's share) - non_kv_memory_gib; vLLM then skips the start-up
    profiling that reads the whole device's free memory. Too small a share is refused with the fix."""
    from pipeline.engines.capacity import planned_kv_figures
    from pipeline.engines.vllm import server_args

    weights = sum(f.stat().st_size for f in tiny_llama.glob("*.safetensors"))
    settings = {"kv_cache_memory": "planned", "device_memory_gib": 2.0, "gpu_memory_utilization": 0.5,
                "non_kv_memory_gib": 0.25}
    args = server_args(tiny_llama, 8000, Settings(**settings))
    pool = int(args[args.index("--kv-cache-memory-bytes") + 1])
    assert pool == int(0.5 * 2 * (1 << 30)) - weights - int(0.25 * (1 << 30))
    tp2 = server_args(tiny_llama, 8000, Settings(**{**settings, "tensor_parallel_size": 2}))
    assert int(tp2[tp2.index("--kv-cache-memory-bytes") + 1]) == pool + weights - weights // 2
    assert "--kv-cache-memory-bytes" not in server_args(tiny_llama, 8000, Settings())  # auto: vLLM sizes it
    assert planned_kv_figures(["vllm", "serve", "m", "--kv-cache-memory-bytes", str(pool)]) == {
        "kv_cache_bytes": pool, "kv_cache_bytes_source": "planned"}
    with pytest.raises(UserError, match="leaves no KV cache for .* raise gpu_memory_utilization"):
        server_args(tiny_llama, 8000, Settings(**{**settings, "gpu_memory_utilization": 0.1}))
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)  # a machine without nvidia-smi
    with pytest.raises(UserError, match="set engine.device_memory_gib, or use engine.kv_cache_memory: auto"):
        server_args(tiny_llama, 8000, Settings(**{**settings, "device_memory_gib": None}))
