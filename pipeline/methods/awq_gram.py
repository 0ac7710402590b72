"""AWQ's scale search with the same objective as llm-compressor's, at a fraction of the cost where
the mapping's output is one Linear's.

llm-compressor's AWQModifier picks, for each mapping (smooth layer -> balance layers), the scale
among `n_grid` candidates that minimises the mean squared error of the *parent* module's output
(the balance layers' lowest common ancestor) with the balance layers' weights replaced by
Q(W * s) / s, over every calibration token. To do that it caches the parent's inputs for every
batch and runs the parent once per candidate over all of them: n_grid + 1 forward passes.

When the parent is the one balance Linear itself (GLM's `post_attention_layernorm -> gate_up_proj`
and `gate_up_proj -> down_proj`, every MoE expert's `up_proj -> down_proj`, `v_proj -> o_proj`),
that error is a quadratic form of the weight error alone:

    sum_tokens ||x (W_q - W)^T||^2 = sum_rows e_i G e_i^T,   E = W_q - W,  G = X^T X

so this modifier accumulates the Gram matrix G (in x in, float32) during the calibration pass
instead of caching X, and scores each candidate with one (out x in) @ (in x in) product: for
GLM-4-9B's down_proj (13696 -> 4096) at 128 x 512 tokens that is 1.5 TFLOP per candidate instead
of 7.4, for gate_up_proj 0.9 instead of 14.7, and for an MoE expert ~50x less; the experts' input
caches (tokens x 1408 values per expert, on the host) are not kept at all. Every other mapping
(attention, whose parent contains the softmax; a gate/up MLP whose parent is nonlinear) goes
through llm-compressor's own code, in the same order, so scales are applied exactly as before.

Candidates, scale formula, observers, quantizer and the smoothing step are llm-compressor's; only
the loss is computed differently: in float32 (llm-compressor's is in the model's dtype), so on a
GPU in bfloat16 ours is the more exact of the two and near-ties can pick a neighbouring ratio.

Since issue 36 the candidates are first ranked by a bfloat16 estimate of that loss (bfloat16 products,
float32 sums: ~2x TF32 on a GPU, ~6x float32 on a CPU with AMX; within ~1e-4 of the float32 loss), and
only the best few are scored again in float32 and compared: the choice is the float32 search's unless
its winner ranks below them. On a GPU several candidates are quantized and scored per pass (stacked
along the rows; each row is quantized alone, so stacking changes no value). The one-by-one search of
before stays selectable (stacked_search=False). For llm-compressor's own forward search (the
attention) an optional two-pass search ranks every candidate on a share of the batches and rescores
the best few on all (ranking_share; off by default, it can keep another scale than the exhaustive
search).
"""

from __future__ import annotations

import contextlib

import torch
from loguru import logger
from pydantic import PrivateAttr

from llmcompressor.modifiers.transform.awq import AWQModifier


def _gram_update(gram: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """gram + x^T x in float32. On CUDA, half-precision inputs go through tensor cores with a
    float32 result (exact products, float32 sums); elsewhere the inputs are cast to float32."""
    x = x.reshape(-1, x.shape[-1])
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        try:
            update = torch.mm(x.t(), x, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # a torch without mm(out_dtype=): TF32 holds half-precision values
            with _tf32():                  # exactly, so its products are exact too (8x IEEE float32's speed)
                update = x.t().float() @ x.float()
    else:
        xf = x.float()
        update = xf.t() @ xf
    return update if gram is None else gram.add_(update)


@contextlib.contextmanager
def _tf32():
    """E @ G in TF32 on CUDA (float32 is ~10x slower there); a no-op on CPU."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous




def _candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float, duo: bool) -> torch.Tensor:
    """One grid candidate's per-channel scales, by llm-compressor's formula (AWQModifier._compute_best_scale)."""
    if duo:
        scales = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    else:
        scales = x_mean.pow(ratio).clamp(min=1e-4).view(-1)
    scales = scales / (scales.max() * scales.min()).sqrt()
    scales[torch.isinf(scales)] = 1
    scales[torch.isnan(scales)] = 1
    return scales


def _stackable(scheme) -> bool:
    """Schemes whose quantization parameters are per row (or per group of a row), from the weight alone: stacking
    candidates along the rows then quantizes each exactly as alone. A global scale (TENSOR_GROUP) spans them all."""
    from compressed_tensors.quantization import QuantizationStrategy

    return scheme.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.CHANNEL) and not scheme.dynamic \
        and scheme.actorder is None


def _candidates_per_pass(weight: torch.Tensor, candidates: int, pass_bytes: int) -> int:
    """As many as fit in `pass_bytes` at about five float32 copies of the weight each (scaled, quantized, error,
    error @ G, their product), at least one. On a CPU one: a stack of them spills the caches that one candidate's
    quantization runs in (measured 2-3x slower there); on a GPU every candidate streams from memory anyway."""
    if weight.device.type == "cpu":
        return 1
    return max(1, min(candidates, pass_bytes // (5 * 4 * weight.numel())))


def _gram_loss(error: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """sum over the rows e of e G e^T, per leading index of `error` (candidates, rows, in); `gram` in bfloat16 makes
    it the ranking estimate (bfloat16 products, float32 sums where the device offers them)."""
    flat = error.reshape(-1, error.shape[-1])
    if gram.dtype == torch.bfloat16:
        low = flat.to(torch.bfloat16)
        try:
            product = torch.mm(low, gram, out_dtype=torch.float32) if low.is_cuda else (low @ gram).float()
        except (TypeError, RuntimeError):  # a torch without mm(out_dtype=)
            product = (low @ gram).float()
        del low
    else:
        product = flat @ gram
    return product.mul_(flat).view(error.shape[0], -1).sum(dim=1)


def _quantize_stacked(weight: torch.Tensor, scales: torch.Tensor, scheme) -> torch.Tensor:
    """Q(W * s) / s for each row of `scales` (candidates, in), in llm-compressor's steps and dtypes: W * s stored in
    the weight's dtype, min-max qparams per row group (memoryless_minmax, as AWQ's search observes), fake-quantized,
    divided by s and stored in the weight's dtype again. Returns (candidates, out, in) in the weight's dtype."""
    from compressed_tensors.quantization import fake_quantize

    from llmcompressor.observers.base import Observer

    out, width = weight.shape
    scaled = (weight.unsqueeze(0) * scales.unsqueeze(1)).to(weight.dtype).view(-1, width)
    observer = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=scheme)
    observer(scaled)
    qparams = observer.get_qparams()
    quantized = fake_quantize(scaled, qparams["scale"], qparams["zero_point"], scheme)
    del scaled
    return (quantized.view(-1, out, width) / scales.unsqueeze(1)).to(weight.dtype)


def _stacked_losses(weight: torch.Tensor, scales: torch.Tensor, gram: torch.Tensor, tokens: int, scheme,
                    per_pass: int) -> list[float]:
    """The loss sum(E G * E) / (tokens * out) of each candidate (rows of `scales`), `per_pass` candidates stacked
    per pass, in `gram`'s precision; one device-to-host transfer at the end."""
    reference = weight.float()
    sums = []
    for start in range(0, scales.shape[0], per_pass):
        error = _quantize_stacked(weight, scales[start:start + per_pass], scheme).float().sub_(reference)
        sums.append(_gram_loss(error, gram))
        del error
    return [total / (tokens * weight.shape[0]) for total in torch.cat(sums).tolist()]


def _ranked_then_rescored(weight: torch.Tensor, scales: torch.Tensor, gram: torch.Tensor, tokens: int, scheme,
                          per_pass: int, rescored: int) -> tuple[list[float], dict[int, float]]:
    """Every candidate's loss estimated with bfloat16 products (on GPUs ~2x, on CPUs with AMX ~6x faster than
    float32 / TF32), then the `rescored` best of them scored again in float32 (TF32 on CUDA), as before: the choice
    is made on those exact losses, so it equals the exhaustive search's whenever the exhaustive best is among the
    estimate's `rescored` best (estimate error ~1e-4 relative). Returns (estimates, {candidate: exact loss}).
    rescored <= 0 or >= the candidates: every candidate scored exactly (no estimate)."""
    count = scales.shape[0]
    if rescored <= 0 or rescored >= count:
        exact = _stacked_losses(weight, scales, gram, tokens, scheme, per_pass)
        return exact, dict(enumerate(exact))
    estimates = _stacked_losses(weight, scales, gram.to(torch.bfloat16), tokens, scheme, per_pass)
    finite = [i for i in range(count) if estimates[i] == estimates[i]]  # NaN estimates never make the shortlist
    shortlist = sorted(sorted(finite, key=lambda i: (estimates[i], i))[:rescored])
    if not shortlist:
        return estimates, {}
    exact = _stacked_losses(weight, scales[shortlist], gram, tokens, scheme, per_pass)
    return estimates, dict(zip(shortlist, exact))


def _losses_one_by_one(layer, weight: torch.Tensor, candidates: list[torch.Tensor], gram: torch.Tensor, tokens: int,
                       scheme) -> list[float]:
    """The search before issue 36, kept for comparison (GramAWQModifier.stacked_search=False) and for schemes that
    do not stack: each candidate written into the layer, observed and fake-quantized through it, scored alone."""
    from compressed_tensors.quantization import forward_quantize
    from compressed_tensors.utils import patch_attrs

    from llmcompressor.modifiers.quantization.calibration import observe, update_qparams
    from llmcompressor.observers.base import Observer
    from llmcompressor.observers.helpers import fuse_weight_observers

    reference, losses = weight.float(), []
    observer = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=scheme)
    with patch_attrs([layer], "weight_observer", [observer]):
        fuse_weight_observers(layer)
        for scales in candidates:
            view = scales.view(1, -1)
            layer.weight.data.copy_(weight * view)
            layer.weight_observer.delete_statistics(check_fused=False)
            observe([layer], "weight")
            update_qparams([layer], "weight", only_update_onload=True)
            quantized = (forward_quantize(layer, layer.weight, "weight", scheme) / view).to(layer.weight.dtype)
            error = quantized.float() - reference
            losses.append(_gram_loss(error.unsqueeze(0), gram).item() / (tokens * error.shape[0]))
            del quantized, error
    return losses


class GramAWQModifier(AWQModifier):
    """AWQModifier whose single-Linear mappings are searched from X^T X (see the module docstring)."""

    # smooth name -> [X^T X (in x in, float32, on the execution device), tokens], for the current layer
    _grams: dict = PrivateAttr(default_factory=dict)
    # smooth name -> mapping scored from X^T X
    _gram_mappings: dict = PrivateAttr(default_factory=dict)
    # every resolved mapping in llm-compressor's order; _resolved_mappings keeps only those it searches itself
    _all_mappings: list = PrivateAttr(default_factory=list)
    _use_gram: bool = PrivateAttr(default=True)
    # mappings smoothed and seconds spent, by how they were searched (kept after finalize: the run reports it)
    _searched: dict = PrivateAttr(default_factory=lambda: {"gram": [0, 0.0], "forward": [0, 0.0]})
    # score the grid candidates stacked, a few passes per mapping (False: one at a time, the search before issue 36),
    # at most this many bytes of them at once (awq.recipe passes awq.SEARCH_PASS_BYTES)
    stacked_search: bool = True
    search_pass_bytes: int = 1 << 30
    # candidates scored again exactly after the bfloat16 estimate ranked them all (0: every one scored exactly)
    rescored_candidates: int = 0
    # llm-compressor's forward search (the attention): candidates ranked on this share of the calibration batches
    # (at least one), the best `rescored_candidates` scored again on all of them (0: every candidate on all)
    ranking_share: float = 0.0
    _batch_limit: int | None = PrivateAttr(default=None)  # forward passes over the first this many batches only
    _grid_override: list | None = PrivateAttr(default=None)  # the shortlist the rescoring pass searches
    _ranking_losses: list | None = PrivateAttr(default=None)  # each candidate's loss in the ranking pass

    @staticmethod
    def _gram_eligible(mapping) -> bool:
        parent = mapping.parent
        return (isinstance(parent, torch.nn.Linear) and len(mapping.balance_layers) == 1
                and mapping.balance_layers[0] is parent and mapping.activation_hook_target is None
                and getattr(getattr(parent, "quantization_scheme", None), "weights", None) is not None)

    def on_calibration_start(self, state, event, **kwargs):
        from compressed_tensors.offload.dist_utils import is_distributed

        self._use_gram = state.loss_masks is None and not is_distributed()
        super().on_calibration_start(state, event, **kwargs)

    def _set_resolved_mappings(self, model) -> None:
        super()._set_resolved_mappings(model)
        self._all_mappings = list(self._resolved_mappings)
        self._gram_mappings = {m.smooth_name: m for m in self._all_mappings
                               if self._use_gram and self._gram_eligible(m)}
        self._resolved_mappings = [m for m in self._all_mappings if m.smooth_name not in self._gram_mappings]
        logger.info(f"AWQ: {len(self._gram_mappings)} of {len(self._all_mappings)} mappings searched from X^T X")

    def _setup_activation_cache_hooks(self) -> None:
        super()._setup_activation_cache_hooks()  # parent-input caches for llm-compressor's mappings only
        for mapping in self._gram_mappings.values():
            if self.duo_scaling is not False and mapping.parent.quantization_scheme.weights.strategy == "tensor":
                raise ValueError(f"duo_scaling needs a per-channel or per-group weight scheme ({mapping.parent_name} "
                                 "is quantized per tensor); set duo_scaling=False")
            self.register_hook(mapping.parent, self._gram_hook(mapping.smooth_name), "forward")

    def _gram_hook(self, smooth_name: str):
        def hook(module, args, output):
            x = args[0].detach()
            entry = self._grams.setdefault(smooth_name, [None, 0])
            entry[0] = _gram_update(entry[0], x)
            entry[1] += x.reshape(-1, x.shape[-1]).shape[0]
            # llm-compressor's activation statistics (mean |x| per channel), as its own hook keeps them
            flat = x.reshape(-1, x.shape[-1]).abs()
            stats = self._smooth_activation_stats.get(smooth_name)
            new_sum, new_count = flat.float().sum(dim=0).cpu(), torch.tensor(flat.size(0))
            if stats is None:
                self._smooth_activation_stats[smooth_name] = [new_sum, new_count]
            else:
                stats[0] += new_sum
                stats[1] += new_count
        return hook

    @torch.no_grad()
    def _apply_smoothing(self, model) -> None:
        import time

        due = [m for m in self._all_mappings if m.smooth_name in self._smooth_activation_stats]
        for mapping in due:
            started = time.perf_counter()
            how = "gram" if mapping.smooth_name in self._gram_mappings else "forward"
            if how == "gram":
                self._smooth_from_gram(model, mapping)
            else:
                self._smooth_with_llm_compressor(model, mapping)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._searched[how][0] += 1
            self._searched[how][1] += time.perf_counter() - started
        self._assert_all_activations_consumed()

    def search_report(self) -> dict:
        """For quant.json: how many mappings each search smoothed, and the seconds it took."""
        return {how: {"mappings": n, "seconds": round(seconds, 2)} for how, (n, seconds) in self._searched.items()}

    def _smooth_with_llm_compressor(self, model, mapping) -> None:
        """llm-compressor's own step for this one mapping (forward passes over cached inputs)."""
        resolved, stats = self._resolved_mappings, self._smooth_activation_stats
        self._resolved_mappings = [mapping]
        self._smooth_activation_stats = {mapping.smooth_name: stats.pop(mapping.smooth_name)}
        try:
            super()._apply_smoothing(model)
        finally:
            self._resolved_mappings, self._smooth_activation_stats = resolved, stats

    def _run_samples(self, module) -> list[torch.Tensor]:
        if self._batch_limit is None:
            return super()._run_samples(module)
        cache = self._parent_args_cache[module]
        outputs = [module(**cache.fetch(index)) for index in range(min(self._batch_limit, len(cache)))]
        return [output[0] if isinstance(output, tuple) else output for output in outputs]

    def _get_grid_search_params(self) -> list[tuple[float, bool]]:
        return self._grid_override if self._grid_override is not None else super()._get_grid_search_params()

    def _compute_loss(self, fp16_outputs, int_w_outputs) -> float:
        loss = super()._compute_loss(fp16_outputs, int_w_outputs)  # over the batches both have (zip)
        if self._ranking_losses is not None:
            self._ranking_losses.append(loss)
        return loss

    def _compute_best_scale(self, mapping, fp16_outputs, orig_layer_weights):
        """llm-compressor's search, in two passes when `ranking_share` leaves batches out: every candidate scored on
        the first share of the batches (ranking; its choice discarded), then llm-compressor's own search over the
        `rescored_candidates` best of them, on every batch: the choice is made on the full loss, so it equals the
        exhaustive search's whenever the exhaustive best ranks among them."""
        import math

        grid = super()._get_grid_search_params()
        ranked_on = max(1, math.ceil(len(fp16_outputs) * self.ranking_share))
        if self.ranking_share <= 0 or ranked_on >= len(fp16_outputs) or not 0 < self.rescored_candidates < len(grid):
            return super()._compute_best_scale(mapping, fp16_outputs, orig_layer_weights)
        self._batch_limit, self._ranking_losses = ranked_on, []
        try:
            super()._compute_best_scale(mapping, fp16_outputs, orig_layer_weights)
        finally:
            losses, self._batch_limit, self._ranking_losses = self._ranking_losses, None, None
            for layer, weight in orig_layer_weights.items():  # the pass leaves its last candidate in the layers, and
                layer.weight.data = weight.clone()           # the next computes its weight means from them
        self._error_metrics.pop()  # the ranking pass's entry; the rescoring pass adds the real one
        finite = [i for i in range(len(grid)) if math.isfinite(losses[i])]
        self._grid_override = [grid[i] for i in sorted(sorted(finite, key=lambda i: (losses[i], i))
                                                        [:self.rescored_candidates])] or grid
        try:
            return super()._compute_best_scale(mapping, fp16_outputs, orig_layer_weights)
        finally:
            self._grid_override = None

    def _smooth_from_gram(self, model, mapping) -> None:
        from compressed_tensors.utils import align_modules, update_offload_parameter

        from llmcompressor.modifiers.utils.hooks import HooksMixin

        gram, tokens = self._grams.pop(mapping.smooth_name, (None, 0))
        layer = mapping.parent
        # no forward pass here, so not llm-compressor's calibration_forward_context(model): entering it walks every
        # module of the model, once per mapping (129 per GLM-4.6V layer): 10 -> 47 ms per mapping from 4 to 16
        # layers (benchmarks/awq_mapping_overhead.py)
        with align_modules([layer, mapping.smooth_layer]), HooksMixin.disable_hooks():
            if gram is None or tokens == 0 or not torch.isfinite(gram).all():
                logger.info(f"Skipping smooth_layer {mapping.smooth_name}: no finite activations to scale")
                del self._smooth_activation_stats[mapping.smooth_name]
                return
            original = layer.weight.detach().clone()
            scales = self._best_scales_from_gram(mapping, gram, tokens, original)
            del gram
            update_offload_parameter(layer, "weight", original.to(layer.weight.device) * scales.view(1, -1).to(
                layer.weight.device))
            smooth = mapping.smooth_layer
            scales = scales.to(smooth.weight.device)
            if smooth.weight.ndim == 1:
                update_offload_parameter(smooth, "weight", smooth.weight.div_(scales))
            else:  # a fused smooth layer wider than the balance input: its last rows (llm-compressor's rule)
                weight = smooth.weight
                weight[-scales.size(0):].div_(scales.view(-1, 1))
                update_offload_parameter(smooth, "weight", weight)
            if getattr(smooth, "bias", None) is not None:
                update_offload_parameter(smooth, "bias", smooth.bias.div_(scales))
        del self._smooth_activation_stats[mapping.smooth_name]

    def _best_scales_from_gram(self, mapping, gram: torch.Tensor, tokens: int,
                               original: torch.Tensor) -> torch.Tensor:
        """llm-compressor's _compute_best_scale with the loss sum(E G * E) / (tokens * out): every grid candidate
        scaled, quantized and ranked by a bfloat16 estimate of its loss, the best `rescored_candidates` scored again
        in float32 and the best of those kept (_ranked_then_rescored); candidates stacked a few per pass on a GPU.
        `stacked_search=False`, or a scheme this path does not cover, takes the search one candidate at a time
        through the layer's own observer, every one scored in float32 (_losses_one_by_one, the search before
        issue 36)."""
        layer = mapping.parent
        device = layer.weight.device
        scheme = layer.quantization_scheme.weights
        x_sum, count = self._smooth_activation_stats[mapping.smooth_name]
        x_mean = x_sum.to(device) / count.to(device)
        w_mean = self._compute_layer_means(mapping.balance_layers).to(device) if self.duo_scaling else None
        candidates = [_candidate_scales(x_mean, w_mean, ratio, duo) for ratio, duo in self._get_grid_search_params()]
        weight, gram = original.to(device), gram.to(device)
        with _tf32():
            if self.stacked_search and _stackable(scheme):
                estimates, exact = _ranked_then_rescored(
                    weight, torch.stack(candidates), gram, tokens, scheme,
                    _candidates_per_pass(weight, len(candidates), self.search_pass_bytes), self.rescored_candidates)
            else:
                estimates = _losses_one_by_one(layer, weight, candidates, gram, tokens, scheme)
                exact = dict(enumerate(estimates))
        best = None
        for index in sorted(exact):  # the first strict minimum in grid order, as llm-compressor keeps it
            if exact[index] < (exact[best] if best is not None else float("inf")):
                best = index
        if best is None:
            raise RuntimeError(f"AWQ: no finite loss in the scale search for {mapping.smooth_name}")
        initial = exact.get(0, estimates[0])  # the first candidate's loss (its estimate when it was not rescored)
        self._error_metrics.append({"layer_name": mapping.smooth_name, "parent_name": mapping.parent_name,
                                    "initial_error": initial, "best_error": exact[best],
                                    "reduction": exact[best] / initial if initial > 0 else 1.0})
        return candidates[best].detach().cpu()

    def on_finalize(self, state, **kwargs) -> bool:
        self._grams.clear()
        self._gram_mappings.clear()
        self._all_mappings.clear()
        return super().on_finalize(state, **kwargs)
