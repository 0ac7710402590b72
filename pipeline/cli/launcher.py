"""`quantize`, the console script: runs the command in this process, or, inside a run, in a process forked
from the run's warm interpreter (pipeline/cli/forkserver.py), which has torch, transformers and lm-eval
imported already.

A stage's own work is often seconds; importing what it needs costs ~5 s on a 2-core CPU and more on the GPU
machine, in every one of a run's stages. So the first stage of a `dvc repro` starts a fork server for the run
(in the background, and runs its own command here as usual), and every later stage hands its command line,
working directory, environment and standard streams to it over a Unix socket: the server forks, the child
runs the command exactly as this process would (`pipeline.cli.app`), and this process relays signals to it and
exits with its status. Anything unusual (no run, the server not up yet or gone, QUANTIZE_FORKSERVER=0, the
server refusing: e.g. a preloaded library had loaded the CUDA driver, which a forked child cannot use) runs
the command here instead; the result is the same, only slower.

Standard library only until it knows where the command runs.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from pipeline.scoring.ahead import AHEAD_ENV

ENABLE_ENV = "QUANTIZE_FORKSERVER"  # 0: every command runs in its own process
STARTED_ENV = "QUANTIZE_STAGE_STARTED"  # when the command began, for the stage's own timing (cli_common)
# what differs between a run's commands and no module reads at import (each forked child takes its command's own
# environment): the stage's name, the shell's, the command's start, the run's ids, the stage log and a job scoring
# ahead of its stage (pipeline/scoring/ahead.py: each job named its stage, and so started a warm interpreter of its
# own that nothing used, and ran unforked)
VOLATILE_ENV = {"DVC_STAGE", "PWD", "OLDPWD", "SHLVL", "_", STARTED_ENV, "QUANTIZE_RUN_PID", "QUANTIZE_STAGE_LOG", AHEAD_ENV}
LOG_DIR = Path(".cache") / "forkserver"  # in the project: the servers' logs
MAX_SOCKET_PATH = 100  # AF_UNIX paths hold 108 bytes: the sockets live in a short private folder


def socket_dir() -> Path:
    """A folder of this user's only (0700) for the servers' sockets, named by their key."""
    import tempfile

    folder = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"quantize-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def main() -> None:
    started = time.time()
    from pipeline.runs import remember_environment

    remember_environment()  # before any library adds its own variables (the commands this one starts get this one)
    where = _forkserver()
    if where is not None:
        code = _run_there(*where, started)
        if code is not None:
            sys.exit(code)
    from pipeline.cli.app import main as run_here

    run_here()


def _forkserver() -> tuple[socket.socket, int] | None:
    """(a connection to the run's fork server, the run's pid); None to run here (starting the server in the
    background when the run has none yet)."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    from pipeline.runs import run_owner

    try:
        owner_pid, owner_started, _ = run_owner()
    except Exception:  # noqa: BLE001 - a bad QUANTIZE_RUN_PID: the command itself says so
        return None
    if owner_pid == os.getpid():
        return None  # not inside a run: nothing to share
    key = forkserver_key(owner_pid, owner_started)
    try:
        path = socket_dir() / f"{key}.sock"
    except OSError:
        return None
    if len(str(path)) > MAX_SOCKET_PATH:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        return conn, owner_pid
    except OSError:
        conn.close()
    _start_forkserver(key, path, owner_pid, owner_started)
    return None


def forkserver_key(owner_pid: int, owner_started: int | None) -> str:
    """The run, the interpreter, the code (every pipeline module's size and time) and the environment a
    preloaded module could have read: a server answers only commands it would run as a fresh process would."""
    root = Path(__file__).resolve().parents[1]  # the whole pipeline package
    code = sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*.py"))
    env = sorted((k, v) for k, v in os.environ.items() if k not in VOLATILE_ENV)
    payload = json.dumps([owner_pid, owner_started, sys.executable, sys.path, code, env])
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def _start_forkserver(key: str, path: Path, owner_pid: int, owner_started: int | None) -> None:
    """Starts the run's fork server, detached (it outlives this stage and ends with the run); one per key:
    a lock file keeps two stages from starting two."""
    lock = path.with_suffix(".starting")
    if path.with_suffix(".refused").exists():
        return  # this run's server found it could not fork safely (pipeline/cli/forkserver.py says why in its log)
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return  # another stage is starting it (the server removes the lock when it listens or gives up)
    os.close(fd)
    try:
        (Path.cwd() / LOG_DIR).mkdir(parents=True, exist_ok=True)
        log = open(Path.cwd() / LOG_DIR / f"{key}.log", "ab")
    except OSError:
        log = subprocess.DEVNULL
    subprocess.Popen([sys.executable, "-m", "pipeline.cli.forkserver", str(path), str(owner_pid), str(owner_started)],
                     stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True)
    if log is not subprocess.DEVNULL:
        log.close()


def _run_there(conn: socket.socket, owner_pid: int, started: float) -> int | None:
    """Hands this command to the fork server and relays signals to the child; its exit status, or None when
    the server refused before the child started (the command then runs here)."""
    return hand_over(conn, {**os.environ, "QUANTIZE_RUN_PID": str(owner_pid), STARTED_ENV: repr(started)})


def hand_over(conn: socket.socket, env: dict[str, str]) -> int | None:
    """This process's command line, working directory, umask and standard streams, with `env`, to the fork server
    on `conn` (pipeline/cli/forkserver.py); then relays signals to the child it forks until it ends. The child's
    exit status, or None when the server refused before a child started (the caller then runs it itself)."""
    request = json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": env,
                          "umask": _umask()}).encode()
    with conn:
        try:
            socket.send_fds(conn, [struct.pack("!I", len(request)) + request], [0, 1, 2])
            child = _read_message(conn)
        except OSError:
            return None
        if not child or child.get("refused"):
            return None
        pid = int(child["pid"])
        forwarded = {sig: signal.signal(sig, lambda s, _f: _forward(pid, s))
                     for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
        try:
            while True:
                try:
                    done = _read_message(conn)
                    break
                except InterruptedError:
                    continue
        finally:
            for sig, handler in forwarded.items():
                signal.signal(sig, handler)
    if not done:
        print("error: the run's fork server ended while running this command (pipeline/cli/forkserver.py); "
              "run it again, or set QUANTIZE_FORKSERVER=0", file=sys.stderr)
        return 1
    if done.get("signal"):
        signal.signal(done["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), done["signal"])  # die as the child died (dvc reports the signal)
    return int(done.get("exit", 1))


def _forward(pid: int, sig: int) -> None:
    """To the child's process group (its own: pipeline/cli/forkserver.py), as a signal to this process's group
    would reach this process and what it started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _read_message(conn: socket.socket) -> dict | None:
    """One length-prefixed JSON message; None at end of stream."""
    head = _read_exact(conn, 4)
    if head is None:
        return None
    body = _read_exact(conn, struct.unpack("!I", head)[0])
    return json.loads(body) if body is not None else None


def _read_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def send_message(conn: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    conn.sendall(struct.pack("!I", len(body)) + body)


def receive_request(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """The fork server's side of _run_there: the request and the three descriptors sent with it."""
    fds = array.array("i")
    msg, ancillary, _, _ = conn.recvmsg(4, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - (len(data) % fds.itemsize)])
    if len(msg) < 4:
        for fd in fds:
            os.close(fd)
        return None
    body = _read_exact(conn, struct.unpack("!I", msg)[0])
    if body is None or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return None
    return json.loads(body), list(fds)


if __name__ == "__main__":
    main()
