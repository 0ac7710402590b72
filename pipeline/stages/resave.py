"""`quantize resave`: detect the source checkpoint and write a plain HF safetensors directory.

Supported sources: a native Hugging Face directory (any AutoModelForCausalLM or
image-text-to-text type: Llama, Glm, Glm4, Glm4v, Glm4vMoe, ...), a ChatGLM remote-code
directory (ChatGLM2/3, GLM-4-9B-chat: converted to GlmForCausalLM, see chatglm.py) and a
``.gguf`` file of an architecture transformers' GGUF loader reads.

A checkpoint of transformers' own `glm46v` model type (Glm46VForConditionalGeneration), which no engine we run has a
model for, is written in the layout vLLM serves and GLM-4.6V's releases carry: Glm4vForConditionalGeneration (text
glm4v_text: the same tensors and config keys) or Glm4vMoeForConditionalGeneration (glm4v_moe_text: the routed experts
one tensor per expert again), its token ids as they were (pipeline/checkpoints/serving_names.py, served_layout);
the summary says so. Processor files transformers cannot rebuild here (GLM's video processor needs torchvision) are
copied as they are.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints import chatglm, checkpoint, config_json, headers
from pipeline.checkpoints.gguf_file import parsed_once
from pipeline.checkpoints.origin import read_origin
from pipeline.checkpoints.serving_names import finish_config, served_config
from pipeline.checkpoints.streaming import MAX_SHARD
from pipeline.errors import UserError
from pipeline.formats.source_json import write_source_json
from pipeline.outputs import Stopwatch, atomic_dir, dir_size, human_size

SUPPORTED = (
    "a Hugging Face checkpoint directory (config.json + safetensors/bin weights), "
    "a ChatGLM2/3 or GLM-4-9B remote-code directory, a .gguf file, or 'demo'"
)
# the processor's files, copied as they are when transformers cannot load the processor here
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


@dataclass
class ResaveResult:
    out: Path
    source_kind: str
    architecture: str
    size_bytes: int
    seconds: float
    written_as: str = ""  # why the architecture is not the source's (a glm46v source in the layout vLLM serves)

    def summary(self) -> str:
        return (
            f"resave: wrote {self.out} ({self.architecture} from {self.source_kind}, "
            f"{human_size(self.size_bytes)}) in {self.seconds:.1f} s" + (f"; {self.written_as}" if self.written_as else "")
        )


def detect(source: Path) -> str:
    """Returns 'gguf', 'chatglm' or 'hf'; raises UserError for anything else."""
    if not source.exists():
        raise UserError(f"{source}: no such file or directory; pass one of the supported sources: {SUPPORTED}")
    if source.is_file():
        if source.suffix == ".gguf":
            return "gguf"
        raise UserError(f"{source}: not a checkpoint; pass one of the supported sources: {SUPPORTED}")
    if not config_json.present(source):
        raise UserError(f"{source}: no config.json; copy the config.json that came with the weights, or pass one of "
                        f"the supported sources: {SUPPORTED}")
    config = checkpoint.open(source).config
    if config.get("model_type") == "chatglm" or any(
        "ChatGLM" in arch for arch in config.get("architectures", [])
    ):
        return "chatglm"
    return "hf"


def _load_hf(source: Path, dtype):
    """The source's model, and what its architecture was written as (a glm46v checkpoint as the same model in the
    layout vLLM serves: built from its full config, every token id kept, and its tensors loaded into that class)."""
    import transformers

    from pipeline.checkpoints.loading import auto_model_class

    config = config_json.load(source)
    served = served_config(config.to_dict(), source)
    if served is None:
        return auto_model_class(config).from_pretrained(source, dtype=dtype), ""
    config = transformers.CONFIG_MAPPING[served["model_type"]](**{k: v for k, v in served.items()
                                                                   if k not in ("model_type", "transformers_version")})
    model = auto_model_class(config).from_pretrained(source, config=config, dtype=dtype)
    # saved the way transformers saves a model of that class: its own conversion (glm4v_moe: one tensor per routed
    # expert, as vLLM loads them), which this load recorded as unused, glm46v's fused experts needing none
    model._weight_conversions = None
    source_arch = config_json.architecture_or(checkpoint.open(source).config, "glm46v")
    return model, (f"written as {served['architectures'][0]}, the layout vLLM serves and GLM-4.6V's releases carry: "
                   f"vLLM 0.24 and lmdeploy 0.18 have no model for {source_arch}")


def _copy_processor(source: Path, out: Path, gguf_file: str | None = None) -> None:
    import shutil

    import transformers

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        processor = transformers.AutoProcessor.from_pretrained(source, **kwargs)
    except Exception:  # text-only models have no processor, only a tokenizer; GLM's video processor needs torchvision
        processor = transformers.AutoTokenizer.from_pretrained(source, **kwargs)
    processor.save_pretrained(out)
    for name in PROCESSOR_FILES:  # what the processor would have written, when it could not be loaded
        if (Path(source) / name).is_file() and not (out / name).exists():
            shutil.copy2(Path(source) / name, out / name)


def _drop_gguf_quantizer(model) -> None:
    # The weights are already dequantized; saving the GGUF quantizer config would make
    # transformers try to re-read a GGUF on load.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False


def _check_gguf(source: Path) -> None:
    """Refuses a GGUF that transformers cannot load, before any weights are read."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    try:
        load_gguf_checkpoint(source, return_tensors=False)
    except ValueError as exc:
        if "not supported" not in str(exc):
            raise UserError(f"{source}: not a readable GGUF file ({exc}); it is truncated or corrupt, "
                            "download it again") from None
        supported = ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
        raise UserError(
            f"{source}: {exc} transformers reads GGUF files of: {supported}. For GLM models use the "
            "Hugging Face (or ChatGLM remote-code) safetensors checkpoint instead"
        ) from None
    except Exception as exc:  # gguf's reader fails with assorted errors on a damaged file
        raise UserError(f"{source}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
                        "it is truncated or corrupt, download it again") from None


def _write_source_json(tmp: Path, source: Path, kind: str, dtype: str, demo: bool) -> None:
    """source.json: the source, its kind and dtype, and what the source states of its licence and Hub repository
    (pipeline/checkpoints/origin.py: the variants' model cards read it)."""
    from pipeline.checkpoints.demo_model import HUB_ID

    from pipeline.checkpoints.origin import gguf_file

    write_source_json(tmp, source, kind, dtype, read_origin(source, kind, HUB_ID if demo else None),
                      gguf_file(source) if kind == "gguf" else None)


def run(source: Path | str, out: Path | str, dtype: str = "float16") -> ResaveResult:
    import torch

    from pipeline.checkpoints.demo_model import demo_gguf

    watch = Stopwatch()
    demo = str(source) == "demo"
    source = demo_gguf() if demo else Path(source)
    kind = detect(source)
    out = Path(out)
    if kind == "chatglm":
        with atomic_dir(out, "resave", {"source": source}) as tmp:
            architecture = chatglm.convert(source, tmp, dtype)
            _write_source_json(tmp, source, kind, dtype, demo)
        return ResaveResult(out, kind, architecture, dir_size(out), watch.seconds)
    reading = parsed_once() if kind == "gguf" else contextlib.nullcontext()  # one parse of the file, not seven
    with reading:
        return _resave(source, kind, out, getattr(torch, dtype), dtype, demo, watch)


def _resave(source: Path, kind: str, out: Path, torch_dtype, dtype: str, demo: bool, watch: Stopwatch) -> ResaveResult:
    if kind == "gguf":
        _check_gguf(source)
    else:
        headers.check(source)  # the weights cover config.json: read from the headers, nothing loaded
    written_as = ""
    with atomic_dir(out, "resave", {"source": source}) as tmp:
        if kind == "gguf":
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(
                source.parent, gguf_file=source.name, dtype=torch_dtype
            )
            _drop_gguf_quantizer(model)
            _copy_processor(source.parent, tmp, gguf_file=source.name)
        else:
            model, written_as = _load_hf(source, torch_dtype)
            _copy_processor(source, tmp)
        model.save_pretrained(tmp, max_shard_size=MAX_SHARD)  # streaming.MAX_SHARD: DVC hashes shards side by side
        finish_config(tmp)  # config keys GLM's releases carry that transformers does not write (vLLM reads them)
        architecture = model.config.architectures[0] if model.config.architectures else type(model).__name__
        _write_source_json(tmp, source, kind, dtype, demo)
    return ResaveResult(out, kind, architecture, dir_size(out), watch.seconds, written_as)
