"""`quantize resave`: detect the source checkpoint and write a plain HF safetensors directory.

Supported sources: a native Hugging Face directory (any AutoModelForCausalLM or
image-text-to-text type: Llama, Glm, Glm4, Glm4v, Glm4vMoe, ...), a ChatGLM remote-code
directory (ChatGLM2/3, GLM-4-9B-chat: converted to GlmForCausalLM, see chatglm.py) and a
``.gguf`` file of an architecture transformers' GGUF loader reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints import chatglm, checkpoint, config_json, headers
from pipeline.checkpoints.origin import read_origin
from pipeline.checkpoints.serving_names import finish_config
from pipeline.errors import UserError
from pipeline.formats.source_json import write_source_json
from pipeline.outputs import Stopwatch, atomic_dir, dir_size, human_size

SUPPORTED = (
    "a Hugging Face checkpoint directory (config.json + safetensors/bin weights), "
    "a ChatGLM2/3 or GLM-4-9B remote-code directory, a .gguf file, or 'demo'"
)
MAX_SHARD = "5GB"


@dataclass
class ResaveResult:
    out: Path
    source_kind: str
    architecture: str
    size_bytes: int
    seconds: float

    def summary(self) -> str:
        return (
            f"resave: wrote {self.out} ({self.architecture} from {self.source_kind}, "
            f"{human_size(self.size_bytes)}) in {self.seconds:.1f} s"
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
    from pipeline.checkpoints.loading import auto_model_class

    config = config_json.load(source)
    return auto_model_class(config).from_pretrained(source, dtype=dtype)


# a multimodal checkpoint's processor files: how images (and videos) become the vision tower's inputs
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


def _copy_processor(source: Path, out: Path, gguf_file: str | None = None) -> None:
    import shutil

    import transformers

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        processor = transformers.AutoProcessor.from_pretrained(source, **kwargs)
    except Exception:  # text-only models have no processor, only a tokenizer
        processor = transformers.AutoTokenizer.from_pretrained(source, **kwargs)
    processor.save_pretrained(out)
    # a processor transformers cannot build here (GLM-4.1V's video processor needs torchvision) left only the
    # tokenizer: its files go as they are, or no engine could prepare an image for models/base
    for name in PROCESSOR_FILES if not gguf_file else ():
        if (source / name).is_file() and not (out / name).exists():
            shutil.copy2(source / name, out / name)


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

    write_source_json(tmp, source, kind, dtype, read_origin(source, kind, HUB_ID if demo else None))


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
    if kind == "gguf":
        _check_gguf(source)
    else:
        headers.check(source)  # the weights cover config.json: read from the headers, nothing loaded
    torch_dtype = getattr(torch, dtype)
    with atomic_dir(out, "resave", {"source": source}) as tmp:
        if kind == "gguf":
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(
                source.parent, gguf_file=source.name, dtype=torch_dtype
            )
            _drop_gguf_quantizer(model)
            _copy_processor(source.parent, tmp, gguf_file=source.name)
        else:
            model = _load_hf(source, torch_dtype)
            _copy_processor(source, tmp)
        model.save_pretrained(tmp, max_shard_size=MAX_SHARD)
        finish_config(tmp)  # config keys GLM's releases carry that transformers does not write (vLLM reads them)
        architecture = model.config.architectures[0] if model.config.architectures else type(model).__name__
        _write_source_json(tmp, source, kind, dtype, demo)
    return ResaveResult(out, kind, architecture, dir_size(out), watch.seconds)
