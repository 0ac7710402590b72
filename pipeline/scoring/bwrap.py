"""The bubblewrap command line of the sandbox (pipeline/scoring/sandbox.py runs it): a root filesystem that holds
only what the interpreter needs to start (its executable, its standard library with site-packages
masked, the shared libraries `ldd` lists for it and its extension modules, `/etc/ld.so.cache`), a
minimal `/dev`, a size-capped tmpfs as /tmp with SANDBOX_HOME as cwd and HOME, new namespaces and a
cleared environment."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SANDBOX_HOME = "/tmp/work"


# ----------------------------------------------------------------------------------------------
# the sandbox's filesystem: the interpreter, its stdlib, the shared libraries they load

@dataclass(frozen=True)
class Mounts:
    executable: str
    directories: tuple[str, ...]  # the stdlib and lib-dynload, as the interpreter searches them
    masked: tuple[str, ...]  # site-packages and the like inside them: replaced by an empty tmpfs
    files: tuple[tuple[str, str], ...]  # (host path to read, path inside) for each shared library


# stdlib extension modules of no use without a display, a terminal or a directory service: their
# libraries (X11/Tk, ncurses, readline, NIS/Kerberos; two thirds of all) stay out, and each mount
# costs startup time in every sandbox
UNMOUNTED_EXTENSIONS = {"_tkinter", "_curses", "_curses_panel", "readline", "nis", "_dbm", "_gdbm"}
LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)\s*$")


@lru_cache(maxsize=1)
def interpreter_mounts() -> Mounts:
    """What the interpreter needs to start with -I -S and import any stdlib module: found by asking it
    for its search path and `ldd` for the libraries of the executable and of every extension module."""
    executable = os.path.realpath(sys.executable)  # a venv's python is a link to the base interpreter
    done = subprocess.run([executable, "-I", "-S", "-c", "import json, sys; print(json.dumps(sys.path))"],
                          capture_output=True, text=True, timeout=30, env=clean_env(), check=True)
    directories = tuple(p for p in json.loads(done.stdout) if os.path.isdir(p))
    if not directories:
        raise ValueError(f"{executable} reports no stdlib directory")
    masked = tuple(os.path.join(d, name) for d in directories for name in ("site-packages", "dist-packages")
                   if os.path.isdir(os.path.join(d, name)))
    extensions = sorted(str(p) for d in directories for p in Path(d).glob("*.so")
                        if p.name.split(".")[0] not in UNMOUNTED_EXTENSIONS)
    ldd = shutil.which("ldd")
    if ldd is None:
        raise ValueError("no `ldd` on PATH (Debian: libc-bin)")
    listed = subprocess.run([ldd, executable, *extensions], capture_output=True, text=True, timeout=60, env=clean_env())
    libraries = sorted({m.group(1) for line in listed.stdout.splitlines() if (m := LDD_LINE.match(line))})
    files = [(os.path.realpath(lib), lib) for lib in libraries if os.path.exists(lib)]
    if os.path.exists("/etc/ld.so.cache"):
        files.append(("/etc/ld.so.cache", "/etc/ld.so.cache"))
    return Mounts(executable, directories, masked, tuple(files))


def bwrap_command(tmpfs_bytes: int, mounts: Mounts | None = None) -> list[str]:
    mounts = mounts or interpreter_mounts()
    command = [
        shutil.which("bwrap") or "bwrap", "--dev", "/dev",  # by path: the children's PATH is /usr/bin:/bin
        "--size", str(tmpfs_bytes), "--perms", "0755", "--tmpfs", "/tmp",  # writable: /tmp/work only
        "--perms", "1777", "--dir", SANDBOX_HOME,
    ]
    targets = [mounts.executable, *mounts.directories, *(target for _, target in mounts.files)]
    parents = sorted({str(parent) for target in targets for parent in Path(target).parents} - {"/", "/tmp"})
    for parent in parents:  # traversable by nobody (bwrap would copy a 0700 /root from the host)
        command += ["--perms", "0755", "--dir", parent]
    command += ["--ro-bind", mounts.executable, mounts.executable]
    for directory in mounts.directories:
        command += ["--ro-bind", directory, directory]
    for directory in mounts.masked:
        command += ["--tmpfs", directory, "--remount-ro", directory]
    for source, target in mounts.files:
        command += ["--ro-bind", source, target]
    command += [
        "--chdir", SANDBOX_HOME,
        "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent", "--new-session", "--clearenv",
        "--setenv", "HOME", SANDBOX_HOME, "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
    ]
    if os.geteuid() != 0:
        command.append("--unshare-user")  # unprivileged bwrap needs a user namespace
    return command + ["--", mounts.executable]


def clean_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
