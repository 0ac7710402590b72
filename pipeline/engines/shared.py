"""One server per checkpoint per run: stages that serve the same checkpoint with the same engine
settings share one running `vllm serve` instead of starting their own (~90-125 s each on the H200).

A registry directory (`QUANTIZE_SERVER_DIR`, default `.cache/servers` in the project;
pipeline/engines/server_registry.py) holds one JSON entry per running server, keyed by the checkpoint's files
(their stat signature) and the server's command line (engine settings, environment), so a checkpoint that changed gets a new key and never an old server's
answers. The first stage that needs a key starts a small supervisor process (`python -m
pipeline.engines.supervisor`), detached from the stage, which starts the server, waits for `/health`, writes
the entry and then watches three things every half second:

- the run that holds the GPU (its *owner*): the `dvc repro` process the stage runs under (found by
  walking up the stage's parents), or the process named by `QUANTIZE_RUN_PID`; when it is gone the
  server is stopped. Outside a run the owner is the stage itself, so a lone `quantize eval` stops its
  server when it ends, as before;
- leases: every stage using the server holds one (a file naming its pid and start time); a stage
  killed with SIGKILL leaves a lease whose process is gone, which counts as released;
- idleness, when `engine.server_idle_timeout` is set: with no live lease for that long the server is
  stopped. Unset (the default), a server lives until its run ends: DVC's stage order can leave a model
  unused for many minutes before its next stage, and a restart costs ~100 s on the H200.

A server can also be started before any stage asks for it (`warm`, no lease taken): a stage that attaches
while it is still starting waits for it, and only that wait counts as the stage's engine start.

The server dies with its supervisor (PR_SET_PDEATHSIG), and the supervisor stops the server's whole
process group on SIGTERM. Starting a server first stops idle servers of the same checkpoint path (a
changed checkpoint: they can never be asked again) and then idle ones beyond `engine.max_servers`
(least recently used first), so a GPU never holds more servers than configured: when every one of them is
in use (a stage's or a job's lease, or still starting), the stage waits for one to be given back, and a stage
that holds them all itself is refused with the setting to raise. One lock file serializes starts and attaches,
so two stages never start the same server twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.engines.server_registry import (  # noqa: F401  (REGISTRY_ENV, keep_last: callers ask them here)
    POLL_S, REGISTRY_ENV, content_fingerprint, entries, forget, keep_last, kept_last, lease_name, leases_dir, live_leases,
    locked, held_bytes, read_entry, registry_dir, running_jobs, server_key, stop_entry, stop_idle, write_entry)
from pipeline.errors import UserError
from pipeline.runs import RUN_PID_ENV, alive, run_owner, start_time  # noqa: F401  (the run a server belongs to)

# ---------------------------------------------------------------- what a stage holds

@dataclass
class SharedServer:
    """A lease on a running server. `started` is True when this stage started it (and paid
    `start_seconds`), False when it attached to one a previous stage of the run started."""

    registry: Path
    key: str
    port: int
    log_path: Path
    started: bool
    start_seconds: float
    owner: str
    server_pid: int
    stop_at_close: bool
    waited: float = 0.0  # seconds this stage waited for the server to be ready (0 for one already up)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def proc(self):  # what VLLMEngine._raise_if_dead reads: a poll()-able view of the server process
        return _Watched(self.server_pid, self.log_path)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join("  " + line for line in text.splitlines()[-lines:])

    def release(self) -> None:
        """Gives the lease back; the server stays for the next stage of the run unless this stage owns
        it alone (no run), in which case it is stopped now."""
        with locked(self.registry):
            with contextlib.suppress(OSError):
                (leases_dir(self.registry, self.key) / lease_name()).unlink()
            entry = read_entry(self.registry, self.key)
            if entry is None:
                return
            entry["last_used"] = time.time()
            write_entry(self.registry, self.key, entry)
            if self.stop_at_close and not live_leases(self.registry, self.key):
                stop_entry(self.registry, self.key, entry)

    stop = release  # ServerProcess's name for it


class _Watched:
    """poll() like a Popen's: None while the server runs, else its exit code as the supervisor noted it."""

    EXITED = re.compile(r"server stopped: the server exited with code (-?\d+)")

    def __init__(self, pid: int, log_path: Path):
        self.pid, self._started, self.log_path = pid, start_time(pid), log_path
        self.returncode = None

    def poll(self):
        if alive(self.pid, self._started):
            return None
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # the supervisor notes the exit code within half a second
            match = self.EXITED.search(_tail(self.log_path, 5))
            if match:
                self.returncode = int(match.group(1))
                return self.returncode
            time.sleep(0.1)
        self.returncode = "unknown"
        return self.returncode


def acquire(command: list[str], port_flag: str, *, model_dir: Path, log_path: Path, env: dict | None = None,
            start_timeout: float = 900.0, idle_timeout: float | None = None, max_servers: int = 1,
            name: str = "server", gpu_bytes: int | None = None, gpu_budget: int | None = None) -> SharedServer:
    """A lease on the server `command` (without its port: `port_flag PORT` is appended) for the
    checkpoint model_dir: attached when a live one has the same key (waiting for it when an earlier stage
    or `warm` is still starting it), else started through a supervisor (the server's output goes to
    log_path). With gpu_bytes and gpu_budget (engine.kv_cache_memory: fitted, server_plan.py) a server starts only
    when its planned memory fits beside the others' in the budget, idle ones stopped for it (least recently used
    first, never the run's base); else it waits until one is given back. Raises UserError when the start fails."""
    registry = registry_dir()
    model_dir = Path(model_dir).resolve()
    owner_pid, owner_started, owner_what = run_owner()
    own_stage = owner_pid == os.getpid()
    env = dict(env or {})
    key = server_key(content_fingerprint(model_dir, registry), command, env)
    started, told = time.monotonic(), False
    while True:
        with locked(registry):
            entry = read_entry(registry, key)
            if entry and _live(entry):
                _lease(registry, key)  # a starting server is waited for below, holding the lease
                attach = True
                break
            if entry:
                stop_entry(registry, key, entry)  # a dead server under this key
            stop_idle(registry, keep=max(0, max_servers - 1), model_path=str(model_dir), exclude=key,
                      need_bytes=gpu_bytes, budget_bytes=gpu_budget,
                      pinned=kept_last(registry) if gpu_budget else None)
            busy = {k: e for k, e in entries(registry).items() if k != key}
            if _fits(busy, max_servers, gpu_bytes, gpu_budget):
                _lease(registry, key)
                _spawn_supervisor(registry, key, command, port_flag, model_dir=model_dir, log_path=log_path, env=env,
                                  owner=(owner_pid, owner_started, owner_what), start_timeout=start_timeout,
                                  idle_timeout=idle_timeout, name=name, gpu_bytes=gpu_bytes)
                attach = False
                break
            _refuse_when_all_mine(registry, busy, max_servers, name, gpu_budget)  # else wait for one to be given back
        told = _wait_note(busy, max_servers, name, Path(log_path), told, gpu_budget)
        time.sleep(POLL_S)
    entry = _wait_ready(registry, key, start_timeout, name, Path(log_path))
    if attach:
        with contextlib.suppress(OSError):
            with open(log_path, "a") as log:
                log.write(f"attached to the server started for this checkpoint (key {key}); its log: "
                          f"{entry['log']}\n")
    waited = time.monotonic() - started
    return SharedServer(registry, key, entry["port"], Path(entry["log"]), not attach, waited if not attach else 0.0,
                        entry["owner"], entry["server_pid"], own_stage, waited=waited)


def _names(busy: dict) -> str:
    return ", ".join(Path(e.get("model_path") or "?").name for e in busy.values())


def _fits(busy: dict, max_servers: int, gpu_bytes: int | None, gpu_budget: int | None) -> bool:
    """Whether one more server may start beside `busy`: fewer than max_servers, and (planned memory) its bytes
    beside theirs within the budget; alone on the GPU it always may (its plan checked that it fits alone)."""
    if len(busy) >= max_servers:
        return False
    return gpu_budget is None or not busy or held_bytes(busy) + (gpu_bytes or 0) <= gpu_budget


def _refuse_when_all_mine(registry: Path, busy: dict, max_servers: int, name: str, gpu_budget: int | None) -> None:
    """No room for one more server and none is idle: a stage waits for one to be given back, unless this process
    holds every one itself (nobody else would give one back). Call with the lock held."""
    mine, pinned = lease_name(), (kept_last(registry) if gpu_budget else None)
    for key, entry in busy.items():
        leases = set(live_leases(registry, key))
        if entry.get("state") == "starting" or leases - {mine}:
            return  # another process holds it and gives it back
        if not leases and entry.get("model_path") != pinned:
            return  # given back since stop_idle looked (its holder ended in between): stopped on the next round
    # a job of the run working on a server's model holds it between its requests too (a judge between its two
    # servers, loading its prompts): stop_idle keeps that server, and the job gives it back when its work ends
    working = {str(Path(j["model"]).resolve()) for j in running_jobs(registry) if j.get("model")}
    if any(e.get("model_path") in working for e in busy.values()):
        return
    if len(busy) >= max_servers:
        raise UserError(f"{name}: engine.max_servers is {max_servers} and this stage holds every server up "
                        f"({_names(busy)}) while it needs one more at once; raise engine.max_servers to "
                        f"{len(busy) + 1}")
    raise UserError(f"{name}: this stage holds every server up ({_names(busy)}) while it needs one more at once, and "
                    f"it does not fit beside them in the {gpu_budget / 2**30:.1f} GiB the servers may hold "
                    "(engine.gpu_memory_utilization); lower engine.batch_size or engine.plan_request_tokens")


def _wait_note(busy: dict, max_servers: int, name: str, log_path: Path, told: bool, gpu_budget: int | None) -> bool:
    """While a stage waits for room for its server: said once in its log. It waits as long as another process holds
    a server (every holder holds one server at a time and gives it back when its work ends: no cycle). Returns
    told."""
    if not told:
        room = (f"room in the GPU memory the servers may hold ({gpu_budget / 2**30:.1f} GiB)" if gpu_budget
                else f"one of the {max_servers} servers engine.max_servers allows")
        with contextlib.suppress(OSError):
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "a") as log:
                log.write(f"[quantize] {name}: waiting for {room}: a server in use to be given back (up: "
                          f"{_names(busy)})\n")
    return True


def warm(command: list[str], port_flag: str, *, model_dir: Path, log_path: Path, env: dict | None = None,
         start_timeout: float = 900.0, idle_timeout: float | None = None, max_servers: int = 1,
         name: str = "server", gpu_bytes: int | None = None, gpu_budget: int | None = None) -> str | None:
    """Starts the server `command` for model_dir in the background, so that it is up when a stage asks for it
    (acquire then attaches): no lease is taken and nothing is waited for. Does nothing when a server under
    that key is running or starting, or when max_servers are up already or (planned memory: gpu_bytes,
    gpu_budget) it does not fit beside them (warming never stops a server for room).
    Returns the key of a server it started, else None."""
    registry = registry_dir()
    model_dir = Path(model_dir).resolve()
    owner = run_owner()
    env = dict(env or {})
    key = server_key(content_fingerprint(model_dir, registry), command, env)
    with locked(registry):
        entry = read_entry(registry, key)
        if entry and _live(entry):
            return None
        if entry:
            stop_entry(registry, key, entry)
        stop_idle(registry, keep=len(entries(registry)), model_path=str(model_dir), exclude=key)  # its old content only
        if not _fits(entries(registry), max_servers, gpu_bytes, gpu_budget):
            return None
        _spawn_supervisor(registry, key, command, port_flag, model_dir=model_dir, log_path=log_path, env=env,
                          owner=owner, start_timeout=start_timeout, idle_timeout=idle_timeout, name=name,
                          gpu_bytes=gpu_bytes)
    return key


def starting(registry: Path | None = None) -> list[dict]:
    """The servers whose start is under way (their supervisor alive, not yet ready)."""
    return [e for e in entries(registry).values()
            if e.get("state") == "starting" and alive(e.get("supervisor_pid"), e.get("supervisor_started"))]


def wait_until_started(timeout: float = 900.0, registry: Path | None = None) -> float:
    """Waits until no server of the registry is starting (a start's torch.compile and CUDA-graph capture load
    the GPU: a speed measurement waits for quiet); returns the seconds waited."""
    began = time.monotonic()
    while starting(registry) and time.monotonic() - began < timeout:
        time.sleep(POLL_S)
    return time.monotonic() - began


def _live(entry: dict) -> bool:
    """Its supervisor runs and the server is ready and answers, or is still starting."""
    from pipeline.engines.http import get_ok

    if not alive(entry.get("supervisor_pid"), entry.get("supervisor_started")):
        return False
    if entry.get("state") == "starting":
        return True
    return entry.get("state") == "ready" and get_ok(f"http://127.0.0.1:{entry['port']}/health")


def _spawn_supervisor(registry: Path, key: str, command: list[str], port_flag: str, *, model_dir: Path,
                      log_path: Path, env: dict, owner: tuple, start_timeout: float, idle_timeout: float | None,
                      name: str, gpu_bytes: int | None = None) -> None:
    """Writes the entry (state starting) and starts the supervisor, detached: it outlives the caller. Call with
    the lock held."""
    from pipeline.engines.server import free_port

    port = free_port()
    log_path = Path(log_path).resolve()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    owner_pid, owner_started, owner_what = owner
    spec = {"key": key, "command": [*command, port_flag, str(port)], "port": port, "env": env,
            "log": str(log_path), "model_path": str(model_dir), "owner_pid": owner_pid,
            "owner_started": owner_started, "owner": owner_what, "idle_timeout": idle_timeout,
            "start_timeout": start_timeout, "registry": str(registry), "name": name, "gpu_bytes": gpu_bytes}
    package_root = str(Path(__file__).resolve().parents[2])
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    supervisor = subprocess.Popen([sys.executable, "-m", "pipeline.engines.supervisor", json.dumps(spec)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True, env=child_env, close_fds=True)
    threading.Thread(target=supervisor.wait, daemon=True).start()  # reaped when it exits; it outlives us
    deadline = time.monotonic() + 60
    while read_entry(registry, key) is None and supervisor.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # its first entry (state starting) names it: others attach from then on


def _wait_ready(registry: Path, key: str, start_timeout: float, name: str, log_path: Path) -> dict:
    """The entry once its server is ready; a start that failed (or took past start_timeout) is a UserError
    quoting the end of the server's log."""
    deadline = time.monotonic() + start_timeout + 30
    while True:
        entry = read_entry(registry, key)
        if entry and entry.get("state") == "ready":
            return entry
        supervisor_gone = entry is not None and not alive(entry.get("supervisor_pid"), entry.get("supervisor_started"))
        if entry is None or entry.get("state") == "failed" or supervisor_gone:
            failure = (entry or {}).get("error") or "its supervisor exited before the server was ready"
            log = Path((entry or {}).get("log") or log_path)
            with locked(registry):
                forget(registry, key)
            raise UserError(f"{name} {failure}; the end of {log}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            with locked(registry):
                stop_entry(registry, key, entry)
            raise UserError(f"{name} did not become ready within {start_timeout:.0f} s (engine.start_timeout); "
                            f"the end of {entry.get('log') or log_path}:\n{_tail(Path(entry.get('log') or log_path))}")
        time.sleep(0.2)


def _lease(registry: Path, key: str) -> None:
    folder = leases_dir(registry, key)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / lease_name()).touch()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join("  " + line for line in text.splitlines()[-lines:])
