"""AWQ smoothing mappings: which norm/linear output feeds which linears.

llm-compressor ships none for GlmForCausalLM, Glm4ForCausalLM or the Glm4v family. GLM
fuses the MLP's gate and up projections into `gate_up_proj` ([gate; up] along the output
dim); llm-compressor scales the *last* out-features of a fused smooth layer when it is
wider than the balance layer's input (AWQModifier._apply_smoothing, "edge case when smooth
layer number of out_features is not equal to balance layer number of in_features"), which
is exactly the `up` half feeding `down_proj`: gate_up_proj -> down_proj is a valid mapping.
Every regex is anchored to the language model so the vision tower is never touched
(compressed-tensors matches with re.match, so the lookahead sees the whole name).

v_proj -> o_proj is listed but llm-compressor skips it under GQA (v_proj is narrower than
o_proj's input), which is every GLM release; it applies only to a model without GQA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.checkpoints import config_json

if TYPE_CHECKING:
    from llmcompressor.modifiers.transform.awq.mappings import AWQMapping

_TEXT = r"re:(?!.*visual).*"  # any module outside the vision tower


# llm-compressor is imported on use, not with this module: its import already logs the CPU
# warning that compat.quiet_cpu_warning has to be in place to tame.
def _mapping(smooth_layer: str, balance_layers: list[str]) -> AWQMapping:
    from llmcompressor.modifiers.transform.awq.mappings import AWQMapping

    return AWQMapping(smooth_layer, balance_layers)


def _registry() -> dict[str, list[AWQMapping]]:
    from llmcompressor.modifiers.transform.awq.mappings import AWQ_MAPPING_REGISTRY

    return AWQ_MAPPING_REGISTRY


def _attention() -> list[AWQMapping]:
    return [
        _mapping(f"{_TEXT}input_layernorm$",
                   [rf"{_TEXT}self_attn\.q_proj$", rf"{_TEXT}self_attn\.k_proj$", rf"{_TEXT}self_attn\.v_proj$"]),
        _mapping(rf"{_TEXT}self_attn\.v_proj$", [rf"{_TEXT}self_attn\.o_proj$"]),
    ]


def _fused_mlp() -> list[AWQMapping]:
    return [
        _mapping(f"{_TEXT}post_attention_layernorm$", [rf"{_TEXT}mlp\.gate_up_proj$"]),
        _mapping(rf"{_TEXT}mlp\.gate_up_proj$", [rf"{_TEXT}mlp\.down_proj$"]),
    ]


def _glm4v_moe(config: dict) -> list[AWQMapping]:
    """GLM-4.5V: the first `first_k_dense_replace` layers have a dense MLP, the rest routed
    experts (linearized to one Linear per expert), a shared expert and a router (`mlp.gate`).

    The router reads post_attention_layernorm's output too. Smoothing that norm would either
    shift the routing logits (router left out) or rewrite the router's weight (router as a
    balance layer); the router is never touched, so in MoE layers that norm is not smoothed
    and only each expert's up_proj -> down_proj is. Dense layers get the full mapping."""
    dense = "|".join(str(i) for i in range(config_json.dense_layers_first(config)))
    mappings = _attention()
    if dense:
        mappings.append(_mapping(
            rf"{_TEXT}layers\.({dense})\.post_attention_layernorm$",
            [rf"{_TEXT}layers\.({dense})\.mlp\.gate_proj$", rf"{_TEXT}layers\.({dense})\.mlp\.up_proj$"],
        ))
    # dense MLP, each routed expert and the shared expert: each up_proj feeds only its down_proj
    mappings.append(_mapping(rf"{_TEXT}mlp\.(.*\.)?up_proj$", [rf"{_TEXT}mlp\.(.*\.)?down_proj$"]))
    return mappings


_GLM_MAPPINGS = {
    # Glm: pre-norm blocks like Llama, fused gate_up_proj.
    "GlmForCausalLM": lambda config: _attention() + _fused_mlp(),
    # Glm4 adds sandwich norms after attention and MLP (post_self_attn_layernorm,
    # post_mlp_layernorm); they act on the block outputs before the residual add, so they
    # feed no Linear directly. The MLP still reads post_attention_layernorm: Glm's mapping.
    "Glm4ForCausalLM": lambda config: _attention() + _fused_mlp(),
    # GLM-4.1V: the text tower is Glm4's; the vision tower is excluded by _TEXT.
    "Glm4vForConditionalGeneration": lambda config: _attention() + _fused_mlp(),
    "Glm4vMoeForConditionalGeneration": _glm4v_moe,
}


def mappings_for(architecture: str, config: dict | None = None) -> list[AWQMapping] | None:
    """Our mapping for the architecture (built from its config.json), else llm-compressor's,
    else None (unsupported)."""
    if architecture in _GLM_MAPPINGS:
        return _GLM_MAPPINGS[architecture](config or {})
    return _registry().get(architecture)


def supported_architectures() -> list[str]:
    return sorted(set(_GLM_MAPPINGS) | set(_registry()))
