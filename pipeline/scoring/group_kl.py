"""What each quantized group of a variant costs it in KL to the base: the parts `quantize sensitivity`
(pipeline/stages/sensitivity.py) and `quantize kl --rank` (pipeline/stages/kl.py, the rank stage's pass over every
W4A16 variant, whose ranking the fix stage reads) share.

A group is one fused layer as vLLM runs it (pipeline/checkpoints/fused.py: q/k/v, gate/up, o_proj, down_proj, a
layer's routed experts); the quantized ones are the Linears whose weights differ from the base's. The second-order
estimate (`SecondOrder`, the `taylor` measure): around the base, KL(base || base + d) = 1/2 d'Hd + O(d^3) (no linear
term: the KL is smallest, zero, at the base), so its gradient at the variant (d the quantization error) is g = Hd,
and restoring group i (d_i -> 0) removes g_i.d_i - 1/2 d_i'H_ii d_i. Without the cross terms between groups
(H_ij d_j, j != i), g_i = H_ii d_i and that is g_i.d_i / 2: one backward pass of the variant per batch ranks every
group at once. The cross terms are what the exact `restore` measure sees and this one does not;
benchmarks/mixed_choice.py compares the choices each ranking makes.
"""

from __future__ import annotations

from pipeline.checkpoints import fused
from pipeline.errors import UserError
from pipeline.scoring.token_kl import log_probs, token_kl


def refuse_quantized_activations(variant_dir, what: str) -> None:
    """Before any model loads: a variant whose activations are quantized (FP8 W8A8) cannot be ranked. The `taylor`
    measure's gradient does not pass the rounding of a later layer's inputs (its gradient is zero almost everywhere:
    every group but the last layers' would rank as costing nothing), and a group restored in `restore` keeps its
    quantized inputs; what the ranking is for, keeping groups in W8A16 (the fix, pipeline/methods/mixed.py), takes a
    W4A16 variant only. A UserError naming the config group and the variants that can be ranked."""
    from pipeline.checkpoints import config_json

    config = config_json.read(variant_dir)
    schemes = config_json.quantized_activations(config)
    if schemes:
        raise UserError(f"{what}: {variant_dir} quantizes its activations ({config_json.path(variant_dir)} "
                        f"quantization_config: {'; '.join(schemes)}), and its groups cannot be ranked: the ranking's "
                        "gradient does not pass the rounding of the activations (zero almost everywhere), and "
                        "keeping a group's weights in 8 bits leaves its inputs quantized; rank a weight-only (W4A16) "
                        "variant: awq, gptq or rtn; nothing was loaded or written")


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


class SecondOrder:
    """The `taylor` measure, batch by batch: `add` scores one batch with the variant in autograd's graph (its
    per-token KL and top-1 agreement, as `quantize kl` reports them), takes the gradient of the summed KL and adds
    each group's g_i.d_i / 2; `sums` gives the variant's summed KL, each group's summed KL once restored, and the
    token count. `seconds` is the time the gradient and the products took (what ranking adds to a KL pass)."""

    def __init__(self, base, variant, groups: list[fused.Group]):
        self.base, self.variant, self.groups = base, variant, groups
        self.weights = [[variant.get_submodule(m).weight for m in group.modules] for group in groups]
        self.variant_sum, self.removed, self.tokens, self.seconds = 0.0, [0.0] * len(groups), 0, 0.0

    def __enter__(self):
        for parameter in self.variant.parameters():
            parameter.requires_grad_(False)
        for group in self.weights:
            for weight in group:
                weight.requires_grad_(True)
        return self

    def __exit__(self, *exc):
        for group in self.weights:
            for weight in group:
                weight.requires_grad_(False)
                weight.grad = None

    def add(self, base_lp, mask, batch: list[list[int]], device):
        """One batch: the per-token KL and top-1 agreement at its real positions (on the CPU)."""
        import torch

        from pipeline.outputs import Stopwatch

        variant_lp, _ = log_probs(self.variant, batch, device, grad=True)
        kl_tokens, same = token_kl(base_lp, variant_lp.detach(), mask)
        kl = (base_lp.exp() * (base_lp - variant_lp)).sum(-1)[mask].sum()
        watch = Stopwatch()
        kl.backward()
        del variant_lp
        with torch.no_grad():
            for index, (group, modules) in enumerate(zip(self.groups, self.weights)):
                for name, weight in zip(group.modules, modules):
                    error = weight.float() - self.base.get_submodule(name).weight.float()
                    self.removed[index] += 0.5 * float((weight.grad.float() * error).double().sum())
                    weight.grad = None
        self.seconds += watch.seconds  # the float() above waited for the device
        self.variant_sum, self.tokens = self.variant_sum + float(kl.detach().double()), self.tokens + int(mask.sum())
        return kl_tokens, same

    def sums(self) -> tuple[float, list[float], int]:
        return self.variant_sum, [self.variant_sum - removed for removed in self.removed], self.tokens


def pass_with_ranking(base, variant, sequences: list[list[int]], batch_size: int, label: str,
                      groups: list[fused.Group] | None = None):
    """One pass over the held-out sequences, both models resident: per batch the base's log-probabilities, then
    `SecondOrder.add` (the variant's, its gradient, each group's share; groups: the quantized ones unless given). Returns the per-token KL, the top-1
    agreement (as `quantize kl` reports them) and the SecondOrder holding the ranking's sums and added seconds."""
    import torch

    from pipeline.console import progress

    device = next(base.parameters()).device
    kls, agree = [], []
    with progress(label, len(sequences), "sequences") as advance, \
            SecondOrder(base, variant, groups or quantized_groups(base, variant)) as second_order:
        for start in range(0, len(sequences), batch_size):
            batch = sequences[start:start + batch_size]
            base_lp, mask = log_probs(base, batch, device)
            kl, same = second_order.add(base_lp, mask, batch, device)
            kls.append(kl)
            agree.append(same)
            advance(len(batch))
    return torch.cat(kls), torch.cat(agree), second_order


def ranked(groups: list[fused.Group], variant, variant_sum: float, restored_sums: list[float], tokens: int) -> list:
    """sensitivity.json's groups (pipeline/formats/sensitivity.py), most KL removed first."""
    kl_mean = variant_sum / tokens
    rows = []
    for group, restored_sum in zip(groups, restored_sums):
        kl_restored = restored_sum / tokens
        rows.append({"name": group.name, "layer": group.layer, "kind": group.kind, "modules": group.modules,
                     "weights": sum(variant.get_submodule(m).weight.numel() for m in group.modules),
                     "kl_restored": kl_restored, "kl_removed": kl_mean - kl_restored,
                     "share_removed": (kl_mean - kl_restored) / kl_mean if kl_mean > 0 else 0.0})
    return sorted(rows, key=lambda row: -row["kl_removed"])


def timing(variant_dir, seconds: float) -> dict:
    """The ranking's time beside the variant's quantization time, where its quant.json says it."""
    from pathlib import Path

    from pipeline.formats.quant_json import read_quant_json

    info = read_quant_json(variant_dir) if (Path(variant_dir) / "quant.json").exists() else None
    total = (info or {}).get("seconds", {}).get("total")
    return {"seconds": round(seconds, 2), "quantize_seconds": total,
            "share_of_quantize_time": round(seconds / total, 4) if total else None}
