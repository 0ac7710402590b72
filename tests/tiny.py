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
