"""The run's GPU memory, one owner: what each server holds (planned, then measured), whether one more fits, and room
made for a stage that loads a model on the GPU in its own process.

- **Servers, measured.** Each shared server is planned a share (pipeline/engines/server_plan.py, fitted to the card)
  and started with it; its supervisor then reads its process group's memory from nvidia-smi once it is ready and
  every few seconds while it serves (server_registry.record_memory). A server is counted at the larger of its plan and
  the most it was measured to hold (server_registry.held_bytes), so one that grows under load (a vision-language
  model's images) is counted as it is, and a checkpoint's server started again is planned at what it was seen to
  hold. `quantize warm` prints the run's plan with those figures.
- **Room for a server** (`room_for_server`): an early start (engine.warm_servers) fits beside what is on the GPU now,
  and leaves engine.build_memory_fraction free while in-process stages are still to come.
- **Room for a stage** (`make_room`): a stage that loads a model in its own process (quantize, fix, kl and its
  ranking, bench's bandwidth probe) asks for the bytes it needs. Idle servers stop first, least recently used first,
  `last` (the base, or the model the stage is about to serve) after every other; then, if that is not enough, the
  work started ahead of its stage (pipeline/scoring/ahead.py: it stops as a cut stage stops, and its stage finishes
  it) and the servers it held, and last a server still starting that nothing waits for any more. What was stopped is
  said; what still holds the GPU is `holders()`.

Standard library only (nvidia-smi through gpu_memory): no torch, no CUDA context.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from pipeline.engines import gpu_memory
from pipeline.engines.gpu_memory import GIB
from pipeline.engines.server_registry import (end_process, entries, held_bytes, locked, measured_memory, registry_dir,
                                              running_jobs, stop_idle)
from pipeline.runs import alive

log = logging.getLogger(__name__)
JOB_STOP_S = 120.0  # how long a job interrupted for room may take to stop (it writes what it scored so far)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _name(entry: dict) -> str:
    return Path(entry.get("model_path") or entry.get("model") or "?").name


def holders(registry: Path | None = None) -> str:
    """What holds the GPU now, in words: each server of the run with what it was measured to hold (or planned), and
    the GPU's memory in use beside them; '' without nvidia-smi."""
    registry = registry or registry_dir()
    total, free = gpu_memory.device_memory_bytes(), gpu_memory.device_memory_free_bytes()
    if total is None or free is None:
        return ""
    servers = []
    for key, entry in entries(registry).items():
        measured = measured_memory(registry, key).get("used_bytes")
        held = f"{_gib(measured)} measured" if measured else f"{_gib(int(entry.get('gpu_bytes') or 0))} planned"
        servers.append(f"{_name(entry)}'s server {held}")
    jobs = [f"{j.get('kind')} {_name(j)}" for j in running_jobs(registry)]
    return (f"{_gib(total - free)} of {_gib(total)} in use"
            + (f": {', '.join(servers)}" if servers else ", no server of this run")
            + (f"; working ahead on them: {', '.join(jobs)}" if jobs else ""))


def make_room(what: str, need_bytes: int, *, last: Path | str | None = None, registry: Path | None = None) -> list[str]:
    """Frees the GPU until need_bytes are free for `what` (a stage's in-process work): idle servers first, `last`'s
    after every other, then the jobs working ahead and their servers, then servers still starting that no lease or
    job waits for. Returns what it stopped, in words (logged);
    [] when the room was there or there is no GPU to free. It never fails: the caller checks what it got (free
    memory) and says what is wrong, with `holders()`."""
    registry = registry or registry_dir()
    free = gpu_memory.device_memory_free_bytes()
    if free is None or free >= need_bytes or not (entries(registry) or running_jobs(registry)):
        return []
    last = str(Path(last).resolve()) if last else None
    stopped: list[str] = []

    def stop_idle_servers(starting: bool = False) -> int | None:
        with locked(registry):
            while entries(registry):
                now = gpu_memory.device_memory_free_bytes()
                if now is None or now >= need_bytes:
                    return now
                found = entries(registry)
                names = {k: _name(e) for k, e in found.items()}
                gone = stop_idle(registry, keep=len(names) - 1, last=last, keep_working=True, starting=starting)
                if not gone:
                    break
                stopped.extend(f"{names[k]}'s server ({'starting' if found[k].get('state') == 'starting' else 'idle'})"
                               for k in gone)
        return gpu_memory.device_memory_free_bytes()

    free = stop_idle_servers()
    # the jobs whose model is `last` go after every other (its server is the one the stage keeps)
    for job in sorted(running_jobs(registry), key=lambda j: str(Path(j.get("model") or "").resolve()) == last):
        if free is None or free >= need_bytes:
            break
        if _interrupt(job):
            stopped.append(f"the {job.get('kind')} of {_name(job)} started ahead (its stage finishes it)")
        free = stop_idle_servers()
    if free is not None and free < need_bytes:
        # last, a server still starting that no stage or job is waiting for any more (its job was stopped above):
        # the H100 run of 2026-12-07 refused kl --rank beside AWQ's server, started for the evaluation working ahead
        # and still loading when that job was stopped; its stage starts it again when it needs it
        free = stop_idle_servers(starting=True)
    if stopped:
        log.info(f"{what}: to free {_gib(need_bytes)} of GPU memory, stopped {', '.join(stopped)}; "
                 f"{_gib(free or 0)} free now")
    return stopped


def _interrupt(job: dict) -> bool:
    """Stops a job working ahead (SIGINT to its process group: it ends as a cut stage ends, keeping what it scored)
    and waits for it; True once it is gone."""
    pid, started = job.get("pid"), job.get("started")
    if not alive(pid, started):
        return False
    return end_process(pid, started, signal.SIGINT, JOB_STOP_S, group=True, poll=0.2)


def room_for_models(what: str, models: list[Path], factor: float, last: Path | None = None) -> list[str]:
    """make_room for a stage whose peak is `factor` x its models' weights (measured on the H200: AWQ ~1.5x, FP8 ~2.3x
    of a 9B checkpoint; quantize and fix ask 2.5x)."""
    weights = sum(f.stat().st_size for m in models for f in Path(m).glob("*.safetensors"))
    return make_room(what, int(factor * weights), last=last)


def room_for_server(server_bytes: int, *, budget_fraction: float, keep_fraction: float,
                    device_memory_gib: float | None = None, registry: Path | None = None) -> bool:
    """Whether a server planned at server_bytes fits now, leaving keep_fraction of the GPU free (the builds still to
    come: engine.build_memory_fraction, else 0): the GPU's free memory less the servers still starting (not all of
    their memory taken yet, each counted at its plan or measured size), and within budget_fraction of the GPU
    (engine.gpu_memory_utilization) beside the servers up, each counted at what it holds. Without nvidia-smi: yes."""
    registry = registry or registry_dir()
    total, free = gpu_memory.device_memory_bytes(device_memory_gib), gpu_memory.device_memory_free_bytes()
    if total is None or free is None:
        return True
    current = entries(registry)
    starting = {k: e for k, e in current.items() if e.get("state") == "starting"}
    pending = sum(max(0, int(e.get("gpu_bytes") or budget_fraction * total)
                      - int(measured_memory(registry, k).get("used_bytes") or 0)) for k, e in starting.items())
    within_budget = held_bytes(current, registry) + server_bytes <= budget_fraction * total
    return within_budget and free - pending - server_bytes >= keep_fraction * total
