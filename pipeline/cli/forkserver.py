"""The run's warm interpreter (`python -m pipeline.cli.forkserver SOCKET OWNER_PID OWNER_STARTED`, started by
pipeline/cli/launcher.py): imports what the stages import (torch, transformers, lm-eval, the pipeline's stages)
once, then serves the run's `quantize` commands on a Unix socket, one forked child per command.

The child takes the command's working directory, environment, umask and standard streams (passed as
descriptors), resets signal handlers and random seeds, and runs `pipeline.cli.app` as a fresh process would; the
server sends the launcher the child's pid, then its exit status. A launcher that goes away (killed) takes its
child with it. The server ends when its run ends (the owner process is gone), after IDLE_S without a command,
or at once, before serving anything, when preloading left it unable to fork safely: a second thread of
Python's own, or a preloaded module that asked torch.cuda anything at import (a forked child cannot use CUDA
that its parent initialized; the launcher then runs commands in their own processes, as without a server).
"""

from __future__ import annotations

import contextlib
import os
import random
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.cli.launcher import receive_request, send_message
from pipeline.runs import alive, remember_environment

IDLE_S = 1800.0
POLL_S = 0.5
# what the stages import, heaviest first; never anything that touches the GPU at import (llm-compressor does:
# the quantize stages import it themselves)
PRELOAD = ("torch", "numpy", "pandas", "scipy.stats", "transformers", "transformers.generation.utils",
           "transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama",
           "transformers.models.glm.modeling_glm", "datasets", "lm_eval", "lm_eval.evaluator", "lm_eval.tasks",
           "lm_eval.api.model", "safetensors", "httpx", "jinja2", "typer", "pipeline.cli.app", "pipeline.stages.evaluate",
           "pipeline.stages.judge", "pipeline.stages.kl", "pipeline.stages.bench", "pipeline.stages.report", "pipeline.stages.calib",
           "pipeline.stages.resave", "pipeline.checkpoints.headers", "pipeline.engines.hf",
           "pipeline.engines.vllm", "pipeline.verdict")


# torch.cuda's entry points that initialize CUDA (or its driver) when called: a call while preloading makes the
# server refuse to fork (a child cannot use CUDA its parent initialized)
CUDA_ENTRY_POINTS = ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device",
                     "get_device_properties", "get_device_capability", "get_device_name", "is_bf16_supported",
                     "mem_get_info", "synchronize")


def cuda_initialized() -> bool:
    """Whether torch (when imported) has initialized CUDA in this process."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _watch_cuda_calls(calls: list):
    """Counts every call of torch.cuda's entry points (each still runs); returns what undoes it. (Importing torch
    maps the CUDA libraries but initializes nothing; a module that asks torch.cuda anything at import may.)"""
    import torch

    originals = {name: getattr(torch.cuda, name) for name in CUDA_ENTRY_POINTS if hasattr(torch.cuda, name)}

    def counted(name, function):
        def call(*args, **kwargs):
            calls.append(name)
            return function(*args, **kwargs)
        return call

    for name, function in originals.items():
        setattr(torch.cuda, name, counted(name, function))
    return lambda: [setattr(torch.cuda, name, function) for name, function in originals.items()]


def preload(modules=PRELOAD) -> tuple[list[str], str | None]:
    """Imports the modules it can, in order: (those that failed: an optional package missing, the first module whose
    import asked torch.cuda anything or initialized CUDA, after which nothing more is imported)."""
    import importlib

    missing, calls = [], []
    try:
        undo = _watch_cuda_calls(calls)
    except ImportError:  # no torch: nothing can touch CUDA through it
        undo = None
    try:
        for name in modules:
            asked = len(calls)
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a module a stage may never need: that stage imports it itself
                missing.append(name)
            if len(calls) > asked or cuda_initialized():
                return missing, name
    finally:
        if undo is not None:
            undo()
    return missing, None


@dataclass(frozen=True)
class Program:
    """What a fork server serves: the modules it imports once, the name its children run as (sys.argv[0]) and
    the function each child runs, as the program's own `main` would run in a fresh process."""
    name: str
    preload: tuple[str, ...]
    main: Callable[[], object]


def _quantize_main() -> None:
    from pipeline.cli.app import app

    app()


QUANTIZE = Program("quantize", PRELOAD, _quantize_main)


def serve(path: Path, owner_pid: int, owner_started: int | None, program: Program = QUANTIZE) -> int:
    lock = path.with_suffix(".starting")
    try:
        began = time.perf_counter()
        missing, culprit = preload(program.preload)
        refusal = _why_not_fork() or (f"importing {culprit} asked torch.cuda (CUDA may be initialized)" if culprit
                                      else None)
        print(f"preloaded in {time.perf_counter() - began:.1f} s; not found: {missing or 'none'}", flush=True)
        if refusal:  # the run's later commands run in their own processes; none starts another server
            print(f"not serving: {refusal}", flush=True)
            path.with_suffix(".refused").write_text(refusal + "\n")
            return 0
        listener = _listen(path)
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()
    try:
        return _loop(listener, owner_pid, owner_started, program)
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            path.unlink()


def _why_not_fork() -> str | None:
    if threading.active_count() > 1:
        return f"{threading.active_count()} Python threads after preloading"
    if cuda_initialized():
        return "CUDA was initialized while preloading"
    return None


def _listen(path: Path) -> socket.socket:
    """Listening on `path`, which appears (by rename) only once the server accepts connections."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.unlink()
    listener.bind(str(tmp))
    os.chmod(tmp, 0o600)
    listener.listen(64)
    os.replace(tmp, path)
    return listener


def _loop(listener: socket.socket, owner_pid: int, owner_started: int | None, program: Program) -> int:
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # child pid -> its launcher's connection
    last = time.monotonic()
    while alive(owner_pid, owner_started) and (children or time.monotonic() - last < IDLE_S):
        for key, _ in selector.select(POLL_S):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                pid = _start(conn, listener, children, program)
                if pid is not None:
                    children[pid] = conn
                    selector.register(conn, selectors.EVENT_READ, pid)
                last = time.monotonic()
            else:  # a launcher's connection readable: it went away (it sends nothing more)
                _kill(key.data)
        for pid in _reap(children):
            selector.unregister(children[pid])
            children.pop(pid).close()
    for pid in list(children):  # the run ended under them
        _kill(pid)
    return 0


def _start(conn: socket.socket, listener: socket.socket, children: dict, program: Program) -> int | None:
    try:
        received = receive_request(conn)
    except (OSError, ValueError):
        received = None
    if received is None or _why_not_fork():
        with contextlib.suppress(OSError):
            send_message(conn, {"refused": True})
        conn.close()
        return None
    request, fds = received
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in children.values():
            other.close()
        _child(conn, request, fds, program)  # never returns
    for fd in fds:
        os.close(fd)
    print(f"{time.strftime('%H:%M:%S')} child {pid}: {program.name} {' '.join(request['argv'])}", flush=True)
    try:
        send_message(conn, {"pid": pid})
    except OSError:
        _kill(pid)
    return pid


def _child(conn: socket.socket, request: dict, fds: list[int], program: Program) -> None:
    code = 1
    inherited = (sys.stdout, sys.stderr)  # objects a preloaded module may hold: they write to fds 1 and 2 too
    try:
        conn.close()
        os.setpgid(0, 0)  # its own process group: the launcher's signals reach it and what it starts
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.umask(int(request["umask"]))
        os.environ.clear()
        os.environ.update(request["env"])
        remember_environment(request["env"])
        sys.argv = [program.name, *request["argv"]]
        _fresh_process_state()
        code = _run_main(program.main)
    except BaseException:  # noqa: BLE001 - whatever happens, the child exits here and says why
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr, *inherited):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _fresh_process_state() -> None:
    """What a new interpreter would have: its own random seeds, streams on the descriptors it was given."""
    import io

    random.seed()
    with contextlib.suppress(Exception):
        import numpy

        numpy.random.seed()
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=getattr(sys, name).encoding,
                                  errors="backslashreplace" if name == "stderr" else "strict",
                                  line_buffering=os.isatty(fd), write_through=name == "stderr")
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=sys.stdin.encoding)


def _run_main(main: Callable[[], object]) -> int:
    """main()'s exit status as a process running it would have it (SystemExit, Ctrl-C, exit handlers run)."""
    import atexit

    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    atexit._run_exitfuncs()
    return code


def _reap(children: dict[int, socket.socket]) -> list[int]:
    """Children that ended: their launcher gets the exit status (or the signal that ended them)."""
    done = []
    for pid, conn in children.items():
        try:
            waited, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            waited, status = pid, 256
        if waited == 0:
            continue
        message = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}
        with contextlib.suppress(OSError):
            send_message(conn, message)
        done.append(pid)
    return done


def _kill(pid: int) -> None:
    """A child whose launcher went away: its process group ends (SIGTERM, then SIGKILL)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    return
            time.sleep(0.1)


if __name__ == "__main__":
    socket_path, owner, owner_start = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sys.exit(serve(Path(socket_path), owner, None if owner_start == "None" else int(owner_start)))
