"""`quantize sensitivity`: each fused group of a variant's quantized Linears ranked by how much of the variant's KL
to the base goes away when only that group is restored to the base's weights (pipeline/stages/sensitivity.py)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.checkpoints import fused
from pipeline.errors import UserError
from pipeline.formats.sensitivity import read_sensitivity
from pipeline.stages import kl, sensitivity

BROKEN = "model.layers.1.mlp.down_proj"


def rounded_copy(src, dest, bits: dict):
    """Every decoder Linear rounded per row to bits[its name] (else bits[None]): a deliberately damaged variant."""
    shutil.copytree(src, dest)
    weights = load_file(dest / "model.safetensors")
    for name, w in weights.items():
        if ".layers." in name and name.endswith("proj.weight"):
            levels = 2 ** (bits.get(name.removesuffix(".weight"), bits[None]) - 1) - 1
            scale = w.float().abs().amax(dim=1, keepdim=True) / levels
            weights[name] = (torch.round(w.float() / scale).clamp(-levels - 1, levels) * scale).to(w.dtype)
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_fused_groups_are_those_vllm_runs_with_one_scheme():
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"] + \
        [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")] + \
        [f"model.layers.1.mlp.experts.{e}.{p}_proj" for e in range(3) for p in ("gate", "up", "down")] + \
        ["model.layers.1.mlp.shared_experts.gate_proj", "model.layers.1.mlp.shared_experts.up_proj"]
    found = fused.groups(names)
    assert [(g.name.removeprefix("model.layers."), g.layer, len(g.modules)) for g in found] == [
        ("0.self_attn.qkv_proj", 0, 3), ("0.self_attn.o_proj", 0, 1), ("0.mlp.gate_up_proj", 0, 2),
        ("0.mlp.down_proj", 0, 1), ("1.mlp.experts", 1, 9), ("1.mlp.shared_experts.gate_up_proj", 1, 2)]
    import re

    for group in found:  # each group's target matches its Linears and no other
        pattern = re.compile(fused.target_regex(group).removeprefix("re:"))
        assert {n for n in names if pattern.match(n)} == set(group.modules), group.name
        assert group.kind == "experts" or pattern.match(group.name)  # vLLM looks a fused layer up by its own name


def test_a_deliberately_broken_group_ranks_first_and_the_kl_is_the_kl_stages(tmp_path, tiny_llama, tiny_calib):
    """Every Linear rounded to 4 bits but one down_proj to 2 bits: restoring that one removes the most KL. The
    variant's KL is `quantize kl`'s on the same tokens; a restored group's KL is torch's kl_div on the restored model."""
    holdout = tiny_calib / "holdout.jsonl"
    variant = rounded_copy(tiny_llama, tmp_path / "broken", {None: 4, BROKEN: 2})
    result = sensitivity.run(tiny_llama, variant, holdout, tmp_path / "broken.json", sequences=4, max_tokens=64)
    groups = result.figures["groups"]
    assert len(groups) == 8 and {g["kind"] for g in groups} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert groups[0]["name"] == BROKEN and groups[0]["modules"] == [BROKEN]
    assert groups[0]["share_removed"] > 2 * groups[1]["share_removed"] > 0
    assert read_sensitivity(tmp_path / "broken.json") == json.loads((tmp_path / "broken.json").read_text())
    whole = kl.run(tiny_llama, variant, holdout, tmp_path / "kl.json", sequences=4, max_tokens=64)
    assert result.figures["kl_mean"] == pytest.approx(whole.figures["kl_mean"], rel=1e-5)
    assert result.figures["tokens"] == whole.figures["tokens"]
    assert groups[0]["weights"] == 64 * 128 and result.figures["seconds"] > 0


def test_a_restored_groups_kl_is_torchs_on_that_model(tmp_path, tiny_llama, tiny_calib):
    from transformers import AutoTokenizer

    from pipeline.checkpoints.loading import load_for_inference
    from pipeline.scoring.token_kl import holdout_texts

    variant = rounded_copy(tiny_llama, tmp_path / "w3", {None: 3})
    result = sensitivity.run(tiny_llama, variant, tiny_calib / "holdout.jsonl", tmp_path / "s.json", sequences=3,
                             max_tokens=48, measure="restore")
    group = next(g for g in result.figures["groups"] if g["kind"] == "qkv_proj")
    base, var = (load_for_inference(p, torch.float32).eval() for p in (tiny_llama, variant))
    with torch.no_grad():
        for name in group["modules"]:
            var.get_submodule(name).weight.copy_(base.get_submodule(name).weight)
        values = []
        for ids in holdout_texts(AutoTokenizer.from_pretrained(tiny_llama), tiny_calib / "holdout.jsonl", 48, 3):
            ids = torch.tensor([ids])
            b, v = (torch.log_softmax(m(input_ids=ids).logits.float(), -1) for m in (base, var))
            values.append(torch.nn.functional.kl_div(v, b, log_target=True, reduction="none").sum(-1).flatten())
    assert group["kl_restored"] == pytest.approx(float(torch.cat(values).double().mean()), rel=1e-4)


def test_the_one_gradient_estimate_ranks_as_restoring_each_group_does(tmp_path, tiny_llama, tiny_calib):
    """The default measure (`taylor`: KL's second-order model around the base, from one gradient at the variant) and
    the exact one (`restore`: one pass per group) on a variant with a deliberately broken group and a 3-bit one: the
    same first two groups, shares within 25 % of each other, and summed over the groups the estimate is the
    variant's whole KL (the quadratic model's identity: sum_i g_i.d_i / 2 = d'Hd / 2)."""
    from scipy.stats import spearmanr

    holdout = tiny_calib / "holdout.jsonl"
    variant = rounded_copy(tiny_llama, tmp_path / "v", {None: 5, BROKEN: 2, "model.layers.0.self_attn.v_proj": 3})
    found = {m: sensitivity.run(tiny_llama, variant, holdout, tmp_path / f"{m}.json", sequences=4, max_tokens=64,
                                measure=m).figures for m in ("taylor", "restore")}
    taylor, restore = ({g["name"]: g["kl_removed"] for g in found[m]["groups"]} for m in ("taylor", "restore"))
    assert [g["name"] for g in found["taylor"]["groups"][:2]] == [g["name"] for g in found["restore"]["groups"][:2]]
    for name in [g["name"] for g in found["restore"]["groups"][:2]]:
        assert taylor[name] == pytest.approx(restore[name], rel=0.25)
    assert spearmanr([taylor[n] for n in restore], list(restore.values())).statistic > 0.7
    assert sum(taylor.values()) == pytest.approx(found["taylor"]["kl_mean"], rel=0.25)
    assert found["taylor"]["measure"] == "taylor" and found["taylor"]["load_seconds"] >= 0


def test_kl_rank_gives_the_kl_stages_figures_and_the_taylor_ranking_in_one_pass(tmp_path, tiny_llama, tiny_calib):
    """`quantize kl --rank` (the fix stage's pass): kl.json and kl.jsonl as `quantize kl` writes them, and beside
    them sensitivity.json with `quantize sensitivity`'s taylor ranking, the same groups in the same order with the
    same figures; its `seconds` is what the ranking added, within the pass it shares."""
    holdout = tiny_calib / "holdout.jsonl"
    variant = rounded_copy(tiny_llama, tmp_path / "v", {None: 4, BROKEN: 2})
    plain = kl.run(tiny_llama, variant, holdout, tmp_path / "plain" / "kl.json", sequences=4, max_tokens=64)
    ranked = kl.run(tiny_llama, variant, holdout, tmp_path / "ranked" / "kl.json", sequences=4, max_tokens=64,
                    rank=True)
    alone = sensitivity.run(tiny_llama, variant, holdout, tmp_path / "alone.json", sequences=4, max_tokens=64).figures
    for key in ("tokens", "kl_mean", "kl_p99", "kl_max", "top1_agreement"):
        assert ranked.figures[key] == pytest.approx(plain.figures[key], rel=1e-5), key
    lines = {name: [json.loads(line) for line in (tmp_path / name / "kl.jsonl").read_text().splitlines()]
             for name in ("plain", "ranked")}
    assert [{k: v for k, v in line.items() if k != "kl"} for line in lines["ranked"]] == \
        [{k: v for k, v in line.items() if k != "kl"} for line in lines["plain"]]
    assert [x for line in lines["ranked"] for x in line["kl"]] == pytest.approx(
        [x for line in lines["plain"] for x in line["kl"]], rel=1e-4, abs=1e-9)
    written = read_sensitivity(tmp_path / "ranked" / "sensitivity.json")
    assert written == ranked.ranking and written["measured_in"] == "quantize kl --rank"
    assert [g["name"] for g in written["groups"]] == [g["name"] for g in alone["groups"]]
    assert [g["kl_removed"] for g in written["groups"]] == pytest.approx([g["kl_removed"] for g in alone["groups"]],
                                                                         rel=1e-4)
    assert written["kl_mean"] == pytest.approx(plain.figures["kl_mean"], rel=1e-5)
    assert 0 <= written["seconds"] <= written["pass_seconds"] and "ranked 8 groups into" in ranked.summary()
    assert not (tmp_path / "plain" / "sensitivity.json").exists() and plain.ranking is None


def test_a_variant_equal_to_its_base_is_refused_and_nothing_is_written(tmp_path, tiny_llama, tiny_calib):
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    with pytest.raises(UserError, match="equal the base's: nothing is quantized"):
        sensitivity.run(tiny_llama, copy, tiny_calib / "holdout.jsonl", tmp_path / "s.json", sequences=2)
    assert not (tmp_path / "s.json").exists()


def test_a_variant_with_quantized_activations_is_refused_before_any_model_loads(tmp_path, tiny_llama, tiny_calib,
                                                                               tiny_variants, monkeypatch):
    """FP8 W8A8 (static activations): the ranking's gradient does not pass activation rounding, and a fix keeps
    W8A16 groups: `quantize sensitivity` and `quantize kl --rank` refuse it from config.json, before loading either
    model; `quantize kl` without --rank measures it as before."""
    from pipeline.checkpoints import config_json

    fp8 = tiny_variants["fp8-w8a8"]
    assert config_json.quantized_activations(config_json.read(fp8))  # what the refusal reads
    assert config_json.quantized_activations(config_json.read(tiny_variants["awq-w4a16"])) == []

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(sensitivity, "load_both", no_load)
    monkeypatch.setattr("pipeline.checkpoints.loading.load_for_inference", no_load)
    said = r"quantizes its activations \(.*config.json quantization_config: group_0: float 8-bit, static, tensor\)"
    for measure in ("taylor", "restore"):
        with pytest.raises(UserError, match=said):
            sensitivity.run(tiny_llama, fp8, tiny_calib / "holdout.jsonl", tmp_path / "s.json", sequences=2,
                            measure=measure)
    with pytest.raises(UserError, match=r"kl --rank: .*quantizes its activations.*rank a weight-only \(W4A16\)"):
        kl.run(tiny_llama, fp8, tiny_calib / "holdout.jsonl", tmp_path / "kl.json", sequences=2, rank=True)
    assert not (tmp_path / "s.json").exists() and not (tmp_path / "kl.json").exists()
    monkeypatch.undo()
    assert kl.run(tiny_llama, fp8, tiny_calib / "holdout.jsonl", tmp_path / "kl.json", sequences=2).figures["tokens"]


def test_the_reader_refuses_an_unranked_file_naming_it(tmp_path):
    group = {"name": "g", "layer": 0, "kind": "o_proj", "modules": ["g"], "weights": 4, "kl_restored": 0.1,
             "kl_removed": 0.1, "share_removed": 0.5}
    data = {"base": "b", "variant": "v", "holdout": "h", "sequences": 1, "tokens": 2, "kl_mean": 0.2, "device": "cpu",
            "dtype": "float32", "seconds": 1.0,
            "groups": [group, {**group, "name": "h", "modules": ["h"], "kl_removed": 0.15}]}
    path = tmp_path / "v" / "sensitivity.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"groups\[1\] \(h\): removes more KL.*quantize sensitivity models/v"):
        read_sensitivity(path)
    with pytest.raises(UserError, match="no sensitivity ranking; run `quantize sensitivity"):
        read_sensitivity(tmp_path / "none.json")


def test_the_command_writes_the_ranking_and_refuses_bad_settings_with_exit_2(tmp_path, tiny_llama, tiny_calib):
    from typer.testing import CliRunner

    from conftest import write_params
    from pipeline.cli.app import app

    params = write_params(tmp_path)
    variant = rounded_copy(tiny_llama, tmp_path / "models" / "broken", {None: 4, BROKEN: 2})
    common = ["--base", str(tiny_llama), "--holdout", str(tiny_calib / "holdout.jsonl"), "--params", str(params)]
    bad = CliRunner().invoke(app, ["sensitivity", str(variant), "--sequences", "0", *common])
    assert bad.exit_code == 2 and "sequences" in bad.output
    out = tmp_path / "results" / "broken" / "sensitivity.json"
    done = CliRunner().invoke(app, ["sensitivity", str(variant), "--sequences", "2", "--out", str(out), *common])
    assert done.exit_code == 0, done.output
    assert f"first {BROKEN}" in done.output and read_sensitivity(out)["sequences"] == 2
