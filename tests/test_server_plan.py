"""The run's vLLM servers fitted to the GPU found (pipeline/engines/server_plan.py, engine.kv_cache_memory: fitted):
each server's share from what it holds, as many resident at once as fit, never a plan that overcommits; on an 80 GB
H100 and a 141 GB H200 (engine.device_memory_gib), for GLM-4-9B, GLM-4.6V-Flash and the GLM-4.6V MoE, their
checkpoints' sizes counted from the published configs built on the meta device; and `quantize warm --plan` on a
real (tiny) checkpoint, the variants not built yet sized from the base's tensors."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY_PARAMS, write_params
from pipeline.checkpoints import config_json
from pipeline.checkpoints.sizes import kv_bytes_per_token, kv_element_bytes
from pipeline.engines import server_plan
from pipeline.errors import UserError

sys.path.insert(0, str(REPO / "benchmarks"))
from glm_shapes import GLM4_9B, GLM46V_FLASH_TEXT, GLM46V_FLASH_VISION, GLM46V_MOE_TEXT, GLM46V_MOE_VISION  # noqa: E402

GIB = server_plan.GIB
H100 = 81559 << 20  # what nvidia-smi reports of an H100 80GB HBM3
H200 = int(140.4 * GIB)
PROFILE = dict(fraction=0.92, reserve_bytes=5 * GIB, batch_size=256, request_tokens=768, max_model_len=131072)
MODELS = ("base", "awq-w4a16", "fp8-w8a8", "rtn-w4a16", "awq-w4a16-mixed", "rtn-w4a16-mixed")
BITS = {"awq-w4a16": 4, "fp8-w8a8": 8, "rtn-w4a16": 4, "awq-w4a16-mixed": 4.5, "rtn-w4a16-mixed": 4.5}


def meta_model(name: str, layers: int | None = None):
    """The published model on the meta device (no memory): its parameters' names and shapes, and its config."""
    from transformers import (Glm4vConfig, Glm4vForConditionalGeneration, Glm4vMoeConfig,
                              Glm4vMoeForConditionalGeneration, GlmConfig, GlmForCausalLM)

    if name == "glm4-9b":
        config = GlmConfig(**GLM4_9B, num_hidden_layers=layers or 40)
        model_class = GlmForCausalLM
    elif name == "glm46v-flash":
        config = Glm4vConfig(text_config=GLM46V_FLASH_TEXT, vision_config=GLM46V_FLASH_VISION, tie_word_embeddings=False)
        model_class = Glm4vForConditionalGeneration
    else:
        text = {**GLM46V_MOE_TEXT, "num_hidden_layers": layers or GLM46V_MOE_TEXT["num_hidden_layers"]}
        config = Glm4vMoeConfig(text_config=text, vision_config=GLM46V_MOE_VISION, tie_word_embeddings=False)
        model_class = Glm4vMoeForConditionalGeneration
    with torch.device("meta"):
        model = model_class(config)
    return model, config.to_dict()


def shares(name: str, device: int, layers: int | None = None, group: int = 128) -> list[server_plan.Share]:
    """Every model of a run with both W4A16 fixes: the base in bf16, each variant its bits per quantized weight."""
    model, config = meta_model(name, layers)
    quantized = sum(p.numel() for n, p in model.named_parameters() if server_plan.quantized(n, p.ndim >= 2))
    kept = sum(p.numel() for p in model.parameters()) - quantized
    found = []
    for model_name in MODELS:
        weights = 2 * (quantized + kept) if model_name == "base" else \
            quantized * (BITS[model_name] / 8 + (2.5 / group if model_name != "fp8-w8a8" else 0)) + 2 * kept
        kv = kv_bytes_per_token(config_json.kv_cache_shape(config), kv_element_bytes("fp8" if model_name == "fp8-w8a8" else "auto"))
        found.append(server_plan.fit(model_name, int(weights), kv, device_bytes=device, **PROFILE))
    return found


def check(plan: server_plan.Plan) -> None:
    """No group of servers resident at once passes the budget; the base is in every group; every model in one."""
    by_name = {s.model: s for s in plan.shares}
    for wave in plan.waves:
        assert sum(by_name[m].total_bytes for m in wave) <= plan.budget_bytes
        assert wave[0] == "base"
    assert {m for w in plan.waves for m in w} == set(MODELS)
    assert plan.budget_bytes <= plan.device_bytes


def test_glm4_9b_on_an_80_gb_h100_runs_the_base_and_two_variants_at_once():
    plan = server_plan.plan(shares("glm4-9b", H100), device_bytes=H100, fraction=0.92, pinned="base")
    check(plan)
    assert plan.waves == [["base", "awq-w4a16", "fp8-w8a8"], ["base", "rtn-w4a16", "awq-w4a16-mixed"],
                          ["base", "rtn-w4a16-mixed"]]
    base, awq, fp8 = (plan.share(m) for m in ("base", "awq-w4a16", "fp8-w8a8"))
    assert 17.4 < base.weight_bytes / GIB < 17.6 and 29.9 < base.total_bytes / GIB < 30.1  # 18.8 GB of bf16 weights
    assert base.kv_tokens == awq.kv_tokens == fp8.kv_tokens == 256 * 768  # the pool its requests need
    assert fp8.pool_bytes * 2 == awq.pool_bytes  # an FP8 cache: half the bytes per token
    assert not base.why and not base.estimated
    assert base.utilization(H100) == pytest.approx(base.total_bytes / H100, abs=1e-4)
    assert base.utilization(H100) * H100 >= base.total_bytes  # rounded up: vLLM's free-memory check at start
    lines = "\n".join(plan.lines())
    assert "side by side: base, awq-w4a16, fp8-w8a8 | then base, rtn-w4a16, awq-w4a16-mixed" in lines
    assert "196,608 tokens" in lines and "3 groups" in lines


def test_glm4_9b_on_a_141_gb_h200_runs_every_model_at_once():
    plan = server_plan.plan(shares("glm4-9b", H200), device_bytes=H200, fraction=0.92, pinned="base")
    check(plan)
    assert plan.waves == [list(MODELS)] and plan.as_dict()["resident_at_once"] == 6


@pytest.mark.parametrize("device, waves", [(H100, 3), (H200, 2)])
def test_glm46v_flash_fits_both_cards(device, waves):
    found = shares("glm46v-flash", device)
    plan = server_plan.plan(found, device_bytes=device, fraction=0.92, pinned="base")
    check(plan)
    assert len(plan.waves) == waves
    base = plan.share("base")
    assert 20.5e9 < base.weight_bytes < 20.8e9  # GLM-4.6V-Flash: 10.3B parameters in bf16, vision tower included


@pytest.mark.parametrize("device", [H100, H200])
def test_the_glm46v_moe_at_full_depth_is_refused_with_what_would_fit(device):
    with pytest.raises(UserError, match=r"base: does not fit on this GPU: 2\d\d\.\d GiB of weights.*"
                                        r"tensor_parallel_size"):
        shares("glm46v-moe", device, group=64)


def test_the_glm46v_moe_at_the_depth_a_disk_allows_fits_an_h100():
    plan = server_plan.plan(shares("glm46v-moe", H100, layers=6, group=64), device_bytes=H100, fraction=0.92,
                            pinned="base")
    check(plan)
    kv = kv_bytes_per_token(config_json.kv_cache_shape(meta_model("glm46v-moe", 6)[1]))
    assert kv == 2 * 6 * 8 * 128 * 2  # its 8 KV heads of 128 at 6 layers
    assert plan.share("base").kv_bytes_per_token == kv


@pytest.mark.parametrize("gib", [24, 40, 48, 80, 94, 141, 192])
def test_no_plan_overcommits_whatever_the_card(gib):
    """A plan either fits every group of servers in the budget (the base beside each), or is refused."""
    device = gib * GIB
    try:
        plan = server_plan.plan(shares("glm4-9b", device), device_bytes=device, fraction=0.92, pinned="base")
    except UserError as exc:
        assert "does not fit" in str(exc)
        return
    check(plan)


def test_a_pool_the_card_cannot_give_is_what_is_left_and_says_so():
    share = server_plan.fit("base", 17 * GIB, 40960, device_bytes=32 * GIB, fraction=0.92, reserve_bytes=5 * GIB,
                            batch_size=256, request_tokens=768, max_model_len=32768)
    assert share.total_bytes == int(0.92 * 32 * GIB)
    assert share.kv_tokens < 256 * 768 and share.kv_tokens >= 32768
    assert "engine.batch_size 256 x engine.plan_request_tokens 768" in share.why
    with pytest.raises(UserError, match=r"lower engine.max_model_len to [\d,]+ at most"):
        server_plan.fit("base", 17 * GIB, 40960, device_bytes=24 * GIB, fraction=0.92, reserve_bytes=5 * GIB,
                        batch_size=256, request_tokens=768, max_model_len=32768)


def test_a_variant_that_does_not_fit_beside_the_base_is_refused_before_any_server_starts():
    big = server_plan.Share("base", 30 * GIB, 40960, 5 * GIB, 7 * GIB, 1000)
    other = server_plan.Share("awq-w4a16", 20 * GIB, 40960, 5 * GIB, 7 * GIB, 1000)
    with pytest.raises(UserError, match="awq-w4a16 .* does not fit beside base's server .* its judge needs both"):
        server_plan.plan([big, other], device_bytes=64 * GIB, fraction=0.9, pinned="base")
    alone = server_plan.plan([big, other], device_bytes=64 * GIB, fraction=0.9)  # no judge on the base: one at a time
    assert alone.waves == [["base"], ["awq-w4a16"]]


def gpu_params(device_gib: float) -> dict:
    params = json.loads(json.dumps(TINY_PARAMS))
    params["engine"] = {"name": "vllm", "batch_size": 8, "dtype": "float16", "max_model_len": 256,
                        "kv_cache_memory": "fitted", "device_memory_gib": device_gib, "non_kv_memory_gib": 0.001,
                        "gpu_memory_utilization": 0.9, "plan_request_tokens": 64, "share_server": True}
    params["judge"] = {**params["judge"], "backend": "vllm", "model": "base"}
    return params


def warm_plan(project):
    import os

    return subprocess.run([sys.executable, "-m", "pipeline.cli.app", "warm", "--plan"], cwd=project,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "QUANTIZE_SERVER_DIR": str(project / "servers")})


def test_quantize_warm_plan_prints_the_plan_from_the_checkpoints_and_the_unbuilt_variants(tmp_path, tiny_llama):
    """Only the base is built: the variants and the fix are sized from its tensors and their methods; on a card too
    small for all of them at once, they run in groups, the base in each."""
    import shutil

    (tmp_path / "models").mkdir()
    shutil.copytree(tiny_llama, tmp_path / "models" / "base")
    (tmp_path / "models" / "base" / ".stage.json").write_text("{}")
    write_params(tmp_path, gpu_params(device_gib=10))  # all at once
    roomy = warm_plan(tmp_path)
    assert roomy.returncode == 0, roomy.stderr
    sizes = {s["model"]: s["total_bytes"] for s in json.loads((tmp_path / "servers" / server_plan.PLAN_FILE).read_text())["servers"]}
    assert len(json.loads((tmp_path / "servers" / server_plan.PLAN_FILE).read_text())["waves"]) == 1
    variant = max(v for m, v in sizes.items() if m != "base")
    write_params(tmp_path, gpu_params(device_gib=(sizes["base"] + 1.5 * variant) / 0.9 / GIB))  # the base and one
    done = warm_plan(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "server plan:" in done.stdout and "(engine.device_memory_gib)" in done.stdout
    assert "awq-w4a16: " in done.stdout and "(estimated: not built yet)" in done.stdout
    assert "rtn-w4a16-mixed" in done.stdout  # the fix params.yaml lists
    stored = json.loads((tmp_path / "servers" / server_plan.PLAN_FILE).read_text())  # what bench.json's capacity.plan reads
    assert stored["pinned"] == "base" and [s["model"] for s in stored["servers"]][:2] == ["base", "awq-w4a16"]
    assert all(sum(next(s["total_bytes"] for s in stored["servers"] if s["model"] == m) for m in wave)
               <= stored["budget_bytes"] for wave in stored["waves"])
    awq = next(line for line in done.stdout.splitlines() if line.strip().startswith("awq-w4a16:"))
    assert "weights" in awq and "KV" in awq
    groups = next(line for line in done.stdout.splitlines() if "side by side:" in line)
    assert groups.count("| then base,") == 3  # base, then each of the four others beside it, one at a time


def test_quantize_warm_plan_refuses_a_card_too_small_naming_the_setting(tmp_path, tiny_llama):
    import shutil

    (tmp_path / "models").mkdir()
    shutil.copytree(tiny_llama, tmp_path / "models" / "base")
    (tmp_path / "models" / "base" / ".stage.json").write_text("{}")
    write_params(tmp_path, gpu_params(device_gib=server_plan.weight_bytes(tmp_path / "models" / "base") / GIB / 2))
    done = warm_plan(tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "base: does not fit on this GPU" in done.stderr + done.stdout
