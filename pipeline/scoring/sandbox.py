"""Run untrusted (model-written) Python in a throwaway sandbox: one fresh process per sample.

Preferred method, "bwrap" (bubblewrap): new network, pid, ipc, uts and cgroup namespaces and a
root filesystem that holds only what the interpreter needs to start: its executable, its standard
library (site-packages masked), the shared libraries `ldd` lists for the interpreter and its
extension modules, `/etc/ld.so.cache`, a minimal `/dev`, and a private size-capped tmpfs as /tmp,
cwd and HOME. No /proc, no /etc/passwd, nothing of the project or of any HOME. The environment is
cleared. Inside, a small bootstrap sets rlimits (address space, CPU, file size, processes, open
files, no core dumps) and, when started as root, drops to uid nobody before it executes the sample:
root ignores RLIMIT_NPROC, nobody does not, so a fork bomb stalls at the limit. On a timeout or too
much output the whole process group is killed; bwrap's pid 1 dies with it and the kernel kills
everything left in the pid namespace. The bubblewrap command line is built in pipeline/scoring/bwrap.py;
this module runs it.

Fallback, "rlimits+audit", only where the caller allows it (`allow_unsandboxed`): the same rlimits
and scrubbed environment in a private temp dir, plus a Python audit hook that refuses sockets,
signals, new processes and writes outside that dir. Much weaker: the sample runs as the calling user
and reads whatever that user may read, and a ctypes call gets around the hook (and could then reach
the checker's process, so even the pass is forgeable there). Every result records its `method`.

Checking a function (`run_check`): the sample's code runs in one sandbox and the checker (the test
and its asserts, trusted) in another, each its own process and pid namespace. The checker calls the
sample's function through a pipe: arguments go over as tagged JSON of plain values, the return value
comes back the same way (a subclass of a builtin type as that type's value) and is rebuilt only as
exact builtin types (int, float, str, list, dict ...), never as an object of the sample's making. The verdict is the checker's exit status; the sample's
process never holds it, never sees the test's expected values, and cannot reach the checker's
process: whatever it prints, however it exits, and whatever it finds in its own memory, it can only
answer calls, and it passes only if its answers satisfy the asserts.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

from pipeline.scoring.bwrap import bwrap_command, clean_env, interpreter_mounts
from pipeline.errors import UserError

TAIL_CHARS = 2000
MAX_REPLY_BYTES = 16 << 20  # one return value, encoded
INSTALL_HINT = "sudo apt-get install -y bubblewrap (or `make sandbox-deps`)"

# Values crossing between the checker and the sample: JSON of tagged plain values, exact types only.
CODEC = r'''
import json as _json
def _enc(v):
    # builtin types and their subclasses, as the base type's value (a Counter crosses as a dict, a str
    # subclass with an always-true __eq__ as its characters); anything else is refused
    if v is None or v is True or v is False:
        return v
    if isinstance(v, int):
        return ["i", hex(int.__index__(v))]
    if isinstance(v, float):
        return ["f", float.hex(float.__float__(v))]
    if isinstance(v, complex):
        return ["c", float.hex(complex.real.__get__(v)), float.hex(complex.imag.__get__(v))]
    if isinstance(v, str):
        return ["s", str.__str__(v)]
    if isinstance(v, bytes):
        return ["y", bytes.hex(v)]
    for base, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F")):
        if isinstance(v, base):
            return [tag, [_enc(x) for x in base.__iter__(v)]]
    if isinstance(v, dict):
        return ["d", [[_enc(k), _enc(x)] for k, x in dict.items(v)]]
    raise TypeError(f"a {type(v).__name__} cannot cross the sandbox (plain values only: int, float, str, list, dict, ...)")
def _dec(v):
    if v is None or type(v) is bool:
        return v
    if type(v) is not list or not v or type(v[0]) is not str:
        raise ValueError("malformed value from the other side of the sandbox")
    tag, rest = v[0], v[1:]
    if tag in ("i", "f", "s", "y") and len(rest) == 1 and type(rest[0]) is str:
        return {"i": lambda s: int(s, 16), "f": float.fromhex, "s": str, "y": bytes.fromhex}[tag](rest[0])
    if tag == "c" and len(rest) == 2 and all(type(x) is str for x in rest):
        return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
    if tag in ("l", "t", "S", "F") and len(rest) == 1 and type(rest[0]) is list:
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](_dec(x) for x in rest[0])
    if tag == "d" and len(rest) == 1 and type(rest[0]) is list and all(type(p) is list and len(p) == 2 for p in rest[0]):
        return {_dec(k): _dec(x) for k, x in rest[0]}
    raise ValueError("malformed value from the other side of the sandbox")
'''


# Runs first inside the sandbox; reads the code from stdin so nothing is written to the host disk.
# argv: memory cpu fsize nproc method role [fd_in fd_out name]. Roles: "run" executes the code;
# "serve" defines the sample's function `name` and answers the checker's calls; "check" runs the
# trusted checker, where `__sample_function__` calls the sample's function over the pipe.
BOOTSTRAP = CODEC + f"MAX_REPLY = {MAX_REPLY_BYTES}\n" + r'''
import builtins, os, resource, sys
memory, cpu, fsize, nproc = (int(v) for v in sys.argv[1:5])
bwrap, role = sys.argv[5] == "bwrap", sys.argv[6]
code = sys.stdin.read()
if role != "run":
    channel_in, channel_out, name = os.fdopen(int(sys.argv[7]), "rb"), os.fdopen(int(sys.argv[8]), "wb"), sys.argv[9]
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
if bwrap and os.getuid() == 0:  # the stdlib stays readable: only its own directories are mounted
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
if not bwrap:
    home = os.path.realpath(os.getcwd())
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    def _outside(path):
        return isinstance(path, (str, bytes)) and not os.path.realpath(os.fsdecode(path)).startswith(home + os.sep)
    def _refuse(event, args):
        if event.startswith(("socket.", "subprocess.", "os.fork", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                             "os.kill", "os.killpg", "signal.pthread_kill")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args[2] & writes and _outside(args[0]) or \
                event in ("os.remove", "os.rmdir", "os.rename", "os.mkdir", "shutil.rmtree") and _outside(args[0]):
            raise PermissionError(f"sandbox: {event} outside the sandbox's directory is not allowed")
        if event == "open" and isinstance(args[0], (str, bytes)) and os.fsdecode(args[0]).startswith("/proc/"):
            raise PermissionError("sandbox: /proc (other processes' environments) is not readable")
    sys.addaudithook(_refuse)
if role == "run":
    exec(compile(code, "<sample>", "exec"), {"__name__": "__main__"})
elif role == "serve":
    namespace = {"__name__": "__main__"}
    exec(compile(code, "<sample>", "exec"), namespace)
    function = namespace.get(name)
    while line := channel_in.readline():
        try:
            _, args, kwargs = _json.loads(line)
            reply = ["ok", _enc(function(*_dec(args), **_dec(kwargs)))]
        except Exception as exc:
            try:
                reply = ["raised", type(exc).__name__, str(exc)[:500]]
            except Exception:
                reply = ["raised", "Exception", ""]
        channel_out.write(_json.dumps(reply).encode() + b"\n")
        channel_out.flush()
else:
    class SampleError(RuntimeError):
        """The sample's function raised something that is not a builtin exception, or did not answer."""

    def _call_sample(*args, **kwargs):
        channel_out.write(_json.dumps(["call", _enc(list(args)), _enc(dict(kwargs))]).encode() + b"\n")
        channel_out.flush()
        line = channel_in.readline(MAX_REPLY + 1)
        if not line.endswith(b"\n"):
            raise SampleError("the sample's process ended, or sent no complete answer")
        reply = _json.loads(line)
        if type(reply) is list and len(reply) == 2 and reply[0] == "ok":
            return _dec(reply[1])
        if type(reply) is list and len(reply) == 3 and reply[0] == "raised" and all(type(x) is str for x in reply[1:]):
            kind = getattr(builtins, reply[1], None)  # a builtin Exception type only: never SystemExit
            kind = kind if isinstance(kind, type) and issubclass(kind, Exception) else SampleError
            raise kind(f"raised in the sample: {reply[1]}: {reply[2]}")
        raise SampleError("malformed answer from the sample's process")

    exec(compile(code, "<checker>", "exec"), {"__name__": "__main__", "__sample_function__": _call_sample})
'''


# seconds this process has spent running sandboxed code (run_python and run_check): the code suite's scoring
# time, which `quantize eval` reports apart from the engine's
SECONDS = [0.0]


@dataclass(frozen=True)
class SandboxResult:
    passed: bool  # exit code 0, within time and output limits
    exit_code: int | None
    timed_out: bool
    stdout_tail: str
    stderr_tail: str
    method: str
    output_capped: bool = False
    seconds: float = 0.0


@dataclass(frozen=True)
class CheckResult:
    passed: bool  # the trusted checker exited 0 within time and output limits
    method: str
    timed_out: bool
    output_capped: bool
    checker_exit_code: int | None
    checker_stderr_tail: str  # which assert failed, or why the sample did not answer
    sample_stdout_tail: str
    sample_stderr_tail: str
    seconds: float = 0.0


class SandboxUnavailable(UserError):
    """bubblewrap is missing or cannot build the sandbox, and running without it was not allowed."""


# ----------------------------------------------------------------------------------------------
# which method, and whether the caller allows the weak one

_allow_unsandboxed = False


@contextlib.contextmanager
def allow_unsandboxed(allowed: bool = True):
    """Within this block, code runs under rlimits+audit where bubblewrap is unusable (else it refuses)."""
    global _allow_unsandboxed
    previous, _allow_unsandboxed = _allow_unsandboxed, bool(allowed)
    try:
        yield
    finally:
        _allow_unsandboxed = previous


def require_isolation(*, allowed: bool, setting: str) -> str:
    """The method samples will run under; refuses (exit 2) when it is not bubblewrap and `allowed` is off.
    `setting` names the params key that allows it, for the message."""
    method = available_method()
    if method != "bwrap" and not allowed:
        raise SandboxUnavailable(
            f"model-written code needs the bubblewrap sandbox, which is unusable here ({bwrap_problem()}). "
            f"Install it: {INSTALL_HINT}. To run the code without isolation anyway (it can then read "
            f"your files and forge its own pass), set params.yaml {setting}: true; the report marks those results"
        )
    return method


def _resolve(method: str | None) -> str:
    if method is not None:
        return method
    return require_isolation(allowed=_allow_unsandboxed, setting="suites.<suite>.allow_unsandboxed")


@lru_cache(maxsize=1)
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot build the sandbox on this machine, or None when it can."""
    if shutil.which("bwrap") is None:
        return "no `bwrap` on PATH"
    try:
        mounts = interpreter_mounts()
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return f"cannot list what the interpreter needs: {exc}"
    probe = bwrap_command(1 << 20, mounts) + ["-I", "-S", "-c", "print('ok')"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=20, env=clean_env(), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap did not start: {exc}"
    if done.returncode != 0 or done.stdout.strip() != "ok":
        return f"bwrap failed: {(done.stderr.strip() or done.stdout.strip())[-300:] or f'exit {done.returncode}'}"
    return None


def available_method() -> str:
    """'bwrap' when bubblewrap can build the sandbox on this machine, else 'rlimits+audit'."""
    return "bwrap" if bwrap_problem() is None else "rlimits+audit"


# ----------------------------------------------------------------------------------------------
# processes

def _spawn(method: str, role: str, limits: list[str], workdir: str, max_file_mb: int,
           channel: tuple[int, int, str] | None = None) -> subprocess.Popen:
    extra = [str(channel[0]), str(channel[1]), channel[2]] if channel else []
    if method == "bwrap":
        command = bwrap_command(4 * (max_file_mb << 20)) + ["-I", "-S", "-c", BOOTSTRAP, *limits, role, *extra]
        cwd, env = None, clean_env()
    else:
        command = [os.path.realpath(sys.executable), "-I", "-S", "-c", BOOTSTRAP, *limits, role, *extra]
        cwd, env = workdir, {**clean_env(), "HOME": workdir, "TMPDIR": workdir}
    return subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, pass_fds=channel[:2] if channel else ())


def _feed(proc: subprocess.Popen, code: str) -> None:
    try:
        proc.stdin.write(code.encode())
        proc.stdin.close()
    except BrokenPipeError:  # died before reading its code
        pass


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(procs: list[subprocess.Popen], until_closed: list[subprocess.Popen], timeout_s: float,
             max_output_bytes: int) -> tuple[dict, bool, bool]:
    """Read every process's stdout and stderr (tails kept) until those of `until_closed` are at EOF,
    the deadline passes or the output, all processes together, passes the cap.
    Returns ({stream: bytes}, timed_out, capped)."""
    buffers = {stream: bytearray() for proc in procs for stream in (proc.stdout, proc.stderr)}
    waiting = {stream for proc in until_closed for stream in (proc.stdout, proc.stderr)}
    total, timed_out, capped = 0, False, False
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        for stream in buffers:
            os.set_blocking(stream.fileno(), False)
            selector.register(stream, selectors.EVENT_READ)
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in selector.select(min(remaining, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    waiting.discard(key.fileobj)
                    continue
                total += len(chunk)
                buffer = buffers[key.fileobj]
                buffer += chunk
                del buffer[:-TAIL_CHARS * 4]  # keep only the tail in memory
            if total > max_output_bytes:
                capped = True
                break
    return {stream: bytes(data) for stream, data in buffers.items()}, timed_out, capped


def _finish(proc: subprocess.Popen) -> int:
    _kill_tree(proc)
    exit_code = proc.wait()
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    return exit_code


def _workdir():
    return tempfile.TemporaryDirectory(prefix="sandbox-", ignore_cleanup_errors=True)


def run_python(code: str, timeout_s: float = 10.0, memory_mb: int = 512, *, max_output_bytes: int = 1 << 20,
               max_file_mb: int = 16, max_processes: int = 32, method: str | None = None) -> SandboxResult:
    """Execute `code` in a fresh sandboxed Python process; never raises for anything the code does.
    Raises SandboxUnavailable when bubblewrap is unusable and `allow_unsandboxed` is not in effect
    (an explicit `method` skips that check)."""
    method = _resolve(method)
    limits = [str(memory_mb << 20), str(int(timeout_s) + 1), str(max_file_mb << 20), str(max_processes), method]
    started = time.monotonic()
    with _workdir() as workdir:
        proc = _spawn(method, "run", limits, workdir, max_file_mb)
        try:
            _feed(proc, code)
            output, timed_out, capped = _collect([proc], [proc], timeout_s, max_output_bytes)
        finally:
            exit_code = _finish(proc)
    exit_code = None if timed_out or capped else exit_code
    SECONDS[0] += time.monotonic() - started
    return SandboxResult(
        passed=exit_code == 0, exit_code=exit_code, timed_out=timed_out,
        stdout_tail=_tail(output[proc.stdout]), stderr_tail=_tail(output[proc.stderr]), method=method,
        output_capped=capped, seconds=round(time.monotonic() - started, 3),
    )


def run_check(sample: str, function: str, checker: str, timeout_s: float = 10.0, memory_mb: int = 512, *,
              max_output_bytes: int = 1 << 20, max_file_mb: int = 16, max_processes: int = 32,
              method: str | None = None) -> CheckResult:
    """Run the trusted `checker` code against the function named `function` that the untrusted
    `sample` code defines, each in its own sandbox; in the checker, the global `__sample_function__`
    calls the sample's function over a pipe (plain values only, both ways). Passed only when the checker exits 0 in time: the sample
    cannot reach that process. Never raises for anything the sample does (SandboxUnavailable as in
    `run_python`)."""
    if not function.isidentifier():
        raise ValueError(f"{function!r} is not a Python name")
    method = _resolve(method)
    limits = [str(memory_mb << 20), str(int(timeout_s) + 1), str(max_file_mb << 20), str(max_processes), method]
    started = time.monotonic()
    with _workdir() as sample_dir, _workdir() as checker_dir:
        to_sample_r, to_sample_w = os.pipe()
        to_checker_r, to_checker_w = os.pipe()
        try:
            server = _spawn(method, "serve", limits, sample_dir, max_file_mb, (to_sample_r, to_checker_w, function))
            try:
                checker_proc = _spawn(method, "check", limits, checker_dir, max_file_mb,
                                      (to_checker_r, to_sample_w, function))
            except BaseException:
                _finish(server)
                raise
        finally:
            for fd in (to_sample_r, to_sample_w, to_checker_r, to_checker_w):
                os.close(fd)  # each end now lives in one child only: a dead side reads as EOF on the other
        try:
            _feed(server, sample)
            _feed(checker_proc, checker)
            output, timed_out, capped = _collect([server, checker_proc], [checker_proc], timeout_s, max_output_bytes)
        finally:
            exit_codes = [_finish(server), _finish(checker_proc)]
    checker_exit = None if timed_out or capped else exit_codes[1]
    SECONDS[0] += time.monotonic() - started
    return CheckResult(
        passed=checker_exit == 0, method=method, timed_out=timed_out, output_capped=capped,
        checker_exit_code=checker_exit, checker_stderr_tail=_tail(output[checker_proc.stderr]),
        sample_stdout_tail=_tail(output[server.stdout]), sample_stderr_tail=_tail(output[server.stderr]),
        seconds=round(time.monotonic() - started, 3),
    )


def _tail(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")[-TAIL_CHARS:]
