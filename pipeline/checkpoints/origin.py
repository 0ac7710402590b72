"""Where a base checkpoint came from and under what licence, read off its source when `quantize resave` converts it
(models/base/source.json's `origin`): a model card's `base_model` and `license` come from here, never from a guess.

- a GGUF file: its `general.*` metadata, which llama.cpp's converter copies from the model's own card
  (`general.license`, `general.license.name`, `general.license.link`, `general.name`, and the repository in
  `general.source.huggingface.repository` or `general.source.repo_url`);
- a Hugging Face folder (a native or a ChatGLM remote-code checkpoint): the README.md front matter it came with
  (`license`, `license_name`, `license_link`), and its Hub repository when the folder is a snapshot in the Hugging
  Face cache (.../models--ORG--NAME/snapshots/REVISION);
- the demo: SmolLM2-135M-Instruct's repository (pipeline/checkpoints/demo_model.py), beside what its GGUF says.

What the source does not say stays None: the card then says "not stated by the base" and what to check.
"""

from __future__ import annotations

import re
from pathlib import Path

FIELDS = ("license", "license_name", "license_link", "hub_id", "name", "read_from")
_HUB_URL = re.compile(r"^https?://(?:www\.)?huggingface\.co/([\w.-]+/[\w.-]+?)/?$")
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_CACHE_FOLDER = re.compile(r"^models--([\w.-]+?)--([\w.-]+)$")


def _empty() -> dict:
    return dict.fromkeys(FIELDS)


def hub_id(text) -> str | None:
    """ORG/NAME from a Hub repository id or its https://huggingface.co/ORG/NAME address; None for anything else."""
    if not isinstance(text, str):
        return None
    text = text.strip()
    match = _HUB_URL.match(text)
    if match:
        return match.group(1)
    return text if _HUB_ID.match(text) and not text.startswith((".", "/")) else None


def _gguf_fields(path: Path) -> dict:
    """The GGUF's `general.*` text fields (memory-mapped: no tensor is read)."""
    from gguf import GGUFReader

    found = {}
    for key, field in GGUFReader(str(path)).fields.items():
        if key.startswith("general."):
            try:
                value = field.contents()
            except (ValueError, IndexError, TypeError):  # a field of a kind this reader does not decode
                continue
            if isinstance(value, str) and value.strip():
                found[key] = value.strip()
    return found


def gguf_file(path: Path | str) -> dict:
    """What a model card says of the GGUF file the base was dequantized from: its quantization type as its metadata
    states it (general.file_type: "Q4_1"), and its sha256 (read in chunks: a file of gigabytes is never held)."""
    import hashlib

    from gguf import GGUFReader, LlamaFileType

    found = {}
    field = GGUFReader(str(path)).fields.get("general.file_type")
    try:
        found["file_type"] = LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_") if field else None
    except (ValueError, IndexError, TypeError):  # a type this gguf release does not name
        found["file_type"] = None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    found["sha256"] = digest.hexdigest()
    return found


def gguf_origin(path: Path | str) -> dict:
    """A GGUF file's licence, name and Hub repository, as its metadata states them."""
    fields = _gguf_fields(Path(path))
    origin = _empty()
    origin.update(license=fields.get("general.license"), license_name=fields.get("general.license.name"),
                  license_link=fields.get("general.license.link"), name=fields.get("general.name"),
                  hub_id=hub_id(fields.get("general.source.huggingface.repository"))
                  or hub_id(fields.get("general.source.repo_url")))
    if origin["license"]:
        origin["read_from"] = f"{Path(path).name}: GGUF metadata general.license"
    return origin


def folder_origin(folder: Path | str) -> dict:
    """A Hugging Face folder's licence from its README.md front matter, and its Hub repository from its place in
    the Hugging Face cache; a README that is missing or unreadable states nothing."""
    folder = Path(folder)
    origin = _empty()
    resolved = folder.resolve()
    if resolved.parent.name == "snapshots" and (match := _CACHE_FOLDER.match(resolved.parent.parent.name)):
        origin["hub_id"] = f"{match.group(1)}/{match.group(2)}"
    readme = folder / "README.md"
    if readme.is_file():
        from huggingface_hub import metadata_load

        try:
            front = metadata_load(readme) or {}
        except (ValueError, OSError, UnicodeDecodeError, TypeError):  # no YAML, or YAML that does not parse
            front = {}
        if not isinstance(front, dict):
            front = {}
        for key in ("license", "license_name", "license_link"):
            value = front.get(key)
            origin[key] = ", ".join(map(str, value)) if isinstance(value, list) else (str(value) if value else None)
        origin["name"] = str(front["model_name"]) if front.get("model_name") else None
        if origin["license"]:
            origin["read_from"] = f"{readme}: front matter license"
    return origin


def read_origin(source: Path | str, kind: str, demo_hub_id: str | None = None) -> dict:
    """{license, license_name, license_link, hub_id, name, read_from} of a resave source (`kind`: gguf, hf or
    chatglm); `demo_hub_id`: the demo's repository, which its GGUF does not name."""
    origin = gguf_origin(source) if kind == "gguf" else folder_origin(source)
    if demo_hub_id and not origin["hub_id"]:
        origin["hub_id"] = demo_hub_id
    return origin
