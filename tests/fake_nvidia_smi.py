#!/usr/bin/env python3
"""nvidia-smi as the run's GPU memory reads it, for tests on a machine without a GPU (tests/test_gpu_room.py): the
GPU's total and what each process holds come from a JSON file (FAKE_NVIDIA_SMI_STATE: {"total_mib": N, "other_mib":
N, "pids": {"PID": MiB}}), which a test rewrites to make a server grow; a process that has exited holds nothing, so
stopping a server frees its memory as on a real GPU. Answers the two queries pipeline/engines/gpu_memory.py asks."""

import json
import os
import sys


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # a zombie (exited, not yet reaped) holds no GPU memory either
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: list[str]) -> int:
    state = json.loads(open(os.environ["FAKE_NVIDIA_SMI_STATE"]).read())
    pids = {int(p): int(m) for p, m in (state.get("pids") or {}).items() if alive(int(p))}
    total, used = int(state["total_mib"]), int(state.get("other_mib", 0)) + sum(pids.values())
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-")), "")
    if any(a.startswith("--query-compute-apps") for a in argv):
        for pid, mib in pids.items():
            print(f"{pid}, {mib}")
        return 0
    values = {"memory.total": total, "memory.free": max(0, total - used), "memory.used": used}
    print(", ".join(str(values[field]) for field in query.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
