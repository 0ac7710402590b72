"""AWQ smoothing mappings: which norm/linear output feeds which linears.

llm-compressor ships none for GlmForCausalLM, Glm4ForCausalLM or the Glm4v family. GLM
fuses the MLP's gate and up projections into `gate_up_proj` ([gate; up] along the output
dim); llm-compressor scales the *last* out-features of a fused smooth layer when it is
wider than the balance layer's input, which is exactly the `up` half feeding `down_proj`.
Every regex is anchored to the language model so the vision tower is never touched.
"""

from __future__ import annotations

from llmcompressor.modifiers.transform.awq.mappings import AWQ_MAPPING_REGISTRY, AWQMapping

_TEXT = r"re:(?!.*visual).*"  # any module outside the vision tower


def _dense(mlp_norm: str = "post_attention_layernorm", fused_gate_up: bool = False) -> list[AWQMapping]:
    mlp_in = [f"{_TEXT}mlp.gate_up_proj$"] if fused_gate_up else [f"{_TEXT}mlp.gate_proj$", f"{_TEXT}mlp.up_proj$"]
    mlp_mid = f"{_TEXT}mlp.gate_up_proj$" if fused_gate_up else f"{_TEXT}mlp.up_proj$"
    return [
        AWQMapping(f"{_TEXT}input_layernorm$",
                   [f"{_TEXT}self_attn.q_proj$", f"{_TEXT}self_attn.k_proj$", f"{_TEXT}self_attn.v_proj$"]),
        AWQMapping(f"{_TEXT}self_attn.v_proj$", [f"{_TEXT}self_attn.o_proj$"]),
        AWQMapping(f"{_TEXT}{mlp_norm}$", mlp_in),
        AWQMapping(mlp_mid, [f"{_TEXT}mlp.down_proj$"]),
    ]


def _glm4v_moe() -> list[AWQMapping]:
    # Routed experts: the router (mlp.gate) reads the same input but is never scaled or
    # quantized, so it is left out of the balance layers. Shared experts are dense.
    return [
        AWQMapping(f"{_TEXT}input_layernorm$",
                   [f"{_TEXT}self_attn.q_proj$", f"{_TEXT}self_attn.k_proj$", f"{_TEXT}self_attn.v_proj$"]),
        AWQMapping(f"{_TEXT}self_attn.v_proj$", [f"{_TEXT}self_attn.o_proj$"]),
        AWQMapping(f"{_TEXT}post_attention_layernorm$",
                   [f"{_TEXT}mlp.experts.*.gate_proj$", f"{_TEXT}mlp.experts.*.up_proj$",
                    f"{_TEXT}mlp.shared_experts.gate_proj$", f"{_TEXT}mlp.shared_experts.up_proj$",
                    f"{_TEXT}mlp.gate_proj$", f"{_TEXT}mlp.up_proj$"]),
        AWQMapping(f"{_TEXT}up_proj$", [f"{_TEXT}down_proj$"]),
    ]


GLM_MAPPINGS: dict[str, list[AWQMapping]] = {
    # Glm: pre-norm blocks like Llama, fused gate_up_proj.
    "GlmForCausalLM": _dense(fused_gate_up=True),
    # Glm4 adds sandwich norms after attention and MLP; the MLP still reads
    # post_attention_layernorm's output, so the mapping is Glm's.
    "Glm4ForCausalLM": _dense(fused_gate_up=True),
    "Glm4vForConditionalGeneration": _dense(fused_gate_up=True),
    "Glm4vMoeForConditionalGeneration": _glm4v_moe(),
}


def mappings_for(architecture: str) -> list[AWQMapping] | None:
    """Our mapping for the architecture, else llm-compressor's, else None (unsupported)."""
    if architecture in GLM_MAPPINGS:
        return GLM_MAPPINGS[architecture]
    return AWQ_MAPPING_REGISTRY.get(architecture)


def supported_architectures() -> list[str]:
    return sorted(set(GLM_MAPPINGS) | set(AWQ_MAPPING_REGISTRY))
