"""Run untrusted (model-written) Python in a throwaway sandbox: one fresh process per sample.

Preferred method, "bwrap" (bubblewrap): new network, pid, ipc, uts and cgroup namespaces; the host
filesystem read-only; a private size-capped tmpfs as /tmp, cwd and HOME; /run and the caller's HOME
hidden; a cleared environment. Inside, a small bootstrap sets rlimits (address space, CPU, file
size, processes, open files, no core dumps) and, when started as root, drops to uid nobody before
it executes the sample: root ignores RLIMIT_NPROC, nobody does not, so a fork bomb stalls at the
limit. On a timeout or too much output the whole process group is killed; bwrap's pid 1 dies with
it and the kernel kills everything left in the pid namespace.

Fallback where bubblewrap is missing or cannot create namespaces, "rlimits+audit": the same
rlimits and scrubbed environment in a private temp dir, plus a Python audit hook that refuses
sockets and new processes. Weaker (a ctypes call gets around the hook), hence recorded in every
result as `method`.
"""

from __future__ import annotations

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
from pathlib import Path

TAIL_CHARS = 2000
SANDBOX_PYTHON = "/run/python"  # where the interpreter's install is mounted inside bwrap
SANDBOX_HOME = "/tmp/work"

# Runs first inside the sandbox; reads the sample from stdin so nothing is written to the host disk.
BOOTSTRAP = r"""
import os, resource, sys
memory, cpu, fsize, nproc = (int(v) for v in sys.argv[1:5])
bwrap = sys.argv[5] == "bwrap"
code = sys.stdin.read()
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
if bwrap and os.getuid() == 0:  # the stdlib stays readable: bwrap mounts it outside root's HOME
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
if not bwrap:
    home = os.path.realpath(os.getcwd())
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    def _outside(path):
        return isinstance(path, (str, bytes)) and not os.path.realpath(os.fsdecode(path)).startswith(home + os.sep)
    def _refuse(event, args):
        if event.startswith(("socket.", "subprocess.", "os.fork", "os.exec", "os.posix_spawn", "os.spawn", "os.system")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args[2] & writes and _outside(args[0]) or \
                event in ("os.remove", "os.rmdir", "os.rename", "os.mkdir", "shutil.rmtree") and _outside(args[0]):
            raise PermissionError(f"sandbox: {event} outside the sandbox's directory is not allowed")
        if event == "open" and isinstance(args[0], (str, bytes)) and os.fsdecode(args[0]).startswith("/proc/"):
            raise PermissionError("sandbox: /proc (other processes' environments) is not readable")
    sys.addaudithook(_refuse)
exec(compile(code, "<sample>", "exec"), {"__name__": "__main__"})
"""


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


def _python_install() -> tuple[Path, Path]:
    """The interpreter's install root and the interpreter's path inside it (stdlib only is needed)."""
    prefix = Path(os.path.realpath(sys.base_prefix))
    executable = Path(os.path.realpath(sys.executable))
    try:
        return prefix, executable.relative_to(prefix)
    except ValueError:  # a venv whose python lives outside base_prefix: mount its own install instead
        return executable.parent.parent, executable.relative_to(executable.parent.parent)


def _bwrap_command(tmpfs_bytes: int) -> list[str]:
    prefix, relative = _python_install()
    command = [
        "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
        "--tmpfs", "/run", "--ro-bind", str(prefix), SANDBOX_PYTHON,
        "--size", str(tmpfs_bytes), "--perms", "0755", "--tmpfs", "/tmp",  # writable: /tmp/work only
        "--perms", "1777", "--dir", SANDBOX_HOME, "--chdir", SANDBOX_HOME,
        "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent", "--new-session", "--clearenv",
        "--setenv", "HOME", SANDBOX_HOME, "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
    ]
    home = os.path.realpath(os.path.expanduser("~"))
    if home not in ("/", "/tmp", "/run"):
        command += ["--tmpfs", home]  # secrets in the caller's HOME stay out of reach
    if os.geteuid() != 0:
        command.append("--unshare-user")  # unprivileged bwrap needs a user namespace
    return command + ["--", f"{SANDBOX_PYTHON}/{relative}"]


@lru_cache(maxsize=1)
def available_method() -> str:
    """'bwrap' when bubblewrap can build the sandbox on this machine, else 'rlimits+audit'."""
    if shutil.which("bwrap") is None:
        return "rlimits+audit"
    probe = _bwrap_command(1 << 20) + ["-I", "-S", "-c", "print('ok')"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=20, env=_clean_env(), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return "rlimits+audit"
    return "bwrap" if done.returncode == 0 and done.stdout.strip() == "ok" else "rlimits+audit"


def _clean_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(proc: subprocess.Popen, code: str, timeout_s: float, max_output_bytes: int):
    """Feed the code, read both pipes up to the cap; returns (stdout, stderr, timed_out, capped)."""
    proc.stdin.write(code.encode())
    proc.stdin.close()
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    total, timed_out, capped = 0, False, False
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        for stream in buffers:
            os.set_blocking(stream.fileno(), False)
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in selector.select(min(remaining, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                total += len(chunk)
                buffer = buffers[key.fileobj]
                buffer += chunk
                del buffer[:-TAIL_CHARS * 4]  # keep only the tail in memory
            if total > max_output_bytes:
                capped = True
                break
    return buffers[proc.stdout], buffers[proc.stderr], timed_out, capped


def run_python(code: str, timeout_s: float = 10.0, memory_mb: int = 512, *, max_output_bytes: int = 1 << 20,
               max_file_mb: int = 16, max_processes: int = 32, method: str | None = None) -> SandboxResult:
    """Execute `code` in a fresh sandboxed Python process; never raises for anything the code does."""
    method = method or available_method()
    limits = [str(memory_mb << 20), str(int(timeout_s) + 1), str(max_file_mb << 20), str(max_processes), method]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sandbox-", ignore_cleanup_errors=True) as workdir:
        if method == "bwrap":
            command, cwd, env = _bwrap_command(4 * (max_file_mb << 20)), None, _clean_env()
            command += ["-I", "-S", "-c", BOOTSTRAP, *limits]
        else:
            command, cwd = [sys.executable, "-I", "-S", "-c", BOOTSTRAP, *limits], workdir
            env = {**_clean_env(), "HOME": workdir, "TMPDIR": workdir}
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            stdout, stderr, timed_out, capped = _collect(proc, code, timeout_s, max_output_bytes)
        except BrokenPipeError:  # died before reading its code
            stdout, stderr, timed_out, capped = b"", b"", False, False
        finally:
            _kill_tree(proc)
            exit_code = proc.wait()
            for stream in (proc.stdout, proc.stderr):
                stream.close()
    exit_code = None if timed_out or capped else exit_code
    return SandboxResult(
        passed=exit_code == 0, exit_code=exit_code, timed_out=timed_out,
        stdout_tail=_tail(stdout), stderr_tail=_tail(stderr), method=method,
        output_capped=capped, seconds=round(time.monotonic() - started, 3),
    )


def _tail(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")[-TAIL_CHARS:]
