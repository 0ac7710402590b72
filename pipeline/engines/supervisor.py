"""The supervisor of one shared server (pipeline/engines/shared.py), run as its own process
(`python -m pipeline.engines.supervisor SPEC`, detached from the stage that asked for the server): starts
the server, waits for `/health`, writes the registry entry, then watches the run that owns the server,
the stages' leases and idleness every half second, and stops the server when the run ends, no stage
has held a lease for engine.server_idle_timeout seconds (when set), or stop_entry asks it to.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.engines.shared import POLL_S, alive, forget, live_leases, read_entry, start_time, write_entry


def supervise(spec: dict) -> int:
    from pipeline.engines.http import get_ok
    from pipeline.engines.server import _die_with_parent

    registry, key = Path(spec["registry"]), spec["key"]
    me = {"supervisor_pid": os.getpid(), "supervisor_started": start_time(os.getpid())}
    entry = {**{k: spec[k] for k in ("key", "port", "log", "model_path", "owner_pid", "owner_started", "owner",
                                     "idle_timeout")}, **me, "state": "starting", "command": spec["command"],
             "last_used": time.time()}
    stopping = {"now": False}

    def on_term(*_):
        stopping["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    with open(spec["log"], "ab") as log:
        log.write(f"$ {' '.join(spec['command'])}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(spec["command"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **spec["env"]}, start_new_session=True,
                                    preexec_fn=_die_with_parent)
        except FileNotFoundError:
            write_entry(registry, key, {**entry, "state": "failed", "error": (
                f"command {spec['command'][0]!r} not found; install it (pip install -e '.[vllm]') or set "
                "engine.server_command to how you start it")})
            return 3
    entry.update(server_pid=proc.pid, server_started=start_time(proc.pid))
    write_entry(registry, key, entry)

    def stop_server() -> None:
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def owner_alive() -> bool:
        return alive(spec["owner_pid"], spec["owner_started"])

    began = time.monotonic()
    deadline = began + float(spec["start_timeout"])
    while not get_ok(f"http://127.0.0.1:{spec['port']}/health", timeout=2.0):
        if proc.poll() is not None:
            write_entry(registry, key, {**entry, "state": "failed",
                                         "error": f"exited with code {proc.returncode} while starting"})
            return 3
        if stopping["now"] or not owner_alive() or time.monotonic() > deadline:
            stop_server()
            write_entry(registry, key, {**entry, "state": "failed", "error": "start abandoned (the stage or run "
                                         "that asked for it is gone, or engine.start_timeout passed)"})
            return 3
        time.sleep(POLL_S)
    entry["state"] = "ready"
    write_entry(registry, key, entry)
    _note(spec["log"], f"server ready after {time.monotonic() - began:.1f} s", "")
    idle_since = None
    while True:
        if stopping["now"]:  # stop_entry asked (its caller holds the lock and forgets the entry)
            _note(spec["log"], "asked to stop")
            stop_server()
            return 0
        if proc.poll() is not None:
            reason = f"the server exited with code {proc.returncode}"
        elif not owner_alive():
            reason = f"its run ({spec['owner']}) ended"
        elif live_leases(registry, key):
            idle_since, reason = None, None
        elif idle_since is None:
            idle_since, reason = time.monotonic(), None
        elif spec["idle_timeout"] is not None and time.monotonic() - idle_since >= float(spec["idle_timeout"]):
            reason = f"idle for {spec['idle_timeout']:g} s (engine.server_idle_timeout)"
        else:
            reason = None
        if reason:
            with _try_locked(registry, stopping) as held:
                if held and reason.startswith("idle") and live_leases(registry, key):
                    idle_since = None  # a stage attached while we waited for the lock
                    continue
                _note(spec["log"], reason)
                stop_server()
                current = read_entry(registry, key)
                if held and current and current.get("supervisor_pid") == os.getpid():
                    forget(registry, key)
            return 0
        time.sleep(POLL_S)


@contextlib.contextmanager
def _try_locked(registry: Path, stopping: dict):
    """The registry lock, unless stop_entry asks this supervisor to stop while it waits (its caller holds
    the lock then): yields whether the lock is held."""
    with open(registry / "lock", "a+") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if stopping["now"]:
                    yield False
                    return
                time.sleep(0.1)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _note(log_path: str, reason: str, what: str = "server stopped: ") -> None:
    with contextlib.suppress(OSError):
        with open(log_path, "a") as log:
            log.write(f"[quantize] {what}{reason}\n")


if __name__ == "__main__":
    sys.exit(supervise(json.loads(sys.argv[1])))
