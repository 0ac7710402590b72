"""A compressed-tensors W4A16 checkpoint (`pack-quantized`, what `quantize awq` / llm-compressor
writes) in the AutoAWQ GEMM layout that lmdeploy's PyTorch engine loads
(lmdeploy/pytorch/nn/linear/awq.py, backends/default/awq_modules.py).

Per quantized Linear with in_features K, out_features N and group size g:

    compressed-tensors                                 AutoAWQ GEMM
    weight_packed      int32, codes q in [-8, 7]        qweight  int32 (K, N/8), q + 8
    weight_zero_point  int32, zp in [-8, 7] (asym only) qzeros   int32 (K/g, N/8), zp + 8 (8 when symmetric)
    weight_scale       (N, K/g)                         scales   float16 (K/g, N)

Both mean W[n, k] = (q - zp) * scale of group k // g; AWQ stores the transpose (in, out) and packs
8 output columns per int32, column j of each 8 at bit shift AWQ_SHIFTS[j]. Nothing is requantized:
the codes are read with compressed-tensors' own unpack_from_int32 and repacked, and a scale that
float16 (the only dtype lmdeploy runs AWQ in) cannot hold exactly is refused.

Memory: a quantized Linear is converted when first read, a block of output channels at a time, and
kept in a small cache (the parts of a fused query_key_value are read in turn); every other tensor is
read a row chunk at a time, like chatglm.py does. Peak memory is a few converted Linears (int4: a
quarter of their float16 size) and a chunk, not the checkpoint.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.checkpoints.streaming import CHUNK_BYTES, DictSource, SafetensorsSource
from pipeline.errors import UserError

BITS = 4
PER_INT32 = 32 // BITS
# lmdeploy's get_shifts: torch.arange(0, 32, 4).view(2, 4).t().flatten()
AWQ_SHIFTS = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28], dtype=torch.int64)
OFFSET = 1 << (BITS - 1)  # compressed-tensors' signed codes + 8 = AWQ's unsigned codes
CT_KINDS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
CACHED_LINEARS = 3  # the parts of a fused query_key_value
BYTES_PER_CODE = 20  # what unpacking and repacking allocate per 4-bit code (measured: about 18)


@dataclass(frozen=True)
class Scheme:
    group_size: int
    symmetric: bool

    def describe(self) -> str:
        return f"AWQ W4A16 GEMM, group {self.group_size}, {'symmetric' if self.symmetric else 'asymmetric'}"

    def awq_config(self, modules_to_not_convert: list[str]) -> dict:
        return {"quant_method": "awq", "bits": BITS, "group_size": self.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": modules_to_not_convert}


def read_scheme(quant_config: dict, config_file: Path) -> Scheme:
    """The int4 group scheme of a weight-only `pack-quantized` config; anything else is refused."""
    groups = list((quant_config.get("config_groups") or {}).values())
    if len(groups) != 1:
        _not_awq(config_file, f"{len(groups)} config groups (one is supported)")
    weights = groups[0].get("weights") or {}
    wanted = {"num_bits": BITS, "type": "int", "strategy": "group"}
    problems = [f"weights.{key} {weights.get(key)!r} (needs {want!r})" for key, want in wanted.items()
                if weights.get(key) != want]
    if groups[0].get("input_activations") or quant_config.get("kv_cache_scheme"):
        problems.append("quantized activations or KV cache (AWQ GEMM is weight-only)")
    if problems:
        _not_awq(config_file, "; ".join(problems))
    return Scheme(int(weights["group_size"]), bool(weights.get("symmetric")))


def _not_awq(config_file: Path, problems: str):
    raise UserError(f"{config_file}: quantization_config has {problems}: not an AWQ W4A16 checkpoint that "
                    "`quantize export` can convert; export a variant written by `quantize awq`")


# ---------------------------------------------------------------- AWQ packing


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """(rows, cols) unsigned 4-bit codes -> int32 (rows, cols / 8), column j of each 8 at AWQ_SHIFTS[j]."""
    fields = codes.to(torch.int64).reshape(codes.shape[0], -1, PER_INT32) << AWQ_SHIFTS.to(codes.device)
    words = fields.sum(-1)  # the fields share no bit: the sum is their bitwise or, in [0, 2**32)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same 32 bits, read as a signed int32


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 (rows, cols / 8) -> the (rows, cols) unsigned codes, as lmdeploy's unpack_awq reads them."""
    return ((packed.to(torch.int64)[..., None] >> AWQ_SHIFTS.to(packed.device)) & 15).flatten(-2)


def dequantize_awq_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """The (out, in) weight an AWQ GEMM Linear holds, computed as lmdeploy's dequantize_gemm does
    ((code - zero) in scales' dtype, times the scale), then transposed to nn.Linear's orientation."""
    codes = unpack_awq(qweight)
    zeros = unpack_awq(qzeros).repeat_interleave(group_size, dim=0)
    return ((codes - zeros).to(scales.dtype) * scales.repeat_interleave(group_size, dim=0)).t()


# ---------------------------------------------------------------- conversion


def exact_float16(tensor: torch.Tensor, what: str) -> torch.Tensor:
    half = tensor.to(torch.float16)
    if not torch.equal(half.to(tensor.dtype), tensor):
        bad = tensor[half.to(tensor.dtype) != tensor].flatten()[0].item()
        raise UserError(f"{what} holds scales float16 cannot represent exactly (e.g. {bad:.3g}), and lmdeploy runs "
                        "AWQ in float16 only. Quantize from a float16 base (`quantize resave --dtype float16`, then "
                        "`quantize awq`), or serve this variant with vLLM")
    return half


def float16_in_range(tensor: torch.Tensor, what: str) -> torch.Tensor:
    half = tensor.to(torch.float16)
    if torch.isinf(half).any():  # cheap first: a chunk is up to 64 MB
        overflow = torch.isinf(half) & torch.isfinite(tensor)
        if overflow.any():
            raise UserError(f"{what} holds values beyond float16's range (e.g. {tensor[overflow][0].item():.3g}), "
                            "and lmdeploy runs AWQ models in float16 only; serve this variant with vLLM instead")
    return half


@dataclass(frozen=True)
class Linear:
    name: str
    out_features: int
    in_features: int


class AwqSource:
    """A compressed-tensors W4A16 checkpoint seen in the AWQ GEMM layout, float tensors in float16.

    `modules` renames: (source modules, output module) pairs; modules sharing an output are stacked
    along the output dim (rows of a bias or float weight; columns of qweight, qzeros and scales).
    Without it every module keeps its name."""

    def __init__(self, source: SafetensorsSource, scheme: Scheme,
                 modules: list[tuple[list[str], str]] | None = None) -> None:
        self.base, self.scheme = source, scheme
        self.leaves = _leaves_by_module(source.names())
        self.linears = {m: self._linear(m) for m in self.leaves if "weight_packed" in self.leaves[m]}
        self._cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._tensors: dict[str, tuple[str, list[str], tuple[int, ...], torch.dtype]] = {}
        for parts, out in modules or [([m], m) for m in self.leaves]:
            self._add(parts, out)

    # ------------------------------------------------------------ planning

    def _linear(self, module: str) -> Linear:
        expected = {"weight_packed", "weight_scale", "weight_shape"}
        expected |= set() if self.scheme.symmetric else {"weight_zero_point"}
        if self.leaves[module] - {"bias"} != expected:
            raise UserError(f"{self.base.where(module + '.weight_packed')}: {module} holds "
                            f"{', '.join(sorted(self.leaves[module]))}, but a Linear of {self.scheme.describe()} holds "
                            f"{', '.join(sorted(expected))} (and its bias); the weights do not match config.json's "
                            "quantization_config, or the variant was not written by `quantize awq`")
        out_features, in_features = self.base.read(module + ".weight_shape", 0, 2).tolist()
        if in_features % self.scheme.group_size or out_features % PER_INT32:
            raise UserError(f"{self.base.where(module + '.weight_packed')}: {module} is {out_features} x "
                            f"{in_features}; AWQ GEMM needs the input width divisible by the group size "
                            f"{self.scheme.group_size} and the output width by {PER_INT32}")
        return Linear(module, out_features, in_features)

    def _add(self, parts: list[str], out: str) -> None:
        linears = [self.linears[p] for p in parts if p in self.linears]
        if linears and len(linears) != len(parts):
            raise UserError(f"{self.base.directory}: {', '.join(parts)} become one module {out}, but only some of "
                            "them are quantized; the AWQ layout cannot stack them")
        if linears:
            for kind, shape in _awq_shapes(linears, self.scheme.group_size).items():
                dtype = torch.float16 if kind == "scales" else torch.int32
                self._tensors[f"{out}.{kind}"] = ("columns", parts, shape, dtype)
        for leaf in sorted(self.leaves[parts[0]] - set(CT_KINDS)):
            names = [f"{p}.{leaf}" for p in parts]
            rows = sum(self.base.shape(n)[0] for n in names)
            dtype = self.base.dtype(names[0])
            self._tensors[f"{out}.{leaf}"] = ("rows", names, (rows, *self.base.shape(names[0])[1:]),
                                              torch.float16 if dtype.is_floating_point else dtype)

    def dense_view(self) -> DictSource:
        """The source checkpoint's names and unquantized shapes (a quantized Linear as its `.weight`), for
        checking them against a config; meta tensors, nothing read."""
        shapes = {n: self.base.shape(n) for n in self.base.names()
                  if n.rpartition(".")[0] not in self.linears or n.rpartition(".")[2] not in CT_KINDS}
        shapes |= {f"{m}.weight": (lin.out_features, lin.in_features) for m, lin in self.linears.items()}
        meta = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
        return DictSource(meta, label=str(self.base.directory))

    def modules_to_not_convert(self) -> list[str]:
        """Every output module left unquantized that has a matrix weight, by full name: lmdeploy tests
        `prefix in entry` against this list, so an entry must name the module whole."""
        kept = [n.removesuffix(".weight") for n, (how, _, shape, _) in self._tensors.items()
                if how == "rows" and n.endswith(".weight") and len(shape) >= 2]
        quantized = {n.removesuffix(".qweight") for n in self._tensors if n.endswith(".qweight")}
        clash = [q for q in quantized if any(q in k for k in kept)]
        if clash:
            raise UserError(f"{self.base.directory}: quantized module {clash[0]} is part of an unquantized module's "
                            "name, so lmdeploy would leave it unquantized; rename the modules")
        return kept

    # ------------------------------------------------------------ TensorSource

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name][2]

    def dtype(self, name: str) -> torch.dtype:
        return self._tensors[name][3]

    def where(self, name: str) -> str:
        how, parts, _, _ = self._tensors[name]
        return self.base.where(parts[0] + ".weight_packed" if how == "columns" else parts[0])

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        how, parts, _, _ = self._tensors[name]
        if how == "columns":
            kind = name.rsplit(".", 1)[1]
            return torch.cat([self._converted(p)[kind][start:stop] for p in parts], dim=1)
        return self._rows(parts, start, stop)

    def _rows(self, names: list[str], start: int, stop: int) -> torch.Tensor:
        pieces, offset = [], 0
        for n in names:
            rows = self.base.shape(n)[0]
            lo, hi = max(start - offset, 0), min(stop - offset, rows)
            if lo < hi:
                pieces.append(self.base.read(n, lo, hi))
            offset += rows
        chunk = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if not chunk.is_floating_point():
            return chunk
        return float16_in_range(chunk, f"{self.base.where(names[0])}: {names[0]}")

    def _converted(self, module: str) -> dict[str, torch.Tensor]:
        if module not in self._cache:
            self._cache[module] = self._convert(self.linears[module])
            if len(self._cache) > CACHED_LINEARS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(module)
        return self._cache[module]

    def _convert(self, linear: Linear) -> dict[str, torch.Tensor]:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        m = linear.name
        scales = self._whole(m + ".weight_scale")
        zero_points = (torch.zeros(scales.shape, dtype=torch.int8) if self.scheme.symmetric else
                       unpack_from_int32(self._whole(m + ".weight_zero_point"), BITS, scales.shape, packed_dim=0))
        where = f"{self.base.where(m + '.weight_scale')}: {m}.weight_scale"
        return {"qweight": self._qweight(linear),
                "qzeros": pack_awq(zero_points.t().contiguous() + OFFSET),
                "scales": exact_float16(scales.t().contiguous(), where)}

    def _qweight(self, linear: Linear) -> torch.Tensor:
        """Repacked a block of output channels at a time: unpacking and repacking keep several int32 and
        int64 copies of every code, which for a whole 9B gate_up_proj would be gigabytes."""
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        qweight = torch.empty((linear.in_features, linear.out_features // PER_INT32), dtype=torch.int32)
        step = max(PER_INT32, CHUNK_BYTES // (linear.in_features * BYTES_PER_CODE) // PER_INT32 * PER_INT32)
        for start in range(0, linear.out_features, step):
            stop = min(start + step, linear.out_features)
            packed = self.base.read(linear.name + ".weight_packed", start, stop)
            codes = unpack_from_int32(packed, BITS, torch.Size((stop - start, linear.in_features)))
            qweight[:, start // PER_INT32:stop // PER_INT32] = pack_awq(codes.t().contiguous() + OFFSET)
        return qweight

    def _whole(self, name: str) -> torch.Tensor:
        return self.base.read(name, 0, self.base.shape(name)[0])


def _leaves_by_module(names: list[str]) -> dict[str, set[str]]:
    leaves: dict[str, set[str]] = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        leaves.setdefault(module, set()).add(leaf)
    return leaves


def _awq_shapes(linears: list[Linear], group_size: int) -> dict[str, tuple[int, int]]:
    """Shapes of qweight, qzeros, scales for Linears stacked along the output dim."""
    in_features, out_features = linears[0].in_features, sum(lin.out_features for lin in linears)
    return {"qweight": (in_features, out_features // PER_INT32),
            "qzeros": (in_features // group_size, out_features // PER_INT32),
            "scales": (in_features // group_size, out_features)}
