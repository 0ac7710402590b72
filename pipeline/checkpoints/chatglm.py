"""ChatGLM remote-code checkpoints (ChatGLM2/3, GLM-4-9B-chat) <-> transformers' native ``Glm``.

Both layouts hold the same numbers under different names; nothing is recomputed:

    transformer.embedding.word_embeddings        model.embed_tokens
    encoder.layers.N.self_attention.query_key_value   rows [q | k | v] -> self_attn.{q,k,v}_proj
        (q: num_attention_heads x kv_channels rows, k and v: multi_query_group_num x kv_channels)
    encoder.layers.N.self_attention.dense        self_attn.o_proj
    encoder.layers.N.mlp.dense_h_to_4h           mlp.gate_up_proj   (rows [gate | up] in both)
    encoder.layers.N.mlp.dense_4h_to_h           mlp.down_proj
    encoder.final_layernorm                      model.norm
    transformer.output_layer                     lm_head
    transformer.rotary_pos_emb.inv_freq          dropped (a buffer neither model reads)

The rotary embeddings: ChatGLM rotates the first kv_channels // 2 dims of each head on interleaved
pairs, as Glm does with partial_rotary_factor 0.5 (its apply_rotary_pos_emb interleaves). What
`rope_ratio` means depends on the checkpoint's own remote code (modeling_chatglm.py, shipped beside
the weights), which config.json alone cannot tell:

    ChatGLM3, GLM-4       base = base * self.rope_ratio        -> rope_theta = 10000 x rope_ratio
    ChatGLM2-6B-32K       seq_idx = arange(n) / self.rope_ratio -> linear scaling, factor rope_ratio
    code that never reads rope_ratio                             -> rope_theta = 10000

`rope_convention` reads the code (its syntax tree, never running it); a rope_ratio other than 1
whose convention cannot be told is refused. tests/test_chatglm.py checks the logits of each
convention against a reference forward.

Keys config.json leaves out take the remote ChatGLMConfig's defaults (multi_query_group_num 1, ...).
`tie_word_embeddings: true` is refused: the remote model never ties its output layer to the
embeddings, whatever the config says.

Conversion streams: the output is planned from config.json and the safetensors headers, every
shape is checked before anything is written, then each output tensor is copied in row chunks
read with ``safe_open(...).get_slice`` and written straight into its shard. The source file is
reopened per chunk so its memory-mapped pages do not pile up in the resident set; peak memory is
a few chunks, not a shard.

Tokenizer: every top-level non-weight file (tokenizer files, chat template, generation config,
the remote ``*.py`` files, licence) is copied as is. The remote tokenizer
(tokenization_chatglm.py + tokenizer.model) only loads with trust_remote_code=True; when the
source also has a tokenizer.json, tokenizer_config.json is rewritten to the native
PreTrainedTokenizerFast (auto_map dropped, chat template and special tokens kept).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from pipeline.checkpoints import checkpoint, config_json
from pipeline.checkpoints.streaming import (MAX_SHARD_BYTES, OutTensor, Piece, SafetensorsSource, TensorSource, carry_files,
                                            check_shapes, whole, write_checkpoint)
from pipeline.errors import UserError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SUPPORTED_CHATGLM = (
    "ChatGLM2-6B, ChatGLM3-6B and GLM-4-9B(-chat) text checkpoints in the remote-code layout "
    "(multi-query attention, RMSNorm, safetensors weights)"
)
INV_FREQ = "transformer.rotary_pos_emb.inv_freq"
ROPE_BASE = 10000

# The remote ChatGLMConfig's defaults (configuration_chatglm.py of ChatGLM2/3 and GLM-4), for keys a
# config.json leaves out: the remote model uses these, so the conversion does too.
CHATGLM_DEFAULTS = {
    "num_layers": 28, "padded_vocab_size": 65024, "hidden_size": 4096, "ffn_hidden_size": 13696,
    "kv_channels": 128, "num_attention_heads": 32, "seq_length": 2048, "attention_dropout": 0.0,
    "layernorm_epsilon": 1e-5, "rmsnorm": True, "apply_residual_connection_post_layernorm": False,
    "post_layer_norm": True, "add_bias_linear": False, "add_qkv_bias": False, "multi_query_attention": False,
    "multi_query_group_num": 1, "rope_ratio": 1,
}
# rope_ratio conventions of the remote code (see the module docstring)
ROPE_BASE_SCALED, ROPE_POSITIONS_SCALED, ROPE_RATIO_UNUSED = "base", "positions", "unused"


# ---------------------------------------------------------------- reading


def check_supported(config: dict, config_file: Path) -> None:
    """Refuses what Glm cannot represent exactly, with the reason."""
    if "vision_config" in config:
        raise UserError(f"{config_file}: a GLM-4V-9B vision checkpoint (vision_config, EVA-CLIP tower "
                        "transformer.vision.*); transformers has no native class for it and converting only its "
                        f"language half would drop the vision tower. Supported: {SUPPORTED_CHATGLM}")
    if "position_encoding_2d" in config or "inner_hidden_size" in config:
        raise UserError(f"{config_file}: a first-generation ChatGLM-6B (2D positions), which has no native "
                        f"transformers class. Supported: {SUPPORTED_CHATGLM}")
    c = {**CHATGLM_DEFAULTS, **config}
    if c.get("tie_word_embeddings"):
        raise UserError(f"{config_file}: tie_word_embeddings is true, but ChatGLM's remote code never ties: its "
                        "output layer (transformer.output_layer) is a weight of its own, whatever the config says, so "
                        "a tied Glm would compute other logits. If the weights hold transformer.output_layer.weight, "
                        "set tie_word_embeddings to false in config.json and convert again")
    wrong = [k for k in ("num_layers", "hidden_size", "ffn_hidden_size", "kv_channels", "num_attention_heads",
                         "padded_vocab_size", "multi_query_group_num")
             if not isinstance(c[k], int) or isinstance(c[k], bool) or c[k] < 1]
    if wrong:
        raise UserError(f"{config_file}: {', '.join(f'{k} {c[k]!r}' for k in wrong)}: not a positive whole number; "
                        "restore the config.json that came with the weights")
    if not isinstance(c["rope_ratio"], (int, float)) or isinstance(c["rope_ratio"], bool) or c["rope_ratio"] <= 0:
        raise UserError(f"{config_file}: rope_ratio {c['rope_ratio']!r}: not a positive number; restore the "
                        "config.json that came with the weights")
    problems = []
    if not c["multi_query_attention"]:
        problems.append("multi_query_attention is false (per-head interleaved qkv)")
    if not c["rmsnorm"]:
        problems.append("rmsnorm is false (LayerNorm)")
    if c["add_bias_linear"]:
        problems.append("add_bias_linear is true")
    if c["apply_residual_connection_post_layernorm"]:
        problems.append("apply_residual_connection_post_layernorm is true")
    if not c["post_layer_norm"]:
        problems.append("post_layer_norm is false")
    if c.get("quantization_bit") or c.get("quantization_config"):
        problems.append("the weights are quantized (quantization_bit / quantization_config)")
    if c.get("pre_seq_len"):
        problems.append("pre_seq_len is set (a P-tuning prefix encoder)")
    if c.get("rope_scaling"):
        problems.append("rope_scaling is set")
    if c["kv_channels"] % 4:
        problems.append(f"kv_channels {c['kv_channels']} is not a multiple of 4")
    if c["multi_query_attention"] and c["num_attention_heads"] % c["multi_query_group_num"]:
        problems.append("num_attention_heads is not a multiple of multi_query_group_num")
    if problems:
        raise UserError(f"{config_file}: {'; '.join(problems)}: not converted, since no exact GlmForCausalLM "
                        f"equivalent is implemented for it. Supported: {SUPPORTED_CHATGLM}")


def chatglm_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every weight of a ChatGLM remote-code checkpoint and its shape, from config.json."""
    c = {**CHATGLM_DEFAULTS, **config}
    hidden, d, heads = c["hidden_size"], c["kv_channels"], c["num_attention_heads"]
    qkv_rows = (heads + 2 * c["multi_query_group_num"]) * d
    shapes = {"transformer.embedding.word_embeddings.weight": (c["padded_vocab_size"], hidden)}
    for i in range(c["num_layers"]):
        p = f"transformer.encoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attention.query_key_value.weight"] = (qkv_rows, hidden)
        if c["add_qkv_bias"]:
            shapes[p + "self_attention.query_key_value.bias"] = (qkv_rows,)
        shapes[p + "self_attention.dense.weight"] = (hidden, heads * d)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.dense_h_to_4h.weight"] = (2 * c["ffn_hidden_size"], hidden)
        shapes[p + "mlp.dense_4h_to_h.weight"] = (hidden, c["ffn_hidden_size"])
    shapes["transformer.encoder.final_layernorm.weight"] = (hidden,)
    shapes["transformer.output_layer.weight"] = (c["padded_vocab_size"], hidden)  # the remote code never ties
    return shapes


def rope_parameters(config: dict, convention: str | None) -> dict:
    """Glm's rope_parameters for the remote code's rope_ratio convention (None: ratio 1 needs none)."""
    ratio = {**CHATGLM_DEFAULTS, **config}["rope_ratio"]
    if ratio == 1 or convention == ROPE_RATIO_UNUSED:
        return {"rope_type": "default", "rope_theta": float(ROPE_BASE), "partial_rotary_factor": 0.5}
    if convention == ROPE_BASE_SCALED:
        return {"rope_type": "default", "rope_theta": float(ROPE_BASE * ratio), "partial_rotary_factor": 0.5}
    if convention == ROPE_POSITIONS_SCALED:  # positions / ratio is inv_freq / ratio: linear scaling
        return {"rope_type": "linear", "factor": float(ratio), "rope_theta": float(ROPE_BASE),
                "partial_rotary_factor": 0.5}
    raise ValueError(f"rope_ratio {ratio} needs a known convention, got {convention!r}")


def glm_config_from_chatglm(config: dict, dtype: str, rope_convention: str | None = ROPE_BASE_SCALED):
    from transformers import GlmConfig

    c = {**CHATGLM_DEFAULTS, **config}
    return GlmConfig(
        architectures=["GlmForCausalLM"],
        vocab_size=c["padded_vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["ffn_hidden_size"],
        num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["multi_query_group_num"],
        head_dim=c["kv_channels"],
        hidden_act="silu",
        attention_dropout=c["attention_dropout"],
        max_position_embeddings=c["seq_length"],
        rms_norm_eps=c["layernorm_epsilon"],
        use_cache=c.get("use_cache", True),
        tie_word_embeddings=False,  # the remote code never ties (check_supported refuses a config that says so)
        rope_parameters=rope_parameters(config, rope_convention),
        attention_bias=c["add_qkv_bias"],
        eos_token_id=c.get("eos_token_id"),
        pad_token_id=c.get("pad_token_id"),
        bos_token_id=c.get("bos_token_id"),
        dtype=dtype,
    )


def plan_to_glm(config: dict, source: TensorSource, dtype: torch.dtype,
                config_file: Path = Path("config.json")) -> list[OutTensor]:
    """Checks the source against config.json, then maps every ChatGLM tensor to its Glm name(s)."""
    c = {**CHATGLM_DEFAULTS, **config}
    check_shapes(source, chatglm_shapes(config), config_file, optional=[INV_FREQ])
    q_rows = c["num_attention_heads"] * c["kv_channels"]
    kv_rows = c["multi_query_group_num"] * c["kv_channels"]
    plan = [whole("transformer.embedding.word_embeddings.weight", source, "model.embed_tokens.weight", dtype)]
    for i in range(c["num_layers"]):
        src, out = f"transformer.encoder.layers.{i}.", f"model.layers.{i}."
        plan.append(whole(src + "input_layernorm.weight", source, out + "input_layernorm.weight", dtype))
        for kind in ("weight", "bias") if c["add_qkv_bias"] else ("weight",):
            qkv = src + f"self_attention.query_key_value.{kind}"
            rest = source.shape(qkv)[1:]
            bounds = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
            for head, (start, stop) in bounds.items():
                plan.append(OutTensor(out + f"self_attn.{head}_proj.{kind}", (stop - start, *rest), dtype,
                                      [Piece(qkv, start, stop)]))
        plan.append(whole(src + "self_attention.dense.weight", source, out + "self_attn.o_proj.weight", dtype))
        plan.append(whole(src + "post_attention_layernorm.weight", source, out + "post_attention_layernorm.weight", dtype))
        plan.append(whole(src + "mlp.dense_h_to_4h.weight", source, out + "mlp.gate_up_proj.weight", dtype))
        plan.append(whole(src + "mlp.dense_4h_to_h.weight", source, out + "mlp.down_proj.weight", dtype))
    plan.append(whole("transformer.encoder.final_layernorm.weight", source, "model.norm.weight", dtype))
    plan.append(whole("transformer.output_layer.weight", source, "lm_head.weight", dtype))
    return plan


def carry_tokenizer(source: Path, dest: Path) -> None:
    """Copies the non-weight files; with a tokenizer.json, points tokenizer_config at the native class."""
    carry_files(source, dest)
    config_file = dest / "tokenizer_config.json"
    if not (dest / "tokenizer.json").exists() or not config_file.exists():
        return
    try:
        tok_config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{source / 'tokenizer_config.json'}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if "auto_map" in tok_config or re.match(r"ChatGLM", str(tok_config.get("tokenizer_class", ""))):
        tok_config.pop("auto_map", None)
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_file.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- rope_ratio in the remote code


def modeling_file(source: Path, config: dict) -> Path | None:
    """The remote modeling code config.json points at (auto_map), when it ships in the directory."""
    auto_map = config.get("auto_map") if isinstance(config.get("auto_map"), dict) else {}
    reference = auto_map.get("AutoModelForCausalLM") or auto_map.get("AutoModel") or "modeling_chatglm.X"
    if isinstance(reference, (list, tuple)):
        reference = reference[0] or ""
    if not isinstance(reference, str) or "--" in reference or "." not in reference:
        return None  # code in another repository ("THUDM/chatglm2-6b--modeling_chatglm.X"): not here
    path = source / (reference.rsplit(".", 1)[0].replace(".", "/") + ".py")
    return path if path.is_file() else None


def _is_ratio(node) -> bool:
    import ast

    return (isinstance(node, ast.Name) and node.id == "rope_ratio") or (
        isinstance(node, ast.Attribute) and node.attr == "rope_ratio")


def _names_base(node) -> bool:
    import ast

    return (isinstance(node, ast.Name) and "base" in node.id) or (isinstance(node, ast.Attribute) and "base" in node.attr) \
        or (isinstance(node, ast.Constant) and isinstance(node.value, (int, float)))


def rope_convention_of_code(code: str) -> str | None:
    """How the remote code applies rope_ratio, read from its syntax tree (never run): ROPE_BASE_SCALED
    (the rotary base multiplied: `base = base * self.rope_ratio`), ROPE_POSITIONS_SCALED (positions
    divided: `seq_idx = torch.arange(...) / self.rope_ratio`), ROPE_RATIO_UNUSED (never named), or None
    when it is used otherwise, both ways, or only passed around: the convention cannot be told."""
    import ast

    tree = ast.parse(code)
    if not any(_is_ratio(n) for n in ast.walk(tree)):
        return ROPE_RATIO_UNUSED
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and (_is_ratio(node.left) or _is_ratio(node.right)):
            other = node.right if _is_ratio(node.left) else node.left
            if isinstance(node.op, ast.Mult) and _names_base(other):
                found.add(ROPE_BASE_SCALED)
            elif isinstance(node.op, ast.Div) and _is_ratio(node.right) and not _is_ratio(node.left):
                found.add(ROPE_POSITIONS_SCALED)
            else:
                found.add("other")
        elif isinstance(node, ast.AugAssign) and _is_ratio(node.value):
            if isinstance(node.op, ast.Mult) and _names_base(node.target):
                found.add(ROPE_BASE_SCALED)
            elif isinstance(node.op, ast.Div) and not _names_base(node.target):
                found.add(ROPE_POSITIONS_SCALED)
            else:
                found.add("other")
    return found.pop() if len(found) == 1 and "other" not in found else None


def rope_convention(source: Path, config: dict, config_file: Path) -> str | None:
    """The remote code's rope_ratio convention, or None when rope_ratio is 1 (all agree); refuses a
    rope_ratio other than 1 whose convention cannot be told."""
    ratio = {**CHATGLM_DEFAULTS, **config}["rope_ratio"]
    if ratio == 1:
        return None
    if _written_by_our_export(source):
        return ROPE_BASE_SCALED  # `quantize export` writes rope_ratio = rope_theta / 10000 for lmdeploy's ChatGLM
    code = modeling_file(source, config)
    why = "no modeling_chatglm.py (the remote code auto_map names) beside the weights"
    if code is not None:
        try:
            convention = rope_convention_of_code(code.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            convention, why = None, f"{code.name} is not readable Python"
        else:
            why = f"{code.name} applies rope_ratio in a way this converter does not recognise"
        if convention is not None:
            return convention
    raise UserError(
        f"{config_file}: rope_ratio {ratio} is applied differently by different ChatGLM versions (ChatGLM3 and "
        "GLM-4 multiply the rotary base by it, ChatGLM2-6B-32K divides the positions by it) and config.json "
        f"cannot tell which, and {why}; not converted. Copy the checkpoint's own modeling_chatglm.py next to "
        "config.json and convert again")


def _written_by_our_export(source: Path) -> bool:
    try:
        record = json.loads((source / "export.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("layout") == "chatglm"


def convert(source: Path, dest: Path, dtype: str = "bfloat16", max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """ChatGLM remote-code dir -> GlmForCausalLM dir, written into the existing empty dir dest."""
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype}: use one of {', '.join(DTYPES)}")
    source = Path(source)
    config = checkpoint.open(source).config
    config_file = config_json.path(source)
    check_supported(config, config_file)
    convention = rope_convention(source, config, config_file)
    tensors = SafetensorsSource(source)
    vision = [n for n in tensors.names() if n.startswith("transformer.vision.")]
    if vision:
        raise UserError(f"{tensors.where(vision[0])}: holds the GLM-4V EVA-CLIP vision tower ({vision[0]}, ...); "
                        f"not converted. Supported: {SUPPORTED_CHATGLM}")
    plan = plan_to_glm(config, tensors, DTYPES[dtype], config_file)
    glm_config = glm_config_from_chatglm(config, dtype, convention)
    write_checkpoint(plan, tensors, dest, max_shard_bytes, label=f"ChatGLM -> Glm ({dtype})")
    glm_config.save_pretrained(dest)
    carry_tokenizer(source, dest)
    return "GlmForCausalLM"
