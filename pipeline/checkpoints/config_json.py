"""config.json: the one reader of a checkpoint's settings, and the facts every stage takes from them.

`read` parses it and refuses, naming the file and the fix, a missing directory or file, text that is
not UTF-8 or not JSON, and JSON that is not an object. `load` has transformers build its config object
(a known model_type, values of the right types). Everything else is a plain function of the parsed
dict, so a vision-language model (Glm4v: the language model's settings under `text_config`) and a
text model answer alike: the architecture, the text section, layer widths, routed experts, the
vocabulary, the positions it was built for, its dtype, the vision tower, the quantization config.
generation_config.json's end-of-sequence ids are read here too. Model loading sits beside this module
(`checkpoints.loading`).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import UserError

NAME = "config.json"
REBUILD = "rebuild the checkpoint (`quantize resave`, `quantize awq`, `quantize fp8`)"
# keys transformers and the ChatGLM remote code use for the same facts, in the order they are tried
_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
_POSITION_KEYS = ("max_position_embeddings", "seq_length", "max_sequence_length", "n_positions")
DTYPES = ("float16", "bfloat16", "float32")


# ---------------------------------------------------------------- the file


def path(model_dir: Path | str) -> Path:
    return Path(model_dir) / NAME


def present(model_dir: Path | str) -> bool:
    """Whether `model_dir` looks like a checkpoint directory (holds a config.json); `read` says what is wrong."""
    return path(model_dir).is_file()


def read(model_dir: Path | str) -> dict:
    """config.json of a checkpoint directory, parsed; refuses a missing directory or file and anything
    that is not a JSON object."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise UserError(f"{model_dir}: no such directory; pass a checkpoint directory (models/base or "
                        "models/<variant>), or build one with `quantize resave`")
    if not model_dir.is_dir():
        raise UserError(f"{model_dir}: not a directory; pass the checkpoint directory that holds config.json "
                        "and the weights")
    config_file = path(model_dir)
    if not config_file.is_file():
        raise UserError(f"{model_dir}: no config.json; a checkpoint directory holds config.json beside its weights: "
                        f"copy it from where the weights came from, or {REBUILD}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{config_file}: not UTF-8 text; restore the config.json that came with the weights") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{config_file}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg}); restore the "
                        "config.json that came with the weights") from None
    except OSError as exc:
        raise UserError(f"{config_file}: cannot be read ({exc.strerror})") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_file}: holds a JSON {type(config).__name__}, not an object of settings; restore "
                        "the config.json that came with the weights")
    return config


def load(model_dir: Path | str, config: dict | None = None):
    """The transformers config object, or a UserError naming config.json and the fix."""
    import transformers
    from transformers import CONFIG_MAPPING, AutoConfig

    model_dir = Path(model_dir)
    config = read(model_dir) if config is None else config
    config_file = path(model_dir)
    model_type = config.get("model_type")
    if not model_type:
        raise UserError(f"{config_file}: no model_type; restore the config.json that came with the weights")
    if model_type == "chatglm":
        raise UserError(f"{config_file}: a ChatGLM remote-code checkpoint, which transformers does not load natively; "
                        f"convert it first: quantize resave {model_dir} --out DIR")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        arch = (config.get("architectures") or ["no architectures entry"])[0]
        raise UserError(f"{config_file}: transformers does not know model_type {model_type!r} ({arch}); upgrade "
                        f"transformers (this is {transformers.__version__}), or resave the checkpoint in a supported "
                        "architecture (`quantize resave` converts ChatGLM and GGUF)")
    try:
        return AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # transformers' strict validation: a wrong type or value in a key
        raise UserError(f"{config_file}: not a valid {model_type} config ({one_line(exc)}); restore the config.json "
                        "that came with the weights") from None


def one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


# ---------------------------------------------------------------- facts (of the parsed dict)


def text_section(config: dict) -> dict:
    """The language model's settings: `text_config` of a vision-language model, else the whole config."""
    text = config.get("text_config")
    return text if isinstance(text, dict) and text else config


def text_section_named(config: dict) -> tuple[dict, str]:
    """(the text section, its key path for messages: 'text_config.' or '')."""
    text = config.get("text_config")
    return (text, "text_config.") if isinstance(text, dict) else (config, "")


def sections(config: dict) -> list[dict]:
    """The config and its sub-configs that carry settings of their own (text, vision)."""
    return [config] + [config[sub] for sub in ("text_config", "vision_config") if isinstance(config.get(sub), dict)]


def architecture(config: dict, model_dir: Path | str | None = None) -> str:
    archs = config.get("architectures") or []
    if not archs:
        where = path(model_dir) if model_dir is not None else NAME
        raise UserError(f"{where}: no 'architectures' entry; restore the config.json that came with the weights, "
                        "or re-save the checkpoint with transformers")
    return archs[0]


def architecture_or(config: dict, default: str) -> str:
    """The architecture for messages and records, `default` when config.json names none."""
    return (config.get("architectures") or [default])[0]


def routed_experts(config: dict) -> int:
    """Routed experts per MoE layer; 0 for a dense model."""
    text = text_section(config)
    return max((text.get(key) or 0 for key in _EXPERT_COUNT_KEYS), default=0)


def dense_layers_first(config: dict) -> int:
    """Leading decoder layers with a dense MLP in a MoE model (GLM-4.5V: first_k_dense_replace)."""
    return int(text_section(config).get("first_k_dense_replace") or 0)


def linear_input_widths(config: dict) -> dict[str, int]:
    """Input width of each kind of quantized Linear, named for messages (group sizes must divide each)."""
    text = text_section(config)
    hidden = text["hidden_size"]
    heads = text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (hidden // heads if heads else None)
    widths = {"hidden size": hidden}
    if text.get("intermediate_size"):
        widths["intermediate size"] = text["intermediate_size"]
    if text.get("moe_intermediate_size"):
        widths["MoE intermediate size"] = text["moe_intermediate_size"]
    if heads and head_dim and heads * head_dim != hidden:
        widths["attention width (heads x head_dim)"] = heads * head_dim
    return widths


def hidden_size(config: dict) -> int | None:
    value = text_section(config).get("hidden_size")
    return value if isinstance(value, int) else None


def kv_cache_shape(config: dict) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the text decoder, under transformers' names or the ChatGLM remote code's."""
    text = text_section(config)
    layers = text.get("num_hidden_layers") or text.get("num_layers")
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or text.get("multi_query_group_num") or heads
    head_dim = text.get("head_dim") or text.get("kv_channels") or text["hidden_size"] // heads
    return layers, kv_heads, head_dim


def vocab_size(config: dict) -> int:
    return text_section(config).get("vocab_size") or config.get("padded_vocab_size") or 0


def synthetic_weights(config: dict) -> str | None:
    """Why the weights were made up (a random model built to time the pipeline sets `synthetic_weights` to it), or
    None for weights that came from training."""
    why = config.get("synthetic_weights")
    return str(why) if why else None


def base_facts(config: dict | None) -> dict:
    """What the verdict asks of the base's config.json: its vocabulary and whether its weights were made up."""
    config = config if isinstance(config, dict) else {}
    return {"vocab_size": vocab_size(config) or None, "synthetic_weights": synthetic_weights(config)}


def tied_embeddings(config: dict) -> bool:
    return bool(text_section(config).get("tie_word_embeddings", False))


def max_positions(config: dict) -> int | None:
    """Positions the model was built for; None when the config does not say."""
    for section in (config, config.get("text_config") or {}):
        for key in _POSITION_KEYS:
            if isinstance(section.get(key), int):
                return section[key]
    return None


def dtype(config: dict, default: str = "float16") -> str:
    """The dtype the weights are meant to run in (torch_dtype / dtype, top level first), `default` if unsaid."""
    for section in (config, config.get("text_config") or {}):
        name = section.get("torch_dtype") or section.get("dtype")
        if name in DTYPES:
            return name
    return default


def has_vision(config: dict) -> bool:
    """A vision tower and an image token to feed it through."""
    return bool(config.get("vision_config")) and config.get("image_token_id") is not None


def quantization(config: dict) -> dict:
    """quantization_config, {} for a model in full precision."""
    found = config.get("quantization_config")
    return found if isinstance(found, dict) else {}


def quantized_activations(config: dict) -> list[str]:
    """Each config group of a compressed-tensors checkpoint whose input activations are quantized, in words (e.g.
    "group_0: float 8-bit, static, tensor"); [] for weight-only quantization (W4A16, W8A16) or none."""
    found = []
    groups = quantization(config).get("config_groups")
    for name, group in (groups.items() if isinstance(groups, dict) else []):
        acts = group.get("input_activations") if isinstance(group, dict) else None
        if isinstance(acts, dict) and acts.get("num_bits"):
            how = "dynamic" if acts.get("dynamic") else "static"
            found.append(f"{name}: {acts.get('type', '?')} {acts['num_bits']}-bit, {how}, {acts.get('strategy', '?')}")
    return found


def is_compressed_tensors(config: dict) -> bool:
    return quantization(config).get("quant_method") == "compressed-tensors"


def _generation_config(model_dir: Path | str) -> dict:
    """generation_config.json's fields, {} when the file is absent or does not parse."""
    generation = Path(model_dir) / "generation_config.json"
    if not generation.is_file():
        return {}
    try:
        found = json.loads(generation.read_text(encoding="utf-8"))
    except (ValueError, OSError):
        return {}
    return found if isinstance(found, dict) else {}


def generation_eos(model_dir: Path | str):
    """generation_config.json's eos_token_id (an id or a list of ids), None when the file or the key is absent
    or the file does not parse (the tokenizer's own end-of-sequence token still stops generation)."""
    return _generation_config(model_dir).get("eos_token_id")


def generation_sampling(model_dir: Path | str) -> dict:
    """The sampling generation_config.json recommends: those of temperature, top_p and top_k it sets to a number in
    range (a file that does not sample, do_sample false, recommends none)."""
    found = _generation_config(model_dir)
    if found.get("do_sample") is False:
        return {}
    ranges = {"temperature": (0, 10), "top_p": (0, 1), "top_k": (0, 1_000_000)}
    return {key: found[key] for key, (low, high) in ranges.items()
            if isinstance(found.get(key), (int, float)) and not isinstance(found[key], bool) and low <= found[key] <= high}


def kv_cache_scheme(config: dict) -> dict | None:
    """The FP8 KV-cache scheme a compressed-tensors checkpoint carries, else None."""
    return quantization(config).get("kv_cache_scheme")
