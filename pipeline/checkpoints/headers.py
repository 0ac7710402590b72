"""Checks a checkpoint directory before any stage loads it, from config.json and the weight
files' headers only (no tensor data is read): every stage that takes a checkpoint (resave of an
HF directory, quantize, eval, kl, judge, bench, export) calls `check` first.

A directory is refused, with the file at fault and the fix, when it is missing, has no
config.json or one that is not valid JSON, names an architecture transformers cannot build, has
no weights, or a weight file that is truncated or not a weight file at all, and when its weights
do not cover its config: a tensor missing (transformers would fill it with random values and
say so only in a log line), one that no module holds, or one of another shape. That last check
builds the model on the meta device from config.json, the way the stages load it (compressed-
tensors modules in their compressed layout, MoE experts as one Linear per expert where the
loader splits them) and runs transformers' own checkpoint-key mapping on meta tensors made from
the safetensors headers, so the tensors are named and shaped exactly as loading would see them.
"""

from __future__ import annotations

import json
import math
import struct
import dataclasses
from pathlib import Path

from pipeline.checkpoints import checkpoint, config_json
from pipeline.checkpoints.checkpoint import Checkpoint
from pipeline.checkpoints.config_json import REBUILD, one_line as _one_line
from pipeline.errors import UserError

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
SHOWN = 5  # names listed per kind of mismatch; the count covers the rest


# ---------------------------------------------------------------- weight files


def weight_files(model_dir: Path) -> list[Path]:
    """The files transformers loads, in its order of preference: model.safetensors, its sharded
    index, pytorch_model.bin, its index. Refuses a directory with none, or an index whose shards are
    missing."""
    for single, index in ((SAFE_WEIGHTS, SAFE_INDEX), (BIN_WEIGHTS, BIN_INDEX)):
        if (model_dir / single).is_file():
            return [model_dir / single]
        if (model_dir / index).is_file():
            weight_map = _read_index(model_dir / index)
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (model_dir / f).is_file()]
            if missing:
                raise UserError(f"{model_dir / index}: lists {_names(missing)}, missing from {model_dir}; copy the "
                                f"complete checkpoint again, or {REBUILD}")
            return [model_dir / f for f in files]
    others = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if others:
        raise UserError(f"{model_dir}: weights named {_names(others)}, but transformers loads {SAFE_WEIGHTS} or the "
                        f"shards listed in {SAFE_INDEX}; copy the index that came with them, or {REBUILD}")
    raise UserError(f"{model_dir}: no weights beside config.json (no {SAFE_WEIGHTS}, {SAFE_INDEX} or {BIN_WEIGHTS}); "
                    f"copy the checkpoint's weight files into it, or {REBUILD}")


def _read_index(index_file: Path) -> dict:
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = f":{exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise UserError(f"{index_file}{where}: not valid JSON; copy the index that came with the weights again") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"{index_file}: no weight_map of tensor names to files; copy the index that came with the "
                        "weights again")
    if any(Path(f).name != f for f in weight_map.values()):
        raise UserError(f"{index_file}: names a shard outside the checkpoint directory; copy the index that came "
                        "with the weights again")
    return weight_map


_TORCH_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "U16": "uint16", "U32": "uint32", "U64": "uint64",
}

# bytes per element of each safetensors dtype (the one table: sizes.py and server_plan.py read it too)
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
            "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8}
TORCH_ITEMSIZE = {_TORCH_DTYPES[code]: size for code, size in ITEMSIZE.items() if code in _TORCH_DTYPES}


def read_headers(files: list[Path]) -> dict:
    """Every tensor of the weight files as an empty meta tensor of its shape and dtype. Reads only
    the headers (safetensors) or the pickled index (torch zip, memory-mapped, not read); refuses a
    truncated or foreign file, and a tensor stored twice."""
    import torch

    tensors, where = {}, {}
    for path in files:
        found = _safetensors_header(path) if path.suffix == ".safetensors" else _bin_header(path)
        for name, (shape, dtype) in found.items():
            if name in where:
                raise UserError(f"{path}: tensor {name} is also in {where[name].name}; the directory mixes two "
                                f"checkpoints: keep one, or {REBUILD}")
            where[name] = path
            tensors[name] = torch.empty(shape, dtype=getattr(torch, dtype, torch.uint8), device="meta")
    return tensors


def _corrupt(path: Path, why: str) -> UserError:
    return UserError(f"{path}: not a readable weight file ({why}); it is truncated or corrupt: copy or download it "
                     f"again, or {REBUILD}")


def safetensors_shapes(path: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, torch dtype name) of every tensor of a safetensors file, from its header alone (no torch)."""
    return _safetensors_header(path)


def _safetensors_header(path: Path) -> dict[str, tuple[list[int], str]]:
    """The header, parsed and checked against the file's size, without reading the data."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _corrupt(path, f"{size} bytes, shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, 100 << 20):
            raise _corrupt(path, f"the header claims {length} bytes, the file has {size}")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _corrupt(path, "the header is not JSON") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "the header is not a JSON object")
    header.pop("__metadata__", None)
    found, end = {}, 0
    for name, entry in header.items():
        try:
            dtype, shape, (start, stop) = entry["dtype"], [int(n) for n in entry["shape"]], entry["data_offsets"]
            itemsize = ITEMSIZE[dtype]
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"tensor {name!r} has no valid dtype, shape and offsets") from None
        if stop - start != math.prod(shape) * itemsize or start < 0:
            raise _corrupt(path, f"tensor {name} holds {stop - start} bytes for shape {shape} {dtype}")
        found[name] = (shape, _TORCH_DTYPES.get(dtype, "uint8"))
        end = max(end, stop)
    if 8 + length + end > size:
        raise _corrupt(path, f"the header places data up to byte {8 + length + end}, the file ends at {size}")
    return found


def _bin_header(path: Path) -> dict[str, tuple[list[int], str]]:
    import torch

    try:
        state = torch.load(path, mmap=True, weights_only=True, map_location="meta")
    except Exception as exc:  # the zip reader and the unpickler fail in many ways on a damaged file
        raise _corrupt(path, _one_line(exc, 160)) from None
    if not isinstance(state, dict):
        raise _corrupt(path, "it does not hold a dict of tensors")
    return {name: (list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items()
            if isinstance(t, torch.Tensor)}


# ---------------------------------------------------------------- weights vs config


def _names(items, shown: int = SHOWN) -> str:
    items = list(items)
    listed = ", ".join(str(i) for i in items[:shown])
    return listed + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _meta_model(model_dir: Path, config):
    """The model the stages would build from this config, on the meta device, with what loading
    adds before the weights arrive (compressed-tensors' compressed modules), and transformers'
    checkpoint-key mapping for it."""
    import contextlib

    import torch
    from transformers.conversion_mapping import get_model_conversion_mapping

    from pipeline.checkpoints.loading import auto_model_class
    from pipeline.checkpoints import linear_experts

    auto = auto_model_class(config)
    model_cls = auto._model_mapping.get(type(config), None)
    if model_cls is None:
        raise UserError(f"{config_json.path(model_dir)}: {type(config).__name__} has no causal-LM class in transformers; "
                        "this pipeline quantizes and evaluates text-generation models")
    hf_quantizer = None
    if getattr(config, "quantization_config", None):
        from transformers.quantizers.auto import get_hf_quantizer

        try:
            hf_quantizer, config, _ = get_hf_quantizer(config, None, {"": "meta"}, True, {})
        except Exception as exc:
            raise UserError(f"{config_json.path(model_dir)}: quantization_config cannot be read ({_one_line(exc)}); "
                            f"restore the config.json that came with the weights, or {REBUILD}") from None
    layout = contextlib.nullcontext()
    if config_json.routed_experts(config.to_dict()) and _linearized(config.model_type):
        layout = linear_experts.linearized_experts(model_cls, config.model_type)  # as oneshot.load_model loads it
    with layout:
        try:
            with torch.device("meta"):
                model = model_cls(config)
            if hf_quantizer is not None:
                hf_quantizer.preprocess_model(model=model, dtype=torch.float32, device_map={"": "meta"},
                                              checkpoint_files=None, use_kernels=False)
        except Exception as exc:  # the config's values do not describe a buildable model
            raise UserError(f"{config_json.path(model_dir)}: transformers cannot build {model_cls.__name__} from it "
                            f"({_one_line(exc)}); restore the config.json that came with the weights") from None
        conversions = get_model_conversion_mapping(model, None, hf_quantizer)
    _packed_zero_points(model)
    return model, conversions


def _linearized(model_type: str) -> bool:
    """Whether the loader splits this MoE's experts into Linears (llm-compressor's mapping, when installed)."""
    from pipeline.checkpoints import linear_experts

    try:
        return linear_experts.loads_linearized(model_type)
    except ImportError:  # no llm-compressor (the `quantize` extra): transformers' own layout
        return False


def _packed_rows(rows: int, num_bits: int) -> int:
    """Rows of a zero point packed along dim 0 into int32, by compressed-tensors' own packer when it has
    one (0.19: dense packing, ceil(rows x bits / 32))."""
    import torch

    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError:
        return math.ceil(rows * num_bits / 32)
    return pack_to_int32(torch.zeros(rows, 1, dtype=torch.int8), num_bits, packed_dim=0).shape[0]


def _packed_zero_points(model) -> None:
    """compressed-tensors builds an asymmetric pack-quantized module's zero point unpacked on the
    meta device, and writes it packed along dim 0 (group and channel strategies,
    compressors/pack_quantized): give the meta module the shape the file holds."""
    import torch

    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        zero_point = getattr(module, "weight_zero_point", None)
        weights = getattr(scheme, "weights", None)
        if (zero_point is None or weights is None or weights.symmetric
                or str(getattr(weights.strategy, "value", weights.strategy)) not in ("group", "channel")
                or str(getattr(scheme.format, "value", scheme.format)) != "pack-quantized" or zero_point.ndim != 2):
            continue
        rows = _packed_rows(zero_point.shape[0], weights.num_bits)
        module.weight_zero_point = torch.nn.Parameter(
            torch.empty(rows, zero_point.shape[1], dtype=torch.int32, device="meta"), requires_grad=False)


def coverage(model_dir: Path, config, tensors: dict) -> dict[str, list]:
    """What loading these tensors into the model config.json describes would leave missing, find
    unexpected, or find in another shape; transformers' loader run on meta tensors."""
    import logging

    import torch
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    model, conversions = _meta_model(model_dir, config)
    load_config = LoadStateDictConfig(device_map={"": "meta"}, weight_mapping=conversions, dtype=torch.float32)
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        info, _ = convert_and_load_state_dict_in_model(model, tensors, load_config)
        model.tie_weights(missing_keys=info.missing_keys, recompute_mapping=False)
        model._adjust_missing_and_unexpected_keys(info)
    finally:
        quiet.setLevel(level)
    mismatched = sorted((name, list(found), list(expected)) for name, found, expected in info.mismatched_keys)
    failed = sorted(info.conversion_errors)
    return {"missing": sorted(info.missing_keys), "unexpected": sorted(info.unexpected_keys),
            "mismatched": mismatched, "unconvertible": failed}


def check_coverage(model_dir: Path, config, tensors: dict, config_dict: dict) -> None:
    found = coverage(model_dir, config, tensors)
    if not any(found.values()):
        return
    problems = []
    if found["missing"]:
        problems.append(f"{len(found['missing'])} missing ({_names(found['missing'])})")
    if found["unexpected"]:
        problems.append(f"{len(found['unexpected'])} unexpected ({_names(found['unexpected'])})")
    if found["mismatched"]:
        shapes = [f"{name} {got} where the config implies {want}" for name, got, want in found["mismatched"]]
        problems.append(f"{len(shapes)} of another shape ({_names(shapes, 3)})")
    if found["unconvertible"]:
        problems.append(f"{len(found['unconvertible'])} that do not convert to the model's layout "
                        f"({_names(found['unconvertible'])})")
    arch = config_json.architecture_or(config_dict, type(config).__name__)
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    described = f"{arch}, {layers} layers" if layers else arch
    raise UserError(
        f"{model_dir}: the weights do not match {config_json.path(model_dir)} ({described}): tensors "
        + "; ".join(problems)
        + ". Loading would fill missing tensors with random values. Use the config.json that came with these "
        f"weights, or {REBUILD}")


def check_config(model_dir: Path | str) -> dict:
    """config.json parsed and accepted by transformers (known model_type, values of the right types);
    returns it as a dict. The weights are not looked at."""
    found = checkpoint.open(model_dir)
    config_json.load(found.path, found.config)
    return found.config


def check(model_dir: Path | str, *, weights: bool = True) -> Checkpoint:
    """The checkpoint (pipeline/checkpoints/checkpoint.py), once it is refused, with the file and the fix, if no
    stage could load it as it says it is; `weights=False` checks config.json only (an engine that loads nothing
    locally)."""
    found = checkpoint.open(model_dir)
    config = config_json.load(found.path, found.config)
    if not weights:
        return found
    files = weight_files(found.path)
    tensors = read_headers(files)
    if not tensors:
        raise UserError(f"{files[0]}: holds no tensors; copy the checkpoint's weights again, or {REBUILD}")
    check_coverage(found.path, config, tensors, found.config)
    return dataclasses.replace(found, weight_files=tuple(files), tensors=len(tensors))
