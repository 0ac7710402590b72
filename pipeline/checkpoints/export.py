"""`quantize export DIR --engine lmdeploy --out OUT`: a checkpoint in the layout an engine loads.

lmdeploy's PyTorch engine serves GLM-4-9B only through its ChatGLM rewrite: it picks the model
class from config.json's auto_map (AutoModelForCausalLM -> ChatGLMForConditionalGeneration), reads
the ChatGLM config keys (num_layers, kv_channels, multi_query_group_num, padded_vocab_size,
rope_ratio, ...) through AutoConfig with trust_remote_code, and loads weights named
transformer.*. So a native ``Glm`` directory is written back in that layout, tensor for tensor
(see chatglm.py for the name mapping); ChatGLM -> Glm -> ChatGLM gives the same bytes, except
the unused rotary_pos_emb.inv_freq buffer, which is not written back.

Quantized variants:

- AWQ W4A16 (compressed-tensors `pack-quantized`, from `quantize awq`) -> the AutoAWQ GEMM layout
  (lmdeploy_awq.py), the same codes, zero points and scales, float tensors in float16 (lmdeploy
  runs AWQ in float16 only). A ``Glm`` variant also gets the ChatGLM names and config, q/k/v
  stacked along the output dim into query_key_value; Llama, Glm4 and Glm4v keep their names.
  config.json gets an AutoAWQ quantization_config, and export.json records what was done.
- Glm4vMoe (GLM-4.5V, GLM-4.6V) and transformers' Glm46V are refused, quantized or not: lmdeploy 0.18 has no model
  for them (its wheel's pytorch/models/module_map.py: GLM-4.1V's Glm4vForConditionalGeneration, GLM-4.6V-Flash's
  published layout, is the only GLM-V there); the message says what serves them instead.
- FP8 W8A8 (compressed-tensors `float-quantized`, from `quantize fp8`) is refused: lmdeploy 0.18
  keeps one FP8 KV-cache scale per tensor, where the variant has one per KV head, and its
  ChatGLM loader splits every query_key_value tensor into q/k/v, so a fused QKV's static input
  scale does not load. vLLM serves the variant as it is.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints import chatglm, checkpoint, config_json, headers, streaming
from pipeline.checkpoints.streaming import OutTensor, Piece, whole
from pipeline.checkpoints.lmdeploy_awq import AwqSource, Scheme, read_scheme
from pipeline.errors import UserError
from pipeline.outputs import Stopwatch, atomic_dir, dir_size, human_size

ENGINES = ("lmdeploy",)
CHATGLM_ARCH = "ChatGLMForConditionalGeneration"
# lmdeploy 0.18 serves these under their Hugging Face names: the AWQ export only changes the layout.
AWQ_NATIVE = ("LlamaForCausalLM", "Glm4ForCausalLM", "Glm4vForConditionalGeneration")
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
    layout: str = ""

    def summary(self) -> str:
        layout = f", {self.layout}" if self.layout else ""
        return (f"export: wrote {self.out} ({self.architecture}{layout} for {self.engine}, "
                f"{human_size(self.size_bytes)}) in {self.seconds:.1f} s")


def _check_loadable(model_dir: Path, config: dict) -> None:
    """An architecture lmdeploy 0.18 has no model for (GLM-4.5V / GLM-4.6V's Glm4vMoe, transformers' Glm46V) is
    refused, whatever its weights: no layout this export writes would load (pipeline/checkpoints/serving.py CANNOT)."""
    from pipeline.checkpoints.serving import cannot

    if why := cannot("lmdeploy", config):
        raise UserError(f"{config_json.path(model_dir)}: {why}")


def _check_exportable(model_dir: Path, config: dict) -> None:
    config_file = config_json.path(model_dir)
    model_type = config.get("model_type")
    if model_type == "chatglm":
        raise UserError(f"{config_file}: already in the ChatGLM remote-code layout; lmdeploy loads {model_dir} "
                        "as it is, no export needed")
    if model_type != "glm":
        arch = config_json.architecture_or(config, model_type)
        raise UserError(f"{config_file}: {arch} needs no export; lmdeploy loads it from the Hugging Face "
                        "directory as it is. `quantize export --engine lmdeploy` converts Glm (GLM-4-9B), "
                        "which lmdeploy's PyTorch engine serves only in the ChatGLM layout")


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


def chatglm_modules(glm) -> list[tuple[list[str], str]]:
    """(Glm modules, the ChatGLM module they become), in file order. q/k/v_proj stack along the output
    dim into query_key_value (rows [q | k | v]); gate_up_proj is [gate | up] in both layouts."""
    modules = [(["model.embed_tokens"], "transformer.embedding.word_embeddings")]
    for i in range(glm.num_hidden_layers):
        src, out = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        modules += [
            ([src + "input_layernorm"], out + "input_layernorm"),
            ([src + f"self_attn.{head}_proj" for head in "qkv"], out + "self_attention.query_key_value"),
            ([src + "self_attn.o_proj"], out + "self_attention.dense"),
            ([src + "post_attention_layernorm"], out + "post_attention_layernorm"),
            ([src + "mlp.gate_up_proj"], out + "mlp.dense_h_to_4h"),
            ([src + "mlp.down_proj"], out + "mlp.dense_4h_to_h"),
        ]
    modules.append((["model.norm"], "transformer.encoder.final_layernorm"))
    if not glm.tie_word_embeddings:
        modules.append((["lm_head"], "transformer.output_layer"))
    return modules


def _untied_head(glm) -> list[str]:
    """lm_head.weight, which a checkpoint with tied embeddings may carry and the export drops."""
    return ["lm_head.weight"] if glm.tie_word_embeddings else []


def plan_to_chatglm(glm, source, config_file: Path = Path("config.json")) -> list[OutTensor]:
    """Checks a Glm checkpoint against its config, then maps every tensor back to its ChatGLM name."""
    streaming.check_shapes(source, glm_shapes(glm), config_file, optional=_untied_head(glm))
    present, plan = set(source.names()), []
    for modules, out in chatglm_modules(glm):
        for kind in ("weight", "bias"):
            names = [f"{m}.{kind}" for m in modules]
            if names[0] in present:
                rows = sum(source.shape(n)[0] for n in names)
                plan.append(OutTensor(f"{out}.{kind}", (rows, *source.shape(names[0])[1:]), source.dtype(names[0]),
                                      [Piece(n, 0, source.shape(n)[0]) for n in names]))
    return plan


def _load_glm_config(model_dir: Path):
    from transformers import GlmConfig

    try:
        return GlmConfig.from_pretrained(model_dir)
    except Exception as exc:  # strict config validation: a wrong type or value in config.json
        raise UserError(f"{model_dir / 'config.json'}: not a valid Glm config ({exc})") from None


def run(model_dir: Path | str, out: Path | str, engine: str = "lmdeploy",
        max_shard_bytes: int = streaming.MAX_SHARD_BYTES) -> ExportResult:
    watch = Stopwatch()
    if engine not in ENGINES:
        raise UserError(f"--engine {engine}: supported engines: {', '.join(ENGINES)}")
    model_dir, out = Path(model_dir), Path(out)
    config = checkpoint.open(model_dir).config
    _check_loadable(model_dir, config)
    if config.get("model_type") == "chatglm":
        _check_exportable(model_dir, config)
    if config.get("quantization_config"):
        return _export_awq(model_dir, out, engine, config, max_shard_bytes, watch)
    headers.check(model_dir)  # a whole checkpoint: the weights cover config.json
    _check_exportable(model_dir, config)
    glm = _load_glm_config(model_dir)
    _check_glm(glm, config_json.path(model_dir))
    source = streaming.SafetensorsSource(model_dir)
    plan = plan_to_chatglm(glm, source, config_json.path(model_dir))
    torch_dtype = str(plan[0].dtype).removeprefix("torch.")
    with atomic_dir(out, "export", {"checkpoint": model_dir}) as tmp:
        streaming.write_checkpoint(plan, source, tmp, max_shard_bytes, label=f"Glm -> ChatGLM ({engine})")
        streaming.carry_files(model_dir, tmp)
        _write_config(tmp, chatglm_config_from_glm(glm, torch_dtype))
        _write_record(tmp, model_dir, engine, CHATGLM_ARCH, watch, layout="chatglm")
    return ExportResult(out, engine, CHATGLM_ARCH, dir_size(out), watch.seconds)


def _write_record(dest: Path, model_dir: Path, engine: str, served: str, watch: Stopwatch, **details) -> None:
    """export.json: what was done, and from which checkpoint (the lmdeploy engine's cache reads `source`)."""
    record = {"source": str(model_dir.resolve()), "engine": engine, "architecture": served, **details,
              "seconds": round(watch.seconds, 2)}
    (dest / "export.json").write_text(json.dumps(record, indent=2) + "\n")


def _write_config(dest: Path, config: dict) -> None:
    """config.json, and for the ChatGLM layout the remote config class, unless the source brought THUDM's."""
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if config.get("model_type") == "chatglm" and not (dest / "configuration_chatglm.py").exists():
        (dest / "configuration_chatglm.py").write_text(CONFIGURATION_CHATGLM)


# ---------------------------------------------------------------- quantized variants


def _awq_scheme(model_dir: Path, quant: dict) -> Scheme:
    config_file = config_json.path(model_dir)
    method, fmt = quant.get("quant_method"), quant.get("format")
    if method == "awq":
        raise UserError(f"{config_file}: already in the AutoAWQ layout; lmdeploy loads {model_dir} as it is, "
                        "no export needed")
    if method == "compressed-tensors" and fmt == "float-quantized":
        raise UserError(_fp8_refusal(model_dir, quant))
    if method != "compressed-tensors" or fmt != "pack-quantized":
        raise UserError(f"{config_file}: quantization_config {method} / {fmt}: `quantize export --engine lmdeploy` "
                        "converts AWQ W4A16 variants (compressed-tensors pack-quantized, written by `quantize awq`) "
                        "and unquantized Glm checkpoints")
    return read_scheme(quant, config_file)


def _fp8_refusal(model_dir: Path, quant: dict) -> str:
    from pipeline.checkpoints.serving import support_from_config

    config = checkpoint.open(model_dir).config
    return f"{model_dir}: {support_from_config(config)['lmdeploy']['how']}: vllm serve {model_dir}"


def _awq_architecture(config: dict, config_file: Path) -> str:
    arch = config_json.architecture_or(config, config.get("model_type"))
    if arch != "GlmForCausalLM" and arch not in AWQ_NATIVE:
        raise UserError(f"{config_file}: {arch}: the AWQ export for lmdeploy supports GlmForCausalLM (written as "
                        f"{CHATGLM_ARCH}), {', '.join(AWQ_NATIVE)}")
    return arch


def _float16(config: dict) -> dict:
    """A copy of config with its dtype float16: the top level's, and the text and vision configs' if they name one."""
    config = copy.deepcopy(config)
    for section in config_json.sections(config):
        section.update({key: "float16" for key in ("torch_dtype", "dtype") if key in section})
    if "dtype" not in config:
        config["torch_dtype"] = "float16"
    return config


def _awq_view(model_dir: Path, config: dict, scheme: Scheme, arch: str) -> tuple[AwqSource, dict, str]:
    """The variant in the AWQ layout under the names lmdeploy loads, the config.json to write (before its
    quantization_config and dtype) and the class lmdeploy builds."""
    source = streaming.SafetensorsSource(model_dir)
    if arch != "GlmForCausalLM":
        out_config = {k: v for k, v in config.items() if k != "quantization_config"}
        return AwqSource(source, scheme), out_config, arch
    config_file = config_json.path(model_dir)
    glm = _load_glm_config(model_dir)
    _check_glm(glm, config_file)
    streaming.check_shapes(AwqSource(source, scheme).dense_view(), glm_shapes(glm), config_file,
                         optional=_untied_head(glm))
    return AwqSource(source, scheme, chatglm_modules(glm)), chatglm_config_from_glm(glm, "float16"), CHATGLM_ARCH


def _export_awq(model_dir: Path, out: Path, engine: str, config: dict, max_shard_bytes: int,
                watch: Stopwatch) -> ExportResult:
    scheme = _awq_scheme(model_dir, config["quantization_config"])
    arch = _awq_architecture(config, config_json.path(model_dir))
    headers.check(model_dir)  # a whole checkpoint: the weights cover config.json, compressed layout included
    awq, out_config, served = _awq_view(model_dir, config, scheme, arch)
    out_config = _float16(out_config) | {"quantization_config": scheme.awq_config(awq.modules_to_not_convert())}
    with atomic_dir(out, "export", {"checkpoint": model_dir}) as tmp:
        plan = [whole(name, awq, name) for name in awq.names()]
        streaming.write_checkpoint(plan, awq, tmp, max_shard_bytes, label=f"{scheme.describe()} ({engine})")
        streaming.carry_files(model_dir, tmp)
        _write_config(tmp, out_config)
        _write_record(tmp, model_dir, engine, served, watch, layout="awq-gemm", group_size=scheme.group_size,
                      symmetric=scheme.symmetric, tensors_converted=len(awq.linears))
    return ExportResult(out, engine, served, dir_size(out), watch.seconds, layout=scheme.describe())
