"""Which run a process belongs to, read from /proc: a run is the `dvc repro` (or `dvc exp run`) process a stage
runs under, or the process QUANTIZE_RUN_PID names. The run's shared servers (pipeline/engines/shared.py) and
its fork server (pipeline/cli/forkserver.py) live as long as it does.

Standard library only: the `quantize` launcher (pipeline/cli/launcher.py) asks before importing anything else.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.errors import UserError

RUN_PID_ENV = "QUANTIZE_RUN_PID"

_STARTED_WITH: dict[str, str] | None = None  # the environment this command was started with (remember_environment)


def remember_environment(env=None) -> None:
    """Keeps the environment the command starts with (the `quantize` launcher's, or the one a forked command is
    handed), before any library sets its own variables in it (torch: KMP_*, TORCHINDUCTOR_CACHE_DIR; the console:
    TQDM_DISABLE)."""
    global _STARTED_WITH
    _STARTED_WITH = dict(os.environ if env is None else env)


def started_environment() -> dict[str, str]:
    """The environment this command was started with: what a command it starts in the run gets, so that the run's
    warm interpreter (keyed by the environment its modules saw) serves that one too; os.environ where none was kept."""
    return dict(os.environ if _STARTED_WITH is None else _STARTED_WITH)


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), None when gone:
    a pid with another start time is another process (pids are reused)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":  # a zombie: dead, not yet reaped
        return None
    return int(fields[19])


def alive(pid: int | None, started: int | None) -> bool:
    return bool(pid) and start_time(pid) is not None and (started is None or start_time(pid) == started)


def parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def is_run(pid: int) -> bool:
    """A `dvc repro` / `dvc exp run` process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    names = [Path(a.decode(errors="replace")).name for a in argv[:3]]
    rest = [a.decode(errors="replace") for a in argv[1:6]]
    return "dvc" in names and ("repro" in rest or "exp" in rest)


def run_owner() -> tuple[int, int | None, str]:
    """(pid, start time, what) of the run this process belongs to: QUANTIZE_RUN_PID, else the nearest
    `dvc repro` ancestor, else this process itself."""
    named = os.environ.get(RUN_PID_ENV)
    if named:
        try:
            pid = int(named)
        except ValueError:
            raise UserError(f"{RUN_PID_ENV}={named!r}: give the process id of the run that holds the GPU") from None
        if start_time(pid) is None:
            raise UserError(f"{RUN_PID_ENV}={pid}: no such process; unset it or name the running run's pid")
        return pid, start_time(pid), f"{RUN_PID_ENV} (pid {pid})"
    pid = parent(os.getpid())
    while pid and pid > 1:
        if is_run(pid):
            return pid, start_time(pid), f"dvc repro (pid {pid})"
        pid = parent(pid)
    return os.getpid(), start_time(os.getpid()), "this stage"
