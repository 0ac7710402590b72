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

from pipeline.engines.support import serving_support
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
                        holdout: int) -> tuple[list[list[int]], str, list[dict]]:
    """Token blocks from a prepared calib.jsonl, or prepared now from a raw conversation file,
    and the held-out conversations written beside them (holdout.jsonl), if any."""
    from pipeline import calib as calib_stage

    calib = Path(calib)
    if calib_stage.is_blocks_file(calib):
        blocks = calib_stage.read_blocks(calib)
        held = _read_holdout(calib.with_name("holdout.jsonl"))
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            result = calib_stage.run(calib, Path(tmp) / "build", model_dir, seq_len=seq_len,
                                     num_blocks=num_blocks, holdout=holdout)
            print(result.summary())
            blocks = calib_stage.read_blocks(Path(tmp) / "build" / "calib.jsonl")
            held = _read_holdout(Path(tmp) / "build" / "holdout.jsonl")
    if not blocks:
        raise UserError(f"{calib}: no calibration blocks")
    lengths = {len(b) for b in blocks}
    if len(lengths) != 1:
        raise UserError(f"{calib}: calibration blocks differ in length ({sorted(lengths)}); rebuild with `quantize calib`")
    digest = hashlib.sha256(json.dumps(blocks).encode()).hexdigest()
    return blocks, digest, held


def _read_holdout(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _render(tokenizer, messages: list[dict]) -> str:
    from jinja2 import TemplateError

    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False)
        except TemplateError:  # a template that rejects this conversation's turns: plain text
            pass
    return "\n".join(m["content"] for m in messages)


def check_blocks(held: list[dict], tokenizer, blocks: list[list[int]], count: int = 2) -> tuple[list[list[int]], str]:
    """Up to `count` blocks for the per-layer error check, cut from the held-out conversations
    (with their reference answers), which calibration never saw; the last calibration blocks
    when there are none."""
    seq_len = len(blocks[0])
    stream: list[int] = []
    for row in held:
        reference = [{"role": "assistant", "content": row["reference"]}] if row.get("reference") else []
        stream.extend(tokenizer(_render(tokenizer, row["messages"] + reference), add_special_tokens=False)["input_ids"])
        if len(stream) >= count * seq_len:
            break
    if len(stream) >= seq_len:
        return [stream[i * seq_len:(i + 1) * seq_len] for i in range(min(count, len(stream) // seq_len))], "holdout"
    if stream:
        return [stream], "holdout"
    return blocks[-count:], "calibration (no holdout.jsonl beside the blocks)"


def load_model(model_dir: Path, dtype, **kwargs):
    """The checkpoint as transformers builds it; MoE routed experts as one Linear per expert
    where llm-compressor knows how (see compat.load_linearized)."""
    import transformers

    from pipeline.checkpoints import auto_model_class

    config = transformers.AutoConfig.from_pretrained(model_dir)
    auto = auto_model_class(config)
    if plan.routed_experts(config.to_dict()):
        from pipeline.quantize import compat

        if compat.loads_linearized(config.model_type):
            model_cls = auto._model_mapping[type(config)]
            return compat.load_linearized(model_cls, model_dir, config.model_type, dtype=dtype, **kwargs)
    return auto.from_pretrained(model_dir, dtype=dtype, **kwargs)


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


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


def _set_dtype(model, dtype) -> None:
    """Casts the model and records the dtype in every sub-config too: a VLM's text_config
    would otherwise keep the float32 it was calibrated in, and servers read it from there."""
    model.to(dtype)
    for config in (model.config, *(getattr(model.config, key, None) for key in model.config.sub_configs)):
        if config is not None:
            config.dtype = dtype


def _free(on_gpu: bool) -> None:
    """Drops the calibrated model before the variant is reloaded: llm-compressor's session holds
    it too, and its save_pretrained wrapper makes a reference cycle."""
    import gc

    import torch
    from llmcompressor.core import active_session

    active_session().reset()
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()


def run(*, method: str, scheme: str, recipe: list, model_dir: Path, out: Path, calib: Path,
        seq_len: int, num_blocks: int, holdout: int, batch_size: int, details: dict) -> QuantResult:
    import torch
    from llmcompressor import oneshot

    from pipeline.quantize import verify
    from pipeline.quantize.compat import patch_cpu_pin_memory, quiet_cpu_warning

    quiet_cpu_warning()
    watch = Stopwatch()
    model_dir, out = Path(model_dir), Path(out)
    blocks, calib_digest, held = resolve_calibration(calib, model_dir, seq_len, num_blocks, holdout)
    tokenizer = _tokenizer(model_dir)
    probe_blocks, probe_source = check_blocks(held, tokenizer, blocks)
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
    expected = plan.expected_quantized(model)
    reference = verify.capture_layer_io(model, probe_blocks)
    print(f"{method}: calibrating on {len(blocks)} blocks x {len(blocks[0])} tokens, "
          f"batch {batch_size}, {'GPU' if on_gpu else 'CPU (small budget: set calib.num_blocks for more)'}")
    oneshot(
        model=model,
        # The blocks are already token ids: the tokenizer is all llm-compressor needs, and it spares
        # loading a multimodal processor (GLM-4.1V's video processor wants torchvision).
        processor=tokenizer,
        dataset=_calibration_dataset(blocks),
        recipe=recipe,
        num_calibration_samples=len(blocks),
        max_seq_length=len(blocks[0]),
        batch_size=min(batch_size, len(blocks)),
        shuffle_calibration_samples=False,
    )
    calibrate_s = watch.seconds - load_s
    quantized = _quantized_modules(model)
    _set_dtype(model, base_dtype)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, save_compressed=True)
        _copy_side_files(model_dir, tmp)
        save_s = watch.seconds - load_s - calibrate_s
        del model
        _free(on_gpu)
        verification = verify.verify(tmp, model_dir, expected, quantized, reference, work_dtype)
        verification["layer_error"]["blocks_from"] = probe_source
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
                        "save": round(save_s, 2), "verify": round(watch.seconds - load_s - calibrate_s - save_s, 2),
                        "total": round(watch.seconds, 2)},
            "peak_rss_bytes": _peak_rss_bytes(),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if on_gpu else None,
            "size_bytes": dir_size(tmp),
            "base_size_bytes": dir_size(model_dir),
            "verify": verification,
            "serving": serving_support(tmp),  # which engines can serve it, and why not
        }
        (tmp / "quant.json").write_text(json.dumps(info, indent=2) + "\n")
    return QuantResult(out, info)
