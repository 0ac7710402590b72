"""ChatGLM remote-code <-> native Glm: exact logits, real shapes on meta, round trip, refusals."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pipeline.checkpoints import chatglm, export, streaming
from pipeline.stages import resave
from pipeline.errors import UserError
from tiny import tiny_tokenizer

# glm-4-9b-chat's config.json as published (THUDM), the key set the export writes back.
GLM4_9B_CHAT = {
    "_name_or_path": "THUDM/glm-4-9b-chat",
    "model_type": "chatglm",
    "architectures": ["ChatGLMModel"],
    "auto_map": {
        "AutoConfig": "configuration_chatglm.ChatGLMConfig",
        "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
        "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
        "AutoModelForSeq2SeqLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
        "AutoModelForSequenceClassification": "modeling_chatglm.ChatGLMForSequenceClassification",
    },
    "add_bias_linear": False, "add_qkv_bias": True, "apply_query_key_layer_scaling": True,
    "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0, "attention_softmax_in_fp32": True,
    "bias_dropout_fusion": True, "ffn_hidden_size": 13696, "fp32_residual_connection": False, "hidden_dropout": 0.0,
    "hidden_size": 4096, "kv_channels": 128, "layernorm_epsilon": 1.5625e-07, "multi_query_attention": True,
    "multi_query_group_num": 2, "num_attention_heads": 32, "num_hidden_layers": 40, "num_layers": 40,
    "rope_ratio": 500, "original_rope": True, "padded_vocab_size": 151552, "post_layer_norm": True, "rmsnorm": True,
    "seq_length": 131072, "use_cache": True, "torch_dtype": "bfloat16", "transformers_version": "4.30.2",
    "tie_word_embeddings": False, "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329,
}


def tiny_config(**overrides) -> dict:
    """glm-4-9b-chat's keys at toy size; kv_channels 16 != hidden 48 / 4 heads, rope_ratio 3.5."""
    tok = tiny_tokenizer()
    config = {**GLM4_9B_CHAT, "hidden_size": 48, "ffn_hidden_size": 40, "kv_channels": 16, "num_attention_heads": 4,
              "multi_query_group_num": 2, "num_layers": 2, "num_hidden_layers": 2, "padded_vocab_size": 400,
              "rope_ratio": 3.5, "seq_length": 256, "layernorm_epsilon": 1e-5,
              "eos_token_id": [tok.eos_token_id, tok.bos_token_id], "pad_token_id": tok.pad_token_id}
    config.update(overrides)
    return config


def random_state(config: dict, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in the ChatGLM layout, from the facts of modeling_chatglm.py (not from chatglm.py)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, d, heads, groups = (config[k] for k in ("hidden_size", "kv_channels", "num_attention_heads",
                                                    "multi_query_group_num"))
    ffn, vocab = config["ffn_hidden_size"], config["padded_vocab_size"]

    def rand(*shape, scale=0.15):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)

    state = {"transformer.embedding.word_embeddings.weight": rand(vocab, hidden, scale=1.0)}
    for i in range(config["num_layers"]):
        p = f"transformer.encoder.layers.{i}."
        state[p + "input_layernorm.weight"] = norm(hidden)
        state[p + "self_attention.query_key_value.weight"] = rand((heads + 2 * groups) * d, hidden)
        if config["add_qkv_bias"]:
            state[p + "self_attention.query_key_value.bias"] = rand((heads + 2 * groups) * d, scale=0.5)
        state[p + "self_attention.dense.weight"] = rand(hidden, heads * d)
        state[p + "post_attention_layernorm.weight"] = norm(hidden)
        state[p + "mlp.dense_h_to_4h.weight"] = rand(2 * ffn, hidden)
        state[p + "mlp.dense_4h_to_h.weight"] = rand(hidden, ffn)
    state["transformer.encoder.final_layernorm.weight"] = norm(hidden)
    state["transformer.output_layer.weight"] = rand(vocab, hidden)
    state["transformer.rotary_pos_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, d // 2, 2).float() / (d // 2))
    return state


# The rotary part of each remote modeling_chatglm.py, as THUDM published it (abridged to that class).
GLM4_ROTARY = """
class RotaryEmbedding(nn.Module):
    def __init__(self, dim, rope_ratio=1, original_impl=False, device=None, dtype=None):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).to(dtype=dtype) / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.dim = dim
        self.original_impl = original_impl
        self.rope_ratio = rope_ratio

    def forward_impl(self, seq_len: int, n_elem: int, dtype: torch.dtype, device: torch.device, base: int = 10000):
        base = base * self.rope_ratio
        theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=torch.float, device=device) / n_elem))
        seq_idx = torch.arange(seq_len, dtype=torch.float, device=device)
        idx_theta = torch.outer(seq_idx, theta).float()
        return torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
"""
CHATGLM2_32K_ROTARY = """
class RotaryEmbedding(nn.Module):
    def __init__(self, dim, rope_ratio=1, original_impl=False, device=None, dtype=None):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).to(dtype=dtype) / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.dim = dim
        self.original_impl = original_impl
        self.rope_ratio = rope_ratio

    def forward_impl(self, seq_len: int, n_elem: int, dtype: torch.dtype, device: torch.device, base: int = 10000):
        theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=dtype, device=device) / n_elem))
        # Create position indexes `[0, 1, ..., seq_len - 1]`
        seq_idx = torch.arange(seq_len, dtype=dtype, device=device) / self.rope_ratio
        idx_theta = torch.outer(seq_idx, theta).float()
        return torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
"""
CHATGLM2_ROTARY = """
class RotaryEmbedding(nn.Module):
    def __init__(self, dim, original_impl=False, device=None, dtype=None):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).to(dtype=dtype) / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.dim = dim

    def forward_impl(self, seq_len: int, n_elem: int, dtype: torch.dtype, device: torch.device, base: int = 10000):
        theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=dtype, device=device) / n_elem))
        seq_idx = torch.arange(seq_len, dtype=dtype, device=device)
        idx_theta = torch.outer(seq_idx, theta).float()
        return torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
"""
# One file doing both (a third-party port switching on a version string): the convention cannot be told.
BOTH_ROTARY = CHATGLM2_32K_ROTARY.replace("        theta = 1.0", "        if self.version == 'v3':\n"
                                          "            base = base * self.rope_ratio\n        theta = 1.0")


def write_chatglm(path, config, state, shards: int = 1, rotary: str | None = GLM4_ROTARY):
    """A ChatGLM remote-code directory: config, safetensors (+ index), remote tokenizer files, and the
    remote modeling_chatglm.py's rotary code (None: no modeling file)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    names = list(state)
    if shards == 1:
        save_file(state, path / "model.safetensors")
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({n: state[n] for n in part}, path / file)
            weight_map.update({n: file for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tiny_tokenizer().save_pretrained(path)
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    tok_config.update(auto_map={"AutoTokenizer": ["tokenization_chatglm.ChatGLM4Tokenizer", None]},
                      tokenizer_class="ChatGLM4Tokenizer")
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "tokenization_chatglm.py").write_text("# THUDM's remote tokenizer would be here\n")
    (path / "configuration_chatglm.py").write_text("# THUDM's remote config would be here\n")
    if rotary is not None:
        (path / "modeling_chatglm.py").write_text("import torch\nfrom torch import nn\n\n" + rotary)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"],
                                                             "pad_token_id": config["pad_token_id"]}))
    return path


# ---------------------------------------------------------------- the reference forward


def reference_logits(state: dict, config: dict, ids: torch.Tensor, rope: str = "base") -> torch.Tensor:
    """ChatGLM2/3 / GLM-4 from the architecture's description, in plain torch (fp32). rope: how the
    remote code applies rope_ratio: "base" (ChatGLM3, GLM-4: base 10000 x rope_ratio), "positions"
    (ChatGLM2-6B-32K: position / rope_ratio, base 10000), "unused" (ChatGLM2-6B: base 10000)."""
    heads, d, groups = config["num_attention_heads"], config["kv_channels"], config.get("multi_query_group_num", 1)
    eps, seq, ratio = config["layernorm_epsilon"], ids.shape[1], config.get("rope_ratio", 1)

    def rms_norm(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rotary(x):  # x [batch, seq, heads, d]: rotate adjacent pairs of the first d/2 dims
        rot = d // 2
        base = 10000 * ratio if rope == "base" else 10000
        positions = torch.arange(seq, dtype=torch.float64) / (ratio if rope == "positions" else 1)
        inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
        angle = positions[:, None] * inv_freq
        cos, sin = angle.cos().float()[:, None, :], angle.sin().float()[:, None, :]
        even, odd = x[..., 0:rot:2], x[..., 1:rot:2]
        rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
        return torch.cat([rotated, x[..., rot:]], dim=-1)

    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    x = state["transformer.embedding.word_embeddings.weight"][ids]
    for i in range(config["num_layers"]):
        p = f"transformer.encoder.layers.{i}."
        h = rms_norm(x, state[p + "input_layernorm.weight"])
        qkv = h @ state[p + "self_attention.query_key_value.weight"].T
        if config["add_qkv_bias"]:
            qkv = qkv + state[p + "self_attention.query_key_value.bias"]
        q, k, v = qkv.split([heads * d, groups * d, groups * d], dim=-1)
        q, k, v = rotary(q.unflatten(-1, (heads, d))), rotary(k.unflatten(-1, (groups, d))), v.unflatten(-1, (groups, d))
        k, v = k.repeat_interleave(heads // groups, dim=2), v.repeat_interleave(heads // groups, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attention = torch.einsum("bhqk,bkhd->bqhd", weights, v).flatten(-2)
        x = x + attention @ state[p + "self_attention.dense.weight"].T
        h = rms_norm(x, state[p + "post_attention_layernorm.weight"])
        gate, up = (h @ state[p + "mlp.dense_h_to_4h.weight"].T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ state[p + "mlp.dense_4h_to_h.weight"].T
    x = rms_norm(x, state["transformer.encoder.final_layernorm.weight"])
    return x @ state["transformer.output_layer.weight"].T


def glm_logits(model_dir, ids):
    from transformers import GlmForCausalLM

    model = GlmForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_converted_glm_matches_the_chatglm_reference(tmp_path, qkv_bias):
    config = tiny_config(add_qkv_bias=qkv_bias)
    state = random_state(config)
    src = write_chatglm(tmp_path / "chatglm", config, state)
    result = resave.run(src, tmp_path / "glm", "float32")
    assert result.source_kind == "chatglm" and result.architecture == "GlmForCausalLM"

    ids = torch.randint(0, config["padded_vocab_size"], (2, 13), generator=torch.Generator().manual_seed(1))
    expected, got = reference_logits(state, config, ids), glm_logits(tmp_path / "glm", ids)
    assert (expected - got).abs().max() < 1e-4
    # The check can fail: rope_theta 10000 (ignoring rope_ratio, as transformers' old script did) is far off.
    wrong = reference_logits(state, {**config, "rope_ratio": 1}, ids)
    assert (wrong - got).abs().max() > 1e-2


ROTARY = {"base": GLM4_ROTARY, "positions": CHATGLM2_32K_ROTARY, "unused": CHATGLM2_ROTARY}


@pytest.mark.parametrize("rope", ["base", "positions", "unused"])
def test_each_rotary_convention_converts_to_the_logits_of_its_own_code(tmp_path, rope):
    """rope_ratio 16 (ChatGLM2-6B-32K's) read three ways by three remote codes; each conversion matches
    the reference forward of its own convention, and the others are far off at 40 positions."""
    config = tiny_config(rope_ratio=16, add_qkv_bias=False)
    state = random_state(config)
    src = write_chatglm(tmp_path / "chatglm", config, state, rotary=ROTARY[rope])
    resave.run(src, tmp_path / "glm", "float32")
    ids = torch.randint(0, config["padded_vocab_size"], (2, 40), generator=torch.Generator().manual_seed(2))
    got = glm_logits(tmp_path / "glm", ids)
    assert (reference_logits(state, config, ids, rope) - got).abs().max() < 1e-4
    for other in set(ROTARY) - {rope}:
        assert (reference_logits(state, config, ids, other) - got).abs().max() > 1e-2, other
    rope_parameters = json.loads((tmp_path / "glm" / "config.json").read_text())["rope_parameters"]
    assert rope_parameters == {"base": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.5},
                               "positions": {"rope_type": "linear", "factor": 16.0, "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.5},
                               "unused": {"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.5}}[rope]


def test_rope_ratio_one_needs_no_code_and_a_missing_group_count_defaults_to_one(tmp_path):
    """The remote ChatGLMConfig defaults multi_query_group_num to 1 (it was a KeyError traceback)."""
    config = tiny_config(rope_ratio=1, multi_query_group_num=1)
    state = random_state(config)
    del config["multi_query_group_num"], config["rope_ratio"]
    src = write_chatglm(tmp_path / "chatglm", config, state, rotary=None)
    resave.run(src, tmp_path / "glm", "float32")
    glm = json.loads((tmp_path / "glm" / "config.json").read_text())
    assert glm["num_key_value_heads"] == 1 and glm["rope_parameters"]["rope_theta"] == 10000.0
    ids = torch.randint(0, config["padded_vocab_size"], (1, 17), generator=torch.Generator().manual_seed(3))
    assert (reference_logits(state, config, ids) - glm_logits(tmp_path / "glm", ids)).abs().max() < 1e-4


@pytest.mark.parametrize("rotary, why", [
    (None, "no modeling_chatglm.py"),
    (BOTH_ROTARY, "applies rope_ratio in a way this converter does not recognise"),
    ("def broken(:\n", "not readable Python"),
])
def test_rope_ratio_whose_convention_cannot_be_told_is_refused(tmp_path, rotary, why):
    config = tiny_config(rope_ratio=16)
    src = write_chatglm(tmp_path / "chatglm", config, random_state(config), rotary=rotary)
    with pytest.raises(UserError) as err:
        resave.run(src, tmp_path / "out", "bfloat16")
    message = str(err.value)
    assert "config.json: rope_ratio 16" in message and why in message and "ChatGLM2-6B-32K divides" in message
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_code_from_another_repository_is_not_guessed(tmp_path):
    config = tiny_config(rope_ratio=16, auto_map={"AutoModelForCausalLM": "THUDM/chatglm2-6b-32k--modeling_chatglm.X"})
    src = write_chatglm(tmp_path / "chatglm", config, random_state(config))  # a local file, but not the one named
    with pytest.raises(UserError, match="no modeling_chatglm.py"):
        resave.run(src, tmp_path / "out", "bfloat16")


def test_tied_embeddings_are_refused_with_the_reason(tmp_path):
    config = tiny_config(tie_word_embeddings=True)
    src = write_chatglm(tmp_path / "chatglm", config, random_state(config))
    with pytest.raises(UserError) as err:
        resave.run(src, tmp_path / "out", "bfloat16")
    assert "tie_word_embeddings is true, but ChatGLM's remote code never ties" in str(err.value)
    assert "transformer.output_layer" in str(err.value) and not (tmp_path / "out").exists()


def test_config_tokenizer_and_files_are_carried(tmp_path):
    config = tiny_config()
    src = write_chatglm(tmp_path / "chatglm", config, random_state(config, torch.bfloat16))
    resave.run(src, tmp_path / "glm", "bfloat16")
    out = tmp_path / "glm"
    glm = json.loads((out / "config.json").read_text())
    assert glm["architectures"] == ["GlmForCausalLM"] and glm["model_type"] == "glm"
    assert glm["rope_parameters"] == {"rope_type": "default", "rope_theta": 35000.0, "partial_rotary_factor": 0.5}
    assert (glm["head_dim"], glm["num_key_value_heads"], glm["vocab_size"]) == (16, 2, 400)
    assert (glm["intermediate_size"], glm["num_hidden_layers"], glm["max_position_embeddings"]) == (40, 2, 256)
    assert glm["eos_token_id"] == config["eos_token_id"] and glm["pad_token_id"] == config["pad_token_id"]
    assert glm["attention_bias"] is True and glm["rms_norm_eps"] == 1e-5
    weights = load_file(out / "model.safetensors")
    assert "transformer.rotary_pos_emb.inv_freq" not in weights and not any("rotary" in n for n in weights)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert (out / "tokenization_chatglm.py").exists() and (out / "generation_config.json").exists()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)  # native: auto_map dropped because tokenizer.json exists
    text = "My order 12 is late, please help!"
    assert tok(text)["input_ids"] == tiny_tokenizer()(text)["input_ids"]
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert json.loads((out / "source.json").read_text())["kind"] == "chatglm"


def test_sharded_source_to_sharded_output(tmp_path):
    config = tiny_config()
    state = random_state(config)
    src = write_chatglm(tmp_path / "chatglm", config, state, shards=3)
    single = tmp_path / "single"
    resave.run(src, single, "float32")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    chatglm.convert(src, sharded, "float32", max_shard_bytes=100_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((sharded / f).stat().st_size <= 100_000 + 4096 for f in files)
    merged = {k: v for f in files for k, v in load_file(sharded / f).items()}
    reference = load_file(single / "model.safetensors")
    assert merged.keys() == reference.keys() and all(torch.equal(merged[k], reference[k]) for k in merged)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in reference.values())
    ids = torch.arange(10)[None]
    assert torch.equal(glm_logits(sharded, ids), glm_logits(single, ids))


def test_glm4_9b_chat_real_shapes_convert_on_meta():
    from transformers import GlmForCausalLM
    from transformers.models.glm.modeling_glm import GlmRotaryEmbedding

    config = dict(GLM4_9B_CHAT)
    # The published tensor shapes of glm-4-9b-chat, written out from the layout's description.
    meta = {"transformer.embedding.word_embeddings.weight": (151552, 4096),
            "transformer.encoder.final_layernorm.weight": (4096,),
            "transformer.output_layer.weight": (151552, 4096),
            "transformer.rotary_pos_emb.inv_freq": (32,)}
    for i in range(40):
        p = f"transformer.encoder.layers.{i}."
        meta.update({p + "input_layernorm.weight": (4096,), p + "post_attention_layernorm.weight": (4096,),
                     p + "self_attention.query_key_value.weight": (4608, 4096),
                     p + "self_attention.query_key_value.bias": (4608,),
                     p + "self_attention.dense.weight": (4096, 4096),
                     p + "mlp.dense_h_to_4h.weight": (27392, 4096), p + "mlp.dense_4h_to_h.weight": (4096, 13696)})
    source = streaming.DictSource({n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in meta.items()})
    plan = chatglm.plan_to_glm(config, source, torch.bfloat16)
    converted = streaming.materialize(plan, source)
    assert converted["model.layers.0.self_attn.q_proj.weight"].shape == (4096, 4096)
    assert converted["model.layers.0.self_attn.k_proj.weight"].shape == (256, 4096)
    assert converted["model.layers.39.self_attn.v_proj.bias"].shape == (256,)

    glm_config = chatglm.glm_config_from_chatglm(config, "bfloat16")
    with torch.device("meta"):
        model = GlmForCausalLM(glm_config)
    model.load_state_dict(converted, strict=True, assign=True)  # every name and shape, nothing left over
    assert 9.3e9 < sum(t.numel() for t in converted.values()) < 9.5e9
    inv_freq, _ = GlmRotaryEmbedding.compute_default_rope_parameters(glm_config)
    assert torch.allclose(inv_freq, 1.0 / 5_000_000 ** (torch.arange(0, 64, 2).float() / 64))


# ---------------------------------------------------------------- export for lmdeploy


def test_round_trip_chatglm_glm_chatglm_is_bit_identical(tmp_path):
    config = tiny_config()
    state = random_state(config, torch.bfloat16, seed=3)
    src = write_chatglm(tmp_path / "chatglm", config, state, shards=2)
    resave.run(src, tmp_path / "glm", "bfloat16")
    result = export.run(tmp_path / "glm", tmp_path / "lmdeploy", engine="lmdeploy", max_shard_bytes=60_000)
    out = tmp_path / "lmdeploy"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    back = {k: v for f in set(index["weight_map"].values()) for k, v in load_file(out / f).items()}
    del state["transformer.rotary_pos_emb.inv_freq"]  # the unused buffer is dropped on the way in
    assert back.keys() == state.keys()
    for name in state:
        assert back[name].dtype == state[name].dtype and torch.equal(back[name], state[name]), name
    written = json.loads((out / "config.json").read_text())
    ignore = {"_name_or_path", "transformers_version"}
    assert {k: v for k, v in written.items() if k not in ignore} == {k: v for k, v in config.items() if k not in ignore}
    assert (out / "configuration_chatglm.py").read_text() == (src / "configuration_chatglm.py").read_text()
    assert result.architecture == "ChatGLMForConditionalGeneration" and "export: wrote" in result.summary()


def test_export_of_a_transformers_glm_loads_as_chatglm_and_comes_back(tmp_path):
    from transformers import AutoConfig, GlmConfig, GlmForCausalLM

    torch.manual_seed(0)
    glm_config = GlmConfig(vocab_size=400, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                           rope_parameters={"rope_type": "default", "rope_theta": 25000.0, "partial_rotary_factor": 0.5},
                           eos_token_id=[2, 3], pad_token_id=0)
    GlmForCausalLM(glm_config).to(torch.bfloat16).save_pretrained(tmp_path / "glm")
    tiny_tokenizer().save_pretrained(tmp_path / "glm")
    export.run(tmp_path / "glm", tmp_path / "lmdeploy")

    loaded = AutoConfig.from_pretrained(tmp_path / "lmdeploy", trust_remote_code=True)  # what lmdeploy does
    assert loaded.model_type == "chatglm" and loaded.auto_map["AutoModelForCausalLM"].endswith("ChatGLMForConditionalGeneration")
    assert (loaded.num_layers, loaded.kv_channels, loaded.multi_query_group_num, loaded.padded_vocab_size) == (2, 16, 2, 400)
    assert loaded.rope_ratio == 2.5 and loaded.add_qkv_bias is True and loaded.eos_token_id == [2, 3]
    exported = load_file(tmp_path / "lmdeploy" / "model.safetensors")
    original = load_file(tmp_path / "glm" / "model.safetensors")
    qkv = exported["transformer.encoder.layers.1.self_attention.query_key_value.weight"]
    assert torch.equal(qkv, torch.cat([original[f"model.layers.1.self_attn.{h}_proj.weight"] for h in "qkv"]))

    resave.run(tmp_path / "lmdeploy", tmp_path / "again", "bfloat16")  # Glm -> ChatGLM -> Glm
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert again.keys() == original.keys() and all(torch.equal(again[k], original[k]) for k in original)


@pytest.mark.parametrize("case, expected", [
    ("llama", "needs no export"),
    ("chatglm", "already in the ChatGLM remote-code layout"),
    ("engine", "supported engines: lmdeploy"),
    ("quantized", "converts AWQ W4A16 variants"),
])
def test_export_refusals(tmp_path, tiny_llama, case, expected):
    model_dir, engine = tiny_llama, "lmdeploy"
    if case == "chatglm":
        model_dir = write_chatglm(tmp_path / "chatglm", tiny_config(), random_state(tiny_config()))
    if case == "quantized":
        model_dir = tmp_path / "awq"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps({"model_type": "glm", "architectures": ["GlmForCausalLM"],
                                                           "quantization_config": {"quant_method": "compressed-tensors"}}))
    if case == "engine":
        engine = "vllm"
    with pytest.raises(UserError, match=expected):
        export.run(model_dir, tmp_path / "out", engine=engine)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- refusals and bad input


def _vision_in_config(path):
    config = tiny_config(vision_config={"hidden_size": 32, "num_hidden_layers": 1, "image_size": 28})
    return write_chatglm(path, config, random_state(tiny_config()))


def _vision_in_weights(path):
    state = random_state(tiny_config())
    state["transformer.vision.patch_embedding.proj.weight"] = torch.zeros(32, 3, 14, 14)
    return write_chatglm(path, tiny_config(), state)


def _missing_shard(path):
    src = write_chatglm(path, tiny_config(), random_state(tiny_config()), shards=2)
    (src / "model-00002-of-00002.safetensors").unlink()
    return src


def _config_lies_about_kv_channels(path):
    src = write_chatglm(path, tiny_config(), random_state(tiny_config()))
    (src / "config.json").write_text(json.dumps(tiny_config(kv_channels=12)))
    return src


def _config_lies_about_layers(path):
    src = write_chatglm(path, tiny_config(), random_state(tiny_config()))
    (src / "config.json").write_text(json.dumps(tiny_config(num_layers=3)))
    return src


def _truncated(path):
    src = write_chatglm(path, tiny_config(), random_state(tiny_config()))
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    return src


def _bin_only(path):
    src = write_chatglm(path, tiny_config(), random_state(tiny_config()))
    torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    return src


def _first_generation(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "chatglm", "architectures": ["ChatGLMModel"],
                                                  "hidden_size": 4096, "inner_hidden_size": 16384,
                                                  "position_encoding_2d": True, "vocab_size": 130528}))
    return path


def _not_multi_query(path):
    return write_chatglm(path, tiny_config(multi_query_attention=False), random_state(tiny_config()))


def _gguf_of_chatglm(path):
    import gguf
    import numpy as np

    path.mkdir()
    writer = gguf.GGUFWriter(str(path / "glm-4-9b-chat.Q8_0.gguf"), "chatglm")
    writer.add_name("glm-4-9b-chat")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path / "glm-4-9b-chat.Q8_0.gguf"


def _truncated_gguf(path):
    from tiny import save_tiny_llama, write_tiny_gguf

    gguf_file = write_tiny_gguf(save_tiny_llama(path / "hf", dtype=torch.float32), path / "tiny.gguf")
    data = gguf_file.read_bytes()
    gguf_file.write_bytes(data[: len(data) // 3])
    return gguf_file


@pytest.mark.parametrize("make, expected", [
    (_vision_in_config, ["config.json", "GLM-4V-9B vision", "Supported:"]),
    (_vision_in_weights, ["model.safetensors", "transformer.vision.patch_embedding.proj.weight", "not converted"]),
    (_missing_shard, ["model.safetensors.index.json", "model-00002-of-00002.safetensors", "missing"]),
    (_config_lies_about_kv_channels, ["model.safetensors", "layers.0.self_attention.query_key_value.weight",
                                      "[128, 48]", "[96, 48]", "config does not match"]),
    (_config_lies_about_layers, ["no tensor transformer.encoder.layers.2.input_layernorm.weight", "config.json"]),
    (_truncated, ["model.safetensors", "truncated or corrupt"]),
    (_bin_only, ["only PyTorch .bin weights"]),
    (_first_generation, ["config.json", "first-generation ChatGLM-6B"]),
    (_not_multi_query, ["config.json", "multi_query_attention is false"]),
    (_gguf_of_chatglm, ["glm-4-9b-chat.Q8_0.gguf", "architecture chatglm is not supported", "llama"]),
    (_truncated_gguf, ["tiny.gguf", "truncated or corrupt"]),
])
def test_bad_input_is_refused_clearly_and_leaves_nothing(tmp_path, make, expected):
    source = make(tmp_path / "src")
    with pytest.raises(UserError) as err:
        resave.run(source, tmp_path / "out", "bfloat16")
    for part in expected:
        assert part in str(err.value), str(err.value)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_refusal_keeps_an_existing_output(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("previous run")
    with pytest.raises(UserError):
        resave.run(_truncated(tmp_path / "src"), tmp_path / "out", "bfloat16")
    assert (tmp_path / "out" / "keep.txt").read_text() == "previous run"
