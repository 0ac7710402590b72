"""Atomic stage outputs, the provenance record every folder a stage writes holds, and the one-line
summary each stage ends with.

A stage writes into a temp dir beside its destination and renames it into place at the end,
so a killed or failed stage never leaves an output that looks complete. No command deletes or
moves what it did not write: an output path that is, contains or lies inside one of the
command's inputs is refused before any work (`check_out`), and a directory output replaces an
existing directory only when it is empty or holds the same stage's provenance record
(`.stage.json`: the stage, its inputs' fingerprints, the files it wrote) and nothing the record
does not list (`check_replaceable`, the one check every folder replacement goes through). (The
report's page and verdict, two files that must change together: pipeline/report/publish.py.) Temp files and
dirs carry the writing process's id in their names; the next write to the same destination removes
those whose process is gone (a killed run's leftovers).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

from pipeline.errors import UserError, human_size, write_refused  # noqa: F401  (human_size: said here too)


# The provenance record inside every folder a stage writes (written last, atomically, inside the temp dir).
STAGE_RECORD = ".stage.json"
# What stages wrote into their outputs before the provenance record existed: such a folder is not replaced.
LEGACY_RECORDS = ("source.json", "quant.json", "export.json", "stats.json")
FULL_HASH_BYTES = 256 << 20  # larger input files are fingerprinted by size and modification time
# What the writers below add to a NAME they write: atomic_dir's temp dir `.NAME.tmp-PID-XXXXXXXX` is the longest
# (write_atomic's `.NAME.tmp-PID` and the `.NAME.old-PID` a replacement moves aside are shorter).
PID_DIGITS = 7  # Linux process ids stay below 2**22 = 4194304
TEMP_RANDOM = 8  # the random part tempfile.mkdtemp appends
TEMP_NAME_EXTRA = len(".") + len(".tmp-") + PID_DIGITS + len("-") + TEMP_RANDOM
DEFAULT_NAME_MAX = 255  # bytes in one file name, when the file system does not say (ext4, xfs, btrfs: 255)


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


def name_max(folder: Path | str) -> int:
    """Bytes one file name may have on the file system that holds `folder` (or would: its nearest existing
    ancestor)."""
    folder = Path(os.path.abspath(folder))
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return DEFAULT_NAME_MAX


def longest_name(folder: Path | str, suffix: str = "") -> int:
    """Bytes a NAME written into `folder` (as NAME+suffix) may have: the file system's limit less what the writers
    add for their temporary names (TEMP_NAME_EXTRA) and the suffix."""
    return name_max(folder) - TEMP_NAME_EXTRA - len(os.fsencode(suffix))


def name_problem(name: str, folder: Path | str, suffix: str = "") -> str | None:
    """Why `name` (+ suffix) cannot be written into `folder` on this file system, else None."""
    size, limit, most = len(os.fsencode(name)), longest_name(folder, suffix), name_max(folder)
    if size <= limit:
        return None
    added = f"{suffix} and the writers' temporary names (.NAME{suffix}.tmp-PID-XXXXXXXX)" if suffix \
        else "the writers' temporary names (.NAME.tmp-PID-XXXXXXXX)"
    return (f"is {size} bytes long, over the {limit} a name in {Path(folder).as_posix()}/ may have here (the file "
            f"system takes {most} bytes, and {added} add {most - limit}); shorten it")


def path_problem(path: Path | str) -> str | None:
    """Why the folder or file `path` cannot be written atomically on this file system (a part of it too long; the
    last one with the writers' temporary names counted), else None."""
    path = Path(path)
    for index, part in enumerate(path.parts):
        if part in (path.anchor, ".", ".."):
            continue
        parent, size = Path(*path.parts[:index]) if index else Path("."), len(os.fsencode(part))
        if index == len(path.parts) - 1:
            problem = name_problem(part, parent)
        else:
            problem = f"is {size} bytes long, over the {name_max(parent)} the file system allows for one name" \
                if size > name_max(parent) else None
        if problem:
            return f"its part {shown_name(part)} {problem}"
    return None


def shown_name(name: str, limit: int = 40) -> str:
    """A name for a message: whole when short, else its start."""
    return repr(name) if len(name) <= limit else f"{name[:limit - 3]!r}..."


def check_out(out: Path | str, inputs: dict[str, Path | str | None], *, option: str = "--out",
              replaces: str | None = None) -> None:
    """Refuses, before any work, an output path that cannot be written on this file system (a name too long,
    temporary names counted: `path_problem`), one that is, contains or lies inside an input (the
    stage would overwrite, delete or change what it reads), and with `replaces` (the stage's name)
    an existing directory that stage may not replace (`check_replaceable`)."""
    out = Path(out)
    if (problem := path_problem(out)) is not None:
        raise UserError(f"{option} {shown_name(str(out), 80)}: {problem}")
    collisions = []
    for label, source in inputs.items():
        if source is None or str(source) == "demo":
            continue
        how = _overlap(out, Path(source))
        if how:
            collisions.append(f"{how} the {label} {source}")
    if collisions:
        raise UserError(f"{option} {out}: " + "; ".join(collisions) + "; a command never writes over what it reads: "
                        "choose an output path outside its inputs")
    if (problem := _unwritable(out)) is not None:
        raise UserError(f"{option} {out}: {problem}; nothing was done: choose a writable path")
    if replaces:
        check_replaceable(out, replaces, option)


def _unwritable(out: Path) -> str | None:
    """Why nothing can be made at `out` (its nearest existing folder is on a read-only file system, or not writable
    for this user), found before any work; else None."""
    import errno

    folder = Path(os.path.abspath(out))
    folder = folder if folder.is_dir() else folder.parent  # a folder a stage writes files into, or beside
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or os.access(folder, os.W_OK):
        return None
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return f"{folder} is {'on a read-only file system' if read_only else 'not writable for you'}" \
        + ("" if read_only else f" ({os.strerror(errno.EACCES).lower()})")


# ---------------------------------------------------------------- provenance

def fingerprint(path: Path | str) -> str | None:
    """A file: sha256 of its bytes (size and mtime above FULL_HASH_BYTES); a folder: sha256 of its files'
    relative paths, sizes and mtimes (cheap for an 18 GB checkpoint); None when absent."""
    path = Path(path)
    if path.is_file():
        info = path.stat()
        if info.st_size > FULL_HASH_BYTES:
            return f"stat:{info.st_size}:{info.st_mtime_ns}"
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        return f"sha256:{digest.hexdigest()}"
    if path.is_dir():
        digest = hashlib.sha256()
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            info = file.stat()
            digest.update(f"{file.relative_to(path).as_posix()}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
        return f"tree:{digest.hexdigest()}"
    return None


def _files(root: Path) -> list[str]:
    """Every file and link under `root` (relative, POSIX), the record itself left out."""
    found = []
    for path in root.rglob("*"):
        if path.is_symlink() or not path.is_dir():
            name = path.relative_to(root).as_posix()
            if name != STAGE_RECORD:
                found.append(name)
    return sorted(found)


def stage_record(root: Path, stage: str, inputs: dict[str, Path | str | None] | None, *,
                 files: list[str] | None = None, fingerprints: dict[str, str] | None = None) -> dict:
    """The provenance record of the output `root`: the stage, each input's path and fingerprint (`fingerprints`: those
    the stage took of the bytes it read, pipeline/formats/read_watch.py; the others taken now), the files."""
    known = fingerprints or {}
    return {
        "stage": stage,
        "inputs": {label: {"path": str(path), "fingerprint": known.get(label) or fingerprint(path)}
                   for label, path in (inputs or {}).items() if path is not None},
        "files": _files(root) if files is None else sorted(files),
    }


def write_stage_record(root: Path, stage: str, inputs: dict[str, Path | str | None] | None, *,
                       fingerprints: dict[str, str] | None = None, **extra) -> None:
    record = stage_record(root, stage, inputs, fingerprints=fingerprints) | extra
    write_atomic(root / STAGE_RECORD, json.dumps(record, indent=2, ensure_ascii=False) + "\n")


def read_stage_record(root: Path) -> dict | None:
    """The folder's provenance record, or None when it has none (or one that does not read as a record)."""
    try:
        record = json.loads((root / STAGE_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(record, dict) and isinstance(record.get("stage"), str) and isinstance(record.get("files"), list)
            and all(isinstance(f, str) for f in record["files"])):
        return None
    return record


def _named(paths: list[str], limit: int = 5) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def replace_problem(dest: Path, stage: str) -> str | None:
    """Why `stage` may not replace the existing `dest`, or None when it may: it is absent, an empty
    folder, or a folder holding `stage`'s own provenance record and no file the record does not list."""
    if not dest.exists() and not dest.is_symlink():
        return None
    if dest.is_symlink() or not dest.is_dir():
        return "exists and is not a directory; this stage writes a directory there"
    if not any(dest.iterdir()):
        return None
    record = read_stage_record(dest)
    if record is None:
        legacy = [name for name in LEGACY_RECORDS if (dest / name).exists()]
        hint = (f" (its {legacy[0]} may be from an earlier version of this pipeline, or a copy: only a "
                f"{STAGE_RECORD} record says which stage wrote a folder)") if legacy else ""
        return (f"a folder no {stage} stage wrote: it holds no {STAGE_RECORD} provenance record{hint}, and this "
                "stage would replace it with everything in it")
    if record["stage"] != stage:
        return f"the output of the {record['stage']} stage (its {STAGE_RECORD} says so), not of {stage}"
    foreign = sorted(set(_files(dest)) - set(record["files"]))
    if foreign:
        return (f"holds {len(foreign)} file{'s' if len(foreign) > 1 else ''} the {stage} stage did not write "
                f"({_named(foreign)}), which replacing the folder would delete")
    return None


def check_replaceable(dest: Path | str, stage: str, option: str = "--out") -> None:
    """The one check before a stage replaces a folder: a UserError naming the path, why, and the way out."""
    dest = Path(dest)
    problem = replace_problem(dest, stage)
    if problem:
        raise UserError(f"{option} {dest}: {problem}; nothing was changed: choose another path, or move "
                        "what is there away yourself")


def remove_output(dest: Path | str, stage: str) -> None:
    """Deletes a folder `stage` wrote (an outdated cache entry), after the same check as a replacement."""
    dest = Path(dest)
    check_replaceable(dest, stage, "removing")
    shutil.rmtree(dest)


def pid_alive(pid: int) -> bool:
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
        if pid == os.getpid() or pid_alive(pid):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


@contextlib.contextmanager
def atomic_dir(dest: Path | str, stage: str, inputs: dict[str, Path | str | None] | None = None, *,
               fingerprints: dict[str, str] | None = None, started: dict | None = None) -> Iterator[Path]:
    """Yields an empty temp dir; on success the stage's provenance record (`inputs`: label -> path) is
    written into it and it replaces ``dest``; on failure it is removed, with the folders made for it. An existing
    ``dest`` is replaced only when `check_replaceable` allows it (checked before and again just before the rename).
    A write the file system refuses, anywhere in the stage's work, is a UserError naming ``dest`` (`write_refused`).
    The inputs are fingerprinted as the stage starts, and an input changed by the end is refused (`_unchanged`): the
    record names what the stage read, never what is at the path after it (`fingerprints`: those the stage took
    itself of the bytes it read, pipeline/formats/read_watch.py; `started`: `fingerprints_of` the inputs, taken by a
    stage that reads them before it writes, as it started)."""
    dest = Path(dest)
    check_replaceable(dest, stage, "output")
    given = fingerprints or {}
    before = started or {label: print_ for label, print_ in fingerprints_of(inputs or {}).items() if label not in given}
    made = make_folders(dest.parent, f"the {stage} output {dest}")
    tmp = None
    try:
        remove_stale(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the output is an ordinary folder
        yield tmp
        _unchanged(inputs or {}, before, stage)
        write_stage_record(tmp, stage, inputs, fingerprints={**before, **given})
        check_replaceable(dest, stage, "output")  # something may have been put there while the stage ran
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        if dest.exists():
            dest.rename(old)
        tmp.rename(dest)
        tmp = None
    except BaseException as exc:
        written = dir_size(tmp) if tmp is not None and tmp.is_dir() else None
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_folders(made)
        if isinstance(exc, Exception) and (refused := write_refused(exc, dest, f"the {stage} output", written)):
            raise refused from None
        raise
    shutil.rmtree(old, ignore_errors=True)


def fingerprints_of(inputs: dict[str, Path | str | None]) -> dict[str, str | None]:
    return {label: fingerprint(path) for label, path in inputs.items() if path is not None}


def _unchanged(inputs: dict, before: dict[str, str | None], stage: str) -> None:
    """A UserError when an input's fingerprint is not the one it had when the stage started."""
    changed = [label for label, print_ in before.items() if fingerprint(inputs[label]) != print_]
    if changed:
        named = "; ".join(f"the {label} {inputs[label]}" for label in changed)
        raise UserError(f"{named} changed while the {stage} stage ran (written to, or replaced); what the stage made "
                        "from it could mix two versions, so nothing was kept: run the command again once it stays put")


def write_atomic(path: Path | str, text: str) -> None:
    """Writes `text` to `path` through a temp file renamed into place: a failed write leaves neither a part of it
    nor its temp file (a refused one is a UserError naming `path`: `write_refused`)."""
    write_together({path: text})


def write_together(files: dict[Path | str, str | bytes]) -> None:
    """Writes each file (path -> text or bytes) through a temp file beside it, and renames them into place once every
    one is written: a failed write changes none of them and leaves no temp file, nor a folder made for them (a
    refused one is a UserError naming the file it was writing and the size it needed: `write_refused`)."""
    temps: dict[Path, Path] = {}
    made: list[Path] = []
    writing, size = Path(next(iter(files), ".")), 0
    try:
        for path, data in files.items():
            writing, data = Path(path), data.encode("utf-8") if isinstance(data, str) else data
            size = len(data)
            made += make_folders(writing.parent, str(writing))
            remove_stale(writing)
            temps[writing] = writing.with_name(f".{writing.name}.tmp-{os.getpid()}")
            temps[writing].write_bytes(data)
        for path, tmp in temps.items():
            tmp.replace(path)
    except BaseException as exc:
        for tmp in temps.values():
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        remove_folders(made)
        if isinstance(exc, Exception) and (refused := write_refused(exc, writing, "the file", size, needed=True)):
            raise refused from None
        raise


# ---------------------------------------------------------------- a write the file system refused

def make_folders(folder: Path, what: str) -> list[Path]:
    """mkdir -p `folder`; returns the folders it made (deepest first), for `remove_folders` after a failure. A
    refused one is a UserError naming `what` was to be written there."""
    made = []
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        made.append(probe)
        probe = probe.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        remove_folders(made)
        made_at = Path(exc.filename or folder)
        if refused := write_refused(exc, made_at, "", label=f"the folder {made_at} for {what}"):
            raise refused from None
        raise
    return made


def remove_folders(made: list[Path]) -> None:
    """Removes the folders `make_folders` made, where still empty: a failed write leaves no empty output folder."""
    for folder in made:
        with contextlib.suppress(OSError):
            folder.rmdir()


def json_text(data) -> str:
    return json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"


def write_json(path: Path | str, data) -> None:
    write_atomic(path, json_text(data))


def dir_size(path: Path | str) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """"1 record", "2 records" (`plural` for a noun that does not take -s)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def __str__(self) -> str:
        s = self.seconds
        return f"{s:.1f} s" if s < 120 else f"{int(s // 60)} min {int(s % 60)} s"
