"""Streamed safetensors: read tensors a row chunk at a time from a checkpoint's shards and write a
planned checkpoint shard by shard, so converting a 9B model needs a few chunks of memory, not a shard.

A `TensorSource` names, shapes and reads tensors (a safetensors directory, or a dict in tests); an
`OutTensor` is one output tensor assembled from `Piece`s (row ranges of source tensors). `write_checkpoint`
checks nothing and computes nothing: it copies planned bytes, with a progress bar (console.progress), into shards named
as transformers names them, plus the index. Used by the ChatGLM <-> Glm conversion (chatglm.py) and
the lmdeploy exports (export.py, lmdeploy_awq.py).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol

import torch

from pipeline.errors import UserError
from pipeline.console import progress

# every checkpoint the pipeline writes (resave, quantize, fix, export) in shards of at most 1 GB: DVC hashes the
# files of a directory output side by side (core.checksum_jobs, .dvc/config), one file per thread, so a 10.6 GB FP8
# checkpoint in one file took 21.7 s of DVC's time after its stage on the H200 (2026-12-02). (The W4A16 failure of
# the H100 run of 2026-12-06, first put down to shards, was a zero point unpacked to the host: unpack.py.)
MAX_SHARD_BYTES = 10**9
MAX_SHARD = "1GB"  # the same, as transformers' save_pretrained(max_shard_size=...) takes it
CHUNK_BYTES = 64 << 20
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")


class TensorSource(Protocol):
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def names(self) -> list[str]: ...
    def where(self, name: str) -> str: ...
    def read(self, name: str, start: int, stop: int) -> torch.Tensor: ...


class SafetensorsSource:
    """The safetensors files of a checkpoint directory, read a row range at a time."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._file: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, torch.dtype] = {}
        for path in self._files():
            self._read_header(path)
        self._check_index()

    def _files(self) -> list[Path]:
        index = self._index()
        if index is not None:
            files = sorted(set(index["weight_map"].values()))
            missing = [f for f in files if not (self.directory / f).exists()]
            if missing:
                raise UserError(
                    f"{self.directory / 'model.safetensors.index.json'}: lists {', '.join(missing)}, "
                    f"missing from {self.directory}; download the complete checkpoint again"
                )
            return [self.directory / f for f in files]
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            has_bin = any(self.directory.glob("*.bin"))
            fix = ("it has only PyTorch .bin weights: convert each to .safetensors "
                   "(safetensors.torch.save_file(torch.load(f, weights_only=True), ...)) or download the "
                   "safetensors revision" if has_bin else "download the weights next to config.json")
            raise UserError(f"{self.directory}: no .safetensors weights; {fix}")
        return files

    def _index(self) -> dict | None:
        index_file = self.directory / "model.safetensors.index.json"
        if not index_file.exists():
            return None
        try:
            index = json.loads(index_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise UserError(f"{index_file}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(index.get("weight_map"), dict):
            raise UserError(f"{index_file}: no weight_map; download the checkpoint's index file again")
        return index

    def _read_header(self, path: Path) -> None:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    if name in self._file:
                        raise UserError(f"{path}: tensor {name} is also in {self._file[name].name}; "
                                        "the directory mixes two checkpoints")
                    self._file[name] = path
                    self._shape[name] = tuple(piece.get_shape())
                    self._dtype[name] = FROM_SAFETENSORS[piece.get_dtype()]
        except SafetensorError as exc:
            raise UserError(f"{path}: not a readable safetensors file ({exc}); it is truncated or corrupt, "
                            "download it again") from None

    def _check_index(self) -> None:
        index = self._index()
        if index is None:
            return
        for name, file in index["weight_map"].items():
            if self._file.get(name, Path()).name != file:
                raise UserError(f"{self.directory / file}: has no tensor {name}, which "
                                "model.safetensors.index.json places there; the shard does not match its index")

    def names(self) -> list[str]:
        return list(self._file)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def dtype(self, name: str) -> torch.dtype:
        return self._dtype[name]

    def where(self, name: str) -> str:
        return str(self._file[name])

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        from safetensors import safe_open

        # A fresh mapping per chunk: pages touched through a long-lived one count as resident.
        with safe_open(self._file[name], framework="pt") as f:
            return f.get_slice(name)[start:stop]


class DictSource:
    """In-memory (or meta-device) tensors behind the same interface, for planning without files."""

    def __init__(self, tensors: dict[str, torch.Tensor], label: str = "state dict") -> None:
        self.tensors, self.label = tensors, label

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def where(self, name: str) -> str:
        return self.label

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name][start:stop]


# ---------------------------------------------------------------- planning


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of a source tensor (dim 0)."""

    source: str
    start: int
    stop: int


@dataclass
class OutTensor:
    """One output tensor: its pieces stacked along dim 0, cast to dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def check_shapes(source: TensorSource, expected: dict[str, tuple[int, ...]], config_file: Path,
                 optional: Iterable[str] = ()) -> None:
    """Every expected tensor present with its shape, and nothing else (bar `optional`)."""
    optional, present = set(optional), set(source.names())
    for name, shape in expected.items():
        if name not in present:
            raise UserError(f"{_label(source)}: no tensor {name}, "
                            f"which {config_file} implies; the config does not match the weights "
                            "(or a shard is missing)")
        if source.shape(name) != tuple(shape):
            raise UserError(f"{source.where(name)}: tensor {name} has shape {list(source.shape(name))} but "
                            f"{config_file} implies {list(shape)}; the config does not match the weights, "
                            "use the config.json that came with them")
    extra = [n for n in source.names() if n not in expected and n not in optional]
    if extra:
        raise UserError(f"{source.where(extra[0])}: tensor {extra[0]} is not part of the model {config_file} "
                        f"describes ({len(extra)} unexpected tensors); the config does not match the weights")


def _label(source: TensorSource) -> str:
    return str(getattr(source, "directory", getattr(source, "label", "checkpoint")))


def whole(name: str, source: TensorSource, out_name: str, dtype: torch.dtype | None = None) -> OutTensor:
    shape = source.shape(name)
    return OutTensor(out_name, shape, dtype or source.dtype(name), [Piece(name, 0, shape[0])])


def materialize(plan: list[OutTensor], source: TensorSource) -> dict[str, torch.Tensor]:
    """The planned tensors in memory (works on meta tensors): for tests and small models."""
    return {t.name: torch.cat([source.read(p.source, p.start, p.stop) for p in t.pieces]).to(t.dtype)
            for t in plan}


# ---------------------------------------------------------------- writing


def plan_shards(plan: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for tensor in plan:
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def write_checkpoint(plan: list[OutTensor], source: TensorSource, dest: Path,
                     max_shard_bytes: int = MAX_SHARD_BYTES, label: str = "convert") -> list[Path]:
    """Writes the plan as safetensors shards (+ index when more than one) into the dir dest."""
    shards = plan_shards(plan, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    total = sum(t.nbytes for t in plan)
    with progress(label, total, unit="bytes") as advance:
        for name, shard in zip(names, shards):
            _write_safetensors(dest / name, shard, source, advance)
    if len(shards) > 1:
        weight_map = {t.name: name for name, shard in zip(names, shards) for t in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [dest / n for n in names]


def _write_safetensors(path: Path, tensors: list[OutTensor], source: TensorSource,
                       advance: Callable[[int], None]) -> None:
    header, offset = {}, 0
    for t in tensors:
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors:
            written = sum(_write_piece(f, t, piece, source, advance) for piece in t.pieces)
            if written != t.nbytes:  # a bug in a plan, never bad input: pieces must fill the tensor
                raise RuntimeError(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")


def _write_piece(f, tensor: OutTensor, piece: Piece, source: TensorSource, advance) -> int:
    row_bytes = math.prod(tensor.shape[1:]) * max(tensor.dtype.itemsize, source.dtype(piece.source).itemsize)
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    written = 0
    for start in range(piece.start, piece.stop, step):
        chunk = source.read(piece.source, start, min(start + step, piece.stop)).to(tensor.dtype).contiguous()
        data = chunk.reshape(-1).view(torch.uint8).numpy()
        f.write(data)
        written += data.nbytes
        advance(data.nbytes)
    return written


def carry_files(source: Path, dest: Path) -> list[str]:
    """Copies every top-level file that is not weights or config.json; returns their names."""
    carried = []
    for path in sorted(source.iterdir()):
        if (path.is_file() and not path.name.startswith(".") and path.name != "config.json"
                and not path.name.endswith(WEIGHT_SUFFIXES) and not path.name.endswith(".index.json")):
            shutil.copy2(path, dest / path.name)
            carried.append(path.name)
    return carried


# ---------------------------------------------------------------- ChatGLM -> Glm
