"""The words every part of a model card shares (pipeline/report/model_card.py assembles them): text from the verdict
made safe for Markdown, the base and what the variant was compared with,
the repository the usage snippets name, and the variant's method module. Nothing here reads a file."""

from __future__ import annotations

from pathlib import PurePath

from pipeline import methods
from pipeline.verdict.headline import and_list as names  # noqa: F401  (the cards' "a, b and c")

# What the snippets name when the card is written without --repo-id: the card says to replace it
PLACEHOLDER_ORG = "your-org"


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


def repo_id_or_placeholder(name: str, repo_id: str | None) -> str:
    """The repository the usage snippets load: the one the card is published in, else `your-org/<variant>`."""
    return repo_id or f"{PLACEHOLDER_ORG}/{name}"


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
