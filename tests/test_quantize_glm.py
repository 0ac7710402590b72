"""AWQ and FP8 on tiny random models of each GLM architecture: exactly the intended Linears are
smoothed and quantized, the vision tower, lm_head and MoE router are left bit-identical, and
every variant reloads and generates."""

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import read_tensors

from pipeline.errors import UserError
from pipeline.quantize import plan, verify
from pipeline.stages.quantize import run as quantize_run
from tiny import save_tiny_glm, save_tiny_glm4, save_tiny_glm4v, save_tiny_glm4v_moe

LAYERS = 2
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
EXPERTS = 4


@dataclass(frozen=True)
class Arch:
    name: str
    build: object
    prefix: str  # of the decoder layers
    vision: bool = False
    moe: bool = False

    def layer(self, i: int) -> str:
        return f"{self.prefix}.{i}"


ARCHS = {
    "Glm": Arch("GlmForCausalLM", save_tiny_glm, "model.layers"),
    "Glm4": Arch("Glm4ForCausalLM", save_tiny_glm4, "model.layers"),
    "Glm4v": Arch("Glm4vForConditionalGeneration", save_tiny_glm4v, "model.language_model.layers", vision=True),
    "Glm4vMoe": Arch("Glm4vMoeForConditionalGeneration", save_tiny_glm4v_moe, "model.language_model.layers",
                     vision=True, moe=True),
}


def intended_linears(arch: Arch) -> set[str]:
    """Every text-tower projection; for the MoE, layer 0 is dense and layer 1 has routed experts."""
    names = {f"{arch.layer(i)}.{m}" for i in range(LAYERS) for m in ATTENTION}
    if not arch.moe:
        return names | {f"{arch.layer(i)}.mlp.{m}" for i in range(LAYERS) for m in ("gate_up_proj", "down_proj")}
    mlp = ("gate_proj", "up_proj", "down_proj")
    names |= {f"{arch.layer(0)}.mlp.{m}" for m in mlp}
    names |= {f"{arch.layer(1)}.mlp.experts.{e}.{m}" for e in range(EXPERTS) for m in mlp}
    return names | {f"{arch.layer(1)}.mlp.shared_experts.{m}" for m in mlp}


def intended_smoothing(arch: Arch) -> dict[str, list[str]]:
    """smooth layer -> balance layers. v_proj -> o_proj is absent: under GQA v_proj is narrower
    than o_proj's input and llm-compressor skips it (as for every GLM release)."""
    qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    mappings = {}
    for i in range(LAYERS):
        at = arch.layer(i)
        mappings[f"{at}.input_layernorm"] = [f"{at}.{m}" for m in qkv]
        if not arch.moe:
            mappings[f"{at}.post_attention_layernorm"] = [f"{at}.mlp.gate_up_proj"]
            mappings[f"{at}.mlp.gate_up_proj"] = [f"{at}.mlp.down_proj"]
    if arch.moe:  # dense layer 0 in full; in MoE layer 1 the norm also feeds the router: not smoothed
        at = arch.layer(0)
        mappings[f"{at}.post_attention_layernorm"] = [f"{at}.mlp.gate_proj", f"{at}.mlp.up_proj"]
        mappings[f"{at}.mlp.up_proj"] = [f"{at}.mlp.down_proj"]
        for expert in [f"experts.{e}" for e in range(EXPERTS)] + ["shared_experts"]:
            mappings[f"{arch.layer(1)}.mlp.{expert}.up_proj"] = [f"{arch.layer(1)}.mlp.{expert}.down_proj"]
    return mappings


@dataclass
class Smoothed:
    balance: list[str]
    before: torch.Tensor
    after: torch.Tensor


@contextlib.contextmanager
def recording_smoothing(records: dict[str, Smoothed]):
    """Spies on the real AWQ smoothing step (our GramAWQModifier's, which hands the mappings it does
    not score from X^T X to llm-compressor's own): for every mapping smoothed, keeps the resolved
    balance layers and the smooth layer's weight before and after the step."""
    from pipeline.methods.awq_gram import GramAWQModifier

    original = GramAWQModifier._apply_smoothing

    def spy(self, model):
        due = [m for m in self._all_mappings if m.smooth_name in self._smooth_activation_stats]
        before = {m.smooth_name: m.smooth_layer.weight.detach().clone() for m in due}
        original(self, model)
        for m in due:
            after = m.smooth_layer.weight.detach().clone()
            records[m.smooth_name] = Smoothed(m.balance_names, before[m.smooth_name], after)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GramAWQModifier, "_apply_smoothing", spy)
        yield


@dataclass
class Built:
    arch: Arch
    base: Path
    awq: Path
    fp8: Path
    smoothing: dict[str, Smoothed]


@pytest.fixture(scope="module", params=list(ARCHS))
def built(request, tmp_path_factory, tiny_calib) -> Built:
    arch = ARCHS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    base = arch.build(root / "base")
    calib = tiny_calib / "calib.jsonl"  # same tokenizer as the tiny GLMs
    smoothing: dict[str, Smoothed] = {}
    with recording_smoothing(smoothing):
        quantize_run(base, root / "awq", calib, "awq", batch_size=8, n_grid=4)
    quantize_run(base, root / "fp8", calib, "fp8")
    return Built(arch, base, root / "awq", root / "fp8", smoothing)


tensors = read_tensors


def untouched_keys(arch: Arch, base: dict) -> list[str]:
    """lm_head, embeddings, final norm, every vision-tower tensor, the router, and the norms AWQ
    must not smooth (Glm4's sandwich norms feed no Linear; the MoE layer's norm feeds the router)."""
    keep = [k for k in base if k.startswith("lm_head.") or "visual" in k or ".mlp.gate." in k
            or "embed_tokens" in k or re.search(r"(post_self_attn_layernorm|post_mlp_layernorm|\.norm)\.weight$", k)]
    if arch.moe:
        keep.append(f"{arch.layer(1)}.post_attention_layernorm.weight")
    return keep


def test_awq_quantizes_exactly_the_text_tower_linears(built):
    weights = tensors(built.awq)
    packed = {k.removesuffix(".weight_packed") for k in weights if k.endswith(".weight_packed")}
    assert packed == intended_linears(built.arch)
    info = json.loads((built.awq / "quant.json").read_text())
    assert info["architecture"] == built.arch.name
    assert info["verify"]["plan"] == {"planned": len(packed), "quantized": len(packed), "matches": True}
    assert info["group_size"] == (32 if built.arch.moe else 64)  # auto: moe_intermediate_size 32, hidden 64
    assert info["symmetric"] is False and all(f"{m}.weight_zero_point" in weights for m in packed)


def test_awq_leaves_lm_head_vision_and_router_bit_identical(built):
    base, variant = tensors(built.base), tensors(built.awq)
    keep = untouched_keys(built.arch, base)
    assert "lm_head.weight" in keep and f"{built.arch.prefix.removesuffix('layers')}norm.weight" in keep
    if built.arch.vision:
        assert sum("visual" in k for k in keep) >= 20  # the whole tiny vision tower
    if built.arch.moe:
        assert f"{built.arch.layer(1)}.mlp.gate.weight" in keep
        assert f"{built.arch.layer(1)}.mlp.gate.e_score_correction_bias" in keep
    changed = [k for k in keep if not torch.equal(base[k], variant[k])]
    assert changed == []
    if built.arch.vision:  # the image processor travels with the variant
        processor = "preprocessor_config.json"
        assert (built.awq / processor).read_bytes() == (built.base / processor).read_bytes()
    info = json.loads((built.awq / "quant.json").read_text())
    assert info["verify"]["vision"]["mismatched"] == []
    if built.arch.vision:  # what the tower is kept in, as stored (the tiny models are saved in float16)
        assert info["verify"]["vision"]["dtypes"] == ["F16"] and base[next(k for k in keep if "visual" in k)].dtype == torch.float16


def _row_scales(before: torch.Tensor, after: torch.Tensor, column_scale: torch.Tensor) -> torch.Tensor:
    """AWQ turns a smooth Linear's weight W into diag(1/s) W (times its balance column scale, if
    it is also a balance layer): recover s per output row, checking that form holds."""
    expected = before * column_scale
    s = expected.norm(dim=1) / after.norm(dim=1)
    assert torch.allclose(after, expected / s[:, None], rtol=1e-4, atol=1e-7)
    return s


def test_awq_smoothed_every_intended_mapping(built):
    records = built.smoothing
    intended = intended_smoothing(built.arch)
    assert {name: sorted(r.balance) for name, r in records.items()} == {k: sorted(v) for k, v in intended.items()}
    norm_scale = {name: r.before / r.after for name, r in records.items() if r.before.ndim == 1}
    rescaled = {}  # kind of smooth layer -> whether some instance got scales other than 1
    for name, record in records.items():
        if record.before.ndim == 1:  # a norm: divided by the scales
            s = norm_scale[name]
        else:
            fed_by = [norm for norm, r in records.items() if name in r.balance]
            column_scale = norm_scale[fed_by[0]] if fed_by else torch.ones(record.before.shape[1])
            s = _row_scales(record.before, record.after, column_scale)
        if name.endswith("gate_up_proj"):  # fused [gate; up]: only the up half, which feeds down_proj
            half = s.numel() // 2
            assert torch.allclose(s[:half], torch.ones(half), atol=1e-5), name
            s = s[half:]
        kind = name.rsplit(".", 1)[-1]
        # the grid search may keep the identity for one layer or expert, not for all of a kind
        rescaled[kind] = rescaled.get(kind, False) or bool((s - 1).abs().max() > 1e-3)
    assert rescaled == dict.fromkeys(rescaled, True) and len(rescaled) == 3


@pytest.mark.parametrize("built", ["Glm4v", "Glm4vMoe"], indirect=True)
def test_mappings_match_text_modules_only(built):
    """Text-only calibration never runs the vision tower, so AWQ would not smooth it anyway: the
    patterns themselves must exclude it, for calibration sets that carry images."""
    from pipeline.methods.awq_mappings import mappings_for
    from pipeline.checkpoints.loading import load_model

    names = [name for name, _ in load_model(built.base, torch.float32).named_modules()]
    assert any("visual" in name and name.endswith("mlp.up_proj") for name in names)
    config = json.loads((built.base / "config.json").read_text())
    for mapping in mappings_for(built.arch.name, config):
        for pattern in (mapping.smooth_layer, *mapping.balance_layers):
            matched = [name for name in names if plan.matches(name, pattern)]
            assert matched and not [name for name in matched if "visual" in name], pattern


def test_fp8_has_per_head_kv_scales_and_leaves_the_rest(built):
    base, weights = tensors(built.base), tensors(built.fp8)
    for i in range(LAYERS):
        for kind in ("k_scale", "v_scale"):
            assert weights[f"{built.arch.layer(i)}.self_attn.{kind}"].shape == (2, 1, 1)  # num_key_value_heads
    fp8_weights = {k.removesuffix(".weight") for k, v in weights.items() if v.dtype == torch.float8_e4m3fn}
    assert fp8_weights == intended_linears(built.arch)
    assert [k for k in untouched_keys(built.arch, base) if not torch.equal(base[k], weights[k])] == []
    config = json.loads((built.fp8 / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"


@pytest.mark.parametrize("method", ["awq", "fp8"])
def test_variant_reloads_generates_and_reports_layer_errors(built, method):
    from transformers import AutoTokenizer

    from pipeline.checkpoints.loading import load_for_inference

    out = getattr(built, method)
    model = load_for_inference(out, torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("My order is late", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 3
    info = json.loads((out / "quant.json").read_text())
    error = info["verify"]["layer_error"]
    assert len(error["relative"]) == LAYERS and error["blocks_from"] == "holdout" and error["blocks"] == 2
    assert all(0 < e < 0.5 for e in error["relative"])  # quantized, and not broken
    assert info["verify"]["reloads"] and info["size_bytes"] < info["base_size_bytes"]
    assert info["calibration"]["tokens"] == 8 * 64 and info["peak_rss_bytes"] > 0


@pytest.mark.parametrize("built", ["Glm4vMoe"], indirect=True)
def test_moe_experts_reload_with_their_zero_points(built):
    """transformers' fused-experts decompression drops int4 zero points; loaded as one Linear per
    expert, each expert's weight is exactly (code - zero point) x scale."""
    from pipeline.checkpoints.loading import load_for_inference

    name = f"{built.arch.layer(1)}.mlp.experts.2.down_proj"
    weights = tensors(built.awq)
    packed, scale, zero = (weights[f"{name}.{k}"] for k in ("weight_packed", "weight_scale", "weight_zero_point"))
    rows, cols = weights[f"{name}.weight_shape"].tolist()
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(rows, -1)[:, :cols].float()
    zeros = ((zero.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF).reshape(rows, -1).float()
    expected = (codes - zeros.repeat_interleave(32, dim=1)) * scale.float().repeat_interleave(32, dim=1)
    loaded = load_for_inference(built.awq, torch.float32).get_submodule(name).weight.detach()
    assert torch.allclose(loaded, expected, atol=1e-3)
    assert zeros.unique().numel() > 1  # asymmetric: the zero points matter


def test_without_gqa_v_proj_is_smoothed_into_o_proj(tmp_path, tiny_calib):
    base = save_tiny_glm(tmp_path / "base", num_key_value_heads=4)
    records: dict[str, Smoothed] = {}
    with recording_smoothing(records):
        quantize_run(base, tmp_path / "awq", tiny_calib / "calib.jsonl", "awq", batch_size=8, n_grid=4)
    rescaled = []
    for i in range(LAYERS):
        record = records[f"model.layers.{i}.self_attn.v_proj"]
        assert record.balance == [f"model.layers.{i}.self_attn.o_proj"]
        norm = records[f"model.layers.{i}.input_layernorm"]  # v_proj is also its balance layer
        s = _row_scales(record.before, record.after, norm.before / norm.after)
        rescaled.append(bool((s - 1).abs().max() > 1e-3))
    assert any(rescaled)


def test_layer_error_of_an_unchanged_model_is_zero(tmp_path, tiny_calib):
    from pipeline.stages.calib import read_blocks
    from pipeline.checkpoints.loading import load_model

    model = load_model(save_tiny_glm4v(tmp_path / "m"), torch.float32)
    reference = verify.capture_layer_io(model, read_blocks(tiny_calib / "calib.jsonl")[:1])
    assert [r.name for r in reference] == [f"model.language_model.layers.{i}" for i in range(LAYERS)]
    assert verify.layer_errors(model, reference) == [0.0] * LAYERS
    with torch.no_grad():
        model.get_submodule("model.language_model.layers.1.mlp.down_proj").weight.mul_(1.1)
    errors = verify.layer_errors(model, reference)
    assert errors[0] == 0.0 and errors[1] > 0


@pytest.mark.parametrize("built", ["Glm4v"], indirect=True)
def test_a_quantized_set_that_differs_from_the_plan_is_refused(built):
    expected = sorted(intended_linears(built.arch))
    quantized = {name: "Linear" for name in expected}
    with pytest.raises(UserError, match=r"planned but not quantized in memory: .*layers\.0\.mlp\.extra"):
        verify.check_plan(built.awq, [*expected, "model.language_model.layers.0.mlp.extra"], quantized)
    with pytest.raises(UserError, match=r"quantized in the checkpoint but not planned: .*layers\.1\.mlp\.down_proj"):
        verify.check_plan(built.awq, [n for n in expected if not n.endswith("layers.1.mlp.down_proj")],
                          {n: "Linear" for n in expected if not n.endswith("layers.1.mlp.down_proj")})


FALLBACK = "calibration (no holdout.jsonl beside the blocks)"


def test_layer_check_uses_holdout_conversations_else_the_last_calibration_blocks():
    from pipeline.stages.quantize import check_blocks
    from tiny import tiny_tokenizer

    blocks = [[1] * 8, [2] * 8, [3] * 8]
    assert check_blocks([], tiny_tokenizer(), blocks) == (blocks[1:], FALLBACK)
    held = [{"messages": [{"role": "user", "content": "Where is my order? It is late."}], "reference": "Let me check."}]
    probe, source = check_blocks(held * 4, tiny_tokenizer(), blocks)
    assert source == "holdout" and len(probe) == 2 and all(len(b) == 8 for b in probe) and probe != blocks[1:]


def _config_only(tmp_path, config: dict):
    """A checkpoint dir with a config.json and no weights: any refusal must come before loading."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    return tmp_path / "m"


def test_moe_whose_experts_cannot_be_linearized_is_refused_before_loading(tmp_path, tiny_calib):
    model_dir = _config_only(tmp_path, {
        "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
        "text_config": {"num_experts": 8, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4},
    })
    from pipeline import methods

    for method in methods.METHODS:  # every registered method: the check is the stage's, before any recipe runs
        with pytest.raises(UserError, match=r"Qwen3VLMoeForConditionalGeneration keeps its 8 routed experts as fused"):
            quantize_run(model_dir, tmp_path / "out", tiny_calib / "calib.jsonl", method.NAME)
    assert not (tmp_path / "out").exists()


def test_unknown_model_type_is_refused_before_loading(tmp_path, tiny_calib):
    model_dir = _config_only(tmp_path, {"architectures": ["MysteryForCausalLM"], "model_type": "mystery"})
    with pytest.raises(UserError, match=r"transformers does not know model_type 'mystery' \(MysteryForCausalLM\)"):
        quantize_run(model_dir, tmp_path / "out", tiny_calib / "calib.jsonl", "fp8")


@pytest.mark.parametrize("text_type, written_as", [("glm4v_text", "Glm4vForConditionalGeneration"),
                                                   ("glm4v_moe_text", "Glm4vMoeForConditionalGeneration")])
def test_transformers_glm46v_type_is_refused_before_loading_with_the_resave_that_fixes_it(tmp_path, tiny_calib,
                                                                                        text_type, written_as):
    """No engine we serve with has a model for Glm46VForConditionalGeneration (vLLM 0.24, lmdeploy 0.18): its variants
    would be checked against names no engine uses and served nowhere; `quantize resave` writes the same model in the
    layout GLM-4.6V's releases carry (tests/test_resave.py), which every method quantizes."""
    model_dir = _config_only(tmp_path, {"architectures": ["Glm46VForConditionalGeneration"], "model_type": "glm46v",
                                        "text_config": {"model_type": text_type, "n_routed_experts": 4}})
    with pytest.raises(UserError, match=rf"Glm46VForConditionalGeneration \(model_type glm46v\): no engine .* the same "
                                        rf"model as a {written_as}.*`quantize resave {model_dir} --out DIR`"):
        quantize_run(model_dir, tmp_path / "out", tiny_calib / "calib.jsonl", "fp8")
    assert not (tmp_path / "out").exists()


def test_glm_group_size_that_does_not_divide_is_refused_before_loading(tmp_path, tiny_calib):
    base = save_tiny_glm4v_moe(tmp_path / "base")
    (base / "model.safetensors").unlink()  # nothing to load: the check must come first
    with pytest.raises(UserError, match=r"64 does not divide 32 \(MoE intermediate size of .*\); use 32"):
        quantize_run(base, tmp_path / "out", tiny_calib / "calib.jsonl", "awq", group_size=64)
