"""A serving engine's HTTP server as a child process: started, health-checked, stopped.

The server runs in its own process group with its output in a log file the caller keeps beside
its results. `start()` returns once `GET /health` answers 200; if the process exits first, or the
start takes longer than `start_timeout`, the server is stopped and a UserError quotes the end of
its log. `stop()` sends SIGTERM to the whole group, then SIGKILL after a grace period. On Linux the
child is also told to die with us (PR_SET_PDEATHSIG), so a killed stage leaves no server holding
the GPU.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from pipeline.engines.http import get_ok
from pipeline.errors import UserError

LOG_TAIL_LINES = 15


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    def __init__(self, command: list[str], *, port: int, log_path: Path, env: dict | None = None,
                 name: str = "server", start_timeout: float = 900.0, stop_timeout: float = 30.0):
        self.command, self.port, self.log_path, self.name = list(command), port, Path(log_path), name
        self.env = {**os.environ, **(env or {})}
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=self.env, start_new_session=True, preexec_fn=_die_with_parent)
            except FileNotFoundError:
                raise UserError(f"{self.name}: command {self.command[0]!r} not found; install it (pip install -e "
                                f"'.[vllm]') or set engine.server_command to how you start it") from None
        deadline = started + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise UserError(f"{self.name} exited with code {code} while starting; the end of {self.log_path}:\n"
                                f"{self.log_tail()}")
            if get_ok(self.base_url + "/health", timeout=2.0):
                self.start_seconds = time.monotonic() - started
                return self
            time.sleep(0.5)
        self.stop()
        raise UserError(f"{self.name} did not answer {self.base_url}/health within {self.start_timeout:.0f} s "
                        f"(engine.start_timeout); the end of {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join("  " + line for line in text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        for sig, wait in ((signal.SIGTERM, self.stop_timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
