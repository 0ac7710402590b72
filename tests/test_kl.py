import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.stages import kl


def rtn_copy(src, dest, bits: int):
    """A crude round-to-nearest per-row copy of every decoder Linear: a deliberately bad variant."""
    shutil.copytree(src, dest)
    weights = load_file(dest / "model.safetensors")
    levels = 2 ** (bits - 1) - 1
    for name, w in weights.items():
        if ".layers." in name and name.endswith("proj.weight"):
            scale = w.float().abs().amax(dim=1, keepdim=True) / levels
            weights[name] = (torch.round(w.float() / scale).clamp(-levels - 1, levels) * scale).to(w.dtype)
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_kl_is_zero_for_a_copy_and_grows_with_damage(tmp_path, tiny_llama, tiny_calib):
    holdout = tiny_calib / "holdout.jsonl"
    copy = kl.run(tiny_llama, shutil.copytree(tiny_llama, tmp_path / "copy"), holdout, tmp_path / "copy.json")
    assert copy.figures["kl_mean"] < 1e-9 and copy.figures["top1_agreement"] == 1.0
    assert copy.figures["tokens"] > 100
    w4 = kl.run(tiny_llama, rtn_copy(tiny_llama, tmp_path / "w4", 4), holdout, tmp_path / "w4.json")
    w2 = kl.run(tiny_llama, rtn_copy(tiny_llama, tmp_path / "w2", 2), holdout, tmp_path / "w2.json")
    assert 0 < w4.figures["kl_mean"] < w2.figures["kl_mean"]
    assert w2.figures["top1_agreement"] < w4.figures["top1_agreement"] <= 1.0
    assert w2.figures["kl_p99"] >= w2.figures["kl_mean"]
    assert json.loads((tmp_path / "w2.json").read_text()) == w2.figures


def test_one_model_at_a_time_gives_the_same_figures(tmp_path, tiny_llama, tiny_calib):
    """When both models do not fit on the GPU, the base's log-probabilities wait in host memory while the
    variant takes its place: the figures are those of both models resident."""
    holdout = tiny_calib / "holdout.jsonl"
    variant = rtn_copy(tiny_llama, tmp_path / "w4", 4)
    both = kl.run(tiny_llama, variant, holdout, tmp_path / "both.json", resident="both", batch_size=3)
    one = kl.run(tiny_llama, variant, holdout, tmp_path / "one.json", resident="one", batch_size=3)
    assert one.figures["models_resident"] == "one" and both.figures["models_resident"] == "both"
    for key in ("tokens", "kl_mean", "kl_p99", "kl_max", "top1_agreement"):
        assert one.figures[key] == both.figures[key], key
    assert kl.checkpoint_dtype(tiny_llama) == "float16"  # what a GPU run would use


def test_kl_writes_every_tokens_value_and_the_summary_is_what_they_give(tmp_path, tiny_llama, tiny_calib):
    """kl.jsonl beside kl.json: one line per sequence, one KL value per scored token (a float32 exactly), the
    tokens whose top-1 agree; recomputed from it (pipeline/verdict/drift.py, float64), the summary's figures agree
    with torch's float32 ones to rounding; float32 leaves no value below 0 by more than a few 1e-7, far inside
    KL_ROUNDING. Peers: torch's quantile on the same values, and the copy's values all exactly 0."""
    from pipeline.formats.kl_lines import KL_ROUNDING, read_kl_lines
    from pipeline.verdict.drift import kl_figures

    holdout = tiny_calib / "holdout.jsonl"
    w4 = kl.run(tiny_llama, rtn_copy(tiny_llama, tmp_path / "w4", 4), holdout, tmp_path / "w4" / "kl.json")
    lines = read_kl_lines(tmp_path / "w4" / "kl.jsonl")
    assert len(lines) == w4.figures["sequences"] and [line["sequence"] for line in lines] == list(range(len(lines)))
    again = kl_figures(lines)
    assert again["tokens"] == w4.figures["tokens"] and again["sequences"] == w4.figures["sequences"]
    for key in ("kl_mean", "kl_p99", "kl_max", "top1_agreement"):
        assert again[key] == pytest.approx(w4.figures[key], rel=1e-5, abs=1e-9), key
    values = torch.tensor([v for line in lines for v in line["kl"]], dtype=torch.float32)
    assert float(torch.quantile(values, 0.99)) == pytest.approx(again["kl_p99"], rel=1e-6)
    assert float(values.min()) > -KL_ROUNDING / 100
    copy = kl.run(tiny_llama, shutil.copytree(tiny_llama, tmp_path / "copy"), holdout, tmp_path / "copy.json")
    assert {v for line in read_kl_lines(tmp_path / "copy.jsonl") for v in line["kl"]} == {0.0}
    assert copy.figures["tokens"] == sum(line["tokens"] for line in read_kl_lines(tmp_path / "copy.jsonl"))


def test_residency_on_a_gpu_both_where_they_fit_and_the_ranking_refused_with_its_figures_where_not(monkeypatch):
    """On the GPU: "auto" is both models where they fit in 90 % of the free memory, else one at a time; --rank needs
    both (and the gradients), so where they do not fit it stops with what it needs and what is free."""
    from pipeline.errors import UserError
    from pipeline.stages import kl as kl_stage

    monkeypatch.setattr(kl_stage, "gpu_free_bytes", lambda: 100 * 2**30)
    needs = {False: 60 * 2**30, True: 95 * 2**30}  # without and with the ranking's gradients
    monkeypatch.setattr(kl_stage, "gpu_bytes_needed", lambda *args: needs[args[-1]])
    args = ("cuda", Path("b"), Path("v"), [[1, 2]], 8, 2)
    assert kl_stage.residency("auto", False, *args) == "both" and kl_stage.residency("one", False, *args) == "one"
    with pytest.raises(UserError, match=r"need ~95 GiB of GPU memory at 8 sequence\(s\) a pass, and 100 GiB is free"):
        kl_stage.residency("auto", True, *args)
    needs[True] = 80 * 2**30
    assert kl_stage.residency("auto", True, *args) == "both" and kl_stage.residency("one", True, *args) == "both"
    needs[False] = 95 * 2**30
    assert kl_stage.residency("auto", False, *args) == "one"
    assert kl_stage.residency("auto", True, "cpu", *args[1:]) == "both"


def test_the_rankings_memory_at_glm4_9b_shapes_lies_between_what_the_h200_showed_and_its_batch_fits(tmp_path,
                                                                                                  monkeypatch):
    """kl --rank on the H200 (GLM-4-9B shapes, 32 x 512 tokens, batch 8, 2026-12-04): out of memory with 76 GiB
    free, done with ~108 GiB free. The estimate falls between the two, and with 77 GiB free the pass halves its
    batch until it fits instead of failing (the sums it takes do not depend on the batch)."""
    import json

    from pipeline.stages import kl as kl_stage

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GlmForCausalLM"], "model_type": "glm", "hidden_size": 4096, "intermediate_size": 13696,
        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2, "vocab_size": 151552,
        "torch_dtype": "bfloat16"}))
    monkeypatch.setattr("pipeline.checkpoints.sizes.checkpoint_weight_bytes", lambda path: 17_500 * 2**20 * 1024 // 1024)
    sequences = [[1] * 512] * 32
    need = kl_stage.gpu_bytes_needed(tmp_path, sequences, 8, 2, gradients=True)
    assert 76 * 2**30 / 0.9 < need < 108 * 2**30 * 0.9, need / 2**30
    assert kl_stage.ranking_batch(tmp_path, sequences, 8, 2, 108 * 2**30) == 8
    smaller = kl_stage.ranking_batch(tmp_path, sequences, 8, 2, 77 * 2**30)
    assert smaller in (2, 4) and kl_stage.gpu_bytes_needed(tmp_path, sequences, smaller, 2, True) < 0.9 * 77 * 2**30
    assert kl_stage.ranking_batch(tmp_path, sequences, 8, 2, 1 * 2**30) == 1  # never below one sequence
