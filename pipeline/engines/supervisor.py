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

from pipeline.engines.server_registry import POLL_S, forget, live_leases, read_entry, record_memory, write_entry
from pipeline.runs import alive, start_time

MEASURE_EVERY_S = 5.0  # how often a serving server's GPU memory is read (nvidia-smi takes ~50 ms)


class Supervisor:
    """One server's life: started, waited for until /health answers, then watched until it must stop."""

    def __init__(self, spec: dict):
        self.spec, self.registry, self.key = spec, Path(spec["registry"]), spec["key"]
        self.entry = {**{k: spec[k] for k in ("key", "port", "log", "model_path", "owner_pid", "owner_started",
                                              "owner", "idle_timeout")},
                      "gpu_bytes": spec.get("gpu_bytes"),  # its planned memory (server_plan.py), None: not planned
                      "supervisor_pid": os.getpid(), "supervisor_started": start_time(os.getpid()),
                      "state": "starting", "command": spec["command"], "last_used": time.time()}
        self.stopping = {"now": False}
        self.proc: subprocess.Popen | None = None
        self.measured_at = 0.0  # monotonic time of the last GPU memory reading
        self.told_over = False  # its log says once that it grew past its plan

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):  # stop_entry asks with SIGTERM
            signal.signal(sig, lambda *_: self.stopping.update(now=True))
        if not self.start_server():
            return 3
        began = time.monotonic()
        failure = self.wait_ready()
        if failure:
            self.write(state="failed", error=failure)
            return 3
        self.write(state="ready")
        _note(self.spec["log"], f"server ready after {time.monotonic() - began:.1f} s", "")
        self.measure(note=True)
        return self.watch()

    def measure(self, note: bool = False) -> None:
        """What the server's process group holds on the GPU now (nvidia-smi), kept in the registry beside its plan
        (server_registry.record_memory): once it is ready and then every MEASURE_EVERY_S while it serves, so a server
        that grows under load is counted as it is. Nothing without nvidia-smi."""
        from pipeline.engines.gpu_memory import used_by_process_group

        self.measured_at = time.monotonic()
        used = (used_by_process_group() or {}).get(self.proc.pid)
        if not used:
            return
        planned = self.spec.get("gpu_bytes")
        record = record_memory(self.registry, self.key, self.spec["model_path"], used, planned)
        if note:
            _note(self.spec["log"], f"GPU memory at ready: {used / 2**30:.2f} GiB"
                  + (f" (planned {planned / 2**30:.2f} GiB)" if planned else ""), "")
        elif planned and record["peak_bytes"] == used > planned and not self.told_over:
            self.told_over = True
            _note(self.spec["log"], f"GPU memory {used / 2**30:.2f} GiB, past its planned {planned / 2**30:.2f} GiB: "
                  "counted as measured from now on", "")

    def write(self, **changes) -> None:
        self.entry.update(changes)
        write_entry(self.registry, self.key, self.entry)

    def start_server(self) -> bool:
        from pipeline.engines.server import _die_with_parent

        spec = self.spec
        with open(spec["log"], "ab") as log:
            log.write(f"$ {' '.join(spec['command'])}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(spec["command"], stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env={**os.environ, **spec["env"]},
                                             start_new_session=True, preexec_fn=_die_with_parent)
            except FileNotFoundError:
                self.write(state="failed", error=(
                    f"command {spec['command'][0]!r} not found; install it (pip install -e '.[vllm]') or set "
                    "engine.server_command to how you start it"))
                return False
        self.write(server_pid=self.proc.pid, server_started=start_time(self.proc.pid))
        return True

    def stop_server(self) -> None:
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def owner_alive(self) -> bool:
        return alive(self.spec["owner_pid"], self.spec["owner_started"])

    def wait_ready(self) -> str | None:
        """None once /health answers; else why the start failed (the server is stopped then)."""
        from pipeline.engines.http import get_ok

        deadline = time.monotonic() + float(self.spec["start_timeout"])
        while not get_ok(f"http://127.0.0.1:{self.spec['port']}/health", timeout=2.0):
            if self.proc.poll() is not None:
                return f"exited with code {self.proc.returncode} while starting"
            if self.stopping["now"] or not self.owner_alive() or time.monotonic() > deadline:
                self.stop_server()
                return ("start abandoned (the stage or run that asked for it is gone, or engine.start_timeout "
                        "passed)")
            time.sleep(POLL_S)
        return None

    def watch(self) -> int:
        """Until the server must stop: asked to (stop_entry), it died, its run ended, or it sat idle too long."""
        idle_since = None
        while True:
            if self.stopping["now"]:  # stop_entry asked (its caller holds the lock and forgets the entry)
                _note(self.spec["log"], "asked to stop")
                self.stop_server()
                return 0
            reason, idle_since = self.why_stop(idle_since)
            if reason:
                with _try_locked(self.registry, self.stopping) as held:
                    if held and reason.startswith("idle") and live_leases(self.registry, self.key):
                        idle_since = None  # a stage attached while we waited for the lock
                        continue
                    _note(self.spec["log"], reason)
                    self.stop_server()
                    current = read_entry(self.registry, self.key)
                    if held and current and current.get("supervisor_pid") == os.getpid():
                        forget(self.registry, self.key)
                return 0
            if time.monotonic() - self.measured_at >= MEASURE_EVERY_S:
                self.measure()
            time.sleep(POLL_S)

    def why_stop(self, idle_since: float | None) -> tuple[str | None, float | None]:
        idle_timeout = self.spec["idle_timeout"]
        if self.proc.poll() is not None:
            return f"the server exited with code {self.proc.returncode}", idle_since
        if not self.owner_alive():
            return f"its run ({self.spec['owner']}) ended", idle_since
        if live_leases(self.registry, self.key):
            return None, None
        if idle_since is None:
            return None, time.monotonic()
        if idle_timeout is not None and time.monotonic() - idle_since >= float(idle_timeout):
            return f"idle for {idle_timeout:g} s (engine.server_idle_timeout)", idle_since
        return None, idle_since


def supervise(spec: dict) -> int:
    return Supervisor(spec).run()


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
