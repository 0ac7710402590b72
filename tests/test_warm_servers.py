"""The test servers fork from a warm interpreter (tests/warm_servers.py, the pipeline's fork server serving
tests/openai_server.py): started as the pipeline starts `vllm serve`, the process stays the server as far as its
starter can tell: it answers, ends with the signal it is sent, and, killed, takes the forked server with it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import warm_servers
from pipeline.engines.http import get_ok
from pipeline.engines.server import free_port

SERVER = Path(__file__).with_name("openai_server.py")


def warm_log() -> Path:
    socket = Path(os.environ[warm_servers.SOCKET_ENV])
    deadline = time.monotonic() + 120
    while not socket.exists() and time.monotonic() < deadline:  # it listens once its imports are done
        time.sleep(0.2)
    assert socket.exists(), socket.with_name("log").read_text()
    return socket.with_name("log")


def start(model, tmp_path, env=None):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), str(model), "--port", str(port)], start_new_session=True,
                            stdout=open(tmp_path / f"server-{port}.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 120
    while not get_ok(f"http://127.0.0.1:{port}/health") and time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / f"server-{port}.log").read_text()
        time.sleep(0.1)
    return proc, port


def forked_pid(log: Path, port: int) -> int | None:
    lines = [line for line in log.read_text().splitlines() if f"--port {port}" in line]
    return int(lines[-1].split(" child ")[1].split(":")[0]) if lines else None


def gone(pid: int, port: int, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() and not get_ok(f"http://127.0.0.1:{port}/health", timeout=0.5):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_server_forks_from_the_warm_interpreter_and_ends_with_the_process_started(tiny_llama, tmp_path, sig):
    log = warm_log()
    proc, port = start(tiny_llama, tmp_path)
    child = forked_pid(log, port)
    assert child is not None and child != proc.pid  # the model answers from a forked child ...
    assert (tmp_path / f"server-{port}.log").read_text().count("listening on") == 1  # ... writing to the starter's log
    os.killpg(proc.pid, sig)  # as pipeline/engines/server.py stops a server: its process group
    assert proc.wait(timeout=30) == -sig  # ended as the signal ends a server run in its own process
    assert gone(child, port)  # and the forked server with it (killed: the warm interpreter saw it go)


def test_a_server_with_another_import_path_runs_in_its_own_process(tiny_llama, tmp_path):
    """Another PYTHONPATH (the access recorder's sitecustomize) may change what imports do: no warm interpreter."""
    log = warm_log()
    extra = tmp_path / "site"
    extra.mkdir()
    proc, port = start(tiny_llama, tmp_path, env={"PYTHONPATH": str(extra)})
    assert forked_pid(log, port) is None
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
