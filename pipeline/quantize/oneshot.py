"""Shared driver for every quantization method: load, calibrate with llm-compressor, save, verify.

A method module (awq.py, fp8.py) only builds its recipe (a list of modifiers) and its
`quant.json` description; everything else happens here, the same way for each method.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError
from pipeline.outputs import Stopwatch, atomic_dir, dir_size, human_size
from pipeline.quantize import plan

log = logging.getLogger(__name__)


@dataclass
class QuantResult:
    out: Path
    info: dict

    def summary(self) -> str:
        i = self.info
        return (
            f"{i['method']}: wrote {self.out} ({i['scheme']}, {human_size(i['size_bytes'])}, "
            f"{i['calibration']['blocks']} x {i['calibration']['seq_len']} calibration tokens) "
            f"in {i['seconds']['total']:.0f} s"
        )


def resolve_calibration(calib: Path, model_dir: Path, seq_len: int, num_blocks: int,
                        holdout: int) -> tuple[list[list[int]], str]:
    """Token blocks from a prepared calib.jsonl, or prepared now from a raw conversation file."""
    from pipeline import calib as calib_stage

    calib = Path(calib)
    if calib_stage.is_blocks_file(calib):
        blocks = calib_stage.read_blocks(calib)
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            result = calib_stage.run(calib, Path(tmp) / "build", model_dir, seq_len=seq_len,
                                     num_blocks=num_blocks, holdout=holdout)
            print(result.summary())
            blocks = calib_stage.read_blocks(Path(tmp) / "build" / "calib.jsonl")
    if not blocks:
        raise UserError(f"{calib}: no calibration blocks")
    lengths = {len(b) for b in blocks}
    if len(lengths) != 1:
        raise UserError(f"{calib}: calibration blocks differ in length ({sorted(lengths)}); rebuild with `quantize calib`")
    digest = hashlib.sha256(json.dumps(blocks).encode()).hexdigest()
    return blocks, digest


def load_model(model_dir: Path, dtype, **kwargs):
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    auto = transformers.AutoModelForCausalLM
    if type(config) in transformers.AutoModelForImageTextToText._model_mapping:
        auto = transformers.AutoModelForImageTextToText
    return auto.from_pretrained(model_dir, dtype=dtype, **kwargs)


def _calibration_dataset(blocks: list[list[int]]):
    from datasets import Dataset

    return Dataset.from_dict({
        "input_ids": blocks,
        "attention_mask": [[1] * len(b) for b in blocks],
    })


def _copy_side_files(model_dir: Path, out: Path) -> None:
    """Tokenizer, processor and chat template files travel with every variant."""
    import shutil

    skip = {"config.json", "model.safetensors.index.json", "source.json", "quant.json", "generation_config.json"}
    for item in model_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name not in skip:
            shutil.copy2(item, out / item.name)


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _quantized_modules(model) -> dict[str, str]:
    modules = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None and scheme.weights is not None:
            modules[name] = type(module).__name__
    return modules


def run(*, method: str, scheme: str, recipe: list, model_dir: Path, out: Path, calib: Path,
        seq_len: int, num_blocks: int, holdout: int, batch_size: int, details: dict) -> QuantResult:
    import torch
    from llmcompressor import oneshot

    from pipeline.quantize.compat import patch_cpu_pin_memory
    from pipeline.quantize.verify import verify

    watch = Stopwatch()
    model_dir, out = Path(model_dir), Path(out)
    blocks, calib_digest = resolve_calibration(calib, model_dir, seq_len, num_blocks, holdout)
    patch_cpu_pin_memory()
    on_gpu = torch.cuda.is_available()
    # fp16 matmuls are slow on CPUs: calibrate in fp32 there, save in the base checkpoint's dtype.
    config = plan.read_config(model_dir)
    base_dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float16")
    work_dtype = base_dtype if on_gpu else torch.float32
    model = load_model(model_dir, work_dtype)
    if on_gpu:
        model.to("cuda")
    load_s = watch.seconds
    print(f"{method}: calibrating on {len(blocks)} blocks x {len(blocks[0])} tokens, "
          f"batch {batch_size}, {'GPU' if on_gpu else 'CPU (small budget: set calib.num_blocks for more)'}")
    oneshot(
        model=model,
        dataset=_calibration_dataset(blocks),
        recipe=recipe,
        num_calibration_samples=len(blocks),
        max_seq_length=len(blocks[0]),
        batch_size=min(batch_size, len(blocks)),
        shuffle_calibration_samples=False,
    )
    calibrate_s = watch.seconds - load_s
    quantized = _quantized_modules(model)
    model.to(base_dtype)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, save_compressed=True)
        _copy_side_files(model_dir, tmp)
        save_s = watch.seconds - load_s - calibrate_s
        del model
        verification = verify(tmp, model_dir, quantized)
        info = {
            "method": method,
            "scheme": scheme,
            **details,
            "ignored": plan.ignore_reasons(),
            "quantized_modules": len(quantized),
            "calibration": {
                "source": str(calib),
                "sha256": calib_digest,
                "blocks": len(blocks),
                "seq_len": len(blocks[0]),
                "tokens": len(blocks) * len(blocks[0]),
                "batch_size": batch_size,
            },
            "device": "cuda" if on_gpu else "cpu",
            "threads": torch.get_num_threads(),
            "seconds": {"load": round(load_s, 2), "calibrate": round(calibrate_s, 2),
                        "save": round(save_s, 2), "total": round(watch.seconds, 2)},
            "peak_rss_bytes": _peak_rss_bytes(),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if on_gpu else None,
            "size_bytes": dir_size(tmp),
            "base_size_bytes": dir_size(model_dir),
            "verify": verification,
        }
        (tmp / "quant.json").write_text(json.dumps(info, indent=2) + "\n")
    return QuantResult(out, info)
