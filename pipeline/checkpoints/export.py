"""`quantize export DIR --engine lmdeploy --out OUT`: a checkpoint in the layout an engine loads.

lmdeploy's PyTorch engine serves GLM-4-9B only through its ChatGLM rewrite: it picks the model
class from config.json's auto_map (AutoModelForCausalLM -> ChatGLMForConditionalGeneration), reads
the ChatGLM config keys (num_layers, kv_channels, multi_query_group_num, padded_vocab_size,
rope_ratio, ...) through AutoConfig with trust_remote_code, and loads weights named
transformer.*. So a native ``Glm`` directory is written back in that layout, tensor for tensor
(see chatglm.py for the name mapping); ChatGLM -> Glm -> ChatGLM gives the same bytes, except
the unused rotary_pos_emb.inv_freq buffer, which is not written back.

Quantized checkpoints are refused here: their export belongs to the quantized-export issue.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints import chatglm
from pipeline.checkpoints.chatglm import OutTensor, Piece, whole
from pipeline.errors import UserError
from pipeline.outputs import Stopwatch, atomic_dir, dir_size, human_size

ENGINES = ("lmdeploy",)
AUTO_MAP = {
    "AutoConfig": "configuration_chatglm.ChatGLMConfig",
    "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
    "AutoModelForSeq2SeqLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
    "AutoModelForSequenceClassification": "modeling_chatglm.ChatGLMForSequenceClassification",
}
# Written only when the directory does not carry THUDM's own configuration_chatglm.py (a model
# that was never in the ChatGLM layout): enough for AutoConfig, which is all lmdeploy imports.
CONFIGURATION_CHATGLM = '''"""ChatGLMConfig written by the glm-quant-pipeline export (not THUDM's file): the ChatGLM
remote-code config keys, with the remote code's defaults, so AutoConfig(trust_remote_code=True) loads
this directory. lmdeploy reads these keys and runs its own ChatGLM implementation."""

try:
    from transformers import PreTrainedConfig as _BaseConfig
except ImportError:  # transformers < 5
    from transformers import PretrainedConfig as _BaseConfig

DEFAULTS = dict(
    num_layers=28, padded_vocab_size=65024, hidden_size=4096, ffn_hidden_size=13696, kv_channels=128,
    num_attention_heads=32, seq_length=2048, hidden_dropout=0.0, classifier_dropout=None,
    attention_dropout=0.0, layernorm_epsilon=1e-5, rmsnorm=True,
    apply_residual_connection_post_layernorm=False, post_layer_norm=True, add_bias_linear=False,
    add_qkv_bias=False, bias_dropout_fusion=True, multi_query_attention=False, multi_query_group_num=1,
    rope_ratio=1, original_rope=True, apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True,
    fp32_residual_connection=False, quantization_bit=0, pre_seq_len=None, prefix_projection=False,
)


class ChatGLMConfig(_BaseConfig):
    model_type = "chatglm"

    def __init__(self, **kwargs):
        for key, value in DEFAULTS.items():
            setattr(self, key, kwargs.pop(key, value))
        kwargs.pop("num_hidden_layers", None)
        self.num_hidden_layers = self.num_layers
        self.vocab_size = self.padded_vocab_size
        super().__init__(**kwargs)
'''


@dataclass
class ExportResult:
    out: Path
    engine: str
    architecture: str
    size_bytes: int
    seconds: float

    def summary(self) -> str:
        return (f"export: wrote {self.out} ({self.architecture} for {self.engine}, "
                f"{human_size(self.size_bytes)}) in {self.seconds:.1f} s")


def _check_exportable(model_dir: Path, config: dict) -> None:
    config_file = model_dir / "config.json"
    model_type = config.get("model_type")
    if model_type == "chatglm":
        raise UserError(f"{config_file}: already in the ChatGLM remote-code layout; lmdeploy loads {model_dir} "
                        "as it is, no export needed")
    if model_type != "glm":
        arch = (config.get("architectures") or [model_type])[0]
        raise UserError(f"{config_file}: {arch} needs no export; lmdeploy loads it from the Hugging Face "
                        "directory as it is. `quantize export --engine lmdeploy` converts Glm (GLM-4-9B), "
                        "which lmdeploy's PyTorch engine serves only in the ChatGLM layout")
    if "quantization_config" in config:
        raise UserError(f"{config_file}: a quantized checkpoint; exporting quantized Glm models for lmdeploy is "
                        "not supported yet. Export the unquantized base instead")


def _check_glm(glm, config_file: Path) -> None:
    rope = glm.rope_parameters or {}
    problems = []
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type {rope.get('rope_type')}")
    if rope.get("partial_rotary_factor", 1.0) != 0.5:
        problems.append(f"partial_rotary_factor {rope.get('partial_rotary_factor')} (ChatGLM rotates half of each head)")
    if glm.hidden_act != "silu":
        problems.append(f"hidden_act {glm.hidden_act}")
    if _head_dim(glm) % 4:
        problems.append(f"head_dim {_head_dim(glm)} is not a multiple of 4")
    if problems:
        raise UserError(f"{config_file}: {'; '.join(problems)}: the ChatGLM layout cannot hold this model exactly")


def _head_dim(glm) -> int:
    return glm.head_dim or glm.hidden_size // glm.num_attention_heads


def _number(value: float):
    return int(value) if float(value).is_integer() else value


def chatglm_config_from_glm(glm, torch_dtype: str) -> dict:
    """The ChatGLM config.json (GLM-4-9B-chat's key set) describing the same model as a GlmConfig."""
    config = {
        "model_type": "chatglm",
        "architectures": ["ChatGLMModel"],
        "auto_map": dict(AUTO_MAP),
        "add_bias_linear": False,
        "add_qkv_bias": bool(glm.attention_bias),
        "apply_query_key_layer_scaling": True,
        "apply_residual_connection_post_layernorm": False,
        "attention_dropout": glm.attention_dropout,
        "attention_softmax_in_fp32": True,
        "bias_dropout_fusion": True,
        "ffn_hidden_size": glm.intermediate_size,
        "fp32_residual_connection": False,
        "hidden_dropout": 0.0,
        "hidden_size": glm.hidden_size,
        "kv_channels": _head_dim(glm),
        "layernorm_epsilon": glm.rms_norm_eps,
        "multi_query_attention": True,
        "multi_query_group_num": glm.num_key_value_heads,
        "num_attention_heads": glm.num_attention_heads,
        "num_hidden_layers": glm.num_hidden_layers,
        "num_layers": glm.num_hidden_layers,
        "rope_ratio": _number(glm.rope_parameters["rope_theta"] / chatglm.ROPE_BASE),
        "original_rope": True,
        "padded_vocab_size": glm.vocab_size,
        "post_layer_norm": True,
        "rmsnorm": True,
        "seq_length": glm.max_position_embeddings,
        "use_cache": glm.use_cache,
        "torch_dtype": torch_dtype,
        "transformers_version": glm.transformers_version,
        "tie_word_embeddings": glm.tie_word_embeddings,
        "eos_token_id": glm.eos_token_id,
        "pad_token_id": glm.pad_token_id,
    }
    if glm.bos_token_id is not None:
        config["bos_token_id"] = glm.bos_token_id
    return config


def glm_shapes(glm) -> dict[str, tuple[int, ...]]:
    hidden, d = glm.hidden_size, _head_dim(glm)
    q_rows, kv_rows = glm.num_attention_heads * d, glm.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (glm.vocab_size, hidden)}
    for i in range(glm.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for head, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            shapes[p + f"self_attn.{head}_proj.weight"] = (rows, hidden)
            if glm.attention_bias:
                shapes[p + f"self_attn.{head}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_rows)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * glm.intermediate_size, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, glm.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not glm.tie_word_embeddings:
        shapes["lm_head.weight"] = (glm.vocab_size, hidden)
    return shapes


def plan_to_chatglm(glm, source, config_file: Path = Path("config.json")) -> list[OutTensor]:
    """Checks a Glm checkpoint against its config, then maps every tensor back to its ChatGLM name."""
    optional = ["lm_head.weight"] if glm.tie_word_embeddings else []
    chatglm.check_shapes(source, glm_shapes(glm), config_file, optional=optional)
    plan = [whole("model.embed_tokens.weight", source, "transformer.embedding.word_embeddings.weight")]
    for i in range(glm.num_hidden_layers):
        src, out = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        plan.append(whole(src + "input_layernorm.weight", source, out + "input_layernorm.weight"))
        for kind in ("weight", "bias") if glm.attention_bias else ("weight",):
            names = [src + f"self_attn.{head}_proj.{kind}" for head in "qkv"]
            rows = sum(source.shape(n)[0] for n in names)
            plan.append(OutTensor(out + f"self_attention.query_key_value.{kind}",
                                  (rows, *source.shape(names[0])[1:]), source.dtype(names[0]),
                                  [Piece(n, 0, source.shape(n)[0]) for n in names]))
        plan.append(whole(src + "self_attn.o_proj.weight", source, out + "self_attention.dense.weight"))
        plan.append(whole(src + "post_attention_layernorm.weight", source, out + "post_attention_layernorm.weight"))
        plan.append(whole(src + "mlp.gate_up_proj.weight", source, out + "mlp.dense_h_to_4h.weight"))
        plan.append(whole(src + "mlp.down_proj.weight", source, out + "mlp.dense_4h_to_h.weight"))
    plan.append(whole("model.norm.weight", source, "transformer.encoder.final_layernorm.weight"))
    if not glm.tie_word_embeddings:
        plan.append(whole("lm_head.weight", source, "transformer.output_layer.weight"))
    return plan


def _load_glm_config(model_dir: Path):
    from transformers import GlmConfig

    try:
        return GlmConfig.from_pretrained(model_dir)
    except Exception as exc:  # strict config validation: a wrong type or value in config.json
        raise UserError(f"{model_dir / 'config.json'}: not a valid Glm config ({exc})") from None


def run(model_dir: Path | str, out: Path | str, engine: str = "lmdeploy",
        max_shard_bytes: int = chatglm.MAX_SHARD_BYTES) -> ExportResult:
    watch = Stopwatch()
    if engine not in ENGINES:
        raise UserError(f"--engine {engine}: supported engines: {', '.join(ENGINES)}")
    model_dir, out = Path(model_dir), Path(out)
    if not model_dir.is_dir():
        raise UserError(f"{model_dir}: no such directory; pass a checkpoint directory written by `quantize resave`")
    config = chatglm.read_config(model_dir)
    _check_exportable(model_dir, config)
    glm = _load_glm_config(model_dir)
    _check_glm(glm, model_dir / "config.json")
    source = chatglm.SafetensorsSource(model_dir)
    plan = plan_to_chatglm(glm, source, model_dir / "config.json")
    torch_dtype = str(plan[0].dtype).removeprefix("torch.")
    with atomic_dir(out) as tmp:
        chatglm.write_checkpoint(plan, source, tmp, max_shard_bytes, label=f"Glm -> ChatGLM ({engine})")
        (tmp / "config.json").write_text(json.dumps(chatglm_config_from_glm(glm, torch_dtype), indent=2) + "\n")
        chatglm.carry_files(model_dir, tmp)
        if not (tmp / "configuration_chatglm.py").exists():
            (tmp / "configuration_chatglm.py").write_text(CONFIGURATION_CHATGLM)
    return ExportResult(out, engine, "ChatGLMForConditionalGeneration", dir_size(out), watch.seconds)
