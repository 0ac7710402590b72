"""GPTQ W4A16 (pipeline/methods/gptq.py), the method added by its module and one registry entry: real llm-compressor
runs on the tiny models, through the CLI and the stage, compared with RTN and AWQ in the report."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import TINY_PARAMS, read_tensors, write_params
from pipeline import methods
from pipeline.settings import params
from pipeline.stages import report
from pipeline.cli.app import app
from pipeline.methods import gptq
from pipeline.quantize import plan
from pipeline.stages.quantize import run as quantize_run
from test_perplexity_verdict import _write, documents, simulated
from test_quantize_glm import ARCHS, intended_linears, untouched_keys


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_llama, tiny_calib):
    """`quantize gptq` through the CLI, and RTN at the same group size through the stage."""
    root = tmp_path_factory.mktemp("gptq")
    settings = write_params(root, TINY_PARAMS)
    result = CliRunner().invoke(app, ["gptq", "--model", str(tiny_llama), "--calib", str(tiny_calib / "calib.jsonl"),
                                      "--out", str(root / "gptq"), "--group-size", "32", "--batch-size", "8",
                                      "--params", str(settings)])
    assert result.exit_code == 0, result.output
    quantize_run(tiny_llama, root / "rtn", tiny_calib / "calib.jsonl", "rtn", group_size=32, batch_size=8)
    return root


@pytest.mark.slow
def test_gptq_writes_w4a16_with_its_activation_order_and_describes_it(built, tiny_llama):
    weights = read_tensors(built / "gptq")
    packed = {k.removesuffix(".weight_packed") for k in weights if k.endswith(".weight_packed")}
    assert len(packed) == 14 and all(".layers." in name for name in packed)  # every decoder Linear, nothing else
    assert not any(k.endswith("g_idx") for k in weights)  # actorder weight: the groups stay in place
    assert weights["lm_head.weight"].dtype == torch.float16
    group = json.loads((built / "gptq" / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert (group["weights"]["actorder"], group["weights"]["group_size"], group["format"]) == ("weight", 32,
                                                                                              "pack-quantized")
    info = json.loads((built / "gptq" / "quant.json").read_text())
    assert (info["method"], info["actorder"], info["group_size"], info["dampening_frac"]) == ("gptq", "weight", 32, 0.01)
    assert info["scheme"] == "W4A16 asymmetric, group 32, GPTQ (actorder weight)"
    assert info["verify"]["reloads"] and info["verify"]["plan"]["matches"]
    assert info["serving_format"] == gptq.SERVING_FORMAT
    assert info["serving"]["vllm"]["status"] == "not shown"  # no GPTQ run recorded on the GPU machine yet


@pytest.mark.slow
def test_gptq_error_feedback_beats_round_to_nearest_on_held_out_blocks(built):
    """Same int4 grid, same group size, same held-out blocks: GPTQ's per-layer output error is below RTN's."""
    errors = {name: json.loads((built / name / "quant.json").read_text())["verify"]["layer_error"]
              for name in ("gptq", "rtn")}
    assert errors["gptq"]["blocks_from"] == errors["rtn"]["blocks_from"] == "holdout"
    assert all(g < r for g, r in zip(errors["gptq"]["relative"], errors["rtn"]["relative"])), errors


@pytest.mark.slow
def test_gptq_calibrates_every_moe_expert_and_leaves_vision_and_router_alone(tmp_path, tiny_calib):
    arch = ARCHS["Glm4vMoe"]
    base = arch.build(tmp_path / "base")
    info = quantize_run(base, tmp_path / "gptq", tiny_calib / "calib.jsonl", "gptq", batch_size=8).info
    weights, original = read_tensors(tmp_path / "gptq"), read_tensors(base)
    assert {k.removesuffix(".weight_packed") for k in weights if k.endswith(".weight_packed")} == intended_linears(arch)
    assert [k for k in untouched_keys(arch, original) if not torch.equal(original[k], weights[k])] == []
    experts = info["verify"]["experts"]  # GPTQ needs tokens: every expert checked, and every expert saw some
    assert experts["checked"] and experts["experts"] > 0 and experts["min_tokens_seen"] > 0
    assert info["group_size"] == 32  # auto: the experts are 32 wide


def test_gptq_settings_are_validated_in_params_yaml_and_on_the_command_line(tmp_path):
    good = {**TINY_PARAMS, "variants": {**TINY_PARAMS["variants"],
                                        "gptq-w4a16": {"method": "gptq", "group_size": 32, "actorder": "none"}}}
    assert params.load(write_params(tmp_path, good)).variants["gptq-w4a16"].actorder == "none"
    bad = {**TINY_PARAMS, "variants": {**TINY_PARAMS["variants"], "gptq-w4a16": {"method": "gptq", "actorder": "group"}}}
    with pytest.raises(params.UserError, match=r"variants.gptq-w4a16.actorder: 'group' is not allowed; .*'weight' or 'none'"):
        params.load(write_params(tmp_path, bad))
    result = CliRunner().invoke(app, ["gptq", "--dampening-frac", "0", "--params", str(write_params(tmp_path))])
    assert result.exit_code == 2 and "--dampening-frac 0: " in result.output and "Traceback" not in result.output


def test_the_plan_counts_gptqs_hessians():
    """Per decoder layer GPTQ holds one float32 in x in matrix per quantized Linear: the plan adds them."""
    config = {"architectures": ["GlmForCausalLM"], "hidden_size": 4096, "intermediate_size": 13696}
    kind, tokens, batch = "GlmDecoderLayer, dense", 128 * 512, 16 * 512
    extra = plan.working_set_bytes(config, kind, tokens, batch, 2, gptq.CALIBRATION_STATE) - \
        plan.working_set_bytes(config, kind, tokens, batch, 2, "none")
    assert extra == 4 * (6 * 4096 ** 2 + 13696 ** 2)  # ~1.1 GiB at GLM-4-9B's widths


def test_the_report_compares_gptq_with_awq_and_rtn(tmp_path):
    rng = np.random.default_rng(3)
    results, models = tmp_path / "results", tmp_path / "models"
    base, _, tokens = simulated(rng, 20, rise=0.01, spread=0.005, noise=0.1)
    shift = np.log1p(0.12) * tokens
    for model, lls in [("base", base), ("awq-w4a16", base - shift), ("rtn-w4a16", base - 1.6 * shift),
                       ("gptq-w4a16", base - 0.8 * shift)]:
        _write(results, model, "ppl-book", documents(lls, tokens))
    for name, method in [("awq-w4a16", "awq"), ("rtn-w4a16", "rtn"), ("gptq-w4a16", "gptq")]:
        (models / name).mkdir(parents=True)
        (models / name / "quant.json").write_text(json.dumps({
            "method": method, "group_size": 64, "scheme": name, "size_bytes": 1, "quantized_modules": 1,
            "calibration": {"blocks": 1, "seq_len": 1, "sha256": "0" * 64}, "seconds": {"total": 1}, "device": "cpu",
            "peak_rss_bytes": 1, "ignored": {}, "verify": {"reloads": True, "sample": "",
                                                           "vision": {"vision_tensors": 0, "mismatched": []}}}))
    settings = json.loads(json.dumps(TINY_PARAMS))
    settings["suites"] = {"ppl-book": {"task": "quant_ppl_book"}}
    settings["variants"] = {"awq-w4a16": {"method": "awq"}, "rtn-w4a16": {"method": "rtn"},
                            "gptq-w4a16": {"method": "gptq"}}
    settings["verdict"]["margins"]["suites"] = {"ppl-book": 0.05}
    out = report.run(results, tmp_path / "reports", params.Params.model_validate(settings), models_dir=models)
    rows = {(c["variant"], c["against"]): c for c in out.verdict["method_comparisons"]}
    assert set(rows) == {("awq-w4a16", "rtn-w4a16"), ("gptq-w4a16", "awq-w4a16"), ("gptq-w4a16", "rtn-w4a16")}
    assert rows[("gptq-w4a16", "rtn-w4a16")]["better"] == "gptq-w4a16"  # lower perplexity, paired per document
    assert rows[("gptq-w4a16", "awq-w4a16")]["better"] == "gptq-w4a16" and rows[("gptq-w4a16", "awq-w4a16")]["ci_high"] < 0
    assert set(out.verdict["variants"]) == {"awq-w4a16", "rtn-w4a16", "gptq-w4a16"}  # GPTQ decided like the others
    html = out.html.read_text()
    assert html.count('<th scope="row">gptq-w4a16 (gptq)</th>') == 2


def test_gptq_is_registered_and_the_gpu_profile_offers_it():
    """The GPU profile carries a gptq-w4a16 variant, commented out with the reason (a fifth always-up server does not
    fit one H200 at a 128k context): uncommented, it is a valid variant of that profile."""
    import yaml

    from conftest import REPO

    assert methods.method("gptq") is gptq and gptq in methods.METHODS
    text = (REPO / "pipeline" / "profiles" / "gpu" / "params.yaml").read_text()
    start = text.index("  # gptq-w4a16:")
    block = []
    for line in text[start:].splitlines():
        if not line.startswith("  # "):
            break
        block.append("  " + line[4:])
    gpu = yaml.safe_load(text)
    gpu["variants"].update(yaml.safe_load("\n".join(block)))
    variant = params.Params.model_validate(gpu).variants["gptq-w4a16"]
    assert (variant.method, variant.group_size, variant.actorder) == ("gptq", 128, "weight")
