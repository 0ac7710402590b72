"""Quantizing models larger than the device: the offloaded path (one decoder layer at a time on the
accelerator) writes the same checkpoint as the whole-model path, AWQ's X^T X search picks what
llm-compressor's own search picks, every MoE expert is calibrated (and a run where one is not fails
with the list), and `--plan` reports figures that add up. On this CPU machine the "device" is the
CPU: the offloaded path runs through the same compressed-tensors offloading, onloading to the CPU."""

import json
from pathlib import Path

import pytest
import torch

from conftest import read_tensors

from pipeline.errors import UserError
from pipeline.quantize import plan
from pipeline.stages import quantize as stage
from pipeline.stages.quantize import run as quantize_run
from tiny import save_tiny_glm, save_tiny_glm4v_moe


def assert_same_checkpoint(a: Path, b: Path) -> None:
    first, second = read_tensors(a), read_tensors(b)
    assert sorted(first) == sorted(second)
    differ = [k for k in first if not torch.equal(first[k], second[k])]
    assert not differ, f"{len(differ)} of {len(first)} tensors differ: {differ[:5]}"


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory) -> Path:
    return save_tiny_glm(tmp_path_factory.mktemp("glm") / "base")


@pytest.fixture(scope="module")
def starved_moe(tmp_path_factory) -> Path:
    """A tiny Glm4vMoe whose router never picks experts 2 and 3 (GLM's score-correction bias, set
    very low): calibrated on routed tokens only, they would see none."""
    from safetensors.torch import load_file, save_file

    base = save_tiny_glm4v_moe(tmp_path_factory.mktemp("moe") / "base")
    tensors = load_file(base / "model.safetensors")
    biases = [k for k in tensors if k.endswith("mlp.gate.e_score_correction_bias")]
    assert biases
    for key in biases:
        tensors[key] = torch.tensor([0.0, 0.0, -10.0, -10.0])
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    return base


@pytest.mark.parametrize("arch", ["Llama", "Glm"])
def test_offloaded_run_with_llm_compressors_search_writes_the_same_checkpoint(arch, tmp_path, tiny_llama, tiny_glm,
                                                                              tiny_variants, tiny_calib):
    """Offloaded placement and llm-compressor's forward search, against the whole-model placement and
    the X^T X search (the defaults): bit-identical (float32 on the CPU, where both searches score
    the same candidates alike; on a GPU in bfloat16, X^T X is the more exact of the two)."""
    calib = tiny_calib / "calib.jsonl"
    if arch == "Llama":
        base, default = tiny_llama, tiny_variants["awq-w4a16"]
        settings = dict(group_size=32, batch_size=8, n_grid=4)
    else:
        base, default = tiny_glm, tmp_path / "default"
        settings = dict(batch_size=8, n_grid=4)
        quantize_run(base, default, calib, "awq", **settings)
    result = quantize_run(base, tmp_path / "offload", calib, "awq", placement="offload", search="forward", **settings)
    assert_same_checkpoint(default, tmp_path / "offload")
    info = result.info
    assert info["placement"] == "offload" and info["search"] == "forward"
    assert json.loads((default / "quant.json").read_text())["placement"] == "device"
    layers = info["layers"]["seconds"]
    assert len(layers) == 2 and all(s > 0 for s in layers)


def test_moe_experts_all_calibrated_and_a_starved_expert_fails_the_run(tmp_path, starved_moe, tiny_calib):
    calib = tiny_calib / "calib.jsonl"
    experts = "model.language_model.layers.1.mlp.experts"
    with pytest.raises(UserError, match=rf"2 MoE experts saw no calibration tokens.*{experts}\.2, {experts}\.3;"):
        quantize_run(starved_moe, tmp_path / "routed-only", calib, "awq", batch_size=8, n_grid=3, calibrate_all_experts=False)
    assert not (tmp_path / "routed-only").exists()

    info = quantize_run(starved_moe, tmp_path / "all", calib, "awq", batch_size=8, n_grid=3).info
    tokens = info["calibration"]["tokens"]
    layer = info["experts"]["layers"][experts]
    assert layer["experts"] == 4 and layer["tokens_seen"] == {"min": tokens, "max": tokens}
    assert layer["experts_without_tokens"] == 0
    # what routing alone would have given: experts 2 and 3 never chosen, top-2 of 4 for every token
    assert info["experts"]["routed"][experts][2:] == [0, 0] and layer["experts_never_routed"] == 2
    assert sum(info["experts"]["routed"][experts]) == 2 * tokens
    assert info["verify"]["experts"] == {"experts": 4, "min_tokens_seen": tokens, "never_routed": 2, "checked": True}


def test_plan_reports_layers_memory_and_probe_time_and_writes_nothing(tmp_path, starved_moe, tiny_calib):
    layout = quantize_run(starved_moe, tmp_path / "out", tiny_calib / "calib.jsonl", "awq", batch_size=8, n_grid=3,
                     plan_only=True)
    assert isinstance(layout, stage.Plan) and not (tmp_path / "out").exists()
    i = layout.info
    params = sum(t.numel() for k, t in read_tensors(starved_moe).items()
                 if not k.endswith("e_score_correction_bias"))  # a buffer, not a parameter
    assert i["params"] == params and i["weights_bytes"] == 4 * params  # float32 on the CPU
    assert i["layers"] == 2 and {k: v["count"] for k, v in i["kinds"].items()} == {
        "Glm4vMoeTextDecoderLayer, dense": 1, "Glm4vMoeTextDecoderLayer, 4 experts": 1}
    # every Linear of the text tower but the routers and lm_head: 4 attention + 3 dense MLP + 4 x 3 experts + 3 shared
    assert i["quantized_linears"] == 8 + 3 + 12 + 3
    assert i["placement"] == "device" and i["device_bytes"] is None and i["host_bytes"] > i["weights_bytes"]
    probe, expected = i["probe"], i["expected"]
    assert set(probe["kinds"]) == set(i["kinds"]) and all(k["seconds"] > 0 for k in probe["kinds"].values())
    in_layers = sum(i["kinds"][kind]["count"] * k["seconds"] for kind, k in probe["kinds"].items())
    assert expected["calibrate_s"] == pytest.approx(expected["fixed_s"] + in_layers + expected["other_s"], abs=0.1)
    text = layout.summary()
    assert "1 x Glm4vMoeTextDecoderLayer, 4 experts" in text and "expected calibration: 1 x" in text


def test_cli_plan_prints_the_plan_and_writes_nothing(tmp_path, tiny_llama, tiny_calib, monkeypatch):
    from typer.testing import CliRunner

    from conftest import TINY_PARAMS, write_params
    from pipeline.cli.app import app

    write_params(tmp_path, {**TINY_PARAMS, "model": {**TINY_PARAMS["model"], "base_dir": str(tiny_llama)}})
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["fp8", "--calib", str(tiny_calib / "calib.jsonl"), "--out", "models/fp8",
                                      "--plan"])
    assert result.exit_code == 0, result.output
    assert "plan: fp8 of" in result.output and "2 x LlamaDecoderLayer, dense" in result.output
    assert "expected calibration: 2 x" in result.output and not (tmp_path / "models").exists()
    result = CliRunner().invoke(app, ["fp8", "--calib", str(tiny_calib / "calib.jsonl"), "--placement", "gpu"])
    assert result.exit_code == 2 and "placement 'gpu': use one of auto, device, offload" in result.output


@pytest.mark.parametrize("free, expected", [(None, "device"), (40 << 30, "device"), (20 << 30, "offload")])
def test_auto_placement_keeps_the_model_on_the_device_only_when_it_fits(free, expected):
    placement, why = plan.choose_placement("auto", 16 << 30, 4 << 30, free)
    assert placement == expected, why
    assert plan.choose_placement("offload", 1, 1, 40 << 30)[0] == "offload"


def test_gram_loss_is_the_output_error_of_the_linear():
    """The identity the X^T X search rests on: sum over tokens of ||x (W_q - W)^T||^2 = sum(E G * E)."""
    from pipeline.methods.awq_gram import _gram_update

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 24, generator=generator)
    weight, quantized = torch.randn(40, 24, generator=generator), torch.randn(40, 24, generator=generator)
    gram = None
    for chunk in x:  # accumulated batch by batch, as the hook does
        gram = _gram_update(gram, chunk)
    error = quantized - weight
    from_gram = ((error @ gram) * error).sum() / (150 * 40)
    direct = torch.nn.functional.mse_loss(x.reshape(-1, 24) @ quantized.T, x.reshape(-1, 24) @ weight.T)
    assert from_gram.item() == pytest.approx(direct.item(), rel=1e-5)


def test_engine_tensor_parallel_size_is_validated_and_reaches_lmdeploy_only(tmp_path):
    from conftest import TINY_PARAMS, write_params
    from pipeline.settings import params

    from pipeline.engines import settings_for

    engine = {**TINY_PARAMS["engine"], "name": "lmdeploy", "tensor_parallel_size": 2}
    engine.pop("max_batch_tokens", None), engine.pop("threads", None)  # hf's own settings
    p = params.load(write_params(tmp_path, {**TINY_PARAMS, "engine": engine}))
    assert settings_for(p.engine, "lmdeploy").tensor_parallel_size == 2
    assert not hasattr(settings_for(p.engine, "hf"), "tensor_parallel_size")
    hf = {**TINY_PARAMS["engine"], "name": "hf", "tensor_parallel_size": 2}
    with pytest.raises(UserError, match="engine.tensor_parallel_size: the vllm and the lmdeploy engines' setting; "
                                        "engine.name is hf"):
        params.load(write_params(tmp_path, {**TINY_PARAMS, "engine": hf}))
    with pytest.raises(UserError, match="engine.tensor_parallel_size: Input should be greater than or equal to 1"):
        params.load(write_params(tmp_path, {**TINY_PARAMS, "engine": {**engine, "tensor_parallel_size": 0}}))
    variants = {"awq-w4a16": {**TINY_PARAMS["variants"]["awq-w4a16"], "search": "fast"}}
    with pytest.raises(UserError, match=r"variants.awq-w4a16.search: 'fast' is not allowed"):
        params.load(write_params(tmp_path, {**TINY_PARAMS, "variants": {**TINY_PARAMS["variants"], **variants}}))


def _quantized_linear(out: int, width: int, group: int):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization import apply_quantization_config

    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group)
    layer = torch.nn.Linear(width, out, bias=False)
    apply_quantization_config(torch.nn.Sequential(layer), QuantizationConfig(
        config_groups={"g": QuantizationScheme(targets=["Linear"], weights=args)}))
    return layer, args


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ranked_search_chooses_what_every_candidate_in_float32_chooses(seed):
    """The X^T X search since issue 36 ranks the grid by a bfloat16 estimate and rescores the best 3 in float32.
    Against the search before (every candidate scored in float32, one at a time through the layer's observer):
    the stacked float32 losses are the same numbers, the estimates within 1e-3, and the choice the same."""
    from pipeline.methods import awq_gram

    generator = torch.Generator().manual_seed(seed)
    layer, scheme = _quantized_linear(96, 256, 64)
    x = torch.randn(2000, 256, generator=generator) * (torch.rand(256, generator=generator) * 4) ** 2  # outlier channels
    gram, weight = x.T @ x, layer.weight.detach().clone()
    x_mean, w_mean = x.abs().mean(0), weight.abs().mean(0)
    candidates = [awq_gram._candidate_scales(x_mean, w_mean, 0.0, False)] + \
        [awq_gram._candidate_scales(x_mean, w_mean, i / 18, True) for i in range(19)]
    before = awq_gram._losses_one_by_one(layer, weight, candidates, gram, 2000, scheme)
    stacked = torch.stack(candidates)
    exhaustive, every = awq_gram._ranked_then_rescored(weight, stacked, gram, 2000, scheme, 7, rescored=0)
    assert exhaustive == before and every == dict(enumerate(before))
    estimates, exact = awq_gram._ranked_then_rescored(weight, stacked, gram, 2000, scheme, 1, rescored=3)
    assert len(exact) == 3 and all(exact[i] == before[i] for i in exact)
    assert estimates == pytest.approx(before, rel=1e-3) and estimates != before
    assert min(exact, key=lambda i: (exact[i], i)) == min(range(20), key=lambda i: (before[i], i))


def test_search_now_writes_the_checkpoint_the_search_before_wrote(tmp_path, tiny_glm, tiny_calib, monkeypatch):
    """End to end at llm-compressor's n_grid 20 on a tiny Glm: the X^T X search as it is now (candidates stacked,
    ranked by the bfloat16 estimate, the best 3 rescored in float32) writes the checkpoint the search before issue 36
    (stacked_search=False: every candidate one by one in float32) writes."""
    from pipeline.methods import awq

    calib, settings = tiny_calib / "calib.jsonl", dict(batch_size=2, n_grid=20)
    quantize_run(tiny_glm, tmp_path / "now", calib, "awq", **settings)
    recipe = awq.recipe

    def before(section, target):
        built = recipe(section, target)
        built.modifiers[0].stacked_search, built.modifiers[0].ranking_share = False, 0.0
        return built
    monkeypatch.setattr(awq, "recipe", before)
    quantize_run(tiny_glm, tmp_path / "before", calib, "awq", **settings)
    assert_same_checkpoint(tmp_path / "now", tmp_path / "before")
    assert len(read_calibration_blocks(calib)) > settings["batch_size"]  # so the ranking pass did leave batches out


def read_calibration_blocks(calib: Path) -> list:
    return [json.loads(line) for line in calib.read_text().splitlines() if line.strip()]


def test_ranked_forward_search_ranks_on_a_share_and_rescores_on_all(tmp_path, tiny_glm, tiny_calib, monkeypatch):
    """The attention's two-pass search (GramAWQModifier.ranking_share, off by default): every candidate on the first
    quarter of the batches, then the shortlist on all of them. Shortlisting 19 of 20 leaves out only the worst-ranked
    candidate, so the checkpoint is the exhaustive search's: the two passes leave no trace of their own (weights,
    grid, metrics)."""
    from pipeline.methods import awq
    from pipeline.methods.awq_gram import GramAWQModifier

    calib, settings = tiny_calib / "calib.jsonl", dict(batch_size=2, n_grid=20)  # 8 blocks: 4 batches
    quantize_run(tiny_glm, tmp_path / "exhaustive", calib, "awq", **settings)
    recipe, passes = awq.recipe, []
    original = GramAWQModifier._run_samples

    def counted(self, module):
        outputs = original(self, module)
        passes.append(len(outputs))
        return outputs

    def ranked(section, target):
        built = recipe(section, target)
        built.modifiers[0].ranking_share, built.modifiers[0].rescored_candidates = 0.25, 19
        return built
    monkeypatch.setattr(awq, "recipe", ranked)
    monkeypatch.setattr(GramAWQModifier, "_run_samples", counted)
    quantize_run(tiny_glm, tmp_path / "ranked", calib, "awq", **settings)
    assert_same_checkpoint(tmp_path / "exhaustive", tmp_path / "ranked")
    per_layer = [1] + [1] * 20 + [4] * 19  # reference on all 4 batches, 20 candidates on 1, the shortlist on all 4
    per_layer[0] = 4
    assert passes == per_layer * 2  # two decoder layers, one attention mapping each


def test_search_curves_record_every_forward_search_without_changing_the_choice(tmp_path, tiny_glm, tiny_calib):
    """benchmarks/awq_search_curves.py: recording the forward searches' losses (and the X^T X proxy beside them)
    leaves the checkpoint as a plain run writes it; one record per attention mapping, the winner the first minimum."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from awq_search_curves import local_minima, record_searches

    calib, settings = tiny_calib / "calib.jsonl", dict(batch_size=2, n_grid=20)
    quantize_run(tiny_glm, tmp_path / "plain", calib, "awq", **settings)
    records: list[dict] = []
    restore = record_searches(records)
    try:
        quantize_run(tiny_glm, tmp_path / "recorded", calib, "awq", **settings)
    finally:
        restore()
    assert_same_checkpoint(tmp_path / "plain", tmp_path / "recorded")
    assert [r["mapping"].rsplit(".", 1)[-1] for r in records] == ["input_layernorm"] * 2  # Glm: 2 layers
    for record in records:
        assert len(record["exact"]) == len(record["proxy"]) == 20
        assert record["winner"] == min(range(20), key=lambda i: (record["exact"][i], i))
        assert 0 <= record["winner_rank_in_proxy"] < 20
    assert local_minima([9.0, 3.0, 2.0, 4.0, 1.0]) == [2, 4] and local_minima([9.0, 1.0, 2.0, 3.0]) == [1]


def test_moe_attention_inputs_wait_with_the_activations(tmp_path, starved_moe, tiny_calib, monkeypatch):
    """With the whole model on the accelerator, AWQ's cached inputs of the attention stay there with the activations
    between layers; llm-compressor would put an MoE model's on the host (offload_device "cpu") and fetch them once
    per scale candidate. On this CPU the run is asked for that placement of the activations ("cpu"): the modifier
    keeps nothing apart, and the checkpoint is the default run's."""
    import torch

    import pipeline.quantize.calibrate as calibrate_module

    calib, settings = tiny_calib / "calib.jsonl", dict(batch_size=8, n_grid=3)
    quantize_run(starved_moe, tmp_path / "default", calib, "awq", **settings)
    original, seen = calibrate_module.calibrate, []

    def with_activations_device(model, tokenizer, blocks, recipe, batch_size, **kwargs):
        result = original(model, tokenizer, blocks, recipe, batch_size, **{**kwargs, "activations_device": "cpu"})
        seen.extend(modifier.offload_device for modifier in recipe if hasattr(modifier, "offload_device"))
        return result
    monkeypatch.setattr(calibrate_module, "calibrate", with_activations_device)
    quantize_run(starved_moe, tmp_path / "kept", calib, "awq", **settings)
    assert seen == [None]
    assert_same_checkpoint(tmp_path / "default", tmp_path / "kept")

    from llmcompressor.modifiers.transform.awq import AWQModifier

    named = AWQModifier(offload_device=torch.device("cpu"))  # a recipe's own choice is kept
    calibrate_module.keep_cached_inputs_with_activations([named])
    assert named.offload_device == torch.device("cpu")


def test_x_t_x_mappings_do_not_walk_the_model(tmp_path, starved_moe, tiny_calib, monkeypatch):
    """Each X^T X mapping (129 per GLM-4.6V layer) costs the same whatever the model's depth: none of them walks the
    model's modules (llm-compressor's calibration_forward_context(model) did, once per mapping: 10 -> 47 ms per
    mapping from 4 to 16 layers, benchmarks/awq_mapping_overhead.py). Counted as calls of the whole model's
    `train` (the context's eval switch) while the searches run."""
    from pipeline.methods.awq_gram import GramAWQModifier

    walks, smoothing = [], []
    train, smooth = torch.nn.Module.train, GramAWQModifier._smooth_from_gram

    def counted_train(module, mode=True):
        if smoothing and type(module).__name__ == "Glm4vMoeForConditionalGeneration":
            walks.append(mode)
        return train(module, mode)

    def counted_smooth(self, model, mapping):
        smoothing.append(mapping.smooth_name)
        try:
            return smooth(self, model, mapping)
        finally:
            smoothing.pop()
    monkeypatch.setattr(torch.nn.Module, "train", counted_train)
    monkeypatch.setattr(GramAWQModifier, "_smooth_from_gram", counted_smooth)
    info = quantize_run(starved_moe, tmp_path / "out", tiny_calib / "calib.jsonl", "awq", batch_size=8, n_grid=3).info
    assert info["search_report"]["gram"]["mappings"] >= 6  # dense up -> down, 4 experts' and the shared expert's
    assert walks == []


@pytest.mark.parametrize("placement", ["device", "offload"])
def test_plan_probe_keeps_the_activations_where_the_run_will(placement, tmp_path, starved_moe, tiny_calib, monkeypatch):
    """`--plan`'s probe and the run ask calibrate.activations_device_for the same question (the activations between
    layers, and AWQ's cached inputs, stay on the GPU when the whole model is there): a probe that left them on the host
    would time ~0.5 s per GLM-4-9B layer of transfers the run does not make. Both calls are recorded here."""
    import pipeline.quantize.calibrate as calibrate_module

    asked, original = [], calibrate_module.activations_device_for

    def recorded(device, on_gpu, offload):
        asked.append(offload)
        return original(device, on_gpu, offload)
    monkeypatch.setattr(calibrate_module, "activations_device_for", recorded)
    settings = dict(batch_size=8, n_grid=3, placement=placement)
    quantize_run(starved_moe, tmp_path / "plan", tiny_calib / "calib.jsonl", "awq", plan_only=True, **settings)
    quantize_run(starved_moe, tmp_path / "run", tiny_calib / "calib.jsonl", "awq", **settings)
    assert asked == [placement == "offload"] * 2
    assert original("cuda:0", True, False) == "cuda:0"
    assert original("cuda:0", True, True) is None and original("cpu", False, False) is None
