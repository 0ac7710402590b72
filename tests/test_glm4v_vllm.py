"""GLM-4.1V / 4.5V (Glm4v, Glm4vMoe) on the engine it ships on, checked on the CPU.

- serving claims come only from runs recorded on the GPU machine (checkpoints/serving.py);
- a MoE gets FP8 experts vLLM's fused MoE accepts (dynamic per-token activations), the rest static;
- a quantized vision checkpoint whose ignore list vLLM would not match under its own names is refused;
- VQA through the vLLM engine: the rendered text (image markup in place) and the images reach the server's
  chat endpoint, and the answers equal the hf engine's. The server here is tests/openai_server.py (vLLM's
  chat path with content format `string` and our pass-through template, backed by the real tiny model);
  the real vLLM runs the same requests on the H200 (benchmarks/gpu_glm46v_vllm.py).
"""

import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import read_jsonl
from pipeline.checkpoints import serving as support
from pipeline.errors import UserError
from tiny import save_tiny_glm4v, save_tiny_glm4v_moe

SERVER = [sys.executable, str(Path(__file__).with_name("openai_server.py"))]
ARCHS = {"Glm": "GlmForCausalLM", "Glm4": "Glm4ForCausalLM", "Glm4v": "Glm4vForConditionalGeneration",
         "Glm4vMoe": "Glm4vMoeForConditionalGeneration", "Glm46V": "Glm46VForConditionalGeneration"}


def _config(arch: str, kind: str, kv: str, moe: bool) -> dict:
    """config.json's quantization_config as the pipeline writes it for each variant kind."""
    from pipeline.methods import fp8

    config = {"architectures": [arch]}
    if kind == "base":
        return config
    if kind in ("awq", "rtn"):
        weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False}
        quant = {"format": "pack-quantized", "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    else:
        quant = {"format": "float-quantized", "config_groups": fp8.config_groups(kind.split("-")[1], moe),
                 "kv_cache_scheme": fp8.kv_cache_scheme(kv)}
    config["quantization_config"] = {"quant_method": "compressed-tensors", **quant}
    return config


def test_a_w4a16_checkpoint_naming_an_activation_order_is_not_shown_by_the_plain_w4a16_runs():
    """GPTQ writes AWQ's tensors with `actorder: weight` in config.json, which vLLM reads: until a run with that
    config is recorded, it is "not shown" with the command to try, never served on AWQ's evidence."""
    config = _config(ARCHS["Glm"], "awq", "none", moe=False)
    assert support.support_from_config(config)["vllm"]["serves"]
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "weight"
    assert support.scheme(config) == "w4a16-actorder-weight"
    entry = support.support_from_config(config)["vllm"]
    assert entry["status"] == "not shown" and not entry["serves"] and "try: vllm serve DIR" in entry["how"]
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = None  # written as null
    assert support.scheme(config) == "w4a16"


def test_every_serves_claim_has_a_recorded_run_behind_it():
    """Glm, Glm4, Glm4v, Glm4vMoe, Glm46V x base, AWQ, RTN, FP8 static, FP8 dynamic x per-head / per-tensor KV."""
    repo = Path(__file__).resolve().parent.parent
    shown = 0
    for name, arch in ARCHS.items():
        for kind in ("base", "awq", "rtn", "fp8-static", "fp8-dynamic"):
            for kv in (("per-head", "per-tensor") if kind.startswith("fp8") else ("none",)):
                config = _config(arch, kind, kv, moe=name == "Glm4vMoe")
                for engine, entry in support.support_from_config(config).items():
                    if engine == "hf":
                        continue
                    runs = [r for r in support.SHOWN if r.engine == engine and r.served and
                            (r.architecture, r.scheme, r.kv) == support.checkpoint_key(config)]
                    assert entry["serves"] == bool(runs), (name, kind, kv, engine, entry)
                    if entry["serves"]:
                        shown += 1
                        assert entry["version"] == runs[-1].version
                        for evidence in runs[-1].evidence.split(", "):
                            if evidence.startswith("benchmarks/"):
                                assert (repo / evidence).exists(), evidence
                            elif evidence.endswith(".json"):
                                assert (repo / "benchmarks" / "results" / evidence).exists(), evidence
                    else:
                        assert entry["status"] in ("not shown", "refused", "cannot")
                        assert "try:" in entry["how"] or entry["status"] in ("refused", "cannot")
    assert shown >= 13  # Glm, Glm4v and Glm4vMoe: base, AWQ, RTN (same format), FP8 (static; Glm4vMoe the MoE default)


@pytest.mark.parametrize("layout, vllm, lmdeploy", [
    ("Glm4v", "shown", "not shown"),  # GLM-4.6V-Flash as published
    ("Glm4vMoe", "shown", "cannot"),  # GLM-4.6V as published
    ("Glm46V", "cannot", "cannot"),  # transformers 5's glm46v type: resave writes it as one of the two
])
def test_glm_46v_published_layouts_and_transformers_own_on_each_engine(layout, vllm, lmdeploy, tmp_path):
    """What each engine does with GLM-4.6V's layouts, base and AWQ: served where a run showed it, "cannot" where the
    engine's source has no model for the architecture (with the way out), never a served claim without a run. The vLLM
    engine refuses a glm46v checkpoint before any server starts, naming the resave that writes it as vLLM serves it."""
    from pipeline.checkpoints import serving_names
    from pipeline.engines import vllm_server
    from pipeline.engines.vllm import Settings, VLLMEngine

    for kind in ("base", "awq"):
        config = _config(ARCHS[layout], kind, "none", moe=layout == "Glm4vMoe")
        found = _support(config)
        assert (found["vllm"]["status"], found["lmdeploy"]["status"]) == (vllm, lmdeploy), (kind, found)
    assert "GLM-4.5V, GLM-4.6V" in _support(_config(ARCHS["Glm4vMoe"], "base", "none", True))["lmdeploy"]["how"]
    if layout != "Glm46V":
        return
    why = _support(_config(ARCHS[layout], "base", "none", False))["vllm"]["how"]
    assert "Transformers backend, which no run covers" in why and "quantize resave DIR --out NEW" in why
    model = tmp_path / "glm46v"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": [ARCHS[layout]], "model_type": "glm46v",
                                                   "text_config": {"model_type": "glm4v_moe_text"}}))
    with pytest.raises(UserError, match=rf"{model}: vLLM 0.24 has no model of its own for Glm46VForConditionalGeneration"):
        VLLMEngine(model, Settings(server_command=["false"]))
    assert vllm_server.warm(model, Settings(server_command=["false"])) is None  # left to the stage, which says why
    assert serving_names.served_layout(json.loads((model / "config.json").read_text()))[1] == ARCHS["Glm4vMoe"]


def _support(config: dict) -> dict:
    return support.support_from_config(config)


def test_moe_fp8_default_is_a_scheme_vllms_fused_moe_takes():
    from pipeline.methods import fp8

    groups = fp8.config_groups("static", moe=True)
    dense, experts = groups["group_0"], groups["experts"]
    assert dense["targets"] == ["Linear"] and dense["input_activations"]["dynamic"] is False
    assert experts["input_activations"] == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                            "dynamic": True}
    assert experts["weights"]["strategy"] == "channel"
    config = _config(ARCHS["Glm4vMoe"], "fp8-static", "per-head", moe=True)
    assert support.scheme(config) == "fp8-static+dynamic-experts"
    assert support.support_from_config(config)["vllm"]["serves"]  # shown on the H200 at GLM-4.6V widths
    assert support.scheme(_config(ARCHS["Glm"], "fp8-static", "per-head", moe=False)) == "fp8-static"
    # the scheme that vLLM refused is recorded as refused, with its error
    refused = _config(ARCHS["Glm4vMoe"], "fp8-static", "per-head", moe=False)
    entry = support.support_from_config(refused)["vllm"]
    assert entry["status"] == "refused" and "AssertionError" in entry["how"]


@pytest.fixture(scope="module")
def moe_variants(tmp_path_factory, tiny_calib):
    from pipeline.stages.quantize import run as quantize_run

    root = tmp_path_factory.mktemp("glm4v-moe")
    base = save_tiny_glm4v_moe(root / "base")
    quantize_run(base, root / "fp8", tiny_calib / "calib.jsonl", "fp8")
    quantize_run(base, root / "awq", tiny_calib / "calib.jsonl", "awq", batch_size=8, n_grid=4)
    return {"base": base, "fp8": root / "fp8", "awq": root / "awq"}


def test_moe_fp8_variant_has_static_dense_and_dynamic_experts_and_says_why(moe_variants):
    from conftest import read_tensors

    tensors = read_tensors(moe_variants["fp8"])
    quant = json.loads((moe_variants["fp8"] / "quant.json").read_text())
    assert any(k.endswith("self_attn.q_proj.input_scale") for k in tensors)  # attention: static scale
    assert any(k.endswith("layers.0.mlp.gate_up_proj.input_scale") or k.endswith("layers.0.mlp.down_proj.input_scale")
               for k in tensors)  # the dense MLP: static
    experts = [k for k in tensors if ".mlp.experts." in k or ".mlp.shared_experts." in k]
    assert experts and not any(k.endswith("input_scale") for k in experts)  # experts: dynamic, no scale
    assert any(k.endswith("mlp.experts.0.gate_proj.weight_scale") for k in tensors)
    assert any(k.endswith("k_scale") for k in tensors)  # per-head FP8 KV scales stay
    assert quant["expert_scheme"]["activations"] == "dynamic" and "fused MoE" in quant["expert_scheme"]["why"]
    assert "MoE experts dynamic" in quant["scheme"]
    config = json.loads((moe_variants["fp8"] / "config.json").read_text())
    assert config["text_config"]["use_qk_norm"] is False  # the key GLM's release carries and vLLM reads


def test_vision_ignore_list_must_match_vllms_names(moe_variants, tmp_path):
    from pipeline.checkpoints import serving_names
    from pipeline.engines.vllm import Settings, VLLMEngine

    for name in ("fp8", "awq"):
        assert serving_names.check(moe_variants[name])["vllm_would_quantize"] == []
    # llm-compressor's own list (HF names only): vLLM builds attn.qkv as qkv_proj and fuses gate/up
    stale = tmp_path / "stale"
    shutil.copytree(moe_variants["fp8"], stale)
    config = json.loads((stale / "config.json").read_text())
    config["quantization_config"]["ignore"].remove(serving_names.VISION_IGNORE)
    (stale / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"vLLM would quantize full-precision modules.*visual\.blocks\.0\.attn\.qkv") as err:
        serving_names.check(stale)
    # what vLLM 0.24 did with such a list on the H200 (benchmarks/results/gpu_glm46v_vllm.json): it built the
    # vision attention's qkv quantized and every other vision Linear unquantized; the check names the same ones
    assert "mlp" not in str(err.value) and "merger" not in str(err.value)
    missed = serving_names.vllm_unignored(json.loads((stale / "config.json").read_text()),
                                          serving_names.unquantized_linears(stale))
    assert missed and all(name.endswith("attn.qkv") for name in missed)
    with pytest.raises(UserError, match="vLLM would quantize"):  # before any server starts
        VLLMEngine(stale, Settings(server_command=["false"]))


def _eval(model_dir: Path, out: Path, engine: str, tmp_path: Path, suite: str = "vqa", task: str = "quant_vqa",
          **engine_settings) -> list[dict]:
    from pipeline.stages import evaluate

    options = {"batch_size": 4, "dtype": "float32"}
    if engine == "vllm":
        options.update(server_command=SERVER, start_timeout=120, log_path=tmp_path / f"{out.name}.log",
                       server_args=["--record", str(tmp_path / "argv.json")], **engine_settings)
    evaluate.run(model_dir, suite=suite, task=task, variant=model_dir.name, out_dir=out, engine=engine,
                 limit=4, max_new_tokens=6, **options)
    return read_jsonl(out / f"{suite}.jsonl")


_vqa = _eval


@pytest.mark.parametrize("build", [save_tiny_glm4v, save_tiny_glm4v_moe], ids=["Glm4v", "Glm4vMoe"])
def test_vqa_through_the_vllm_engine_equals_hf(build, tmp_path):
    model = build(tmp_path / "model")
    hf = _vqa(model, tmp_path / "hf", "hf", tmp_path)
    vllm = _vqa(model, tmp_path / "vllm", "vllm", tmp_path, enable_expert_parallel=True)
    strip = lambda rows: [{k: r[k] for k in ("id", "prompt", "output")} for r in rows]  # noqa: E731
    assert strip(vllm) == strip(hf) and len(hf) == 4
    assert "<|begin_of_image|><|image|><|end_of_image|>" in hf[0]["prompt"]
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("--chat-template-content-format") + 1] == "string"
    assert "--enable-expert-parallel" in argv
    summary = json.loads((tmp_path / "vllm" / "vqa.json").read_text())
    assert summary["engine"] == "vllm"
    defects = [(d["key"], d["avoided"]) for d in summary.get("engine_defects") or []]
    if build is save_tiny_glm4v:  # GLM-4.1V layout: the setting that avoids vLLM's M-RoPE defect reaches the server
        assert json.loads(argv[argv.index("--compilation-config") + 1]) == {"custom_ops": ["-rotary_embedding"]}
        assert defects == [("vllm-mrope-gptj", True)]
    else:  # GLM-4.5V / 4.6V: not hit, nothing added
        assert "--compilation-config" not in argv and defects == []


def test_text_suites_run_on_a_vision_model_through_the_vllm_engine_as_on_hf(tmp_path):
    """A vision checkpoint's text suites go to /v1/completions as token ids, the same tokens as hf."""
    model = save_tiny_glm4v(tmp_path / "model")
    strip = lambda rows: [{k: r[k] for k in ("id", "prompt", "output")} for r in rows]  # noqa: E731
    hf = _eval(model, tmp_path / "hf", "hf", tmp_path, suite="math", task="quant_gsm8k")
    vllm = _eval(model, tmp_path / "vllm", "vllm", tmp_path, suite="math", task="quant_gsm8k")
    assert strip(vllm) == strip(hf) and len(hf) == 4


def test_bench_sends_requests_with_images_to_the_vllm_engines_chat_endpoint_and_reads_its_prompt_counts(tmp_path,
                                                                                                     monkeypatch):
    """The image workloads through a real HTTP server started as `vllm serve` is: streamed /v1/chat/completions with
    the images as data URLs, exactly output_len tokens each (ignore_eos), the server's own prompt count (image tokens
    expanded by its processor) equal to ours, and the requests of each load that its KV pool holds."""
    from typer.testing import CliRunner

    from conftest import TINY_PARAMS, write_params
    from pipeline.cli.app import app

    model = save_tiny_glm4v(tmp_path / "model")
    settings = json.loads(json.dumps(TINY_PARAMS))
    settings["engine"].update(name="vllm", server_command=SERVER, start_timeout=120, share_server=False)
    settings["bench"] = {"holdout": False, "slo": {"ttft_ms": 600000}}
    write_params(tmp_path, settings)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", str(model), "--concurrency", "1", "--input-len", "16", "--output-len", "3",
                                      "--images", "2", "--image-size", "32", "--out", "r/bench.json"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "r" / "bench.json").read_text())
    load = summary["workloads"]["2-images"]
    [level] = load["levels"]
    assert level["failed"] == 0 and level["output_tokens_mean"] == 3  # streamed token ids, ignore_eos honoured
    # the server counted each prompt itself (usage.prompt_tokens): its text and 64 tokens per 32 x 32 image, as here
    assert level["server_prompt_tokens_mean"] == level["input_tokens_mean"] > 2 * 64 + 16
    assert load["kv_tokens_per_request"] == level["server_prompt_tokens_mean"] + 3
    assert "usage.prompt_tokens" in load["kv_tokens_source"]
    fixed = summary["workloads"]["fixed"]
    assert fixed["label"] == "text only" and fixed["levels"][0]["server_prompt_tokens_mean"] == 16
    log = (tmp_path / "r" / "bench.vllm.log").read_text()
    pool = int(log.split("GPU KV cache size: ")[1].split(" tokens")[0].replace(",", ""))
    by_load = summary["capacity"]["by_load"]
    assert by_load["2-images"]["requests_in_kv_pool"] == int(pool // load["kv_tokens_per_request"]) > 0
    assert by_load["fixed"]["requests_in_kv_pool"] == pool // 19
    assert by_load["2-images"]["goodput_tok_s_per_gpu"] > 0  # a generous TTFT SLO: every request good
