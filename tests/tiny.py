"""Tiny random models and tokenizers built in code: the tests never download anything."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = Path(__file__).resolve().parent.parent / "calib_data" / "support_logs.jsonl"


@lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    from tokenizers import ByteLevelBPETokenizer

    texts = []
    for line in CORPUS.read_text(encoding="utf-8").splitlines()[:200]:
        texts.extend(turn["content"] for turn in json.loads(line)["turns"])
    texts.append("Solve this math problem. Think step by step. Answer: 0 1 2 3 4 5 6 7 8 9")
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts, vocab_size=384, min_frequency=2, special_tokens=SPECIAL, show_progress=False)
    return tokenizer._tokenizer.to_str()


def tiny_tokenizer():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>",
    )
    tok.chat_template = CHATML
    return tok


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    tok = tiny_tokenizer()
    settings = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def save_tiny_llama(path: Path, seed: int = 0, dtype=torch.float16, **overrides) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).to(dtype)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return Path(path)


# ---------------------------------------------------------------- GGUF

def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary layout for q/k (convert_hf_to_gguf.py); transformers undoes it on load."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_tiny_gguf(model_dir: Path, gguf_path: Path) -> Path:
    """Writes the HF Llama at model_dir as a float32 GGUF with a gpt2-style tokenizer."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    tensors = {k: v.float().numpy() for k, v in load_file(model_dir / "model.safetensors").items()}
    tok = json.loads(_trained_tokenizer_json())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    writer = gguf.GGUFWriter(str(gguf_path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL else gguf.TokenType.NORMAL for t, _ in vocab])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_chat_template(CHATML)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for name, array in tensors.items():
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            if module == "self_attn.q_proj":
                array = _permute(array, config.num_attention_heads)
            elif module == "self_attn.k_proj":
                array = _permute(array, config.num_key_value_heads)
            gguf_name = f"blk.{index}.{per_layer[module]}.weight"
        else:
            gguf_name = names[name]
        writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


# ---------------------------------------------------------------- GLM family

def _glm_text_settings(tok, **overrides) -> dict:
    """GLM-4-9B's shape, shrunk: GQA (4 query heads, 2 KV heads), head_dim 16, half the head rotary."""
    settings = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    settings.update(overrides)
    return settings


def _tiny_vision_settings(out_hidden_size: int) -> dict:
    return dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=out_hidden_size,
                patch_size=2, image_size=8, spatial_merge_size=2, temporal_patch_size=2)


def _randomize_norms(model) -> None:
    """Random-init RMSNorm weights are all ones; real ones are not, and AWQ's smoothing is only
    visible when the channels it rescales differ."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") and param.ndim == 1:
            param.data = torch.exp(0.5 * torch.randn_like(param, dtype=torch.float32)).to(param.dtype)


def _save_tiny(model, path: Path, dtype) -> Path:
    tok = tiny_tokenizer()
    model = model.to(dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


def save_tiny_glm(path: Path, seed: int = 0, dtype=torch.float16, **overrides) -> Path:
    """GlmForCausalLM (GLM-4-9B layout): pre-norm blocks, fused gate_up_proj, q/k/v bias."""
    from transformers import GlmConfig, GlmForCausalLM

    torch.manual_seed(seed)
    model = GlmForCausalLM(GlmConfig(**_glm_text_settings(tiny_tokenizer(), **overrides)))
    _randomize_norms(model)
    return _save_tiny(model, path, dtype)


def save_tiny_glm4(path: Path, seed: int = 0, dtype=torch.float16, **overrides) -> Path:
    """Glm4ForCausalLM (GLM-4-0414 layout): Glm plus sandwich norms after attention and MLP."""
    from transformers import Glm4Config, Glm4ForCausalLM

    torch.manual_seed(seed)
    model = Glm4ForCausalLM(Glm4Config(**_glm_text_settings(tiny_tokenizer(), **overrides)))
    _randomize_norms(model)
    return _save_tiny(model, path, dtype)


# GLM-4.1V's 3-D (temporal, height, width) rotary over half of each head: [8, 12, 12] of 128 / 4
# frequencies there, [2, 1, 1] of the tiny head_dim 16 / 4 here.
_GLM4V_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}


def _save_image_processor(path: Path) -> None:
    """GLM-4.1V's preprocessor_config.json, matched to the tiny vision tower (2-pixel patches).
    Written with the PIL image processor: the default one, like the video processor, needs
    torchvision, which the tests do without (the pipeline calibrates on text with the tokenizer)."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    Glm4vImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2).save_pretrained(path)


def save_tiny_glm4v(path: Path, seed: int = 0, dtype=torch.float16) -> Path:
    """Glm4vForConditionalGeneration (GLM-4.1V layout): a Glm4 text tower plus a one-block vision tower."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    tok = tiny_tokenizer()
    text = _glm_text_settings(tok)
    del text["head_dim"], text["tie_word_embeddings"]  # Glm4v derives head_dim from hidden / heads
    config = Glm4vConfig(text_config={**text, "rope_parameters": _GLM4V_ROPE},
                         vision_config=_tiny_vision_settings(text["hidden_size"]), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Glm4vForConditionalGeneration(config)
    _randomize_norms(model)
    _save_image_processor(path)
    return _save_tiny(model, path, dtype)


def save_tiny_glm4v_moe(path: Path, seed: int = 0, dtype=torch.float16) -> Path:
    """Glm4vMoeForConditionalGeneration (GLM-4.5V layout): layer 0 dense, layer 1 routed experts
    (4 experts, top 2) plus a shared expert, a sigmoid router, and a vision tower."""
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    tok = tiny_tokenizer()
    text = _glm_text_settings(tok, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                              n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
    del text["tie_word_embeddings"]
    config = Glm4vMoeConfig(text_config={**text, "rope_parameters": _GLM4V_ROPE},
                            vision_config=_tiny_vision_settings(text["hidden_size"]), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Glm4vMoeForConditionalGeneration(config)
    _randomize_norms(model)
    with torch.no_grad():  # the router starts at zeros: give it something to route with
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.5)
    _save_image_processor(path)
    return _save_tiny(model, path, dtype)
