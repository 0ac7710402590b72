"""vLLM defects that change what a checkpoint computes, and the server settings that avoid them.

Each defect names the checkpoints it hits (read from config.json), the releases it was seen in, the setting
that avoids it, the upstream thread and our evidence. The vLLM engine adds the settings of every defect
that hits the checkpoint to `vllm serve` (engine.defect_workarounds: true, the default) and records the
defects it avoided in what it describes, so each suite's summary, and the report, says what the scores
were computed under. With defect_workarounds: false vLLM runs as it ships, and the engine still records
the defects the checkpoint is exposed to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipeline.errors import UserError


@dataclass(frozen=True)
class Defect:
    key: str
    what: str  # what goes wrong, for whom
    when: str  # the configurations that hit it
    avoided_by: str  # the setting the engine passes, in words
    upstream: str
    evidence: str  # our own measurement of it
    model_types: frozenset[str]  # config.json model_type values it hits
    custom_ops: tuple[str, ...] = ()  # entries for vLLM's --compilation-config custom_ops

    def hits(self, config: dict) -> bool:
        return config.get("model_type") in self.model_types

    def summary(self, avoided: bool) -> dict:
        return {"key": self.key, "avoided": avoided, "what": self.what, "when": self.when,
                "avoided_by": self.avoided_by, "upstream": self.upstream, "evidence": self.evidence}


# vLLM's CUDA M-RoPE kernel (vllm/model_executor/layers/rotary_embedding/mrope.py: triton_mrope) rotates NeoX
# pairs (i, i + d/2) whatever the layer's is_neox_style. GLM-4.1V's text tower (vLLM builds it as
# Glm4ForCausalLM, glm4.py: is_neox_style=False) rotates GPT-J pairs (2i, 2i + 1), as transformers' Glm4v
# does. The kernel runs only for 3-D (image) positions and only while the rotary_embedding custom op is on,
# which vLLM does whenever torch.compile's inductor is off (--enforce-eager, compilation mode 0). The op's
# native path (what the compiled graph runs anyway) honours is_neox_style. GLM-4.5V / 4.6V (glm4v_moe)
# rotate NeoX pairs in both engines and are not hit.
MROPE_GPTJ = Defect(
    key="vllm-mrope-gptj",
    what="GLM-4.1V-layout models (Glm4vForConditionalGeneration): every attention layer rotates an image "
         "prompt's positions NeoX-style where the model rotates GPT-J-style, so answers about images change; "
         "text-only prompts are not affected",
    when="vLLM's rotary_embedding custom op on: --enforce-eager or compilation mode 0 (vLLM 0.24 seen on the H200)",
    avoided_by='--compilation-config \'{"custom_ops": ["-rotary_embedding"]}\': the op\'s PyTorch path, '
               "which torch.compile runs by default",
    upstream="vllm-project/vllm#42016 (fix proposed: #42765)",
    evidence="benchmarks/gpu_glm4v_layers.py (tensor by tensor) and gpu_glm46v_vllm.py agreement "
             "(benchmarks/results/gpu_glm4v_vqa_agreement.json)",
    model_types=frozenset({"glm4v"}),
    custom_ops=("-rotary_embedding",),
)

DEFECTS = (MROPE_GPTJ,)


def hitting(config: dict) -> list[Defect]:
    """The known defects this checkpoint's config exposes it to."""
    return [defect for defect in DEFECTS if defect.hits(config)]


def server_args(config: dict, user_args: list[str], enabled: bool) -> list[str]:
    """The `vllm serve` arguments that avoid every defect hitting this checkpoint ([] when none does or
    workarounds are off). A compilation config of the user's own (server_args) is not overridden silently."""
    custom_ops = [op for defect in hitting(config) if enabled for op in defect.custom_ops]
    if not custom_ops:
        return []
    if any(arg.split("=")[0] in ("--compilation-config", "-cc") or arg.startswith("-cc.") for arg in user_args):
        keys = ", ".join(defect.key for defect in hitting(config))
        raise UserError(f"params.yaml: engine.server_args sets vLLM's compilation config, and this checkpoint needs "
                        f"custom_ops {custom_ops} in it to avoid {keys} (pipeline/engines/vllm_defects.py): add "
                        "them to your --compilation-config, or set engine.defect_workarounds: false to serve it "
                        "as vLLM ships")
    return ["--compilation-config", json.dumps({"custom_ops": custom_ops})]


def described(config: dict, enabled: bool) -> list[dict]:
    """What the engine records: each defect that hits the checkpoint and whether it was avoided."""
    return [defect.summary(avoided=enabled) for defect in hitting(config)]
