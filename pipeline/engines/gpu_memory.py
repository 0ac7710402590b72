"""The GPU's memory as nvidia-smi reports it (the whole device, every process's use counted), without a CUDA
context in this process: a stage that only talks to a server, or decides whether one more fits, loads no CUDA.

Standard library only.
"""

from __future__ import annotations

import os
import shutil
import subprocess

GIB = 1 << 30


def _query(field: str) -> int | None:
    """One field of nvidia-smi's --query-gpu for the first GPU, in bytes (it reports MiB); None without it."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return int(out[0]) << 20 if out else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def device_memory_bytes(device_memory_gib: float | None = None) -> int | None:
    """One GPU's memory: engine.device_memory_gib when set, else nvidia-smi's."""
    if device_memory_gib:
        return int(float(device_memory_gib) * GIB)
    return _query("memory.total")


def device_memory_free_bytes() -> int | None:
    """Free memory of the first GPU, every process's use counted; None without nvidia-smi."""
    return _query("memory.free")


def used_by_process_group() -> dict[int, int] | None:
    """GPU memory in use per process group (nvidia-smi's per-process figures, summed by each process's group): a vLLM
    server's engine core is a child of `vllm serve`, which starts its own group, so a server's whole footprint is its
    group's entry. None without nvidia-smi; processes gone or not ours (another PID namespace) are left out."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    used: dict[int, int] = {}
    for line in out.splitlines():
        try:
            pid, mib = (int(x) for x in line.split(","))
            group = os.getpgid(pid)
        except (ValueError, ProcessLookupError, PermissionError):
            continue
        used[group] = used.get(group, 0) + (mib << 20)
    return used
