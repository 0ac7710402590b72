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
from pipeline.formats.quant_json import read_quant_json
from pipeline.formats.sensitivity import write_sensitivity
from pipeline.outputs import Stopwatch
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


def quantized_groups(base, variant) -> list[fused.Group]:
    """The variant's Linears whose weights differ from the base's, as fused groups; none is a UserError."""
    import torch

    base_modules = dict(base.named_modules())
    changed = [name for name, module in variant.named_modules()
               if isinstance(module, torch.nn.Linear) and name in base_modules
               and not torch.equal(module.weight, base_modules[name].weight)]
    if not changed:
        raise UserError("the variant's weights equal the base's: nothing is quantized, nothing to rank; pass a "
                        "quantized variant (models/<variant>)")
    return fused.groups(changed)


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
    """The same three figures, restoring estimated to second order from one gradient (the `taylor` measure).

    Around the base, KL(base || base + d) = 1/2 d'Hd + O(d^3) (no linear term: the KL is smallest, zero, at the
    base), so its gradient at the variant (d the quantization error) is g = Hd, and restoring group i (d_i -> 0)
    removes g_i.d_i - 1/2 d_i'H_ii d_i. Without the cross terms between groups (H_ij d_j, j != i), g_i = H_ii d_i
    and that is g_i.d_i / 2: one forward and one backward pass of the variant per batch, for every group at once.
    The cross terms are what the `restore` measure sees and this one does not; benchmarks/mixed_choice.py compares
    the choices each ranking makes."""
    import torch

    from pipeline.console import progress

    device = next(base.parameters()).device
    for parameter in variant.parameters():
        parameter.requires_grad_(False)
    weights = [[variant.get_submodule(m).weight for m in group.modules] for group in groups]
    for group in weights:
        for weight in group:
            weight.requires_grad_(True)
    variant_sum, removed_sums, tokens = 0.0, [0.0] * len(groups), 0
    batches = [sequences[start:start + batch_size] for start in range(0, len(sequences), batch_size)]
    try:
        with progress("sensitivity: one gradient for every group", len(batches), "batches") as advance:
            for batch in batches:
                base_lp, mask = log_probs(base, batch, device)
                variant_lp, _ = log_probs(variant, batch, device, grad=True)
                kl = (base_lp.exp() * (base_lp - variant_lp)).sum(-1)[mask].sum()
                kl.backward()
                del variant_lp
                variant_sum, tokens = variant_sum + float(kl.detach().double()), tokens + int(mask.sum())
                with torch.no_grad():
                    for index, (group, modules) in enumerate(zip(groups, weights)):
                        for name, weight in zip(group.modules, modules):
                            error = weight.float() - base.get_submodule(name).weight.float()
                            removed_sums[index] += 0.5 * float((weight.grad.float() * error).double().sum())
                            weight.grad = None
                advance(1)
    finally:
        for group in weights:
            for weight in group:
                weight.requires_grad_(False)
    return variant_sum, [variant_sum - removed for removed in removed_sums], tokens


MEASURES = {"taylor": estimate, "restore": measure}  # the default first


def ranked(groups: list[fused.Group], variant, variant_sum: float, restored_sums: list[float], tokens: int) -> list:
    kl_mean = variant_sum / tokens
    rows = []
    for group, restored_sum in zip(groups, restored_sums):
        kl_restored = restored_sum / tokens
        rows.append({"name": group.name, "layer": group.layer, "kind": group.kind, "modules": group.modules,
                     "weights": sum(variant.get_submodule(m).weight.numel() for m in group.modules),
                     "kl_restored": kl_restored, "kl_removed": kl_mean - kl_restored,
                     "share_removed": (kl_mean - kl_restored) / kl_mean if kl_mean > 0 else 0.0})
    return sorted(rows, key=lambda row: -row["kl_removed"])


def load_both(base_dir, variant_dir, dtype, device: str):
    """The base and the variant, for inference, one after the other. Loading both at once in two threads was
    measured on the H200 (benchmarks/results/gpu_mixed_cost.json): no faster (5.05 s against 4.85 s, 4.72 against
    4.55), and one of the two runs got a model with float32 parts (transformers sets torch's default dtype while it
    builds a model: the two builds raced)."""
    from pipeline.checkpoints.loading import load_for_inference

    place = "cuda" if device == "cuda" else None
    return [load_for_inference(path, dtype, device=place).eval() for path in (base_dir, variant_dir)]


def _timing(variant_dir: Path, seconds: float) -> dict:
    """The time it took beside the variant's quantization time, where its quant.json says it."""
    info = read_quant_json(variant_dir) if (Path(variant_dir) / "quant.json").exists() else None
    total = (info or {}).get("seconds", {}).get("total")
    return {"seconds": round(seconds, 2), "quantize_seconds": total,
            "share_of_quantize_time": round(seconds / total, 4) if total else None}


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
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = checkpoint.open(Path(base_dir)).dtype if device == "cuda" else settings_for(e, DEFAULT).dtype
    sequences = holdout_texts(AutoTokenizer.from_pretrained(base_dir), Path(holdout), k.max_tokens, k.sequences)
    base, variant = load_both(base_dir, variant_dir, getattr(torch, dtype), device)
    groups, loaded = quantized_groups(base, variant), watch.seconds
    variant_sum, restored_sums, tokens = MEASURES[measure](base, variant, groups, sequences, batch_size)
    summary = {"base": str(base_dir), "variant": str(variant_dir), "holdout": str(holdout),
               "sequences": len(sequences), "tokens": tokens, "kl_mean": variant_sum / tokens,
               "measure": measure, "groups": ranked(groups, variant, variant_sum, restored_sums, tokens),
               "device": device,
               "dtype": dtype, "load_seconds": round(loaded, 2), "measure_seconds": round(watch.seconds - loaded, 2),
               **_timing(Path(variant_dir), watch.seconds)}
    write_sensitivity(out, summary)
    return SensitivityResult(Path(out), summary)
