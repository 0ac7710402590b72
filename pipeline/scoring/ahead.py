"""Work started ahead of its stage: a model's evaluation and judging begin in the background as soon as its server
is up, while DVC runs the stages before them; the stage that owns the results collects them.

DVC runs one stage at a time. On the GPU profile the servers of the models start as soon as each checkpoint exists
(engine.warm_servers) and then sat idle while the quantize and KL stages ran, and the evaluate stages scored one
model at a time: most of the H200 unused. With engine.score_ahead (the GPU profile), `quantize warm` and the first
evaluate or judge stage start, for every model whose server is up or starting, the very command its stage will run
(`quantize eval models/X`, `quantize judge models/X`) as a job in the background, owned by the run as its servers
are (it ends with the run: a cut `dvc repro` call leaves it working for the next). When DVC reaches the stage, the
stage waits for that job (a lock the job holds while it works), then runs as it always does: the suites the job
scored are current (same inputs) and kept, and whatever the job could not finish (a suite whose data did not exist
yet, a failure) the stage scores itself and reports as always. The results are the files the stage would have
written, from the same inputs; only when they were computed changes, and the stage log says so (`ahead`).

`quantize bench` waits until no job of the run is working (wait_quiet): its speed figures need the GPU to itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline.runs import alive, run_owner, start_time, started_environment

AHEAD_ENV = "QUANTIZE_AHEAD"  # set in a job: the stage name it works ahead of (e.g. evaluate@base)
KINDS = {"eval": "evaluate", "judge": "judge"}  # command -> the DVC stage it works ahead of


def _jobs_dir() -> Path:
    from pipeline.engines.server_registry import JOBS, registry_dir

    return registry_dir() / JOBS


def _name(kind: str, model_dir: Path) -> str:
    return f"{kind}-{hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16]}"


def in_job() -> bool:
    return bool(os.environ.get(AHEAD_ENV))


@contextlib.contextmanager
def owned(kind: str, model_dir: Path, wait: bool = True):
    """Holds the (kind, model) lock while the work runs: a stage waits for a job working ahead of it (wait) and
    yields the seconds it waited; a job (wait False) yields None when the stage or another job has the work."""
    folder = _jobs_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{_name(kind, model_dir)}.lock", "a+") as handle:
        began = time.monotonic()
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = 0.0
        except BlockingIOError:
            if not wait:
                yield None
                return
            import logging

            logging.getLogger(__name__).info(f"{KINDS[kind]}: waiting for the work started ahead on {model_dir}")
            fcntl.flock(handle, fcntl.LOCK_EX)
            waited = time.monotonic() - began
        try:
            yield waited
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def start(kind: str, model_dir: Path, params_file: Path) -> str | None:
    """Starts `quantize KIND MODEL_DIR` in the background as a job of this run, unless one runs already or this
    process is a job itself. Returns the job's log path, or None."""
    if in_job():
        return None
    owner_pid, owner_started, _ = run_owner()
    if owner_pid == os.getpid():
        return None  # no run: nothing would collect it
    folder = _jobs_dir()
    folder.mkdir(parents=True, exist_ok=True)
    entry_path = folder / f"{_name(kind, model_dir)}.json"
    entry = _read(entry_path)
    if entry and alive(entry.get("pid"), entry.get("started")):
        return None
    done = _read(entry_path.with_suffix(".done")) or {}
    if done.get("complete") and done.get("owner") == [owner_pid, owner_started]:
        return None  # a job of this run did all of it: the stage will find it current
    stage = f"{KINDS[kind]}@{Path(model_dir).name}"
    if recorded_current(stage):
        return None  # DVC ran it already: work ahead would only write its outputs again, and DVC would rerun it
    log = Path("results") / Path(model_dir).name / f"{kind}.ahead.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # the environment the stage was started with, not os.environ after torch and the console added their variables:
    # a job started with those had its own key for the run's warm interpreter, and started one that served nothing
    env = {**started_environment(), AHEAD_ENV: stage, "QUANTIZE_RUN_PID": str(owner_pid)}
    env.pop("DVC_STAGE", None)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli.launcher", kind, str(model_dir), "--params",
                                 str(params_file)], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    threading.Thread(target=proc.wait, daemon=True).start()  # reaped if it ends before we do
    entry = {"kind": kind, "model": str(model_dir), "stage": stage, "pid": proc.pid, "started": start_time(proc.pid),
             "owner_pid": owner_pid, "log": str(log), "began_at": round(time.time(), 2)}
    tmp = entry_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry))
    tmp.replace(entry_path)
    return str(log)


def recorded_current(stage: str, lock: Path = Path("dvc.lock")) -> bool:
    """Whether dvc.lock records `stage` with every output still as it recorded it (size and md5, the way DVC hashes
    a file): DVC has run it, and a job ahead of it would rewrite its outputs (a judge's timings, a summary's
    seconds), which makes the next `dvc repro` run it again. A stage whose outputs changed, or that the lock does not
    hold (a fix added to a finished run), is not. Its inputs are not compared: a stage whose inputs changed runs in
    its turn, without the head start."""
    try:
        import yaml

        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        recorded = ((yaml.load(lock.read_text(), Loader=loader) or {}).get("stages") or {}).get(stage)
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        return False
    outs = recorded.get("outs") if isinstance(recorded, dict) else None
    if not outs:
        return False
    for out in outs:
        path = Path(str(out.get("path") or ""))
        if not path.is_file() or out.get("md5") is None or path.stat().st_size != out.get("size"):
            return False
        digest = hashlib.md5(usedforsecurity=False)
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != out["md5"]:
            return False
    return True


def finished(kind: str, model_dir: Path, complete: bool) -> None:
    """In a job, at its end: whether it did all of its stage's work (complete: a later job would find nothing to
    do, so none is started again in this run) or left some for later (a suite whose data was not written yet)."""
    if not in_job():
        return
    owner_pid, owner_started, _ = run_owner()
    path = _jobs_dir() / f"{_name(kind, model_dir)}.done"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"complete": bool(complete), "owner": [owner_pid, owner_started]}))
    tmp.replace(path)


def running() -> list[dict]:
    """The jobs of the registry still working."""
    from pipeline.engines.server_registry import running_jobs

    return running_jobs()


def wait_quiet(timeout: float = 3600.0) -> float:
    """Waits until no job works (a speed measurement needs the GPU to itself); returns the seconds waited."""
    began = time.monotonic()
    while running() and time.monotonic() - began < timeout:
        time.sleep(0.5)
    return time.monotonic() - began


def end_with_the_run() -> None:
    """In a job: stop (as a cut stage stops, SIGINT) when the run that owns it ends."""
    if not in_job():
        return
    owner_pid, owner_started, _ = run_owner()

    def watch() -> None:
        while alive(owner_pid, owner_started):
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
