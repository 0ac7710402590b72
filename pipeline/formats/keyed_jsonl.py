"""Append-only keyed JSON Lines: the resume caches of `quantize eval` (pipeline/scoring/eval_cache.py) and of the
judge's judgments (pipeline/judge/client.py). One JSON object a line, each with a string "key"; the
last entry read for a key wins.

A kill can land at any byte of an append. On the next open, an unterminated last line (the one the
kill cut, possibly inside a multi-byte character, possibly a whole entry but for its newline) is
dropped, counted (`dropped`) and cut off the file, so the next append starts a line of its own: the
requests it held are simply computed again. No kill leaves any other line broken, so any other line
that is not a JSON object with a string "key" (and the fields its cache writes: `valid`) is a UserError
naming the file and the line.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Callable

from pipeline.errors import UserError


class KeyedJsonl:
    """The entries of one keyed JSONL file by key, read at open (those `keep` accepts), appended to."""

    def __init__(self, path: Path, keep: Callable[[dict], bool] | None = None,
                 valid: Callable[[dict], bool] | None = None):
        """keep: which entries to use (e.g. another model's are skipped); valid: whether an entry holds the
        fields, types and ranges its cache writes (any entry that does not is refused with its line)."""
        self.path = Path(path)
        self._valid = valid
        self.entries: dict[str, dict] = {}
        self.dropped = 0  # 1 when the open dropped (and cut off) a torn last line
        if self.path.exists():
            self._load(keep)

    def _load(self, keep: Callable[[dict], bool] | None) -> None:
        raw = self.path.read_bytes()
        *lines, tail = raw.split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            entry = _entry(line)
            if entry is None or (self._valid is not None and not self._valid(entry)):  # before the file is touched
                raise UserError(f"{self.path}, line {number}: not a cache entry (a JSON object with a string "
                                f"\"key\" and the fields this cache writes; only a torn last line is repaired). "
                                f"Delete that line, or the file, and rerun: what it held is computed again")
            if keep is None or keep(entry):
                self.entries[entry["key"]] = entry
        if tail:  # no newline at the end: an append cut by a kill
            self.dropped += 1
            os.truncate(self.path, len(raw) - len(tail))

    def append(self, entries: list[dict]) -> None:
        """Writes the entries, one line each, in one append, and adds them to `entries`."""
        if not entries:
            return
        from pipeline.errors import write_refused
        from pipeline.outputs import make_folders, remove_folders

        made = make_folders(self.path.parent, f"the resume cache {self.path}")
        text = "".join(json.dumps(entry, ensure_ascii=False) + "\n" for entry in entries)
        size = self.path.stat().st_size if self.path.is_file() else None
        try:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
        except OSError as exc:  # a full disk, a file-size limit: the cache as it was, the lines not written
            with contextlib.suppress(OSError):
                os.truncate(self.path, size) if size is not None else self.path.unlink()
            remove_folders(made)
            if refused := write_refused(exc, self.path, "the resume cache", len(text.encode("utf-8")), needed=True):
                raise refused from None
            raise
        for entry in entries:
            self.entries[entry["key"]] = entry


def _entry(line: bytes) -> dict | None:
    try:
        entry = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("key"), str) else None
