"""What a quantization run will do, decided from config.json before any weight is loaded:
the architecture's support, the group size, and what is left in full precision and why."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.errors import UserError

GROUP_SIZES = (128, 64, 32, 16)

# (pattern, reason): modules left in full precision.
IGNORE = [
    ("lm_head", "output head: small, and its error goes straight into every logit"),
    ("re:.*visual.*", "vision tower: kept in full precision by design"),
    ("re:.*mlp\\.gate$", "MoE router: tiny, and routing is sensitive to error"),
]


def text_config(config: dict) -> dict:
    return config.get("text_config") or config


def architecture(config: dict) -> str:
    archs = config.get("architectures") or []
    if not archs:
        raise UserError("config.json has no 'architectures' entry; re-save the checkpoint with transformers")
    return archs[0]


def linear_input_widths(config: dict) -> dict[str, int]:
    """Input width of each kind of quantized Linear, named for the error message."""
    text = text_config(config)
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


def group_size_problem(config: dict, group_size: int, model_dir: Path | str) -> str | None:
    for what, width in linear_input_widths(config).items():
        if width % group_size:
            fits = [g for g in GROUP_SIZES if all(w % g == 0 for w in linear_input_widths(config).values())]
            hint = f"; use {fits[0]}" if fits else ""
            return f"{group_size} does not divide {width} ({what} of {model_dir}){hint}"
    return None


def choose_group_size(config: dict, requested: int | str, model_dir: Path | str) -> int:
    """128 unless the model needs smaller; an explicit size that does not fit is refused."""
    if requested == "auto":
        for size in GROUP_SIZES:
            if group_size_problem(config, size, model_dir) is None:
                return size
        widths = ", ".join(f"{k} {v}" for k, v in linear_input_widths(config).items())
        raise UserError(f"{model_dir}: no group size in {GROUP_SIZES} divides the layer widths ({widths})")
    problem = group_size_problem(config, int(requested), model_dir)
    if problem:
        raise UserError(f"group_size: {problem}")
    return int(requested)


def read_config(model_dir: Path | str) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise UserError(f"{model_dir}: no config.json; is this a checkpoint directory? (build one with `quantize resave`)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{path}: not valid JSON; restore the config.json that came with the weights") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: not a JSON object; restore the config.json that came with the weights")
    return config


def ignore_patterns() -> list[str]:
    return [pattern for pattern, _ in IGNORE]


def ignore_reasons() -> dict[str, str]:
    return dict(IGNORE)


def matches(name: str, pattern: str) -> bool:
    """compressed-tensors' rule: `re:` patterns with re.match, anything else the exact name."""
    if pattern.startswith("re:"):
        return re.match(pattern.removeprefix("re:"), name) is not None
    return name == pattern


def is_ignored(name: str) -> bool:
    return any(matches(name, pattern) for pattern in ignore_patterns())


def expected_quantized(model) -> list[str]:
    """The plan: every nn.Linear outside the ignore list, read off the loaded model before
    calibration (MoE experts count once linearized, one Linear per expert)."""
    import torch

    return sorted(name for name, module in model.named_modules()
                  if isinstance(module, torch.nn.Linear) and not is_ignored(name))


_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")


def routed_experts(config: dict) -> int:
    text = text_config(config)
    return max((text.get(key) or 0 for key in _EXPERT_COUNT_KEYS), default=0)


def check_architecture(config: dict, model_dir: Path | str) -> str:
    """Refuses, before any weight loads, what transformers cannot build or what would be half
    quantized: routed experts stored as fused 3-D tensors are no nn.Linear, so a "Linear"
    recipe would skip them unless they load as one Linear per expert."""
    from transformers import CONFIG_MAPPING

    from pipeline.quantize import compat

    if not config.get("model_type"):
        raise UserError(f"{Path(model_dir) / 'config.json'}: no model_type; restore the config.json that came with "
                        "the weights")
    if not config.get("architectures"):
        raise UserError(f"{Path(model_dir) / 'config.json'}: no 'architectures' entry; restore the config.json that "
                        "came with the weights, or re-save the checkpoint with transformers")
    arch = architecture(config)
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise UserError(f"{model_dir}: transformers does not know model_type {model_type!r} ({arch}); "
                        "upgrade transformers, or resave the checkpoint in a supported architecture")
    if routed_experts(config) and not compat.loads_linearized(model_type):
        raise UserError(
            f"{model_dir}: {arch} keeps its {routed_experts(config)} routed experts as fused 3-D tensors, which "
            f"llm-compressor cannot load as one Linear per expert (model_type {model_type!r} has no "
            "linearization mapping), so they would stay unquantized; register one in "
            "pipeline/quantize/compat.py EXTRA_LINEARIZED_MOE"
        )
    return arch
