"""Where AWQ calibration time goes, per mapping and phase, read off the code paths a real run takes: the
functions our stage and llm-compressor call are wrapped while a `quantize awq` run is in progress (nothing in
pipeline/ changes), each call timed (CUDA synchronised before and after; on a CPU, this process's CPU seconds,
steadier than wall time on a shared machine) and charged to the innermost phase running (exclusive times).

Phases: the calibration pass (forward through the layer with llm-compressor's hooks; X^T X accumulation charged
apart), the propagation pass, the activations between layers (llm-compressor's IntermediatesCache fetch/update:
host <-> device moves when they wait on the host), per mapping: the reference and per-candidate forward passes
(llm-compressor's search), quantizing the candidates (observe, qparams, fake-quantize), the loss (llm-compressor's
MSE, or E G E^T), the rest of the mapping (candidate scales, smoothing, bookkeeping), and the final quantization
(QuantizationModifier's weights: llm-compressor runs it data-free after the layers, so it falls in 'pipeline,
other'). `old_path()` selects the code before issue 36
(one-by-one float32 X^T X search, exhaustive forward search, activations between layers on the host) for a before/after comparison.

Used by benchmarks/awq_profile.py (CPU) and benchmarks/gpu_awq_speed.py (H200).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import defaultdict

LAYER = "layer"  # phases that belong to the decoder layer, not to one mapping


def _in_layer(name: str) -> str:
    return re.sub(r"^.*layers\.\d+\.", "", name or "")


def mapping_label(smooth_name: str, parent_name: str) -> str:
    """e.g. 'input_layernorm -> self_attn': the smooth layer and the module whose output the search scores."""
    return f"{_in_layer(smooth_name)} -> {_in_layer(parent_name)}"


class Profile:
    def __init__(self):
        import torch

        self.cuda = torch.cuda.is_available()
        self.seconds: dict = defaultdict(float)
        self.calls: dict = defaultdict(int)
        self._stack: list[float] = []
        self.mapping = LAYER
        self._first_run = False
        self._patches: list = []
        self.total = 0.0

    def now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    @contextlib.contextmanager
    def phase(self, name: str, mapping: str | None = None):
        started = self.now()
        self._stack.append(0.0)
        try:
            yield
        finally:
            elapsed, inner = self.now() - started, self._stack.pop()
            key = (mapping or self.mapping, name)
            self.seconds[key] += elapsed - inner
            self.calls[key] += 1
            if self._stack:
                self._stack[-1] += elapsed

    def wrap(self, owner, attr: str, name) -> None:
        """owner.attr timed as phase `name` (a str, or a function of the call's arguments giving one)."""
        original = getattr(owner, attr)
        self._patches.append((owner, attr, original))
        profile = self

        def timed(*args, **kwargs):
            with profile.phase(name(*args, **kwargs) if callable(name) else name):
                return original(*args, **kwargs)
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, original in reversed(self._patches):
            setattr(owner, attr, original)
        self._patches.clear()


def _wrap_mappings(profile: Profile) -> None:
    from pipeline.methods.awq_gram import GramAWQModifier

    for attr in ("_smooth_from_gram", "_smooth_with_llm_compressor"):
        original = getattr(GramAWQModifier, attr)
        profile._patches.append((GramAWQModifier, attr, original))

        def per_mapping(self, model, mapping, _original=original):
            profile.mapping, profile._first_run = mapping_label(mapping.smooth_name, mapping.parent_name), True
            try:
                with profile.phase("candidate scales, smoothing, rest"):
                    return _original(self, model, mapping)
            finally:
                profile.mapping = LAYER
        setattr(GramAWQModifier, attr, per_mapping)

    original_hook = GramAWQModifier._gram_hook
    profile._patches.append((GramAWQModifier, "_gram_hook", original_hook))

    def gram_hook(self, smooth_name):
        hook = original_hook(self, smooth_name)
        label = mapping_label(smooth_name, self._gram_mappings[smooth_name].parent_name)

        def timed(module, args, output):
            with profile.phase("X^T X accumulation (in the calibration pass)", label):
                return hook(module, args, output)
        return timed
    GramAWQModifier._gram_hook = gram_hook


def _run_samples_phase(profile: Profile):
    def name(*args, **kwargs):
        first, profile._first_run = profile._first_run, False
        return "reference forward (unquantized)" if first else "candidate forwards"
    return name


@contextlib.contextmanager
def profiled():
    """A Profile collecting while the block runs (one `quantize awq` run inside)."""
    import compressed_tensors.quantization as ct_quantization
    import llmcompressor.modifiers.quantization.calibration as calibration
    import llmcompressor.modifiers.transform.awq.base as awq_base
    from llmcompressor.modifiers.utils.hooks import HooksMixin
    from llmcompressor.pipelines.cache import IntermediatesCache
    from llmcompressor.pipelines.sequential.helpers import Subgraph

    import pipeline.methods.awq_gram as awq_gram

    profile = Profile()
    profile.wrap(Subgraph, "forward", lambda *a, **k: "propagation pass" if HooksMixin._HOOKS_DISABLED
                 else "calibration pass")
    profile.wrap(IntermediatesCache, "fetch", "activations between layers (fetch)")
    profile.wrap(IntermediatesCache, "update", "activations between layers (store)")
    _wrap_mappings(profile)
    # our subclass's _run_samples (its ranking pass runs the first batches only, without llm-compressor's)
    profile.wrap(awq_gram.GramAWQModifier, "_run_samples", _run_samples_phase(profile))
    for owner in (awq_base, calibration):
        profile.wrap(owner, "observe", "quantize candidates")
        profile.wrap(owner, "update_qparams", "quantize candidates")
    profile.wrap(awq_base, "forward_quantize", "quantize candidates")
    profile.wrap(ct_quantization, "forward_quantize", "quantize candidates")
    profile.wrap(awq_base.AWQModifier, "_compute_loss", "loss (MSE of the outputs)")
    profile.wrap(awq_gram, "_quantize_stacked", "quantize candidates")
    profile.wrap(awq_gram, "_gram_loss", "loss (E G E^T)")
    _time_calibration(profile)
    try:
        yield profile
    finally:
        profile.restore()


def _time_calibration(profile: Profile) -> None:
    """profile.total: the seconds inside calibrate.calibrate (llm-compressor's oneshot), the phases' whole."""
    import pipeline.quantize.calibrate as calibrate

    original = calibrate.calibrate
    profile._patches.append((calibrate, "calibrate", original))

    def timed(*args, **kwargs):
        started = profile.now()
        try:
            return original(*args, **kwargs)
        finally:
            profile.total += profile.now() - started
    calibrate.calibrate = timed


@contextlib.contextmanager
def old_path():
    """The AWQ path before issue 36: the X^T X search one candidate at a time, activations between layers on the host."""
    import pipeline.methods.awq as awq
    import pipeline.quantize.calibrate as calibrate

    recipe, calibrate_fn = awq.recipe, calibrate.calibrate

    def old_recipe(settings, target):
        built = recipe(settings, target)
        for modifier in built.modifiers:
            if hasattr(modifier, "stacked_search"):
                modifier.stacked_search, modifier.ranking_share = False, 0.0
        return built

    def old_calibrate(*args, **kwargs):
        return calibrate_fn(*args, **{**kwargs, "activations_device": None})
    awq.recipe, calibrate.calibrate = old_recipe, old_calibrate
    try:
        yield
    finally:
        awq.recipe, calibrate.calibrate = recipe, calibrate_fn


def rows(profile: Profile, layers: int) -> list[dict]:
    """Seconds and calls per decoder layer, by (mapping, phase); the rest of the run as 'pipeline, other'."""
    out = [{"mapping": mapping, "phase": phase, "s_per_layer": seconds / layers,
            "calls_per_layer": profile.calls[(mapping, phase)] / layers}
           for (mapping, phase), seconds in sorted(profile.seconds.items())]
    accounted = sum(profile.seconds.values())
    out.append({"mapping": LAYER, "phase": "pipeline, other (tracing, data, the final weight quantization)",
                "s_per_layer": (profile.total - accounted) / layers, "calls_per_layer": 0})
    return out


def table(columns: dict[str, list[dict]], unit: str) -> str:
    """Markdown: one row per (mapping, phase), one column per profiled run."""
    keys = list(dict.fromkeys((r["mapping"], r["phase"]) for rs in columns.values() for r in rs))
    by = {name: {(r["mapping"], r["phase"]): r for r in rs} for name, rs in columns.items()}
    lines = [f"| mapping | phase | {' | '.join(f'{name}: {unit} / layer (calls)' for name in columns)} |",
             "|---|---|" + "---|" * len(columns)]
    for key in keys:
        cells = [f"{by[n][key]['s_per_layer']:.3f} ({by[n][key]['calls_per_layer']:.0f})" if key in by[n] else "–"
                 for n in columns]
        lines.append(f"| {key[0]} | {key[1]} | {' | '.join(cells)} |")
    totals = [f"**{sum(r['s_per_layer'] for r in rs):.3f}**" for rs in columns.values()]
    lines.append(f"| all | per layer, in all | {' | '.join(totals)} |")
    return "\n".join(lines)


@contextlib.contextmanager
def ranked_forward(share: float = 0.25):
    """Our stage with the attention's forward search ranked on `share` of the batches, the best 3 rescored on all
    (GramAWQModifier.ranking_share; off by default, see pipeline/methods/awq.py)."""
    import pipeline.methods.awq as awq

    recipe = awq.recipe

    def ranked_recipe(settings, target):
        built = recipe(settings, target)
        for modifier in built.modifiers:
            if hasattr(modifier, "ranking_share"):
                modifier.ranking_share = share
        return built
    awq.recipe = ranked_recipe
    try:
        yield
    finally:
        awq.recipe = recipe
