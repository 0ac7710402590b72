"""What a serving engine reads of a checkpoint beyond what transformers writes: the config keys GLM's
own releases carry, and the names vLLM gives the modules an ignore list must match.

Config keys: a `Glm4vMoeConfig` written by transformers 5.17 has no `use_qk_norm`, which vLLM's
Glm4Moe text model reads (GLM-4.5V's release carries `"use_qk_norm": false`); such a checkpoint is
refused by vLLM at load. `add_release_keys` writes the keys GLM's releases carry where they are
missing, with the value that matches what transformers computes (no QK norm).

Names: vLLM loads GLM-4V checkpoints through a prefix mapper (`model.visual.` -> `visual.`,
`model.language_model.` -> `language_model.model.`, `lm_head.` -> `language_model.lm_head.`) and
fuses some vision Linears (`attn.qkv` is looked up as `attn.qkv_proj` and checked as its q/k/v shards;
`mlp.gate_proj` + `mlp.up_proj` as `mlp.gate_up_proj`, checked as those two). Its compressed-tensors loader maps the
ignore list through the same prefix mapper and asks, per layer it builds, whether the layer's name
(or every shard's) equals an entry or `re.match`es a `re:` entry. A vision Linear that the
checkpoint leaves in bf16 but whose vLLM name matches no entry is built quantized: no error, and
only image answers suffer. llm-compressor writes the ignore list as HF module names
(`model.visual.blocks.0.attn.qkv`), whose q/k/v shards vLLM's check never matches: on the H200, vLLM 0.24
built every vision `attn.qkv` quantized from such a list, without a word; `VISION_IGNORE` (one
regex that matches both namings) is added to every variant's ignore list, and `vllm_unignored`
lists what vLLM would quantize, for `verify` to refuse. Config groups' targets go through the same prefix mapper
when they are layer paths (a `re:` target is left as it is), so the `mixed` method's `re:` targets name vLLM's layer
names beside the HF ones (`target_renaming`).

GLM-4.6V's layouts (issue 55): the published checkpoints carry the layouts vLLM serves, GLM-4.6V-Flash
`Glm4vForConditionalGeneration` (model_type glm4v) and GLM-4.6V `Glm4vMoeForConditionalGeneration` (glm4v_moe);
transformers 5's own `glm46v` model type (`Glm46VForConditionalGeneration`) is not one vLLM has a model for.
`served_config` says what such a checkpoint is in the layout vLLM serves (`quantize resave` writes it so).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.checkpoints import checkpoint, config_json, fused

# config keys GLM's releases carry that transformers does not write, on the text config: {model_type: {key: value}}
RELEASE_KEYS = {"glm4v_moe_text": {"use_qk_norm": False}, "glm4_moe": {"use_qk_norm": False}}

VISION_IGNORE = "re:^(model\\.)?visual\\..*"

# vLLM's names for GLM-4V checkpoints, as vLLM 0.24.0 decided them on the H200 (benchmarks/results/
# gpu_glm46v_vllm.json): the prefix mapper below; the vision attention's `attn.qkv` looked up under the
# quantization prefix `attn.qkv_proj`, a fused layer checked as its q/k/v shards (so its HF name never matches:
# with llm-compressor's own list vLLM built it CompressedTensorsLinearMethod, the rest of the tower
# unquantized); the vision MLP's gate_proj + up_proj fused as gate_up_proj and checked as those two shards.
VLLM_PREFIXES = {"model.visual.": "visual.", "model.language_model.": "language_model.model.",
                 "lm_head.": "language_model.lm_head."}
VLLM_PREFIX_ARCHS = {"Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration"}
VLLM_FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
EXPERT_LINEAR = re.compile(r"\.experts\.\d+\.")
VLLM_VISION_RENAMES = [(re.compile(r"\.attn\.qkv$"), ".attn.qkv_proj"),
                       (re.compile(r"\.(gate|up)_proj$"), ".gate_up_proj")]


# GLM-4.6V's layouts, as found (issue 55):
# - published: GLM-4.6V-Flash (9B) is `Glm4vForConditionalGeneration`, model_type glm4v (its Hub page tags it glm4v;
#   transformers 5.17's docs/source/en/model_doc/glm4v.md lists it among the models of that type; its README's commit
#   "Glm4vMoeForConditionalGeneration change to Glm4vForConditionalGeneration"); GLM-4.6V (106B) is
#   `Glm4vMoeForConditionalGeneration`, model_type glm4v_moe (the Hub's API for zai-org/GLM-4.6V, revision 4e2d47eb,
#   2025-12-09). Both ship the Glm46VProcessor, which vLLM's glm4_1v.py handles.
# - vLLM 0.24.0 (vllm/model_executor/models/registry.py of its wheel) registers Glm4vForConditionalGeneration and
#   Glm4vMoeForConditionalGeneration (module glm4_1v), no Glm46VForConditionalGeneration: with model_impl auto, an
#   unregistered architecture falls back to vLLM's generic Transformers backend (registry.py
#   _try_resolve_transformers), whose names and fused layers are not the ones checked here and which no run covers.
# - transformers 5.17's glm46v (models/glm46v/modular_glm46v.py): Glm46VForConditionalGeneration is
#   Glm4vForConditionalGeneration with the text and vision models built from their own configs (text glm4v_text by
#   default, or glm4v_moe_text) and GLM-4.6's token-id defaults (video start/end 151361/151362). Built and saved
#   here (tests/tiny.py save_tiny_glm46v): with glm4v_text its tensors (names and shapes) and every config key equal
#   Glm4v's; with glm4v_moe_text its config keys equal Glm4vMoe's (less use_qk_norm, a release key written below),
#   but its routed experts are saved as two fused 3-D tensors per layer (mlp.experts.gate_up_proj, .down_proj),
#   where Glm4vMoe's checkpoints and vLLM's loader have one gate/up/down tensor per expert (transformers converts
#   glm4v_moe's on load and save, `conversion_mapping.py`, and glm46v's not). Loaded as Glm4v / Glm4vMoe, either gives
#   the very logits of the glm46v model (tests/test_resave.py).
# glm46v's text model_type -> the same model in the layout vLLM serves: (model_type, architecture, vision model_type)
GLM46V = "glm46v"
SERVED_AS = {"glm4v_text": ("glm4v", "Glm4vForConditionalGeneration", "glm4v_vision"),
             "glm4v_moe_text": ("glm4v_moe", "Glm4vMoeForConditionalGeneration", "glm4v_moe_vision")}


def served_layout(config: dict, model_dir: Path | str | None = None) -> tuple[str, str, str] | None:
    """(model_type, architecture, vision model_type) of a glm46v checkpoint in the layout vLLM serves; None for any
    other model type. A glm46v text model_type with no such layout is refused by name."""
    from pipeline.errors import UserError

    if config.get("model_type") != GLM46V:
        return None
    text, where = config_json.text_section_named(config)
    text_type = text.get("model_type") if where else None
    text_type = text_type or "glm4v_text"  # transformers' Glm46VConfig default
    if text_type not in SERVED_AS:
        where_file = config_json.path(model_dir) if model_dir is not None else config_json.NAME
        raise UserError(f"{where_file}: model_type glm46v with {where or 'a '}model_type {text_type!r}: no layout vLLM "
                        f"serves holds it (it serves glm46v's text models {', '.join(SERVED_AS)} as "
                        f"{', '.join(arch for _, arch, _ in SERVED_AS.values())})")
    return SERVED_AS[text_type]


def served_config(config: dict, model_dir: Path | str | None = None) -> dict | None:
    """A glm46v config (transformers' full dict: every token id set) as the same model's config in the layout vLLM
    serves (Glm4v or Glm4vMoe), every other key as it is; None for any other model type."""
    layout = served_layout(config, model_dir)
    if layout is None:
        return None
    model_type, architecture, vision_type = layout
    served = {**config, "model_type": model_type, "architectures": [architecture]}
    if isinstance(config.get("vision_config"), dict):
        served["vision_config"] = {**config["vision_config"], "model_type": vision_type}
    return served


def add_release_keys(config: dict) -> list[str]:
    """Adds missing release keys to the text config in place; returns what was added, e.g.
    ['text_config.use_qk_norm']."""
    text, where = config_json.text_section_named(config)
    added = []
    for key, value in RELEASE_KEYS.get(text.get("model_type"), {}).items():
        if key not in text:
            text[key] = value
            added.append(where + key)
    return added


def add_vision_ignore(config: dict) -> bool:
    """Adds VISION_IGNORE to a quantized multimodal config's ignore list; True when it changed."""
    quant = config_json.quantization(config)
    if not quant or not config.get("vision_config"):
        return False
    ignore = quant.setdefault("ignore", [])
    if VISION_IGNORE in ignore:
        return False
    ignore.append(VISION_IGNORE)
    return True


def finish_config(model_dir: Path | str) -> dict:
    """Writes the release keys and the vision ignore entry into model_dir/config.json; returns what changed."""
    path, config = config_json.path(model_dir), config_json.read(model_dir)
    added, vision = add_release_keys(config), add_vision_ignore(config)
    if added or vision:
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return {"release_keys": added, "vision_ignore": VISION_IGNORE if vision else None}


# ---------------------------------------------------------------- vLLM's names

def _map_prefix(name: str) -> str:
    for old, new in VLLM_PREFIXES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def target_renaming(architecture: str):
    """How vLLM renames a checkpoint's module for this architecture (its prefix mapper), None when it keeps the HF
    names: the `mixed` method's `re:` targets name both (pipeline/checkpoints/fused.py target_regex)."""
    return _map_prefix if architecture in VLLM_PREFIX_ARCHS else None


def _map_target(target: str, architecture: str) -> str:
    """A config group's target as vLLM 0.24 reads it (compressed_tensors.py apply_vllm_mapper): a layer path (a dot,
    no `re:`) through the prefix mapper; a class name or a `re:` pattern as it is."""
    if architecture in VLLM_PREFIX_ARCHS and "." in target and not target.startswith("re:"):
        return _map_prefix(target)
    return target


def vllm_layer(hf_linear: str, architecture: str) -> str:
    """The name of the layer vLLM builds for a checkpoint Linear (a fused layer for q/k/v or gate/up)."""
    name = _map_prefix(hf_linear) if architecture in VLLM_PREFIX_ARCHS else hf_linear
    if name.startswith("visual."):
        for pattern, replacement in VLLM_VISION_RENAMES:
            name = pattern.sub(replacement, name)
    return name


def _matches(name: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return name == entry


def vllm_ignores(layer: str, ignore: list[str]) -> bool:
    """vLLM's should_ignore_layer: a fused layer is ignored when each shard is (all or none)."""
    proj = layer.rsplit(".", 1)[-1]
    if proj in VLLM_FUSED and layer not in ignore:
        shards = [layer[: -len(proj)] + shard for shard in VLLM_FUSED[proj]]
        return all(any(_matches(shard, entry) for entry in ignore) for shard in shards)
    return any(_matches(layer, entry) for entry in ignore)


def vllm_unignored(config: dict, unquantized_linears: list[str]) -> list[str]:
    """The checkpoint's unquantized Linears (HF names) that vLLM would build quantized."""
    quant = config_json.quantization(config)
    if not quant:
        return []
    architecture = config_json.architecture_or(config, "")
    mapped = [_map_prefix(e) if architecture in VLLM_PREFIX_ARCHS and not e.startswith("re:") else e
              for e in quant.get("ignore") or []]
    return [name for name in unquantized_linears if not vllm_ignores(vllm_layer(name, architecture), mapped)]


def _stored_group(linear: str, groups: dict) -> str | None:
    """The config group compressed-tensors quantized a Linear with: a name or `re:` target outranks a class target."""
    for key, group in groups.items():
        if any(t != "Linear" and _matches(linear, t) for t in group.get("targets") or []):
            return key
    return next((key for key, group in groups.items() if "Linear" in (group.get("targets") or [])), None)


def _served_group(layer: str, groups: dict, architecture: str = "") -> str | None:
    """The config group vLLM builds a layer with (its find_matched_target): the first target equal to or `re.match`ing
    the layer's name, else one contained in its class name (every vLLM linear class contains "Linear"), else the
    target every shard of a fused layer matches. Targets as vLLM maps them (`_map_target`)."""
    targets = [(_map_target(t, architecture), key) for key, group in groups.items() for t in group.get("targets") or []]
    for target, key in targets:
        if _matches(layer, target):
            return key
    for target, key in targets:
        if not target.startswith("re:") and target.lower() in "linear":
            return key
    proj = layer.rsplit(".", 1)[-1]
    if proj in VLLM_FUSED:
        shards = [next((key for t, key in targets if _matches(layer[: -len(proj)] + shard, t)), None)
                  for shard in VLLM_FUSED[proj]]
        return shards[0] if all(shards) else None
    return None


def vllm_scheme_conflicts(config: dict, quantized_linears: list[str]) -> list[str]:
    """Quantized Linears (HF names) that vLLM would build with another config group than the one that quantized them
    (a checkpoint of several config groups: the `mixed` method's W4A16 and W8A16): vLLM reads their weights with the
    wrong scheme (its shapes refuse the load, or worse). 'name: stored in group_1, vLLM builds model...qkv_proj with
    group_0'."""
    quant = config_json.quantization(config) or {}
    groups = {k: g for k, g in (quant.get("config_groups") or {}).items() if isinstance(g, dict)}
    if len(groups) < 2:
        return []
    architecture = config_json.architecture_or(config, "")
    conflicts = []
    for linear in quantized_linears:
        if EXPERT_LINEAR.search(linear):
            continue  # a routed expert runs in its layer's FusedMoE, looked up by the layer's prefix
        layer = fused.group_name(vllm_layer(linear, architecture))  # q/k/v -> qkv_proj, gate/up -> gate_up_proj
        stored, served = _stored_group(linear, groups), _served_group(layer, groups, architecture)
        if stored != served:
            conflicts.append(f"{linear}: stored in {stored}, vLLM builds {layer} with {served}")
    return conflicts


# ---------------------------------------------------------------- a checkpoint checked against vLLM's names

def quantized_linears(variant_dir: Path) -> list[str]:
    """Modules the checkpoint stores quantized (a `weight_scale` beside them), from the safetensors headers."""
    from safetensors import safe_open

    found = set()
    for shard in sorted(Path(variant_dir).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            found |= {key[: -len(".weight_scale")] for key in f.keys() if key.endswith(".weight_scale")}
    return sorted(found)


def unquantized_linears(variant_dir: Path) -> list[str]:
    """Modules the checkpoint keeps in full precision that are Linears (2-D `.weight`, no scale beside it,
    not an embedding), from the safetensors headers."""
    from safetensors import safe_open

    shapes, names = {}, set()
    for shard in sorted(Path(variant_dir).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for key in f.keys():
                names.add(key)
                if key.endswith(".weight"):
                    shapes[key] = len(f.get_slice(key).get_shape())
    return sorted(key[: -len(".weight")] for key, dims in shapes.items()
                  if dims == 2 and "embed" not in key and f"{key[: -len('.weight')]}.weight_scale" not in names)


def check(variant_dir: Path) -> dict:
    """Refuses a variant whose ignore list vLLM would not match: a full-precision Linear (the vision tower,
    lm_head, a router) that vLLM would build quantized under its own names (this module); and one whose config
    groups vLLM would resolve otherwise than compressed-tensors did (`vllm_scheme_conflicts`)."""
    from pipeline.errors import UserError

    config = checkpoint.open(variant_dir).config
    conflicts = vllm_scheme_conflicts(config, quantized_linears(variant_dir))
    if conflicts:
        raise UserError(f"{variant_dir}: vLLM would load {len(conflicts)} quantized Linears with another config group "
                        f"than the one they were quantized with: {'; '.join(conflicts[:3])}"
                        + (" ..." if len(conflicts) > 3 else "") + "; a group's targets must also name the fused "
                        "layer vLLM builds (pipeline/checkpoints/fused.py target_regex)")
    keep = unquantized_linears(variant_dir)
    missed = vllm_unignored(config, keep)
    if missed:
        shown = ", ".join(missed[:6]) + (f" ... ({len(missed)} in all)" if len(missed) > 6 else "")
        raise UserError(f"{variant_dir}: vLLM would quantize full-precision modules at load, because its names for "
                        f"them match no entry of config.json's quantization_config.ignore: {shown}; add "
                        f"{VISION_IGNORE!r} (vision tower) or vLLM's names of these modules to that list")
    return {"full_precision_linears": len(keep), "vllm_would_quantize": []}
