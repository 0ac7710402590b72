"""The registry of a run's shared servers (pipeline/engines/shared.py): one JSON entry per running server in a
directory (`QUANTIZE_SERVER_DIR`, default `.cache/servers` in the project), keyed by the checkpoint's files and the
server's command line; a lease file per stage using a server; one lock file that serializes starts, attaches and
stops; and stopping: one server (its supervisor, then its process group) or the idle ones beyond a count.

Read and written by the stages (shared.py) and by each server's supervisor (pipeline/engines/supervisor.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import time
from pathlib import Path

from pipeline.runs import alive, start_time

REGISTRY_ENV = "QUANTIZE_SERVER_DIR"
POLL_S = 0.5


def registry_dir() -> Path:
    return Path(os.environ.get(REGISTRY_ENV) or Path.cwd() / ".cache" / "servers")


# ---------------------------------------------------------------- keys

def content_fingerprint(model_dir: Path | str, registry: Path | None = None) -> str:
    """What a server is keyed by for its checkpoint: the checkpoint files' stat signature (checkpoints/
    fingerprint.py: names, sizes, modification times, inodes; not change times, which DVC's cache links change),
    which changes whenever a file is written again, so
    a changed checkpoint never gets an old server's answers; read without hashing a byte (hashing GLM-4-9B's 18.8
    GB cost a warm or served stage 12-20 s on the H200, 2026-12-02)."""
    from pipeline.checkpoints.fingerprint import stat_signature

    return stat_signature(Path(model_dir).resolve(), change_time=False)[:16]


def server_key(fingerprint: str, command: list[str], env: dict | None) -> str:
    """command: the server's full command line without its port (model path and every setting)."""
    canonical = json.dumps({"fingerprint": fingerprint, "command": command, "env": env or {}}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


# ---------------------------------------------------------------- the registry

@contextlib.contextmanager
def _locked(registry: Path):
    registry.mkdir(parents=True, exist_ok=True)
    with open(registry / "lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def locked(registry: Path | None = None):
    """The registry's lock (stop_idle and stop_entry expect it held)."""
    return _locked(registry or registry_dir())


def _entry_path(registry: Path, key: str) -> Path:
    return registry / f"{key}.json"


def leases_dir(registry: Path, key: str) -> Path:
    return registry / f"{key}.leases"


def read_entry(registry: Path, key: str) -> dict | None:
    try:
        return json.loads(_entry_path(registry, key).read_text())
    except (OSError, ValueError):
        return None


def write_entry(registry: Path, key: str, entry: dict) -> None:
    path = _entry_path(registry, key)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry, indent=1))
    tmp.replace(path)


def entries(registry: Path | None = None) -> dict[str, dict]:
    registry = registry or registry_dir()
    found = {}
    for path in sorted(registry.glob("*.json")) if registry.exists() else []:
        entry = read_entry(registry, path.stem)
        if entry and entry.get("key") == path.stem:
            found[path.stem] = entry
    return found


def live_leases(registry: Path, key: str) -> list[str]:
    """Lease files whose process still runs; the others (a stage killed with SIGKILL) are removed."""
    live = []
    folder = leases_dir(registry, key)
    for lease in folder.glob("*") if folder.exists() else []:
        try:
            pid, started = (int(x) for x in lease.name.split("-"))
        except ValueError:
            continue
        if alive(pid, started):
            live.append(lease.name)
        else:
            with contextlib.suppress(OSError):
                lease.unlink()
    return live


def lease_name() -> str:
    return f"{os.getpid()}-{start_time(os.getpid())}"


def forget(registry: Path, key: str) -> None:
    with contextlib.suppress(OSError):
        _entry_path(registry, key).unlink()
    with contextlib.suppress(OSError):
        _memory_path(registry, key).unlink()  # the checkpoint's peak (models/) stays: a restart is counted by it
    folder = leases_dir(registry, key)
    if folder.exists():
        for lease in folder.glob("*"):
            with contextlib.suppress(OSError):
                lease.unlink()
        with contextlib.suppress(OSError):
            folder.rmdir()


def end_process(pid: int | None, started, first: int, wait: float, *, group: bool = False, poll: float = 0.1) -> bool:
    """Sends `first` (SIGTERM, SIGINT) to a process (its process group with `group`), waits up to `wait` seconds for it
    to end, then SIGKILL; True once it is gone (`started`: its start time, so a reused pid is left alone)."""
    if not alive(pid, started):
        return True
    send = os.killpg if group else os.kill
    with contextlib.suppress(ProcessLookupError, PermissionError):
        send(pid, first)
    deadline = time.monotonic() + wait
    while alive(pid, started) and time.monotonic() < deadline:
        time.sleep(poll)
    if alive(pid, started):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            send(pid, signal.SIGKILL)
        time.sleep(poll)
    return not alive(pid, started)


def stop_entry(registry: Path, key: str, entry: dict, wait: float = 60.0) -> None:
    """Asks the supervisor to stop its server (SIGTERM) and waits for both to be gone; SIGKILL after
    `wait` seconds. The server's process group is killed too, in case the supervisor could not."""
    end_process(entry.get("supervisor_pid"), entry.get("supervisor_started"), signal.SIGTERM, wait)
    server = entry.get("server_pid")
    if server and alive(server, entry.get("server_started")):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server, signal.SIGKILL)
    forget(registry, key)


JOBS = "jobs"  # in the registry: the run's work started ahead of its stages (pipeline/scoring/ahead.py), an entry each


def running_jobs(registry: Path | None = None) -> list[dict]:
    """The entries of the run's jobs still working (each names its `model`, `kind`, `pid`)."""
    folder = (registry or registry_dir()) / JOBS
    found = []
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(entry, dict) and alive(entry.get("pid"), entry.get("started")):
            found.append(entry)
    return found


KEEP_LAST = "keep-last"  # in the registry: the checkpoint whose idle server goes last (the run's base)


def keep_last(model_dir: Path | str, registry: Path | None = None) -> None:
    """Names the checkpoint whose idle server is stopped after every other one (the base: every variant's judge asks
    it), for every stop_idle of the run that names none itself."""
    registry = registry or registry_dir()
    registry.mkdir(parents=True, exist_ok=True)
    path = registry / KEEP_LAST
    value = str(Path(model_dir).resolve())
    with contextlib.suppress(OSError):
        if not path.is_file() or path.read_text() != value:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(value)
            tmp.replace(path)


def kept_last(registry: Path) -> str | None:
    try:
        return (registry / KEEP_LAST).read_text().strip() or None
    except OSError:
        return None


# ---------------------------------------------------------------- what each server holds, measured

MEMORY = "memory"  # in the registry: each server's GPU memory as its supervisor measured it (nvidia-smi), a file each


def _memory_path(registry: Path, key: str) -> Path:
    return registry / MEMORY / f"{key}.json"


def _model_memory_path(registry: Path, model_path: str) -> Path:
    return registry / MEMORY / "models" / f"{hashlib.sha256(model_path.encode()).hexdigest()[:16]}.json"


def _read_json(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _write_json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def record_memory(registry: Path, key: str, model_path: str, used_bytes: int, planned: int | None) -> dict:
    """One measurement of a server's GPU memory (its process group's, nvidia-smi): kept per server (now and its peak)
    and per checkpoint path (the peak of every server it had in this registry), so that a server started again, and
    the run's plan, count what the model was seen to hold rather than what it was planned to. Written by the
    server's supervisor alone (no lock: one writer a file)."""
    now = _read_json(_memory_path(registry, key))
    peak = max(int(now.get("peak_bytes") or 0), int(used_bytes))
    record = {"key": key, "model_path": model_path, "used_bytes": int(used_bytes), "peak_bytes": peak,
              "planned_bytes": planned, "samples": int(now.get("samples") or 0) + 1, "at": round(time.time(), 1)}
    _write_json(_memory_path(registry, key), record)
    by_model = _read_json(_model_memory_path(registry, model_path))
    if peak > int(by_model.get("peak_bytes") or 0):
        _write_json(_model_memory_path(registry, model_path), {"model_path": model_path, "peak_bytes": peak,
                                                               "planned_bytes": planned, "at": record["at"]})
    return record


def measured_memory(registry: Path, key: str) -> dict:
    """What record_memory kept of a server ({} when it was never measured: no nvidia-smi, or not yet)."""
    return _read_json(_memory_path(registry, key))


def model_peak_bytes(model_path: Path | str, registry: Path | None = None) -> int | None:
    """The most GPU memory a server of this checkpoint path was measured to hold in this registry; None if never."""
    found = _read_json(_model_memory_path(registry or registry_dir(), str(Path(model_path).resolve())))
    return int(found["peak_bytes"]) if found.get("peak_bytes") else None


def held_bytes(found: dict[str, dict], registry: Path | None = None) -> int:
    """The GPU memory the servers `found` (entries) hold, each counted at the larger of its plan (gpu_bytes,
    engine.kv_cache_memory: fitted) and the most it was measured to hold: a server that grew past its plan under
    load (a vision-language model's images) is counted as it is."""
    registry = registry or registry_dir()
    return sum(max(int(e.get("gpu_bytes") or 0), int(measured_memory(registry, k).get("peak_bytes") or 0))
               for k, e in found.items())


def stop_idle(registry: Path | None = None, *, keep: int = 0, model_path: str | None = None,
              exclude: str | None = None, last: str | None = None, need_bytes: int | None = None,
              budget_bytes: int | None = None, pinned: str | None = None, keep_working: bool = False,
              starting: bool = False) -> list[str]:
    """Stops idle servers (no live lease): those serving `model_path` (another content of that
    checkpoint), then the least recently used beyond `keep` servers in all, or while the servers' planned memory
    and need_bytes together pass budget_bytes (a server about to start: server_plan.py), the one serving `last` (a
    checkpoint path: the base, which every variant's judge asks) after every other; the one serving `pinned` (the
    run's base, when another server needs room) is not stopped for room; nor, for room or with keep_working, one whose
    model a job of the run works on. A server still starting is stopped for room only with `starting` (an in-process
    stage that cannot run beside it: gpu_room.make_room, once nothing else is left to stop). Call with the lock held.
    Returns the keys stopped."""
    registry = registry or registry_dir()
    stopped = []
    current = {k: e for k, e in entries(registry).items() if k != exclude}
    for key, entry in list(current.items()):
        if not alive(entry.get("supervisor_pid"), entry.get("supervisor_started")):
            forget(registry, key)  # its supervisor died (SIGKILL): the server died with it
            current.pop(key)
    last = str(Path(last).resolve()) if last else kept_last(registry)
    # a server whose model a job of the run is still working on (its judging between its two servers, say) is kept
    # while another server needs room: it would be started again for that job
    working = {str(Path(j["model"]).resolve()) for j in running_jobs(registry) if j.get("model")} \
        if budget_bytes is not None or keep_working else set()
    idle = sorted((e.get("model_path") == last, e.get("last_used", 0), k) for k, e in current.items()
                  if not live_leases(registry, k) and e.get("model_path") not in working)
    idle = [(used, key) for _, used, key in idle]
    for _, key in idle:
        if model_path is not None and current[key].get("model_path") == model_path:
            stop_entry(registry, key, current.pop(key))
            stopped.append(key)
    def crowded() -> bool:
        over = budget_bytes is not None and held_bytes(current, registry) + (need_bytes or 0) > budget_bytes
        return len(current) > keep or over

    for _, key in idle:  # a server still starting (warm) is about to be asked for: not evicted for room
        if key in current and crowded() and (starting or current[key].get("state") != "starting") \
                and (pinned is None or current[key].get("model_path") != pinned):
            stop_entry(registry, key, current.pop(key))
            stopped.append(key)
    return stopped
