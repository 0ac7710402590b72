"""The GPU's memory shared by a run's vLLM servers, fitted to what each one holds (engine.kv_cache_memory: fitted).

A server holds its checkpoint's weights, a KV pool and what is neither (activations, CUDA graphs, the CUDA context:
engine.non_kv_memory_gib). Its pool is the one its requests need: engine.batch_size requests in flight of
engine.plan_request_tokens tokens each (GSM8K's prompt with its 512 new tokens, the run's most numerous batched
request), and never less than one request of engine.max_model_len (vLLM refuses to start otherwise); when the GPU
cannot give that much, what is left of it beside the weights, said so (`Share.why`). The servers together keep to
engine.gpu_memory_utilization of the GPU (0.9, vLLM's own default for one server): as many are resident at once as
fit, and the others start when one is given back (pipeline/engines/shared.py admits a server by these bytes). Each
server is started with `--kv-cache-memory-bytes` its pool and `--gpu-memory-utilization` its own share, which is
what vLLM checks the GPU's free memory against at start.

A server's share depends on its own checkpoint and the settings only, so the same checkpoint gets the same command
line (and the same shared server) whatever else the run serves. The run's plan (`plan`) puts the shares side by
side: which servers are resident at once, in the run's order (the base first: every variant's judge asks it), and
refuses, before any server starts, a card on which a model does not fit alone or a variant not beside the base.
`quantize warm` prints it and keeps it in the servers' registry (PLAN_FILE); `quantize bench` writes the share its
server was measured at into bench.json (`capacity.plan`).

A checkpoint not built yet is sized from the base's tensors (their headers only) and its method's bits per weight
(`estimated`). Standard library only: no torch, no CUDA.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pipeline.engines.gpu_memory import GIB
from pipeline.errors import UserError

# in the servers' registry (.cache/servers; a folder of its own: the registry's *.json are its servers' entries): the
# run's plan as `quantize warm` printed it
PLAN_FILE = Path("plan") / "servers.json"


@dataclass(frozen=True)
class Share:
    """One server's memory: weights, KV pool and reserve, and how many tokens the pool holds."""

    model: str
    weight_bytes: int
    kv_bytes_per_token: int
    reserve_bytes: int
    pool_bytes: int
    wanted_tokens: int
    estimated: bool = False  # weights estimated from the base and the method: the checkpoint is not built yet
    why: str = ""  # when the pool holds fewer tokens than wanted: what limited it
    measured_bytes: int | None = None  # the most a server of it was measured to hold, where more than planned

    @property
    def kv_tokens(self) -> int:
        return self.pool_bytes // self.kv_bytes_per_token if self.kv_bytes_per_token else 0

    @property
    def planned_bytes(self) -> int:
        return self.weight_bytes + self.pool_bytes + self.reserve_bytes

    @property
    def total_bytes(self) -> int:
        """What the server is counted at: its plan, or what it was measured to hold where that is more."""
        return max(self.planned_bytes, self.measured_bytes or 0)

    def measured(self, peak_bytes: int | None) -> Share:
        """This share counted at peak_bytes (a server of it measured on the GPU) where that passes the plan."""
        return replace(self, measured_bytes=peak_bytes) if peak_bytes and peak_bytes > self.planned_bytes else self

    def utilization(self, device_bytes: int) -> float:
        """vLLM's --gpu-memory-utilization for this server: its share of the GPU, rounded up (vLLM checks the GPU's
        free memory at start against it)."""
        return min(1.0, math.ceil(self.total_bytes / device_bytes * 10000) / 10000)

    def as_dict(self, device_bytes: int | None = None) -> dict:
        shown = {**asdict(self), "kv_tokens": self.kv_tokens, "planned_bytes": self.planned_bytes,
                 "total_bytes": self.total_bytes,
                 "total_gib": round(self.total_bytes / GIB, 2)}
        if device_bytes:
            shown["gpu_memory_utilization"] = self.utilization(device_bytes)
        return shown


def fit(model: str, weight_bytes: int, kv_bytes_per_token: int, *, device_bytes: int, fraction: float,
        reserve_bytes: int, batch_size: int, request_tokens: int, max_model_len: int, estimated: bool = False) -> Share:
    """The share of one server: the KV pool batch_size requests of request_tokens need (at least one request of
    max_model_len), or what is left of fraction x the GPU beside its weights and reserve. Refuses a server that
    cannot hold its weights and one request of max_model_len on this GPU, with the settings that would fit."""
    budget = int(fraction * device_bytes)
    wanted = max(batch_size * request_tokens, max_model_len)
    left = budget - weight_bytes - reserve_bytes
    need = max_model_len * kv_bytes_per_token
    if left < need:
        fits = max(0, left // kv_bytes_per_token) if kv_bytes_per_token else 0
        raise UserError(
            f"{model}: does not fit on this GPU: {_gib(weight_bytes)} of weights, {_gib(reserve_bytes)} reserved "
            f"(engine.non_kv_memory_gib, and engine.vision_memory_gib for a vision-language model) and one request "
            f"of engine.max_model_len {max_model_len:,} tokens "
            f"({_gib(need)} of KV cache) are more than engine.gpu_memory_utilization {fraction:g} of "
            f"{_gib(device_bytes)}; " + (f"lower engine.max_model_len to {_round_down(fits):,} at most, " if fits >= 16
                                        else "") + "or serve it on a larger GPU or with engine.tensor_parallel_size")
    if left >= wanted * kv_bytes_per_token:
        return Share(model, weight_bytes, kv_bytes_per_token, reserve_bytes, wanted * kv_bytes_per_token, wanted,
                     estimated)
    why = (f"{left // kv_bytes_per_token:,} of the {wanted:,} tokens engine.batch_size {batch_size} x "
           f"engine.plan_request_tokens {request_tokens:,} want: what {_gib(budget)} (engine.gpu_memory_utilization "
           f"{fraction:g} of {_gib(device_bytes)}) leaves beside {_gib(weight_bytes)} of weights")
    return Share(model, weight_bytes, kv_bytes_per_token, reserve_bytes, left, wanted, estimated, why)


def _round_down(tokens: int) -> int:
    return max(16, tokens // 1024 * 1024) if tokens >= 1024 else tokens


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"


@dataclass
class Plan:
    """The run's servers side by side: each one's share, and the groups resident at once (`waves`, in the run's
    order: each group starts when the one before gives its servers back, the pinned model staying)."""

    device_bytes: int
    fraction: float
    shares: list[Share]
    pinned: str | None  # resident throughout (the base: every variant's judge asks it)
    waves: list[list[str]] = field(default_factory=list)
    device_source: str = "nvidia-smi"

    @property
    def budget_bytes(self) -> int:
        return int(self.fraction * self.device_bytes)

    def share(self, model: str) -> Share | None:
        return next((s for s in self.shares if s.model == model), None)

    def as_dict(self) -> dict:
        return {"device_bytes": self.device_bytes, "device_gib": round(self.device_bytes / GIB, 2),
                "device_source": self.device_source, "gpu_memory_utilization": self.fraction,
                "budget_bytes": self.budget_bytes, "pinned": self.pinned, "waves": self.waves,
                "resident_at_once": max((len(w) for w in self.waves), default=0),
                "servers": [s.as_dict(self.device_bytes) for s in self.shares]}

    def lines(self) -> list[str]:
        """The plan as `quantize warm` prints it: per server its memory and KV tokens, then who runs side by side."""
        head = (f"server plan: {_gib(self.device_bytes)} GPU ({self.device_source}), the servers together "
                f"{_gib(self.budget_bytes)} (engine.gpu_memory_utilization {self.fraction:g})")
        rows = []
        for s in self.shares:
            rows.append(f"  {s.model}: {_gib(s.total_bytes)} = weights {_gib(s.weight_bytes)}"
                        f"{' (estimated: not built yet)' if s.estimated else ''} + KV {_gib(s.pool_bytes)} "
                        f"({s.kv_tokens:,} tokens) + reserve {_gib(s.reserve_bytes)}"
                        + (f"; measured {_gib(s.measured_bytes)}: counted so" if s.measured_bytes else "")
                        + (f"; KV limited to {s.why}" if s.why else ""))
        together = ["  side by side: " + " | then ".join(", ".join(w) for w in self.waves)]
        if len(self.waves) > 1:
            together.append(f"  {len(self.waves)} groups: a server of an earlier group stops when the next needs its "
                            "room, and starts again if a later stage asks for it (quantize bench runs last)")
        return [head, *rows, *together]


def plan(shares: list[Share], *, device_bytes: int, fraction: float, pinned: str | None = None,
         device_source: str = "nvidia-smi") -> Plan:
    """The run's servers side by side, in the order given (the run's: base, variants, fixes): a group takes the
    next server while it fits beside the ones it holds, else the next group begins with the pinned server and it.
    Refuses a plan in which the pinned server and another do not fit together (a variant's judge needs both)."""
    result = Plan(device_bytes, fraction, list(shares), pinned, device_source=device_source)
    budget = result.budget_bytes
    keep = result.share(pinned) if pinned else None
    for s in shares:
        if keep is not None and s.model != keep.model and keep.total_bytes + s.total_bytes > budget:
            raise UserError(
                f"{s.model} ({_gib(s.total_bytes)}) does not fit beside {keep.model}'s server "
                f"({_gib(keep.total_bytes)}) in {_gib(budget)} (engine.gpu_memory_utilization {fraction:g} of "
                f"{_gib(device_bytes)}), and its judge needs both; lower engine.batch_size or "
                f"engine.plan_request_tokens (each server's KV pool is their product), or judge on another server "
                f"(judge.backend: openai)")
    wave: list[Share] = [keep] if keep is not None else []
    for s in shares:
        if keep is not None and s.model == keep.model:
            continue
        if sum(w.total_bytes for w in wave) + s.total_bytes > budget and len(wave) > (1 if keep else 0):
            result.waves.append([w.model for w in wave])
            wave = [keep] if keep is not None else []
        wave.append(s)
    if wave:
        result.waves.append([w.model for w in wave])
    return result


# ---------------------------------------------------------------- sizes read off the checkpoints

def weight_bytes(model_dir: Path, tensor_parallel: int = 1) -> int:
    """The bytes of the checkpoint's weight files, per GPU (all of them load)."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) // tensor_parallel


def quantized(name: str, elements_2d: bool) -> bool:
    """Whether a variant quantizes the tensor: a decoder layer's matrix outside the vision tower and the MoE router
    (what every method here targets: lm_head, embeddings, norms and the vision tower stay as they are)."""
    return elements_2d and ".layers." in name and "visual" not in name and not name.endswith("mlp.gate.weight")


def estimated_weight_bytes(base_dir: Path, bits: float, group_size: int | None, tensor_parallel: int = 1) -> int:
    """A variant's weight bytes before it is built: the base's tensors, each quantized one at `bits` per weight plus
    a 16-bit scale and a 4-bit zero point per group (group_size None: per channel, negligible), the rest as they are."""
    from pipeline.checkpoints.headers import TORCH_ITEMSIZE, safetensors_shapes
    from pipeline.checkpoints.sizes import stored_bits_per_weight

    total = 0.0
    per_weight = stored_bits_per_weight(bits, group_size, zero_point_bits=4) / 8
    for path in sorted(Path(base_dir).glob("*.safetensors")):
        for name, (shape, dtype) in safetensors_shapes(path).items():
            elements = math.prod(shape)
            total += elements * per_weight if quantized(name, len(shape) >= 2) else \
                elements * TORCH_ITEMSIZE.get(dtype, 2)
    return int(total) // tensor_parallel


# ---------------------------------------------------------------- the plan's file

def write(plan_: Plan, registry: Path) -> Path:
    path = registry / PLAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(plan_.as_dict(), indent=1))
    tmp.replace(path)
    return path


def read(registry: Path) -> dict | None:
    try:
        return json.loads((registry / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return None
