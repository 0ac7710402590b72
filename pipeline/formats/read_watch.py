"""An input file read once, its bytes fingerprinted as they are read, and checked not to have changed under the
reader (`ReadWatch`): a file overwritten in place while it is read (its size, modification or change time move), or
replaced by a rename (the path names another inode), is refused with a message, never read as a mix of the two. The
fingerprint a stage records is then that of the bytes it read, not of whatever is at the path after the stage."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

from pipeline.errors import UserError


class _HashingRaw(io.RawIOBase):
    """A raw binary file whose every byte read goes into `digest` (a BufferedReader above it reads in chunks)."""

    def __init__(self, handle, watch: "ReadWatch") -> None:
        self.handle, self.watch = handle, watch

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.handle.readinto(buffer)
        if n:
            self.watch.digest.update(memoryview(buffer)[:n])
            self.watch.bytes_read += n
        return n

    def fileno(self) -> int:
        return self.handle.fileno()

    def close(self) -> None:
        self.handle.close()
        super().close()


def _identity(info: os.stat_result) -> tuple:
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


class ReadWatch:
    """`open()` the file (a buffered binary reader), read it, then `check()`: what is left unread is read into the
    fingerprint, and a file that changed since it was opened is a UserError. `sha256` / `fingerprint`: of the bytes
    read (pipeline/outputs.py's form, "sha256:HEX")."""

    def __init__(self, path: Path | str, what: str = "input") -> None:
        self.path, self.what = Path(path), what
        self.digest, self.bytes_read = hashlib.sha256(), 0
        self.opened: tuple | None = None
        self._raw: _HashingRaw | None = None
        self._fd: int | None = None

    def open(self) -> io.BufferedReader:
        handle = open(self.path, "rb", buffering=0)
        self.opened = _identity(os.fstat(handle.fileno()))
        self._fd = os.dup(handle.fileno())  # the file opened, for what the reader leaves unread
        self._raw = _HashingRaw(handle, self)
        return io.BufferedReader(self._raw, buffer_size=1 << 20)

    def check(self) -> None:
        """Reads what is left of the file into the fingerprint, then refuses a file changed since it was opened."""
        if self.opened is None:
            return
        if self._fd is not None:  # what the reader left unread (a gzip's trailer, whitespace after ']')
            try:
                while chunk := os.pread(self._fd, 1 << 20, self.bytes_read):
                    self.digest.update(chunk)
                    self.bytes_read += len(chunk)
            finally:
                os.close(self._fd)
                self._fd = None
        self.refuse_if_changed()

    def refuse_if_changed(self) -> None:
        """A UserError when the file changed since it was opened."""
        change = self.change() if self.opened is not None else None
        if change:
            raise UserError(f"{self.path}: the {self.what} changed while it was read ({change}); nothing was written "
                            "from it: run the command again once nothing writes to the file (copy it first if "
                            "something keeps writing to it)")

    def change(self) -> str | None:
        """How the file differs from the one opened, or None."""
        try:
            now = os.stat(self.path)
        except OSError as exc:
            return f"it is no longer there: {exc.strerror}"
        before = self.opened
        if (now.st_dev, now.st_ino) != before[:2]:
            return "another file was put in its place"
        if now.st_size != before[2]:
            return f"its size went from {before[2]:,} to {now.st_size:,} bytes"
        if (now.st_mtime_ns, now.st_ctime_ns) != before[3:]:
            return "it was written to"
        if self._fd is None and self.bytes_read != now.st_size:  # read to its end (check): all of it
            return f"{self.bytes_read:,} bytes were read of its {now.st_size:,}"
        return None

    @property
    def sha256(self) -> str:
        return self.digest.hexdigest()

    @property
    def fingerprint(self) -> str:
        return f"sha256:{self.sha256}"
