"""What a quantization run will do, decided from config.json before any weight is loaded: the architecture's
support, what is left in full precision and why, the decoder layers, the memory on the device and the host, and
where the model is placed (the group size: pipeline/methods/int4.py)."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.checkpoints import config_json
from pipeline.errors import UserError

# (pattern, reason): modules left in full precision.
IGNORE = [
    ("lm_head", "output head: small, and its error goes straight into every logit"),
    ("re:.*visual.*", "vision tower: kept in full precision by design"),
    ("re:.*mlp\\.gate$", "MoE router: tiny, and routing is sensitive to error"),
]


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


def check_architecture(config: dict, model_dir: Path | str) -> str:
    """Refuses, before any weight loads, what transformers cannot build or what would be half
    quantized: routed experts stored as fused 3-D tensors are no nn.Linear, so a "Linear"
    recipe would skip them unless they load as one Linear per expert."""
    from transformers import CONFIG_MAPPING

    from pipeline.checkpoints import linear_experts

    if not config.get("model_type"):
        raise UserError(f"{config_json.path(model_dir)}: no model_type; restore the config.json that came with "
                        "the weights")
    arch = config_json.architecture(config, model_dir)
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise UserError(f"{model_dir}: transformers does not know model_type {model_type!r} ({arch}); "
                        "upgrade transformers, or resave the checkpoint in a supported architecture")
    _check_served_layout(config, model_dir, arch)
    experts = config_json.routed_experts(config)
    if experts and not linear_experts.loads_linearized(model_type):
        raise UserError(
            f"{model_dir}: {arch} keeps its {experts} routed experts as fused 3-D tensors, which "
            f"llm-compressor cannot load as one Linear per expert (model_type {model_type!r} has no "
            "linearization mapping), so they would stay unquantized; register one in "
            "pipeline/checkpoints/linear_experts.py EXTRA_LINEARIZED_MOE"
        )
    return arch


def _check_served_layout(config: dict, model_dir: Path | str, arch: str) -> None:
    """A checkpoint of transformers' glm46v type is refused by name: no engine we run has a model for it (vLLM 0.24,
    lmdeploy 0.18), so neither would verify's checks of vLLM's names hold nor would its variants be served, and with
    a MoE text model transformers keeps its experts fused (pipeline/checkpoints/serving_names.py: GLM-4.6V's layouts).
    `quantize resave` writes the same model in the layout vLLM serves, as the dvc pipeline's resave stage does."""
    from pipeline.checkpoints import serving_names

    layout = serving_names.served_layout(config, model_dir)
    if layout is not None:
        raise UserError(f"{model_dir}: {arch} (model_type {config.get('model_type')}): no engine this pipeline serves "
                        f"with has a model for it (vLLM 0.24, lmdeploy 0.18); it is the same model as a {layout[1]}, "
                        f"the layout GLM-4.6V's releases carry: `quantize resave {model_dir} --out DIR` writes it so; "
                        "then quantize DIR")


# ---------------------------------------------------------------- resources

# modules named like decoder layers: model.layers.3, model.language_model.layers.3
_DECODER_LAYER = re.compile(r"(.*\.)?layers\.\d+")


def _is_vision(name: str) -> bool:
    return ".visual." in name or name.startswith("visual.") or "vision" in name


def decoder_layers(model) -> list[tuple[str, "object"]]:
    """The text decoder layers, in order (the units the sequential pipeline calibrates one by one)."""
    return [(name, module) for name, module in model.named_modules()
            if _DECODER_LAYER.fullmatch(name) and not _is_vision(name)]


def _experts_in(layer) -> int:
    """Routed experts inside a decoder layer (fused or one Linear per expert), 0 for a dense layer."""
    for name, module in layer.named_modules():
        if name.endswith("experts") and not name.endswith("shared_experts") and hasattr(module, "num_experts"):
            return int(module.num_experts)
    return 0


def layer_kind(layer) -> str:
    experts = _experts_in(layer)
    return f"{type(layer).__name__}, {experts} experts" if experts else f"{type(layer).__name__}, dense"


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def footprint(model) -> dict:
    """Parameters of the whole model and of each kind of decoder layer."""
    layers = decoder_layers(model)
    kinds: dict[str, dict] = {}
    for name, layer in layers:
        kind = kinds.setdefault(layer_kind(layer), {"count": 0, "params": _params(layer), "first": name})
        kind["count"] += 1
    total = _params(model)
    in_layers = sum(k["count"] * k["params"] for k in kinds.values())
    return {"layers": len(layers), "kinds": kinds, "params": total, "other_params": total - in_layers,
            "largest_layer_params": max((k["params"] for k in kinds.values()), default=0)}


def working_set_bytes(config: dict, kind: str, tokens: int, batch_tokens: int, dtype_bytes: int,
                      state: str = "none") -> int:
    """A rough upper estimate of the device memory one decoder layer's calibration needs beyond its
    weights: the batch's activations through the widest projection, plus what the method holds per layer
    (its CALIBRATION_STATE, pipeline/methods/): "activation-cache" (AWQ), the cached inputs of the attention (replayed per
    scale candidate), its outputs, and the float32 Gram matrices of the single-Linear mappings;
    "hessians" (GPTQ), one float32 in x in matrix per quantized Linear. `--plan`'s probe measures the real figure."""
    text = config_json.text_section(config)
    hidden = text["hidden_size"]
    experts = int(kind.split(", ")[1].split()[0]) if "experts" in kind else 0
    inner = (text.get("moe_intermediate_size") or text.get("intermediate_size") or 4 * hidden) if experts \
        else (text.get("intermediate_size") or 4 * hidden)
    activations = batch_tokens * (4 * hidden + 3 * 2 * inner) * dtype_bytes
    if state == "activation-cache":
        cached = 3 * tokens * hidden * dtype_bytes
        grams = 4 * (hidden ** 2 + (max(experts, 1) + 1) * inner ** 2)
        return activations + cached + grams
    if state == "hessians":  # attention's four Linears read `hidden`; each MLP (or expert) two at hidden, one at inner
        mlps = (experts + 1) if experts else 1
        return activations + 4 * (4 * hidden ** 2 + mlps * (2 * hidden ** 2 + inner ** 2))
    return activations


def between_layers_bytes(tokens: int, hidden: int, dtype_bytes: int) -> int:
    """The sequential pipeline's activations between decoder layers: a layer's inputs, its outputs and the
    position embeddings beside them (on the host, or on the device when the whole model sits there)."""
    return 3 * tokens * hidden * dtype_bytes


def host_bytes(params: int, dtype_bytes: int, tokens: int, hidden: int, layers: int, probe_tokens: int,
               offload: bool) -> int:
    """Host memory: the weights (all of them with offloading; with the model on the device they pass
    through the host once while loading), the calibration activations between layers (the sequential
    pipeline keeps them on the host), the verify stage's per-layer reference inputs and outputs, and
    ~2 GB of libraries."""
    weights = params * dtype_bytes
    between_layers = between_layers_bytes(tokens, hidden, dtype_bytes)
    reference = 2 * probe_tokens * hidden * 4 * layers * 2
    return weights + between_layers + reference + (2 << 30)


PLACEMENTS = ("auto", "device", "offload")


def choose_placement(requested: str, weights_bytes: int, working_bytes: int, free_device_bytes: int | None) -> tuple[str, str]:
    """(placement, why). "device": the whole model on the accelerator (fastest when it fits);
    "offload": on the host, each decoder layer brought to the accelerator in turn."""
    if requested not in PLACEMENTS:
        raise UserError(f"placement {requested!r}: use one of {', '.join(PLACEMENTS)}")
    if requested != "auto":
        return requested, "as asked"
    if free_device_bytes is None:
        return "device", "no accelerator: everything runs on the CPU"
    need = weights_bytes + working_bytes + (2 << 30)
    if need <= 0.9 * free_device_bytes:
        return "device", f"weights + calibration ({need / 2**30:.1f} GiB) fit in 90 % of the free {free_device_bytes / 2**30:.1f} GiB"
    return "offload", (f"weights + calibration ({need / 2**30:.1f} GiB) exceed 90 % of the free "
                       f"{free_device_bytes / 2**30:.1f} GiB: one layer at a time on the device")
