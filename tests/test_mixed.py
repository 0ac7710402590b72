"""The `mixed` method (pipeline/methods/mixed.py): a W4A16 method with the groups `quantize sensitivity` ranks most
costly kept in W8A16 within a budget of mean bits per weight; one compressed-tensors checkpoint, one config group per
scheme, verified like every variant."""

import json

import pytest
import torch

from conftest import read_tensors
from pipeline.errors import UserError
from pipeline.methods import mixed


def ranked(*groups):
    """Sensitivity groups (name, weights, kl_removed), ranked as the file holds them."""
    return [{"name": n, "layer": 0, "kind": "x", "modules": [n], "weights": w, "kl_restored": 1 - k, "kl_removed": k,
             "share_removed": k} for n, w, k in groups]


def test_the_budget_keeps_the_most_sensitive_groups_that_fit():
    groups = ranked(("big", 600, 0.5), ("small", 100, 0.2), ("mid", 300, 0.1), ("none", 100, 0.0))
    rows, bits = mixed.choose(groups, 4.5)  # 4 + 0.5 over 1100 weights: 137.5 weights' worth of 8 bits
    assert [r["scheme"] for r in rows] == ["W4A16", "W8A16", "W4A16", "W4A16"]
    assert bits == pytest.approx(4 + 4 * 100 / 1100)
    assert "over 4.5" in rows[0]["why"] and "removes none" in rows[3]["why"] and "within the budget" in rows[1]["why"]
    rows, bits = mixed.choose(groups, 8)
    assert [r["scheme"] for r in rows] == ["W8A16", "W8A16", "W8A16", "W4A16"]  # no KL removed: not worth a bit
    rows, bits = mixed.choose(groups, 4)
    assert {r["scheme"] for r in rows} == {"W4A16"} and bits == 4


@pytest.fixture(scope="module")
def rtn_and_ranking(tmp_path_factory, tiny_llama, tiny_calib):
    from pipeline.stages import sensitivity
    from pipeline.stages.quantize import run as quantize_run

    root = tmp_path_factory.mktemp("mixed")
    quantize_run(tiny_llama, root / "rtn-w4a16", tiny_calib / "calib.jsonl", "rtn", group_size=32)
    sensitivity.run(tiny_llama, root / "rtn-w4a16", tiny_calib / "holdout.jsonl", root / "sensitivity.json",
                    sequences=4, max_tokens=64)
    return root


def test_a_mixed_variant_is_one_checkpoint_with_a_config_group_per_scheme(rtn_and_ranking, tiny_llama, tiny_calib):
    from pipeline.formats.sensitivity import read_sensitivity
    from pipeline.stages import kl
    from pipeline.stages.quantize import run as quantize_run

    root = rtn_and_ranking
    ranking = read_sensitivity(root / "sensitivity.json")
    result = quantize_run(tiny_llama, root / "mixed", tiny_calib / "calib.jsonl", "mixed", base="rtn", max_bits=4.5,
                          group_size=32, sensitivity=root / "sensitivity.json")
    info = json.loads((root / "mixed" / "quant.json").read_text())
    kept = [g for g in info["groups"] if g["scheme"] == "W8A16"]
    assert kept and info["groups_in_8_bits"] == len(kept) and info["groups_total"] == len(ranking["groups"])
    assert 4 < info["bits_per_weight"] <= 4.5 and info["bits_per_weight_with_scales"] > info["bits_per_weight"]
    assert info["base_method"] == "rtn" and f"{len(kept)} of {len(ranking['groups'])} groups in W8A16" in info["scheme"]
    assert info["verify"]["reloads"] is True
    quant = json.loads((root / "mixed" / "config.json").read_text())["quantization_config"]
    bits = {g["weights"]["num_bits"]: g["targets"] for g in quant["config_groups"].values()}
    assert bits[4] == ["Linear"] and len(bits[8]) == len(kept)
    # the kept groups' weights hold at most 256 levels per group of 32, the others at most 16
    tensors = read_tensors(root / "mixed")
    scheme_of = {g["name"]: g["scheme"] for g in info["groups"]}
    modules = {m: scheme_of[g["name"]] for g in ranking["groups"] for m in g["modules"]}
    for module, scheme in modules.items():
        packed = tensors[f"{module}.weight_packed"]
        assert packed.dtype == torch.int32
        rows_in = tensors[f"{module}.weight_shape"].tolist()[1]
        assert packed.shape[1] * 32 // (8 if scheme == "W8A16" else 4) == rows_in, module
    variant_kl = kl.run(tiny_llama, root / "rtn-w4a16", tiny_calib / "holdout.jsonl", root / "rtn-kl.json",
                        sequences=4, max_tokens=64).figures["kl_mean"]
    mixed_kl = kl.run(tiny_llama, root / "mixed", tiny_calib / "holdout.jsonl", root / "mixed-kl.json",
                      sequences=4, max_tokens=64).figures["kl_mean"]
    assert mixed_kl < variant_kl
    from pipeline.checkpoints.serving import scheme, serving_support

    assert scheme(json.loads((root / "mixed" / "config.json").read_text())) == "w4a16+w8a16"  # a key of its own
    served = serving_support(root / "mixed")
    assert served["hf"]["serves"] and not served["vllm"]["serves"]  # vLLM: shown for GlmForCausalLM (2026-12-03), not for Llama
    assert result.info["size_bytes"] > json.loads((root / "rtn-w4a16" / "quant.json").read_text())["size_bytes"]


def test_a_ranking_of_another_model_or_none_is_refused_before_any_weight_loads(tmp_path, rtn_and_ranking, tiny_llama,
                                                                              tiny_calib):
    from pipeline.stages.quantize import run as quantize_run

    other = json.loads((rtn_and_ranking / "sensitivity.json").read_text())
    other["groups"][0]["modules"] = ["model.layers.7.mlp.down_proj"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "sensitivity.json").write_text(json.dumps(other))
    with pytest.raises(UserError, match=r"model.layers.7.mlp.down_proj .*is not a module of .*measured on another"):
        quantize_run(tiny_llama, tmp_path / "m", tiny_calib / "calib.jsonl", "mixed", base="rtn", group_size=32,
                     sensitivity=tmp_path / "other" / "sensitivity.json")
    with pytest.raises(UserError, match="no sensitivity ranking; run `quantize sensitivity models/<W4A16 variant>` first"):
        quantize_run(tiny_llama, tmp_path / "m", tiny_calib / "calib.jsonl", "mixed", base="rtn", group_size=32,
                     sensitivity=tmp_path / "none" / "sensitivity.json")
    assert not (tmp_path / "m").exists()


def test_vllm_resolves_every_kept_group_to_the_scheme_it_was_stored_with(rtn_and_ranking, tiny_llama, tiny_calib,
                                                                         tmp_path):
    """vLLM looks a fused layer (qkv_proj) up by its own name, then by its class ("Linear" is in QKVParallelLinear),
    then by its shards: a W8A16 target naming only q/k/v would have it built with the 4-bit scheme. The written
    checkpoint passes the check; the same checkpoint with the fused name taken out of its targets is refused by
    verify's check, naming the layer."""
    import shutil

    from pipeline.checkpoints import serving_names
    from pipeline.stages.quantize import run as quantize_run

    ranking = json.loads((rtn_and_ranking / "sensitivity.json").read_text())  # a layer's q/k/v first
    qkv = [g for g in ranking["groups"] if g["kind"] == "qkv_proj"]
    ranking["groups"] = [{**g, "kl_removed": 1.0 / (i + 1)} for i, g in
                         enumerate(qkv[:1] + [g for g in ranking["groups"] if g is not qkv[0]])]
    (tmp_path / "sensitivity.json").write_text(json.dumps(ranking))
    out = tmp_path / "qkv8"
    quantize_run(tiny_llama, out, tiny_calib / "calib.jsonl", "mixed", base="rtn", max_bits=5, group_size=32,
                 sensitivity=tmp_path / "sensitivity.json")
    config = json.loads((out / "config.json").read_text())
    linears = serving_names.quantized_linears(out)
    assert any(n.endswith("q_proj") for n in linears) and serving_names.vllm_scheme_conflicts(config, linears) == []
    assert serving_names.check(out)["vllm_would_quantize"] == []
    broken = shutil.copytree(out, tmp_path / "broken")
    groups = config["quantization_config"]["config_groups"]
    four = next(k for k, g in groups.items() if g["targets"] == ["Linear"])
    eight = next(g for g in groups.values() if g["targets"] != ["Linear"])
    index, target = next((i, t) for i, t in enumerate(eight["targets"]) if t.endswith("qkv_proj)$"))
    fused_layer = target.rpartition("|")[2].removesuffix(")$").replace("\\", "")
    eight["targets"][index] = target.rpartition("|")[0] + ")$"  # q/k/v named, the fused layer not
    (broken / "config.json").write_text(json.dumps(config))
    conflicts = serving_names.vllm_scheme_conflicts(config, linears)
    assert sorted(c.split(":")[0] for c in conflicts) == [fused_layer.replace("qkv_proj", f"{p}_proj") for p in "kqv"]
    assert f"vLLM builds {fused_layer} with {four}" in conflicts[0]
    with pytest.raises(UserError, match="vLLM would load 3 quantized Linears with another config group"):
        serving_names.check(broken)


def test_vllm_maps_a_glm_vs_plain_targets_but_matches_re_targets_against_its_own_names():
    """vLLM 0.24 (compressed_tensors.py apply_vllm_mapper) puts a config group's layer-path targets through the model's
    prefix mapper and leaves `re:` ones as they are: on a GLM-V a plain HF name reaches the layer, a `re:` naming only
    HF names does not (the 4-bit group builds it), and one naming vLLM's too does (fused.target_regex's renaming)."""
    from pipeline.checkpoints import fused, serving_names

    o_proj = "model.language_model.layers.0.self_attn.o_proj"
    group = fused.Group(o_proj, 0, "o_proj", [o_proj])
    renaming = serving_names.target_renaming("Glm4vForConditionalGeneration")
    assert serving_names.target_renaming("GlmForCausalLM") is None  # a text model: vLLM keeps the HF names

    def conflicts(target: str) -> list[str]:
        weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
        config = {"architectures": ["Glm4vForConditionalGeneration"], "quantization_config": {"config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights},
            "group_1": {"targets": [target], "weights": {**weights, "num_bits": 8}}}}}
        return serving_names.vllm_scheme_conflicts(config, [o_proj])

    assert conflicts(o_proj) == []
    assert conflicts(fused.target_regex(group)) == [
        f"{o_proj}: stored in group_1, vLLM builds language_model.model.layers.0.self_attn.o_proj with group_0"]
    assert conflicts(fused.target_regex(group, renaming)) == []
