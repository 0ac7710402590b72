"""The words every part of a model card shares (pipeline/report/model_card.py assembles them): text from the verdict
made safe for Markdown, the base and what the variant was compared with, what the usage snippets load (the Hub
repository of a card for the Hub, the checkpoint's own folder on a local record), a suite's and a group's names as
a reader of the checkpoint knows them, and the variant's method module. Nothing here reads a file."""

from __future__ import annotations

from pathlib import PurePath

from pipeline import methods
from pipeline.checkpoints.serving_names import VLLM_FUSED
from pipeline.verdict.facts import SPEED_SUITE, and_list as names  # noqa: F401  (the cards' "a, b and c")

LOCAL_DIR = "models"  # where a local record's snippets load the checkpoint from: the pipeline's models/<variant>


def md(text) -> str:
    """Text from the verdict as Markdown shows it: no HTML (no tag can open), no table break (`|`), on one line."""
    return " ".join(str(text).split()).replace("<", "&lt;").replace("|", "\\|")


def code(text) -> str:
    """A command or a name as an inline code span (a backtick inside is fenced with two)."""
    text = " ".join(str(text).split())
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def valid_repo_id(text: str) -> bool:
    """Whether `text` is a Hub repository id with its owner (ORG/NAME), by huggingface_hub's own rules."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return text.count("/") == 1


def loads_from(name: str, repo_id: str | None) -> str:
    """What the usage snippets load: the Hub repository the card is published in, else (a local record) the
    checkpoint's own folder, models/<variant>."""
    return repo_id or f"{LOCAL_DIR}/{name}"


def suite_name(suite: str) -> str:
    """A suite as a card's prose names it: the judge as "the judge", speed as it is, a suite by its name."""
    return "the judge" if suite == "judge" else suite


def checkpoint_names(group: str) -> str:
    """A group of layers by the names the checkpoint has (model.layers.3.self_attn.qkv_proj, vLLM's fused layer, is
    model.layers.3.self_attn.q_proj, k_proj and v_proj in the checkpoint)."""
    head, _, last = group.rpartition(".")
    parts = VLLM_FUSED.get(last)
    return f"{head}.{names(parts)}" if parts and head else group


# ---------------------------------------------------------------- the base and the reference

def base_name(origin: dict | None, source: dict | None) -> str:
    """The base as the card names it: its Hub repository, else the name its source states, else the source's file
    or folder name (never a path of the machine that ran it)."""
    origin = origin or {}
    named = origin.get("hub_id") or origin.get("name")
    if named:
        return str(named)
    found = (source or {}).get("source")
    return PurePath(str(found)).name if found else "the base model"


def source_file(source: dict | None) -> str | None:
    """The source `quantize resave` converted, by its file or folder name only (a cache path says nothing to a reader)."""
    found = (source or {}).get("source")
    return PurePath(str(found)).name if found else None


def reference(source: dict | None, base: str) -> str:
    """What the variant was compared with, exactly: "HuggingFaceTB/SmolLM2-135M-Instruct as converted from the GGUF
    file SmolLM2-135M-Instruct.Q4_1.gguf (its quantized weights dequantized to float16)"."""
    if not source:
        return f"{base} (how it was converted was not recorded)"
    dtype, kind, found = source.get("dtype") or "its dtype", source.get("kind"), source_file(source)
    if kind == "gguf":
        return (f"{base} as converted from the GGUF file {found} (its quantized weights dequantized to {dtype}), "
                "not the original unquantized release")
    if kind == "chatglm":
        return f"{base} converted from its ChatGLM remote code to GlmForCausalLM, in {dtype}"
    return f"{base} in {dtype}"


def reference_is_quantized(source: dict | None) -> bool:
    """Whether the reference was itself quantized before (a GGUF's weights): its recovery is against that, not the
    original release."""
    return (source or {}).get("kind") == "gguf"


# ---------------------------------------------------------------- the scheme

def method_module(quant: dict):
    """The variant's method module (pipeline/methods/), None for a name the registry does not hold."""
    name = quant.get("method")
    return methods.method(name) if methods.is_method(name) else None


def pipeline_revision(env: dict) -> str:
    """The pipeline's revision as a reader can fetch it: its repository's address (the package's Project-URL,
    recorded by the report as `pipeline_repository`) and the git revision, or what is missing said plainly."""
    revision, where = env.get("git_revision"), env.get("pipeline_repository")
    if not revision:
        return "glm-quant-pipeline, revision not recorded"
    if where:
        return f"glm-quant-pipeline {md(where)}, git revision {md(revision)}"
    return (f"glm-quant-pipeline git revision {md(revision)}, whose repository has no public address: a reader cannot "
            "fetch this revision")
