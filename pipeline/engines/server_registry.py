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
    folder = leases_dir(registry, key)
    if folder.exists():
        for lease in folder.glob("*"):
            with contextlib.suppress(OSError):
                lease.unlink()
        with contextlib.suppress(OSError):
            folder.rmdir()


def stop_entry(registry: Path, key: str, entry: dict, wait: float = 60.0) -> None:
    """Asks the supervisor to stop its server (SIGTERM) and waits for both to be gone; SIGKILL after
    `wait` seconds. The server's process group is killed too, in case the supervisor could not."""
    supervisor, started = entry.get("supervisor_pid"), entry.get("supervisor_started")
    if alive(supervisor, started):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(supervisor, signal.SIGTERM)
        deadline = time.monotonic() + wait
        while alive(supervisor, started) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(supervisor, started):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(supervisor, signal.SIGKILL)
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


def planned_bytes(found: dict[str, dict]) -> int:
    """The GPU memory the servers `found` (entries) were planned to hold (engine.kv_cache_memory: fitted)."""
    return sum(int(e.get("gpu_bytes") or 0) for e in found.values())


def stop_idle(registry: Path | None = None, *, keep: int = 0, model_path: str | None = None,
              exclude: str | None = None, last: str | None = None, need_bytes: int | None = None,
              budget_bytes: int | None = None, pinned: str | None = None) -> list[str]:
    """Stops idle servers (no live lease): those serving `model_path` (another content of that
    checkpoint), then the least recently used beyond `keep` servers in all, or while the servers' planned memory
    and need_bytes together pass budget_bytes (a server about to start: server_plan.py), the one serving `last` (a
    checkpoint path: the base, which every variant's judge asks) after every other; the one serving `pinned` (the
    run's base, when another server needs room) is not stopped for room. Call with the lock held.
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
        if budget_bytes is not None else set()
    idle = sorted((e.get("model_path") == last, e.get("last_used", 0), k) for k, e in current.items()
                  if not live_leases(registry, k) and e.get("model_path") not in working)
    idle = [(used, key) for _, used, key in idle]
    for _, key in idle:
        if model_path is not None and current[key].get("model_path") == model_path:
            stop_entry(registry, key, current.pop(key))
            stopped.append(key)
    def crowded() -> bool:
        over = budget_bytes is not None and planned_bytes(current) + (need_bytes or 0) > budget_bytes
        return len(current) > keep or over

    for _, key in idle:  # a server still starting (warm) is about to be asked for: not evicted for room
        if key in current and crowded() and current[key].get("state") != "starting" \
                and (pinned is None or current[key].get("model_path") != pinned):
            stop_entry(registry, key, current.pop(key))
            stopped.append(key)
    return stopped
