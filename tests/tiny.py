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


# GLM-4.1V / 4.5V's special tokens and chat template (the release's, shortened to what a prompt with text and
# images needs): the tokens vLLM's GLM-4V processor looks up, and the markup both engines put where an image goes
GLM_CHAT_TOKENS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
GLM_IMAGE_TOKENS = ["<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|video|>",
                    "<|end_of_video|>"]
GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>{%- for msg in messages %}{%- if msg.role == 'system' %}<|system|>\n{{ msg.content }}"
    "{%- elif msg.role == 'user' %}<|user|>\n{%- if msg.content is string %}{{ msg.content }}{%- else %}"
    "{%- for item in msg.content %}{%- if item.type == 'video' or 'video' in item %}"
    "<|begin_of_video|><|video|><|end_of_video|>{%- elif item.type == 'image' or 'image' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- elif msg.role == 'assistant' %}<|assistant|>\n{{ msg.content }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>\n{%- endif %}")


def glm_vision_tokenizer():
    """The tiny BPE plus GLM's chat and image/video special tokens and GLM-4.1V's chat template."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": GLM_CHAT_TOKENS + GLM_IMAGE_TOKENS})
    tok.chat_template = GLM4V_CHAT_TEMPLATE
    return tok


def _glm_vision_token_ids(tok) -> dict:
    ids = dict(zip(["image_start_token_id", "image_token_id", "image_end_token_id", "video_start_token_id",
                    "video_token_id", "video_end_token_id"], tok.convert_tokens_to_ids(GLM_IMAGE_TOKENS)))
    return ids


def _save_glm_vision_side_files(path: Path, vision: dict, family: str = "Glm4v") -> None:
    """GLM-4.1V's processor files, matched to the vision tower: the image processor (PIL, written through
    transformers, typed as the release's Glm4vImageProcessor), the video processor and processor_config.json
    (written as JSON: the video processor class needs torchvision, which the CPU tests do without). family: the
    processor classes' prefix (GLM-4.6V's releases ship Glm46V's)."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    patch, merge, temporal = vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"]
    side = patch * merge
    Glm4vImageProcessorPil(patch_size=patch, temporal_patch_size=temporal, merge_size=merge,
                           size={"shortest_edge": (8 * side) ** 2, "longest_edge": (16 * side) ** 2}).save_pretrained(path)
    config_path = Path(path) / "preprocessor_config.json"
    image = json.loads(config_path.read_text())
    image.update(image_processor_type=f"{family}ImageProcessor", processor_class=f"{family}Processor")
    config_path.write_text(json.dumps(image, indent=2))
    video = {**{k: image[k] for k in ("image_mean", "image_std", "patch_size", "temporal_patch_size", "merge_size",
                                      "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb",
                                      "do_resize") if k in image},
             "size": image["size"], "video_processor_type": f"{family}VideoProcessor",
             "processor_class": f"{family}Processor", "fps": 2.0, "max_image_size": {"longest_edge": (16 * side) ** 2},
             "do_sample_frames": True, "num_frames": 16, "max_duration": 300}
    (Path(path) / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    (Path(path) / "processor_config.json").write_text(json.dumps({"processor_class": f"{family}Processor"}, indent=2))


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


def _save_tiny_vision(model, path: Path, dtype, tok, vision: dict, family: str = "Glm4v",
                      synthetic_weights: str | None = None) -> Path:
    from pipeline.checkpoints.serving_names import finish_config

    model = model.to(dtype)
    if synthetic_weights:  # a random model built to time the pipeline (config_json.synthetic_weights): the report says so
        model.config.synthetic_weights = synthetic_weights
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    _save_glm_vision_side_files(path, vision, family)
    finish_config(path)  # the keys GLM's releases carry (use_qk_norm), as `quantize resave` writes them
    return Path(path)


# GLM-4.5V's MoE text tower, tiny: layer 0 dense, layer 1 routed experts (4 experts, top 2) plus a shared expert
_TINY_MOE = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                 first_k_dense_replace=1, n_group=1, topk_group=1)


def _build_tiny_glm_vision(config_cls, model_cls, path: Path, seed: int, dtype, text: dict | None, vision: dict | None,
                           device: str, moe: bool, text_type: str | None = None, vision_type: str | None = None,
                           family: str = "Glm4v", synthetic_weights: str | None = None) -> Path:
    """A GLM vision-language model of config_cls / model_cls with GLM's tokens, processors and chat template.
    text_type / vision_type: the sub-configs' model_type where the class does not imply it (Glm46V)."""
    tok = glm_vision_tokenizer()
    settings = _glm_text_settings(tok, **{**(_TINY_MOE if moe else {}), **(text or {})})
    if not moe and not (text or {}).get("head_dim"):
        settings.pop("head_dim", None)  # Glm4v: hidden / heads unless set
    settings.pop("tie_word_embeddings")
    visual = {**_tiny_vision_settings(settings["hidden_size"]), **(vision or {})}
    text_config = {"rope_parameters": _GLM4V_ROPE, **settings, **({"model_type": text_type} if text_type else {})}
    config = config_cls(text_config=text_config, vision_config={**visual, **({"model_type": vision_type} if vision_type
                                                                               else {})},
                        tie_word_embeddings=False, **_glm_vision_token_ids(tok))
    torch.manual_seed(seed)
    with torch.device(device):  # real widths are built on the GPU
        model = model_cls(config).to(dtype)
    _randomize_norms(model)
    if moe:
        with torch.no_grad():  # the router starts at zeros: give it something to route with
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.normal_(0, 0.5)
    return _save_tiny_vision(model, path, dtype, tok, visual, family, synthetic_weights)


def save_tiny_glm4v(path: Path, seed: int = 0, dtype=torch.float16, text: dict | None = None,
                    vision: dict | None = None, device: str = "cpu", synthetic_weights: str | None = None) -> Path:
    """Glm4vForConditionalGeneration (GLM-4.1V layout, GLM-4.6V-Flash's as published): a Glm4 text tower plus a
    one-block vision tower, with GLM's image/video tokens, its processors and chat template (what vLLM's GLM-4V
    processor needs). text / vision: settings over the tiny ones (e.g. real widths at reduced depth)."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    return _build_tiny_glm_vision(Glm4vConfig, Glm4vForConditionalGeneration, path, seed, dtype, text, vision, device,
                                  moe=False, synthetic_weights=synthetic_weights)


def save_tiny_glm4v_moe(path: Path, seed: int = 0, dtype=torch.float16, text: dict | None = None,
                        vision: dict | None = None, device: str = "cpu", synthetic_weights: str | None = None) -> Path:
    """Glm4vMoeForConditionalGeneration (GLM-4.5V layout, GLM-4.6V's as published): layer 0 dense, layer 1 routed
    experts (4 experts, top 2) plus a shared expert, a sigmoid router, and a vision tower; GLM's tokens,
    processors and chat template as in save_tiny_glm4v."""
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    return _build_tiny_glm_vision(Glm4vMoeConfig, Glm4vMoeForConditionalGeneration, path, seed, dtype, text, vision,
                                  device, moe=True, synthetic_weights=synthetic_weights)


def save_tiny_glm46v(path: Path, seed: int = 0, dtype=torch.float16, moe: bool = False) -> Path:
    """Glm46VForConditionalGeneration (transformers 5's own `glm46v` model type), as transformers saves it: its
    dense text config (glm4v_text) or, moe, its MoE one (glm4v_moe_text, GLM-4.5V's text tower as in
    save_tiny_glm4v_moe, whose routed experts transformers saves as fused 3-D tensors), with Glm46V's processors."""
    from transformers import Glm46VConfig, Glm46VForConditionalGeneration

    return _build_tiny_glm_vision(Glm46VConfig, Glm46VForConditionalGeneration, path, seed, dtype, None, None, "cpu",
                                  moe=moe, text_type="glm4v_moe_text" if moe else "glm4v_text",
                                  vision_type="glm4v_moe_vision" if moe else "glm4v_vision", family="Glm46V")


# ---------------------------------------------------------------- a reasoning model (issue 66)

# Qwen3's switch on the tiny ChatML template: with enable_thinking false the reply opens on an empty reasoning block
THINKING_TEMPLATE = CHATML.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}")
# GLM-4.5V / 4.6V's switch (their release's template, shortened): "/nothink" after the user's turn, an empty block
GLM_THINKING_TEMPLATE = (
    "[gMASK]<sop>{%- for m in messages %}{%- if m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{{- '/nothink' if (enable_thinking is defined and not enable_thinking) else '' -}}"
    "{%- elif m.role == 'assistant' %}<|assistant|>\n{{ m.content }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{{- '\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}{%- endif -%}")


def thinking_tokenizer(template: str = THINKING_TEMPLATE):
    """The tiny BPE with `<think>` and `</think>` as tokens of their own (not special, as Qwen3's and GLM's) and a
    template that switches thinking."""
    tok = tiny_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = template
    return tok


def save_thinking_llama(path: Path, script: str, prompts: list[str], steps: int = 60, seed: int = 0) -> Path:
    """A tiny Llama trained for a few dozen steps (one thread: seconds) to answer every prompt of `prompts` (rendered,
    thinking on) with `script` and EOS: a reasoning model whose generation the test knows (greedy decoding reproduces
    it; 40 steps were enough)."""
    from transformers import LlamaForCausalLM

    tok = thinking_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tok)))
    target = tok(script, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rows = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(r) for r in rows) + len(target)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        whole = row + target
        ids[i, :len(whole)] = torch.tensor(whole)
        mask[i, :len(whole)] = 1
        labels[i, len(row):len(whole)] = torch.tensor(target)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model: more threads only contend
    try:
        for _ in range(steps):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)
