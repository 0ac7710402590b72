"""Atomic stage outputs and the one-line summary each stage ends with.

A stage writes into a temp dir beside its destination and renames it into place at the end,
so a killed or failed stage never leaves an output that looks complete. No command deletes or
moves what it did not write: an output path that is, contains or lies inside one of the
command's inputs is refused before any work (`check_out`), and a directory output only replaces
an existing directory that is empty or a previous output of a stage (it holds one of
OUTPUT_RECORDS). Temp files and dirs carry the writing process's id in their names; the next
write to the same destination removes those whose process is gone (a killed run's leftovers).
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


# The record every directory-writing stage leaves in its output: resave, awq/fp8, export, calib.
OUTPUT_RECORDS = ("source.json", "quant.json", "export.json", "stats.json")


def _overlap(out: Path, source: Path) -> str | None:
    # realpath, not Path.resolve: a symlink loop given as an input must not raise here (the stage names it)
    out, source = Path(os.path.realpath(out)), Path(os.path.realpath(source))
    if out == source:
        return "is"
    if source.is_relative_to(out):
        return "contains"
    if out.is_relative_to(source):
        return "lies inside"
    return None


def check_out(out: Path | str, inputs: dict[str, Path | str | None], *, option: str = "--out",
              replaces_dir: bool = False) -> None:
    """Refuses, before any work, an output path that is, contains or lies inside an input (the
    stage would overwrite, delete or change what it reads), and with `replaces_dir` an existing
    directory that no stage wrote (the atomic rename would delete its files)."""
    out = Path(out)
    collisions = []
    for label, source in inputs.items():
        if source is None or str(source) == "demo":
            continue
        how = _overlap(out, Path(source))
        if how:
            collisions.append(f"{how} the {label} {source}")
    if collisions:
        from pipeline.errors import UserError

        raise UserError(f"{option} {out}: " + "; ".join(collisions) + "; a command never writes over what it reads: "
                        "choose an output path outside its inputs")
    if replaces_dir:
        refuse_foreign_dir(out, option)


def refuse_foreign_dir(dest: Path, option: str = "--out") -> None:
    """An existing `dest` that the atomic rename would replace must be empty or a stage's output."""
    if not dest.exists() and not dest.is_symlink():
        return
    from pipeline.errors import UserError

    if dest.is_symlink() or not dest.is_dir():
        raise UserError(f"{option} {dest}: exists and is not a directory; this stage writes a directory there: "
                        "choose another path, or remove it yourself")
    if any(dest.iterdir()) and not any((dest / record).is_file() for record in OUTPUT_RECORDS):
        raise UserError(f"{option} {dest}: a directory no quantize stage wrote (it holds none of "
                        f"{', '.join(OUTPUT_RECORDS)}), which this stage would replace; choose another path, or "
                        "empty it yourself")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(dest: Path) -> list[Path]:
    """Removes what killed runs writing `dest` left beside it: `.NAME.tmp-PID-*` (atomic_dir),
    `.NAME.tmp-PID` (write_atomic) and `.NAME.old-PID`, owned by this user, whose PID is not
    running. Anything else is left alone."""
    import re

    pattern = re.compile(rf"\.{re.escape(dest.name)}\.(?:tmp|old)-(\d+)(?:-[A-Za-z0-9_]+)?")
    removed = []
    if not dest.parent.is_dir():
        return removed
    for path in dest.parent.iterdir():
        match = pattern.fullmatch(path.name)
        if not match or path.is_symlink() or path.lstat().st_uid != os.getuid():
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


@contextlib.contextmanager
def atomic_dir(dest: Path | str) -> Iterator[Path]:
    """Yields an empty temp dir; on success it replaces ``dest``, on failure it is removed. An
    existing ``dest`` is replaced only when it is empty or a stage's output (OUTPUT_RECORDS)."""
    dest = Path(dest)
    refuse_foreign_dir(dest, "output")
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent))
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
    remove_stale(path)
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
            remove_stale(path)
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
