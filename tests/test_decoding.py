"""The hf engine's faster decoding (pipeline/engines/decoding.py) changes speed, not outputs
(up to float noise, which FP8-fake-quantized activations can amplify on long generations)."""

import pytest
import torch
from tiny import save_tiny_glm, tiny_llama_config, tiny_tokenizer

from pipeline.engines import GenRequest
from pipeline.engines.decoding import (GROUPED_SDPA, PreallocatedLayer, preallocated_cache,
                                       use_grouped_attention)
from pipeline.engines import hf as hf_engine
from pipeline.engines.hf import HFEngine

PROMPTS = ["a", "the order arrived broken and", "refund please, my account number is twelve"]


def _llama(attn="sdpa", **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(tiny_llama_config(**overrides), attn_implementation=attn).eval()


def _left_padded():
    tok = tiny_tokenizer()
    tok.padding_side = "left"
    return tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)


def _greedy(model, inputs, cache=None, new=12):
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, past_key_values=cache,
                             pad_token_id=0)
    return out.sequences, torch.stack(out.scores)


def test_grouped_attention_gives_the_stock_logits_for_left_padded_batches():
    model = _llama(num_attention_heads=8, num_key_value_heads=2)  # 4 query heads per KV head
    inputs = _left_padded()
    assert inputs["attention_mask"].min() == 0  # the padded path, where the stock one copies K/V
    tokens, scores = _greedy(model, inputs)

    assert use_grouped_attention(model)
    assert model.config._attn_implementation == GROUPED_SDPA
    grouped_tokens, grouped_scores = _greedy(model, inputs)

    assert torch.equal(grouped_tokens, tokens)
    torch.testing.assert_close(grouped_scores, scores, rtol=1e-5, atol=1e-5)


def test_grouped_attention_leaves_other_attention_alone():
    model = _llama(attn="eager")
    assert not use_grouped_attention(model)
    assert model.config._attn_implementation == "eager"


def test_preallocated_cache_gives_the_same_tokens_writing_in_place():
    model = _llama()
    inputs = _left_padded()
    tokens, scores = _greedy(model, inputs)
    capacity = inputs["input_ids"].shape[1] + 12
    cache = preallocated_cache(model, capacity)
    cached_tokens, cached_scores = _greedy(model, inputs, cache)

    assert torch.equal(cached_tokens, tokens)
    torch.testing.assert_close(cached_scores, scores, rtol=1e-5, atol=1e-5)
    for layer in cache.layers:
        assert layer.get_seq_length() == capacity - 1  # the last token is sampled, never fed back
        assert layer.keys.untyped_storage().data_ptr() == layer.key_buffer.untyped_storage().data_ptr()


def test_preallocated_cache_refuses_to_grow_past_its_capacity():
    layer = PreallocatedLayer(capacity=4)
    layer.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    with pytest.raises(RuntimeError, match="holds 4 tokens, asked for 5"):
        layer.update(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8))


def test_no_preallocated_cache_for_sliding_window_layers():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    assert preallocated_cache(MistralForCausalLM(config), 64) is None
    assert preallocated_cache(_llama(), 64) is not None


def _engine_outputs(model_dir, fast: bool) -> list[tuple[str, int]]:
    engine_class = type("Engine", (HFEngine,), {"fast_decoding": fast})
    engine = engine_class(model_dir, hf_engine.Settings(batch_size=3))
    requests = [GenRequest(prompt=p, max_new_tokens=10) for p in PROMPTS]
    return [(c.text, c.n_tokens) for c in engine.generate(requests)], engine


@pytest.mark.parametrize("variant", ["base", "awq-w4a16"])  # FP8 activations amplify float noise: see README
def test_engine_outputs_are_unchanged_for_base_and_weight_only_variants(variant, tiny_llama, tiny_variants):
    model_dir = tiny_llama if variant == "base" else tiny_variants[variant]
    stock, _ = _engine_outputs(model_dir, fast=False)
    fast, engine = _engine_outputs(model_dir, fast=True)
    assert fast == stock
    assert engine.model.config._attn_implementation == GROUPED_SDPA


def test_fp8_kv_cache_stays_quantized_in_the_preallocated_cache(tiny_variants):
    """compressed-tensors quantizes K/V on their way into whatever cache generate passes."""
    engine = HFEngine(tiny_variants["fp8-w8a8"], hf_engine.Settings(batch_size=3))
    inputs = _left_padded()
    cache = engine._cache(inputs["input_ids"].shape[1] + 6)
    _greedy(engine.model, inputs, cache, new=6)
    for layer, block in zip(cache.layers, engine.model.model.layers):
        for cached, scale in ((layer.keys, block.self_attn.k_scale), (layer.values, block.self_attn.v_scale)):
            assert scale.shape == (cached.shape[1], 1, 1)  # one scale per KV head
            on_grid = (cached / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
            assert torch.equal(on_grid, cached)
            assert cached.abs().max() > 0


def test_glm_engine_outputs_are_unchanged(tmp_path):
    model_dir = save_tiny_glm(tmp_path / "glm", dtype=torch.float32)
    stock, _ = _engine_outputs(model_dir, fast=False)
    fast, engine = _engine_outputs(model_dir, fast=True)
    assert fast == stock
    assert engine.model.config._attn_implementation == GROUPED_SDPA


def test_batches_hold_at_most_max_batch_tokens_of_kv_cache(tiny_llama):
    engine = HFEngine(tiny_llama, hf_engine.Settings(batch_size=4, max_batch_tokens=300))
    words = [40, 5, 38, 6, 39, 7, 120]  # prompt lengths in words (one token each, or more)
    requests = [GenRequest(prompt=" ".join(["refund"] * n), max_new_tokens=20) for n in words]
    lengths = [len(engine.encode(r.prompt)) for r in requests]

    batches = engine.batches(requests)

    assert sorted(i for batch in batches for i in batch) == list(range(len(requests)))  # each once
    assert batches[0] == [words.index(120)]  # alone: past the budget by itself, still run
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert lengths[batch[0]] == longest  # longest first: the batch's padded width
        assert len(batch) <= 4
        assert len(batch) == 1 or len(batch) * (longest + 20) <= 300
    assert [len(b) for b in batches] != [1] * len(requests)  # short prompts do share a batch
    assert engine.generate([]) == []  # a resumed run with nothing left to do
