"""Which quantized Linears one serving layer runs together, so they must share one scheme: vLLM fuses q/k/v into
one qkv_proj and gate/up into one gate_up_proj (its models' `packed_modules_mapping`), and runs a decoder layer's
routed experts as one FusedMoE layer. The unit `quantize sensitivity` measures and `quantize mixed` keeps in
8 bits is one such group."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# a module's last name -> the fused layer vLLM builds from it (vLLM's packed_modules_mapping, inverted)
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
EXPERT = re.compile(r"^(?P<moe>.+\.experts)\.\d+\.")  # a routed expert's Linear: model.layers.3.mlp.experts.17.up_proj
LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass
class Group:
    name: str  # the fused layer's name: model.layers.3.self_attn.qkv_proj, model.layers.3.mlp.experts
    layer: int | None  # the decoder layer's index (None outside the decoder layers)
    kind: str  # qkv_proj, o_proj, gate_up_proj, down_proj, experts, ...
    modules: list[str] = field(default_factory=list)  # the Linears it holds, in model order


def group_name(module: str) -> str:
    """The fused layer a Linear belongs to (its own name when vLLM runs it alone)."""
    expert = EXPERT.match(module)
    if expert:
        return expert.group("moe")
    head, _, last = module.rpartition(".")
    return f"{head}.{FUSED[last]}" if last in FUSED and head else module


def groups(modules: list[str]) -> list[Group]:
    """The quantized Linears (names, in model order) as fused groups, in order of first appearance."""
    found: dict[str, Group] = {}
    for module in modules:
        name = group_name(module)
        if name not in found:
            layer = LAYER.search(f".{name}.")
            found[name] = Group(name, int(layer.group(1)) if layer else None, name.rpartition(".")[2])
        found[name].modules.append(module)
    return list(found.values())


def target_regex(group: Group, renaming=None) -> str:
    """A compressed-tensors (and vLLM) target matching exactly this group's Linears, `re:` and anchored: a layer's
    routed experts by their prefix, any other group by its names and by the fused layer's name vLLM builds from
    them (qkv_proj from q/k/v). A name target outranks a class target ("Linear") in both
    (compressed_tensors.utils.match.match_targets, vLLM's find_matched_target), so the group's scheme overrides the
    default's for exactly these modules; vLLM looks a fused layer up by its own name first and only then by its
    class ("QKVParallelLinear" contains "Linear"), so without the fused name it would build q/k/v kept in 8 bits
    with the 4-bit scheme (pipeline/checkpoints/serving_names.py `vllm_scheme_conflicts` checks every variant).
    renaming: how vLLM renames the checkpoint's modules (a vision-language model's prefix mapper,
    serving_names.target_renaming); vLLM matches a `re:` target against its own names (it maps only plain layer
    paths), so the target names both, else every group kept in 8 bits of a GLM-4V would be built with the 4-bit
    scheme."""
    def both(names: list[str]) -> list[str]:
        renamed = [renaming(name) for name in names] if renaming else []
        return names + [name for name in renamed if name not in names]

    if group.kind == "experts":
        return "re:^(" + "|".join(re.escape(p) for p in both([group.name])) + r")\.\d+\.[^.]+$"
    names = group.modules + ([group.name] if group.name not in group.modules else [])
    return "re:^(" + "|".join(re.escape(m) for m in both(names)) + ")$"
