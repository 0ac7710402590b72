"""Atomic stage outputs and the one-line summary each stage ends with.

A stage writes into a temp dir beside its destination and renames it into place at the end,
so a killed or failed stage never leaves an output that looks complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_dir(dest: Path | str) -> Iterator[Path]:
    """Yields an empty temp dir; on success it replaces ``dest``, on failure it is removed."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the output is an ordinary folder
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: Path | str, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def write_json(path: Path | str, data) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def dir_size(path: Path | str) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def human_size(n_bytes: int) -> str:
    size = float(n_bytes)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def __str__(self) -> str:
        s = self.seconds
        return f"{s:.1f} s" if s < 120 else f"{int(s // 60)} min {int(s % 60)} s"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temps(directory: Path, names: list[str]) -> None:
    """Removes `.NAME.tmp-PID` / `.NAME.old-PID` files that a killed run left for these names (its PID is gone)."""
    for name in names:
        for leftover in directory.glob(f".{name}.*-*"):
            kind, _, pid = leftover.name[len(name) + 2:].partition("-")
            if kind in ("tmp", "old") and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                with contextlib.suppress(OSError):
                    leftover.unlink()


def write_together(files: dict[Path, str]) -> None:
    """Writes several files as one: each to a temp file beside it (encoded and flushed first), then all
    renamed. If anything fails before the renames, no file changes; if a rename fails, the files already
    renamed get their previous versions back. No temp file survives (a killed run's are removed by the
    next call). The last file of `files` is renamed last: put the one a reader gates on there."""
    encoded = {Path(path): text.encode("utf-8") for path, text in files.items()}  # fails before any write
    pid = os.getpid()
    temps: dict[Path, Path] = {}
    backups: dict[Path, Path] = {}
    renamed: list[Path] = []
    try:
        for path, data in encoded.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(path.parent, [path.name])
            temps[path] = path.with_name(f".{path.name}.tmp-{pid}")
            with open(temps[path], "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        for path in encoded:
            if path.is_file():
                backups[path] = path.with_name(f".{path.name}.old-{pid}")
                with contextlib.suppress(FileNotFoundError):
                    backups[path].unlink()
                try:
                    os.link(path, backups[path])
                except OSError:  # no hard links on this filesystem
                    shutil.copy2(path, backups[path])
        for path in encoded:
            os.replace(temps[path], path)
            del temps[path]
            renamed.append(path)
    except BaseException:
        for path in reversed(renamed):  # put back what was there
            with contextlib.suppress(OSError):
                if path in backups:
                    os.replace(backups.pop(path), path)
                else:
                    path.unlink()
        raise
    finally:
        for leftover in [*temps.values(), *backups.values()]:
            with contextlib.suppress(OSError):
                leftover.unlink()
