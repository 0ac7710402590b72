"""`quantize bench` on the CPU with the hf engine (lmdeploy runs it on the GPU machine), the speed
table in the report, and the clear error when the lmdeploy extra is missing."""

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import TINY_PARAMS, with_variants, write_params
from pipeline.stages import report
from pipeline.cli.app import app
from pipeline.settings.params import Params
from test_report import write_results
from tiny import tiny_tokenizer

REPLIES = ["Yes.", "Your order ships tomorrow from our warehouse.", "Sorry about that, refund issued today."]


def write_holdout(path, too_long_words: int = 600):
    """Held-out prompts as `quantize calib` writes them: the conversation up to a user turn, the real reply apart."""
    records = [{"id": f"h{i}", "messages": [{"role": "user", "content": f"Where is order {i}?"}],
                "prompt": f"Where is order {i}?", "reference": reply} for i, reply in enumerate(REPLIES)]
    records.append({"id": "long", "messages": [{"role": "user", "content": "word " * too_long_words}],
                    "prompt": "word " * too_long_words, "reference": "ok"})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bench_sweeps_concurrency_on_both_workloads(tmp_path, tiny_llama, monkeypatch):
    write_params(tmp_path)
    holdout = write_holdout(tmp_path / "holdout.jsonl")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", str(tiny_llama), "--concurrency", "1,2", "--input-len", "16",
                                      "--output-len", "8", "--holdout", str(holdout), "--out", "bench.json"])
    assert result.exit_code == 0, result.output
    assert "bench: wrote bench.json (hf, fixed workload" in result.output
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert summary["parallel"] == {"tensor_parallel_size": 1}  # the hf engine runs on one device

    fixed, real = summary["workloads"]["fixed"], summary["workloads"]["holdout"]
    assert [l["concurrency"] for l in fixed["levels"]] == [1, 2] == [l["concurrency"] for l in real["levels"]]
    # a text-only model: bench.images (default [1, 4]) asks nothing of it, and its figures carry no load's name
    assert set(summary["workloads"]) == {"fixed", "holdout"} and "label" not in fixed
    assert "by_load" not in summary["capacity"] and "images_not_measured" not in summary
    for level in fixed["levels"] + real["levels"]:
        assert level["failed"] == 0 and level["requests"] == 4
        assert 0 < level["ttft_p50_ms"] <= level["ttft_p90_ms"] < 1000 * level["wall_s"]
        assert level["tpot_ms"] > 0 and level["output_tokens_per_s"] > 0
    assert fixed["levels"][0]["input_tokens_mean"] == 16 and fixed["levels"][0]["output_tokens_mean"] == 8

    # the real-length workload: the 600-word conversation does not fit the 512-token context and is
    # left out; the others are answered with as many tokens as their real replies had (at most 8)
    tok = tiny_tokenizer()
    lengths = [max(2, min(8, len(tok(r, add_special_tokens=False)["input_ids"]))) for r in REPLIES]
    assert real["prompts"] == 3
    served = lengths + lengths[:1]  # 4 requests cycle through the 3 prompts
    assert real["levels"][0]["output_tokens_mean"] == pytest.approx(sum(served) / 4)

    roof = summary["roofline"]
    assert 0 < roof["weight_bytes"] < roof["bytes_per_token"]
    assert roof["bandwidth_gb_s"] > 0.1
    assert 0 < roof["fraction_of_bound"] <= 1  # nothing decodes faster than its memory traffic allows
    assert roof["achieved_tokens_per_s"] == pytest.approx(1000 / fixed["levels"][0]["tpot_ms"])


def test_bench_weight_bytes_leave_out_the_untied_embedding(tiny_llama):
    from pipeline.checkpoints.sizes import checkpoint_weight_bytes
    from pipeline.engines import hf as hf_engine
    from pipeline.engines.hf import HFEngine

    engine = HFEngine(tiny_llama, hf_engine.Settings(dtype="float16"))
    embedding = engine.model.get_input_embeddings().weight
    everything = sum(p.numel() * 2 for p in engine.model.parameters())
    assert engine.weight_bytes_per_token() == everything - embedding.numel() * 2
    assert checkpoint_weight_bytes(tiny_llama) == engine.weight_bytes_per_token()  # fp16 on disk, fp16 in memory


def test_bench_times_requests_with_images_on_a_vision_model_in_process(tmp_path, monkeypatch):
    """A vision model on the hf engine: the text-only load and the same text with 1 and 2 images of the visual suites'
    items, each at the size its suite scored it at, each image's tokens by the model's processor, the engine expanding
    each image token to as many; bench.json says per suite which sizes and tokens per image it sent."""
    from tiny import save_tiny_glm4v
    from pipeline.engines.vision import image_tokens, load_image_processor
    from pipeline.settings import suites as registry

    model = save_tiny_glm4v(tmp_path / "glm4v")
    write_params(tmp_path, {**TINY_PARAMS, "bench": {"holdout": False}})
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", str(model), "--concurrency", "1", "--input-len", "16", "--output-len",
                                      "3", "--images", "2,1", "--out", "bench.json"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert list(summary["workloads"]) == ["fixed", "1-image", "2-images"]  # 4 at these sizes pass 512 tokens
    fixed = summary["workloads"]["fixed"]
    assert fixed["label"] == "text only" and fixed["kv_tokens_per_request"] == 16 + 3
    # the suites' own sizes, and each image's tokens as the model's processor gives them (an independent count here)
    processor = load_image_processor(model)
    visual = [s for s in registry.shipped().values() if "images" in s.needs]
    first = {s.name: (s.hook("bench_images")(1)[0]["image"] if s.hook("bench_images") else None) for s in visual}
    expected = {name: image_tokens(processor, [image])[0] for name, image in first.items() if image is not None}
    for count in (1, 2):
        load = summary["workloads"][f"{count}-image" + ("s" if count > 1 else "")]
        assert load["label"] == f"{count} image" + ("s" if count > 1 else "") and load["images_per_request"] == count
        assert load["image_size"] is None and "at the sizes they were scored at" in load["images_from"]
        sent = load["image_sizes"]
        assert set(sent) == {s.name for s in visual} and sum(v["images"] for v in sent.values()) == 64 * count
        for name, tokens in expected.items():
            assert list(first[name].size) in sent[name]["sizes"]
            assert sent[name]["tokens_per_image"]["min"] <= tokens <= sent[name]["tokens_per_image"]["max"]
        assert sent["counting"]["sizes"] == [[320, 320]] and sent["small_text"]["sizes"] == [[320, 96]]
        mean = sum(v["tokens_per_image"]["mean"] * v["images"] for v in sent.values()) / (64 * count)
        assert load["image_tokens_per_image"] == pytest.approx(mean, abs=0.11)  # each mean rounded to 0.1
        [level] = load["levels"]
        assert level["failed"] == 0 and level["requests"] == 4 and level["output_tokens_mean"] == 3
        assert load["text_tokens_mean"] > 16
        assert load["kv_tokens_per_request"] == pytest.approx(level["input_tokens_mean"] + 3, abs=0.051)  # to 0.1
        assert "image processor" in load["kv_tokens_source"]
        assert summary["capacity"]["by_load"][load["name"]]["kv_tokens_per_request"] == load["kv_tokens_per_request"]
        assert summary["capacity"]["by_load"][load["name"]]["requests_in_kv_pool"] is None  # no KV pool in-process
    assert summary["workloads"]["2-images"]["prompt_tokens_mean"] > summary["workloads"]["1-image"]["prompt_tokens_mean"]
    # --image-size scales every suite's images to that longest side (the 1 image load: one size per suite's shape)
    result = CliRunner().invoke(app, ["bench", str(model), "--concurrency", "1", "--input-len", "16", "--output-len",
                                      "3", "--images", "1", "--image-size", "32", "--out", "scaled.json"])
    assert result.exit_code == 0, result.output
    scaled = json.loads((tmp_path / "scaled.json").read_text())["workloads"]["1-image"]
    assert scaled["image_sizes"]["counting"]["sizes"] == [[32, 32]] and "scaled to 32 pixels" in scaled["images_from"]
    assert all(max(size) == 32 for v in scaled["image_sizes"].values() for size in v["sizes"])
    # an engine that takes no images measures the text-only loads and says why there are no others
    from pipeline.engines import engine_spec
    from pipeline.settings.params import BenchParams
    from pipeline.stages.bench import _image_counts

    assert _image_counts(model, BenchParams(), engine_spec("lmdeploy"), "lmdeploy") == (
        [], "lmdeploy takes no images; requests with images are measured on hf, vllm or openai (--engine)")

    # a request that does not fit the model's context is refused before the weights load (480 text tokens and 4 images
    # at least), naming the settings to change; nothing written
    result = CliRunner().invoke(app, ["bench", str(model), "--concurrency", "1", "--input-len", "480", "--output-len", "3",
                                      "--images", "4", "--image-size", "64", "--out", "big.json"])
    assert result.exit_code == 2 and "bench.images: a request with 4 images (" in result.output
    # 64 pixels on the longest side, x 2 frames, passes the processor's 4,096-pixel cap: the fewest tokens of an image
    assert "tokens at bench.image_size 64) + --output-len 3" in result.output and "512-token context" in result.output
    assert not (tmp_path / "big.json").exists()
    result = CliRunner().invoke(app, ["bench", str(model), "--images", "0"])
    assert result.exit_code == 2 and "--images [0]: must be a list of image counts per request" in result.output
    import shutil

    bare = Path(shutil.copytree(model, tmp_path / "bare"))
    (bare / "preprocessor_config.json").unlink()  # a checkpoint copied without its image processor
    result = CliRunner().invoke(app, ["bench", str(bare), "--images", "1"])
    assert result.exit_code == 2 and "no preprocessor_config.json" in result.output and "--images none" in result.output


def test_bench_refuses_lengths_beyond_the_context(tmp_path, tiny_llama, monkeypatch):
    write_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", str(tiny_llama), "--input-len", "500", "--output-len", "100"])
    assert result.exit_code == 2
    assert "exceed" in result.output and "512-token context" in result.output
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("command", [
    ["eval", "{model}", "--suite", "math", "--engine", "lmdeploy"],
    ["bench", "{model}", "--engine", "lmdeploy"],
])
def test_lmdeploy_engine_without_the_gpu_extra_says_what_to_do(tmp_path, tiny_llama, monkeypatch, command):
    monkeypatch.setitem(sys.modules, "lmdeploy", None)  # as on a machine without the lmdeploy extra, even where it is
    write_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, [part.format(model=tiny_llama) for part in command])
    assert result.exit_code == 2
    assert "needs the lmdeploy extra" in result.output and "pip install -e '.[lmdeploy]'" in result.output


def bench_summary(batch1_tpot_ms: float, engine: str = "lmdeploy") -> dict:
    def spread(median):
        return {"mean": median * 1.05, "median": median, "p90": median * 1.3, "p99": median * 2}

    levels = []
    for c in (1, 4, 16, 64):
        tpot = batch1_tpot_ms * (1 + (c - 1) / 10)
        levels.append({"concurrency": c, "tpot_ms": tpot, "ttft_p50_ms": 20.0 + c, "ttft_ms": spread(20.0 + c),
                       "tpot_ms_stats": spread(tpot), "output_tokens_per_s": c * 1000 / tpot,
                       "memory_bytes": 30 << 30})
    return {"engine": engine, "engine_info": {"engine": engine, "version": "0.18.0", "tensor_parallel_size": 1,
                                              "settings": {"batch_size": 64}},
            "device": "NVIDIA H200", "date": "2026-11-30", "input_len": 128, "output_len": 256,
            "workloads": {"fixed": {"name": "fixed", "levels": levels}},
            "roofline": {"fraction_of_bound": 0.5, "bound_tokens_per_s": 300.0}}


@pytest.mark.parametrize("nogo_if_slower", [False, True])
def test_slower_than_base_at_batch_1_is_shown_and_optionally_no_go(tmp_path, nogo_if_slower):
    results = tmp_path / "results"
    scores = [1] * 120 + [0] * 80  # 200 items: fewer cannot show a GO at margin 0.03
    for name, tpot in (("base", 6.7), ("awq", 10.4), ("fp8", 5.0)):
        write_results(results, name, scores)
        (results / name / "bench.json").write_text(json.dumps(bench_summary(tpot)))
    settings = json.loads(json.dumps(with_variants(TINY_PARAMS, "awq", "fp8")))
    settings["verdict"].update(nogo_if_slower_at_batch1=nogo_if_slower, speed_engine="lmdeploy")
    verdict = report.run(results, tmp_path / "reports", Params.model_validate(settings),
                         models_dir=tmp_path / "models").verdict

    awq, fp8 = verdict["variants"]["awq"], verdict["variants"]["fp8"]
    assert awq["speed"]["slower"] and awq["speed"]["ratio"] == pytest.approx(6.7 / 10.4)
    assert not fp8["speed"]["slower"] and fp8["decision"] == "GO"  # faster: speed never passes or fails it
    if nogo_if_slower:
        assert awq["decision"] == "NO-GO"
        assert any("slower than the base at batch 1" in r for r in awq["reasons"])
    else:
        assert awq["decision"] == "GO" and not awq["speed"]["counted"]
    html = (tmp_path / "reports" / "index.html").read_text()
    assert 'id="speed-table"' in html and "0.64×" in html and ">149<" in html  # 1000 / 6.7 ms
    for chart in ('id="throughput-chart"', 'id="ttft_ms-chart"', 'id="tpot_ms_stats-chart"'):
        assert chart in html  # the pictures: throughput against concurrency, TTFT and TPOT percentiles
    assert html.count('class="line s') >= 3 * 2  # one line (and a legend swatch) per model
    assert "lmdeploy 0.18.0 on" in html and "tensor parallel 1" in html  # which engine, which version


def test_speed_is_not_compared_across_engines(tmp_path):
    results = tmp_path / "results"
    for name, engine in (("base", "hf"), ("awq", "lmdeploy")):
        write_results(results, name, [1] * 10)
        (results / name / "bench.json").write_text(json.dumps(bench_summary(5.0 if name == "base" else 50.0, engine)))
    settings = json.loads(json.dumps(with_variants(TINY_PARAMS, "awq")))
    settings["verdict"].update(nogo_if_slower_at_batch1=True, speed_engine="lmdeploy")
    verdict = report.run(results, tmp_path / "reports", Params.model_validate(settings),
                         models_dir=tmp_path / "models").verdict
    speed = verdict["variants"]["awq"]["speed"]
    assert not speed["comparable"] and "benched differently" in speed["reason"] and not speed["counted"]


def test_a_speed_no_go_needs_the_deployment_engine(tmp_path):
    """AWQ on lmdeploy's PyTorch engine is slower than bf16 (README: 0.79x) while vLLM serves it 1.27x
    faster: a speed verdict from an engine the variant will not be deployed on is shown, never counted."""
    results = tmp_path / "results"
    for name, tpot in (("base", 6.7), ("awq", 8.5)):
        write_results(results, name, [1] * 120 + [0] * 80)  # 200 unchanged items: GO at margin 0.03
        (results / name / "bench.json").write_text(json.dumps(bench_summary(tpot, "lmdeploy")))
    settings = json.loads(json.dumps(with_variants(TINY_PARAMS, "awq")))
    settings["verdict"].update(nogo_if_slower_at_batch1=True, speed_engine="vllm")
    verdict = report.run(results, tmp_path / "reports", Params.model_validate(settings),
                         models_dir=tmp_path / "models").verdict
    awq = verdict["variants"]["awq"]
    assert awq["speed"]["slower"] and not awq["speed"]["counted"] and awq["decision"] == "GO"
    assert "deployed on vllm (verdict.speed_engine)" in awq["speed"]["reason"]

    settings["verdict"]["speed_engine"] = None  # stopping on speed without naming the engine: refused
    with pytest.raises(Exception, match="needs verdict.speed_engine"):
        Params.model_validate(settings)


def test_speed_without_a_batch_1_decode_rate_says_so():
    from pipeline.verdict.speed import compare_speed, speed_row

    base, variant = speed_row(bench_summary(6.7)), speed_row(bench_summary(6.7))
    variant["batch1_tokens_per_s"] = None  # one output token per request: no time per output token
    speed = compare_speed(base, variant, tolerance=0.05)
    assert not speed["comparable"] and "no batch-1 decode rate" in speed["reason"]
    assert compare_speed(None, variant, 0.05)["reason"] == "no base bench"


def test_lmdeploy_judge_backend_without_the_gpu_extra_fails_before_any_answer(tmp_path, tiny_llama, monkeypatch):
    monkeypatch.setitem(sys.modules, "lmdeploy", None)  # as on a machine without the lmdeploy extra
    write_params(tmp_path)
    holdout = write_holdout(tmp_path / "holdout.jsonl")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["judge", str(tiny_llama), "--base", str(tiny_llama), "--prompts", str(holdout),
                                      "--backend", "lmdeploy"])
    assert result.exit_code == 2 and "needs the lmdeploy extra" in result.output
    assert not (tmp_path / "results").exists()  # no answers were generated first


def test_lmdeploy_engine_serves_native_checkpoints_as_they_are_and_exports_the_others(tmp_path, tiny_llama,
                                                                                      tiny_variants):
    from pipeline.engines.lmdeploy import servable_dir
    from tiny import save_tiny_glm

    cache = tmp_path / "cache"
    assert servable_dir(tiny_llama, cache) == (tiny_llama, False)  # LlamaForCausalLM: lmdeploy loads it as is

    served, exported = servable_dir(tiny_variants["awq-w4a16"], cache)  # compressed-tensors: AWQ GEMM export
    config = json.loads((served / "config.json").read_text())
    assert exported and served.parent == cache and config["quantization_config"]["quant_method"] == "awq"
    assert servable_dir(tiny_variants["awq-w4a16"], cache) == (served, True)  # exported once, then reused

    glm_served, _ = servable_dir(save_tiny_glm(tmp_path / "glm"), cache)  # Glm: ChatGLM names
    auto_map = json.loads((glm_served / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_chatglm.ChatGLMForConditionalGeneration"


def test_a_rebuilt_checkpoint_replaces_its_cached_lmdeploy_export(tmp_path, tiny_variants, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="pipeline.engines.lmdeploy")
    import shutil

    from pipeline.engines.lmdeploy import servable_dir
    from tiny import save_tiny_glm

    cache = tmp_path / "cache"
    variant = Path(shutil.copytree(tiny_variants["awq-w4a16"], tmp_path / "awq-w4a16"))
    other, _ = servable_dir(save_tiny_glm(tmp_path / "glm"), cache)
    first, _ = servable_dir(variant, cache)

    weights = variant / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # as a rebuild would
    second, _ = servable_dir(variant, cache)

    assert second != first and (second / "config.json").exists()
    assert not first.exists()  # the stale 18 GB-class copy is gone ...
    assert (other / "config.json").exists()  # ... and another checkpoint's export is kept
    assert f"export: removed {first}" in caplog.text


def test_bench_names_the_line_of_a_bad_holdout_record(tmp_path, tiny_llama, monkeypatch):
    write_params(tmp_path)
    holdout = tmp_path / "holdout.jsonl"
    holdout.write_text(json.dumps({"id": "y", "messages": [{"role": "user", "content": "hi"}], "reference": None})
                       + "\n" + json.dumps({"id": "x", "reference": "Hello."}) + "\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", str(tiny_llama), "--concurrency", "1", "--input-len", "8",
                                      "--output-len", "4", "--holdout", str(holdout), "--out", "bench.json"])
    assert result.exit_code == 2
    # a log that ends on the user's turn has no reference and is skipped; a record without messages is an error
    assert f"{holdout}:2: not a holdout record" in result.output and "quantize calib" in result.output
    assert not (tmp_path / "bench.json").exists()


def test_the_report_shows_what_each_variant_buys_beside_its_decision(tmp_path):
    """bench.json `capacity` (quantize bench on vLLM) -> one line per variant in verdict.json and the page."""
    results = tmp_path / "results"
    scores = [1] * 120 + [0] * 80
    for name, tpot, goodput, kv in (("base", 6.3, 2000.0, 500_000), ("fp8", 4.1, 3000.0, 1_000_000)):
        write_results(results, name, scores)
        summary = bench_summary(tpot, "vllm")
        summary["capacity"] = {"kv_cache_tokens": kv, "max_context_batch1": min(kv, 131072), "weight_bytes": 9 << 30,
                               "goodput_tok_s_per_gpu": goodput, "slo": {"ttft_ms": 200.0, "tpot_ms": 15.0}}
        (results / name / "bench.json").write_text(json.dumps(summary))
    verdict = report.run(results, tmp_path / "reports", Params.model_validate(with_variants(TINY_PARAMS, "fp8")),
                         models_dir=tmp_path / "models").verdict
    assert verdict["variants"]["fp8"]["capacity_line"] == "GO, 1.5× tokens/s, 2.0× KV capacity"
    assert "GO, 1.5× tokens/s, 2.0× KV capacity" in (tmp_path / "reports" / "index.html").read_text()
