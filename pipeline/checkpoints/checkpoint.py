"""A checkpoint as every stage sees it: one value made from its config.json (and, once checked, its weight files'
headers), passed down instead of each module reading the file again.

`open(model_dir)` reads config.json through its one reader (`config_json.read`: every refusal names the file and
the fix) and keeps the parsed text for the process, keyed by the file's path, size, modification and change times and inode,
so a stage that asks for the same checkpoint in ten places reads and parses it once, and a config.json written
again (`quantize resave`, a variant's release keys) is read again. Each `Checkpoint` holds its own parsed copy:
a caller that edits `config` changes no other caller's.

`headers.check(model_dir)` returns the same value with the weight files and the tensor count it found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.checkpoints import config_json

_READ: dict[tuple, str] = {}  # (path, size, mtime, change time, inode) -> config.json's text as parsed once


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory: its parsed config.json and the facts the stages take from it."""

    path: Path
    config: dict = field(repr=False)
    weight_files: tuple[Path, ...] = ()  # filled by headers.check, which read their headers
    tensors: int = 0

    @property
    def architecture(self) -> str:
        return config_json.architecture_or(self.config, self.config.get("model_type") or "")

    @property
    def dtype(self) -> str:
        return config_json.dtype(self.config)

    @property
    def vocab_size(self) -> int:
        return config_json.vocab_size(self.config)

    @property
    def has_vision(self) -> bool:
        return config_json.has_vision(self.config)

    @property
    def quantization(self) -> dict:
        return config_json.quantization(self.config)

    @property
    def is_compressed_tensors(self) -> bool:
        return config_json.is_compressed_tensors(self.config)

    @property
    def kv_cache_scheme(self) -> dict | None:
        return config_json.kv_cache_scheme(self.config)

    @property
    def kv_cache_shape(self) -> tuple[int, int, int]:
        return config_json.kv_cache_shape(self.config)

    @property
    def max_positions(self) -> int | None:
        return config_json.max_positions(self.config)

    @property
    def hidden_size(self) -> int | None:
        return config_json.hidden_size(self.config)

    @property
    def tied_embeddings(self) -> bool:
        return config_json.tied_embeddings(self.config)


def open(model_dir: Path | str) -> Checkpoint:  # noqa: A001 - the module's one verb, as in checkpoint.open(dir)
    """The checkpoint at model_dir; a missing or broken config.json is refused naming the file and the fix."""
    model_dir = Path(model_dir)
    try:
        st = config_json.path(model_dir).stat()
        key = (str(model_dir.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    except OSError:
        key = None  # config_json.read says what is missing
    if key is None or key not in _READ:
        config = config_json.read(model_dir)
        if key is not None:
            _READ[key] = json.dumps(config)
        return Checkpoint(model_dir, config)
    return Checkpoint(model_dir, json.loads(_READ[key]))


def base_config(models_dir: Path) -> dict | None:
    """models/base's config.json when the base checkpoint is there (the report's vocabulary and weights' origin)."""
    return open(models_dir / "base").config if config_json.present(models_dir / "base") else None
