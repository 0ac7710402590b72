"""What a calibration run did, layer by layer, read off forward hooks while llm-compressor runs:
the seconds and peak device memory of each decoder layer, and for MoE models how many tokens
each routed expert saw (and how many the router actually sent it).

Hooks count only while llm-compressor's own hooks are live (its calibration pass): the second,
propagating pass of the sequential pipeline and AWQ's grid search replay modules with its hooks
disabled, and would otherwise count every token several times.
"""

from __future__ import annotations

import statistics
import time

from pipeline.quantize import plan


def _hooks_live() -> bool:
    from llmcompressor.modifiers.utils.hooks import HooksMixin

    return not HooksMixin._HOOKS_DISABLED


class LayerTimer:
    """Wall seconds each decoder layer was the one being calibrated: from its first input to its
    last output of a visit (the sequential pipeline visits each layer once per calibrating
    modifier), AWQ's or GPTQ's per-layer work in between included; and the peak device memory
    allocated meanwhile (CUDA only)."""

    def __init__(self, model, layer_done=None):
        """layer_done(1): called when a layer is done (the next one entered for the first time)."""
        import torch

        self.cuda = torch.cuda.is_available()
        self.layers = plan.decoder_layers(model)
        self.layer_done, self.entered = layer_done, set()
        self.seconds = {name: 0.0 for name, _ in self.layers}
        self.peak_bytes = {name: 0 for name, _ in self.layers}
        self.overall_peak = 0
        self._current: str | None = None
        self._visit_start = self._last_output = 0.0
        self._handles = []
        for name, layer in self.layers:
            self._handles.append(layer.register_forward_pre_hook(self._enter(name)))
            self._handles.append(layer.register_forward_hook(self._leave(name)))

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def _close_visit(self) -> None:
        if self._current is not None:
            self.seconds[self._current] += self._last_output - self._visit_start
            if self.cuda:
                import torch

                peak = torch.cuda.max_memory_allocated()
                self.peak_bytes[self._current] = max(self.peak_bytes[self._current], peak)
                self.overall_peak = max(self.overall_peak, peak)
        self._current = None

    def _enter(self, name: str):
        def hook(module, args):
            if self._current == name:
                return
            if name not in self.entered:
                if self.entered and self.layer_done is not None:
                    self.layer_done(1)
                self.entered.add(name)
            self._sync()
            self._close_visit()
            if self.cuda:
                import torch

                self.overall_peak = max(self.overall_peak, torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            self._current, self._visit_start = name, time.perf_counter()
        return hook

    def _leave(self, name: str):
        def hook(module, args, output):
            if self._current == name:
                self._sync()
                self._last_output = time.perf_counter()
        return hook

    def close(self) -> dict:
        self._close_visit()
        for handle in self._handles:
            handle.remove()
        if self.cuda:
            import torch

            self.overall_peak = max(self.overall_peak, torch.cuda.max_memory_allocated())
        return {
            "seconds": {name: round(s, 3) for name, s in self.seconds.items()},
            "peak_gpu_bytes": dict(self.peak_bytes) if self.cuda else None,
            "overall_peak_gpu_bytes": self.overall_peak if self.cuda else None,
        }


def expert_modules(model) -> list[tuple[str, object]]:
    """MoE experts held as one Linear MLP per expert (llm-compressor's LinearExperts2D)."""
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    return [(name, module) for name, module in model.named_modules() if isinstance(module, LinearExperts2D)]


class ExpertCounter:
    """Per routed expert: calibration tokens it processed (what its observers and AWQ saw) and
    tokens the router chose it for (what it would see without calibrate-all-experts)."""

    def __init__(self, model):
        self.experts = expert_modules(model)
        self.seen = {name: [0] * module.num_experts for name, module in self.experts}
        self.routed = {name: [0] * module.num_experts for name, module in self.experts}
        self._handles = []
        for name, module in self.experts:
            self._handles.append(module.register_forward_pre_hook(self._route(name)))
            for index in range(module.num_experts):
                self._handles.append(module[index].register_forward_pre_hook(self._see(name, index)))

    def _route(self, name: str):
        def hook(module, args):
            if _hooks_live() and len(args) >= 2:
                import torch

                counts = torch.bincount(args[1].reshape(-1), minlength=module.num_experts).tolist()
                self.routed[name] = [a + b for a, b in zip(self.routed[name], counts)]
        return hook

    def _see(self, name: str, index: int):
        def hook(module, args):
            if _hooks_live():
                x = args[0]
                self.seen[name][index] += x.reshape(-1, x.shape[-1]).shape[0]
        return hook

    def close(self) -> dict | None:
        for handle in self._handles:
            handle.remove()
        if not self.experts:
            return None
        return summarize_experts(self.seen, self.routed)


def summarize_experts(seen: dict[str, list[int]], routed: dict[str, list[int]]) -> dict:
    layers = {}
    for name, counts in seen.items():
        chosen = routed[name]
        layers[name] = {
            "experts": len(counts),
            "tokens_seen": {"min": min(counts), "max": max(counts)},
            "experts_without_tokens": sum(1 for c in counts if c == 0),
            "tokens_routed": {"min": min(chosen), "median": statistics.median(chosen), "max": max(chosen)},
            "experts_never_routed": sum(1 for c in chosen if c == 0),
        }
    starved = [f"{name}.{index}" for name, counts in seen.items() for index, c in enumerate(counts) if c == 0]
    return {"layers": layers, "starved": starved,
            "seen": {name: counts for name, counts in seen.items()},
            "routed": {name: counts for name, counts in routed.items()}}
