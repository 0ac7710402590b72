"""`quantize sensitivity`: which of a variant's quantized groups cost it most, measured.

For each fused group of quantized Linears (pipeline/checkpoints/fused.py: q/k/v, gate/up, o_proj, down_proj, a
layer's routed experts; the unit vLLM runs with one scheme) the variant's mean per-token KL(base || variant) on the
held-out conversations is measured again with only that group's weights restored to the base's: what goes away is
what keeping that group in higher precision would buy, the measure the `mixed` method (pipeline/methods/mixed.py)
ranks by. Unlike a per-layer output error it counts what the rest of the network makes of a group's error, in the
units the verdict reads (pipeline/stages/kl.py, same held-out set, same tokens, same per-token KL:
pipeline/scoring/token_kl.py).

The quantized Linears are those whose weights differ from the base's (every Linear outside the ignore list of a
compressed-tensors variant, decompressed at load; any other dense variant too). Both models stay resident; each
batch's base log-probabilities are computed once and compared with the variant's and with each restored variant's,
so a run costs (groups + 2) forward passes over the held-out tokens. sensitivity.json (pipeline/formats/
sensitivity.py) records the time it took beside the variant's quantization time (quant.json).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints import fused, headers
from pipeline.errors import UserError
from pipeline.formats.sensitivity import write_sensitivity
from pipeline.outputs import Stopwatch
from pipeline.scoring import group_kl
from pipeline.scoring.token_kl import holdout_texts, log_probs, token_kl
from pipeline.engines import DEFAULT, EngineSettings, default_settings, settings_for
from pipeline.settings.params import KlParams, sections_with_overrides


@dataclass
class SensitivityResult:
    out: Path
    figures: dict  # sensitivity.json

    def summary(self) -> str:
        s, top = self.figures, self.figures["groups"][0]
        share = f" ({s['share_of_quantize_time']:.0%} of its quantization time)" if s.get("share_of_quantize_time") \
            is not None else ""
        return (f"sensitivity: wrote {self.out} ({len(s['groups'])} groups on {s['tokens']} tokens, variant KL "
                f"{s['kl_mean']:.4f}; first {top['name']}: restoring it removes {top['share_removed']:.0%}) in "
                f"{s['seconds']:.0f} s{share}")


@contextlib.contextmanager
def restored(base, variant, group: fused.Group):
    """The variant with this group's weights swapped for the base's, put back on leaving."""
    kept = {}
    try:
        for name in group.modules:
            module = variant.get_submodule(name)
            kept[name] = module.weight.data
            module.weight.data = base.get_submodule(name).weight.data
        yield variant
    finally:
        for name, weight in kept.items():
            variant.get_submodule(name).weight.data = weight


def measure(base, variant, groups: list[fused.Group], sequences: list[list[int]], batch_size: int = 8):
    """Summed per-token KL of the variant, and of the variant with each group restored, and the token count."""
    from pipeline.console import progress

    device = next(base.parameters()).device
    variant_sum, restored_sums, tokens = 0.0, [0.0] * len(groups), 0
    batches = [sequences[start:start + batch_size] for start in range(0, len(sequences), batch_size)]
    with progress("sensitivity: groups restored one at a time", len(batches) * (len(groups) + 1), "passes") as advance:
        for batch in batches:
            base_lp, mask = log_probs(base, batch, device)
            kl, _ = token_kl(base_lp, log_probs(variant, batch, device)[0], mask)
            variant_sum, tokens = variant_sum + float(kl.double().sum()), tokens + kl.numel()
            advance(1)
            for index, group in enumerate(groups):
                with restored(base, variant, group):
                    kl, _ = token_kl(base_lp, log_probs(variant, batch, device)[0], mask)
                restored_sums[index] += float(kl.double().sum())
                advance(1)
    return variant_sum, restored_sums, tokens


def estimate(base, variant, groups: list[fused.Group], sequences: list[list[int]], batch_size: int = 8):
    """The same three figures, restoring estimated to second order from one gradient (the `taylor` measure:
    pipeline/scoring/group_kl.py), one forward pass of the base and one forward and backward pass of the variant
    per batch, for every group at once."""
    return group_kl.pass_with_ranking(base, variant, sequences, batch_size, "sensitivity: one gradient for every group",
                                      groups)[2].sums()


MEASURES = {"taylor": estimate, "restore": measure}  # the default first


def load_both(base_dir, variant_dir, dtype, device: str):
    """The base and the variant, for inference, one after the other. Loading both at once in two threads was
    measured on the H200 (benchmarks/results/gpu_mixed_cost.json): no faster (5.05 s against 4.85 s, 4.72 against
    4.55), and one of the two runs got a model with float32 parts (transformers sets torch's default dtype while it
    builds a model: the two builds raced)."""
    from pipeline.checkpoints.loading import load_for_inference

    place = "cuda" if device == "cuda" else None
    return [load_for_inference(path, dtype, device=place).eval() for path in (base_dir, variant_dir)]


def run(base_dir: Path | str, variant_dir: Path | str, holdout: Path | str, out: Path | str,
        settings: KlParams | None = None, engine: EngineSettings | None = None, *, device: str | None = None,
        batch_size: int = 8, measure: str = "taylor", **overrides) -> SensitivityResult:
    """settings: params.yaml `kl` (the conversations and tokens `quantize kl` scores, so the KL ranked here is the
    one the verdict reads); engine: its dtype on a CPU (on a GPU the base checkpoint's); measure: `taylor` (one
    gradient, `estimate`) or `restore` (one pass per group, `measure`). `overrides` (e.g. sequences=8) replace the
    field of that name, validated again."""
    if measure not in MEASURES:
        raise UserError(f"--measure {measure}: use one of {', '.join(MEASURES)}")
    import torch
    from transformers import AutoTokenizer

    from pipeline.checkpoints import checkpoint

    k, e = sections_with_overrides(settings or KlParams, engine or default_settings(), **overrides)
    watch = Stopwatch()
    for model_dir in (variant_dir, base_dir):  # both whole before either loads
        headers.check(model_dir)
    group_kl.refuse_quantized_activations(Path(variant_dir), "quantize sensitivity")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = checkpoint.open(Path(base_dir)).dtype if device == "cuda" else settings_for(e, DEFAULT).dtype
    sequences = holdout_texts(AutoTokenizer.from_pretrained(base_dir), Path(holdout), k.max_tokens, k.sequences)
    base, variant = load_both(base_dir, variant_dir, getattr(torch, dtype), device)
    groups, loaded = group_kl.quantized_groups(base, variant), watch.seconds
    variant_sum, restored_sums, tokens = MEASURES[measure](base, variant, groups, sequences, batch_size)
    summary = {"base": str(base_dir), "variant": str(variant_dir), "holdout": str(holdout),
               "sequences": len(sequences), "tokens": tokens, "kl_mean": variant_sum / tokens,
               "measure": measure, "groups": group_kl.ranked(groups, variant, variant_sum, restored_sums, tokens),
               "device": device,
               "dtype": dtype, "load_seconds": round(loaded, 2), "measure_seconds": round(watch.seconds - loaded, 2),
               **group_kl.timing(Path(variant_dir), watch.seconds)}
    write_sensitivity(out, summary)
    return SensitivityResult(Path(out), summary)
