"""One run of a project at a time (`held`): `quantize repro` and `make demo` take an exclusive lock on
.cache/run.lock (flock: let go when the process ends, however it ends) and write who holds it; a second run is
refused with our own message ("another run holds this project: PID N, started ..."), exit 2, not DVC's "`.cache/code`
is busy" (exit 255) partway through. A plain `dvc repro` holding DVC's own locks (.dvc/tmp/rwlock) is named the same
way."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Iterator

from pipeline.errors import UserError, cut

LOCK_FILE = Path(".cache") / "run.lock"
DVC_RWLOCK = Path(".dvc") / "tmp" / "rwlock"


def project_root(start: Path | None = None) -> Path:
    """The folder holding .dvc (as DVC finds it), else `start` (the working directory)."""
    start = Path(start or Path.cwd()).resolve()
    for folder in (start, *start.parents):
        if (folder / ".dvc").is_dir():
            return folder
    return start


def _started(pid: int) -> str | None:
    """When process `pid` started, as UTC text, from /proc (None when it is gone)."""
    from pipeline.runs import start_time

    ticks = start_time(pid)
    if ticks is None:
        return None
    try:
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    moment = datetime.datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"), datetime.timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _refusal(root: Path, pid: int | None, started: str | None, command: str | None) -> UserError:
    who = f"PID {pid}" if pid else "a process"
    when = f", started {started}" if started else ""
    what = f" ({command})" if command else ""
    stop = f"stop it (kill {pid})" if pid else "stop it"
    return UserError(f"another run holds this project: {who}{when}{what}, in {root}; wait for it to end, or {stop}, "
                     "then run the command again (two runs of one project would write the same outputs)")


def _dvc_holder(root: Path) -> tuple[int, str] | None:
    """(pid, command) of a live process DVC's rwlock says holds an output of this project, else None."""
    from pipeline.runs import start_time

    try:
        lock = json.loads((root / DVC_RWLOCK).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    infos = list((lock.get("write") or {}).values()) if isinstance(lock, dict) else []
    infos += [info for readers in (lock.get("read") or {}).values() for info in readers] if isinstance(lock, dict) \
        else []
    for info in infos:
        if isinstance(info, dict) and isinstance(info.get("pid"), int) and info["pid"] != os.getpid() \
                and start_time(info["pid"]) is not None:
            return info["pid"], cut(str(info.get("cmd") or "dvc"), 120)
    return None


@contextlib.contextmanager
def held(root: Path | None = None) -> Iterator[None]:
    """Holds the project's run lock for the enclosed run; a UserError when another run holds it."""
    root = project_root(root)
    path = root / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+", encoding="utf-8")
    except OSError as exc:  # a read-only project, no permission: one message, not a traceback
        from pipeline.errors import write_refused

        if refused := write_refused(exc, path, "the run lock"):
            raise refused from None
        raise
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            try:
                holder = json.loads(handle.read() or "{}")
            except ValueError:
                holder = {}
            pid = holder.get("pid") if isinstance(holder.get("pid"), int) else None
            raise _refusal(root, pid, holder.get("started") or (pid and _started(pid)), holder.get("command")) \
                from None
        if (dvc := _dvc_holder(root)) is not None:
            raise _refusal(root, dvc[0], _started(dvc[0]), dvc[1])
        _record_holder(handle, path)
        yield
    finally:
        handle.close()  # lets go of the lock


def _record_holder(handle, path: Path) -> None:
    """This run as the lock's holder (its pid, start and command: what a second run is told); a full disk is one
    message naming the lock (pipeline/errors.py write_refused)."""
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "started": _started(os.getpid()),
                                 "command": cut(" ".join(["quantize repro", *sys.argv[2:]]), 200)}))
        handle.flush()
    except OSError as exc:
        from pipeline.errors import write_refused

        if refused := write_refused(exc, path, "the run lock", needed=True, size=200):
            raise refused from None
        raise
