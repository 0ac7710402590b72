"""MoE checkpoints whose routed experts load, build and save as one nn.Linear per expert (llm-compressor's
linearization), so a "Linear" recipe quantizes every expert and a quantized variant decompresses each expert like
any Linear. Loading (checkpoints/loading.py), the header checks (checkpoints/headers.py), the quantization plan and
its probe all ask here; llm-compressor is imported on use (without the `quantize` extra, `loads_linearized`
raises ImportError and callers take transformers' own layout)."""

from __future__ import annotations

import contextlib
import functools
import sys

# model_type -> (config class, fused experts class), in llm-compressor's ARCH_TO_IMPORT_PATHS
# format. llm-compressor 0.14 lists glm4_moe but not GLM-4.5V's text tower; both share
# transformers' qwen2_moe checkpoint layout (one gate/up/down Linear per expert).
EXTRA_LINEARIZED_MOE = {
    "glm4v_moe": (
        "transformers.models.glm4v_moe.configuration_glm4v_moe.Glm4vMoeTextConfig",
        "transformers.models.glm4v_moe.modeling_glm4v_moe.Glm4vMoeTextExperts",
    ),
}


def register_moe_linearization() -> None:
    from llmcompressor.modeling.moe.conversion_mappings import ARCH_TO_IMPORT_PATHS

    for model_type, paths in EXTRA_LINEARIZED_MOE.items():
        ARCH_TO_IMPORT_PATHS.setdefault(model_type, paths)


def loads_linearized(model_type: str) -> bool:
    """Whether the model's routed experts can be loaded as one Linear per expert."""
    from llmcompressor.modeling.moe.conversion_mappings import has_linearize_load_mappings

    register_moe_linearization()
    return has_linearize_load_mappings(model_type)


def load_linearized(model_cls, model_dir, model_type: str, **kwargs):
    """Loads a MoE checkpoint with its routed experts as one nn.Linear per expert, straight from
    the per-expert tensors of the checkpoint (no fused 3-D copy), and saves it back in that
    layout, which is vLLM's. A quantized variant loads the same way, so compressed-tensors
    decompresses each expert like any Linear (transformers' fused-experts decompression drops
    the zero points of asymmetric int4).

    The steps of llm-compressor's `load_quantizable_moe`, except that the experts class is
    swapped in its own module while the model is built (transformers' `register_patch_mapping`
    walks every loaded transformers module and trips over those that need torchvision), and
    the global conversion mapping is restored afterwards so later loads are unaffected."""
    with linearized_experts(model_cls, model_type) as save_map:
        model = model_cls.from_pretrained(model_dir, **kwargs)
    model._weight_conversions = save_map  # what save_pretrained reverts: per-expert names, as loaded
    return model


@contextlib.contextmanager
def linearized_experts(model_cls, model_type: str):
    """While inside, model_cls builds its routed experts as one Linear per expert and transformers
    maps the checkpoint's per-expert tensors onto them; yields the mapping that saves them back."""
    from llmcompressor.modeling.moe.conversion_mappings import get_linearize_load_mappings
    from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                 register_checkpoint_conversion_mapping)

    experts_cls, load_map, save_map = get_linearize_load_mappings(model_type)
    previous = get_checkpoint_conversion_mapping(model_type)
    register_checkpoint_conversion_mapping(model_type, load_map, overwrite=True)
    try:
        with _built_with_linear_experts(model_cls, experts_cls):
            yield save_map
    finally:
        _restore_conversion_mapping(model_type, previous)


@contextlib.contextmanager
def _built_with_linear_experts(model_cls, experts_cls):
    """While model_cls.__init__ runs, its experts module is built as llm-compressor's
    LinearExperts2D; outside it (e.g. transformers' weight init) the name means the original."""
    from compressed_tensors.utils import patch_attr
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    linear_cls = LinearExperts2D.get_linear_experts_cls(experts_cls)
    module = sys.modules[experts_cls.__module__]
    original_init = model_cls.__init__

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        with patch_attr(module, experts_cls.__name__, linear_cls):
            original_init(self, *args, **kwargs)

    with patch_attr(model_cls, "__init__", init):
        yield


def _restore_conversion_mapping(model_type: str, previous) -> None:
    import transformers.conversion_mapping as conversion

    if previous is not None:
        conversion.register_checkpoint_conversion_mapping(model_type, previous, overwrite=True)
    else:
        conversion._checkpoint_conversion_mapping_cache.pop(model_type, None)


def build_linearized(model_cls, config):
    """A model built from its config (random weights) with its routed experts then split into one
    Linear per expert, as load_linearized would load it: what the one-layer probe of `--plan` times."""
    from llmcompressor.modeling.moe.linearize import linearize_moe

    model = model_cls(config)
    linearize_moe(model)
    return model
