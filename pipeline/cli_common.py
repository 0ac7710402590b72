"""What every `quantize` subcommand shares: the --params option, the `stage` wrapper (a UserError becomes a
message and exit code 2; QUANTIZE_STAGE_LOG records what the stage cost), loading params.yaml, the
checks made before any work (outputs that overlap inputs, a checkpoint no stage could load), and freeing
the GPU of idle vLLM servers before an in-process model loads. pipeline/cli.py registers the commands."""

from __future__ import annotations

import functools
import json
import logging
import sys
from pathlib import Path

import typer

from pipeline import params as params_mod
from pipeline.errors import UserError

log = logging.getLogger("pipeline.cli")

PARAMS_OPTION = typer.Option(Path("params.yaml"), "--params", help="Parameter file every default comes from.")


def stage(func):
    """Turns UserError into a clean message and exit code 2; with QUANTIZE_STAGE_LOG set, appends what the
    stage cost to that file (one JSON line: _record_stage)."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        code = 1
        try:
            result = func(*args, **kwargs)
            code = 0
            return result
        except UserError as exc:
            code = exc.exit_code
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(exc.exit_code) from None
        except typer.Exit as exc:
            code = exc.exit_code
            raise
        finally:
            _record_stage(code)
    return wrapper


def _record_stage(code: int) -> None:
    """{"stage" (DVC's stage name, under dvc repro), "command", "wall_s" (since the process started, imports
    included), "engine_start_s" (model loads and server starts; 0 for an attach), "engines", "exit"}."""
    import os
    import time

    path = os.environ.get("QUANTIZE_STAGE_LOG")
    if not path:
        return
    from pipeline.engines import STARTS, engine_start_seconds

    try:
        if os.environ.get("QUANTIZE_STAGE_STARTED"):  # run in a fork of the run's warm interpreter: since the
            wall = time.time() - float(os.environ["QUANTIZE_STAGE_STARTED"])  # `quantize` launcher started
        else:
            ticks = os.sysconf("SC_CLK_TCK")
            stat = Path("/proc/self/stat").read_text()
            started = int(stat[stat.rindex(")") + 2:].split()[19]) / ticks
            wall = float(Path("/proc/uptime").read_text().split()[0]) - started
    except (OSError, ValueError):
        wall = None
    line = {"stage": os.environ.get("DVC_STAGE"), "command": sys.argv[1:], "wall_s": round(wall, 2) if wall else None,
            "engine_start_s": engine_start_seconds(), "engines": [{**s, "seconds": round(s["seconds"], 2)}
                                                                   for s in STARTS],
            "exit": code, "ended": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps(line) + "\n")
    except OSError as exc:
        log_warning = logging.getLogger("pipeline.cli")
        log_warning.warning(f"QUANTIZE_STAGE_LOG={path}: cannot append ({exc.strerror})")


def load_params(path: Path) -> params_mod.Params:
    return params_mod.load(path)


def refuse_overlap(out: Path, *, replaces: str | None = None, **inputs) -> None:
    """Before any work: the output must not be, contain or lie inside an input (keyword: its label); with
    `replaces` (the stage's name) an existing folder there must be that stage's output (outputs.check_replaceable)."""
    from pipeline.outputs import check_out

    check_out(out, {label.replace("_", " "): path for label, path in inputs.items()}, replaces=replaces)


def checked_model(model_dir: Path, weights: bool = True) -> Path:
    """The checkpoint refused before any work when no stage could load it as it says it is."""
    from pipeline.checkpoints import headers

    headers.check(model_dir, weights=weights)
    return model_dir


def free_gpu_of_idle_servers(what: str, need_bytes: int | None = None) -> None:
    """A stage that loads a model in-process (quantize, kl) first stops vLLM servers the run keeps idle
    (pipeline/engines/shared.py) when they leave the GPU less free memory than the stage needs (need_bytes;
    None: all of it), least recently used first. The GPU profile's dvc.yaml runs these stages before any served
    one, so only servers started early (engine.warm_servers, which leave engine.build_memory_fraction free) or a
    run resumed in another order meet this; on a machine without nvidia-smi there is no GPU to free."""
    from pipeline.engines import shared
    from pipeline.engines.vllm import device_memory_free_bytes

    if not shared.entries():
        return
    stopped = []
    with shared.locked():
        while shared.entries():
            free = device_memory_free_bytes()
            if free is None or (need_bytes is not None and free >= need_bytes):
                break
            gone = shared.stop_idle(keep=len(shared.entries()) - 1)
            if not gone:
                break
            stopped += gone
    if stopped:
        log.info(f"{what}: stopped {len(stopped)} idle vLLM server(s) to free the GPU for an in-process model")


def make_room_on_gpu(p, what: str, models: list[Path], factor: float) -> None:
    """Before a stage loads models in-process on the GPU: idle servers go when the GPU has less free memory than
    `factor` x the models' weights (the stage's peak: measured on the H200, AWQ ~1.5x, FP8 ~2.3x of a 9B
    checkpoint, KL both models plus logits), then servers of checkpoints that exist start early (warm_run_servers,
    leaving engine.build_memory_fraction free)."""
    weights = sum(f.stat().st_size for m in models for f in Path(m).glob("*.safetensors"))
    free_gpu_of_idle_servers(what, int(factor * weights))
    warm_run_servers(p, BUILD)


BUILD, SERVE = "build", "serve"  # the phases of a run warm_run_servers is called in


def warm_run_servers(p, phase: str) -> list[str]:
    """engine.warm_servers, inside a run (a `dvc repro` above this stage, or QUANTIZE_RUN_PID): start in the
    background the shared server of every checkpoint the run's served stages will ask for that exists already
    (base, then the variants in params.yaml's order), up to engine.max_servers, so that a server's start
    overlaps the stages that run meanwhile instead of the stage that needs it. In the build phase (stages that
    load a model in-process may still come) a start must leave engine.build_memory_fraction of the GPU free;
    each server takes gpu_memory_utilization of it (planned KV pool: pipeline/engines/vllm.py). Returns the
    models whose server it started. Never fails a stage: the stage that asks for a server says what is wrong."""
    import os

    from pipeline.engines import capability, shared, warm
    from pipeline.outputs import STAGE_RECORD

    e = p.engine
    names = {name for name in (e.name, p.bench.engine or e.name, p.judge.backend) if capability(name, "starts_server")}
    if not e.warm_servers or not names or shared.run_owner()[0] == os.getpid():
        return []
    engine = e.name if e.name in names else sorted(names)[0]
    options = e.options(engine)
    models = [("base", Path(p.model.base_dir)), *((name, Path("models") / name) for name in p.variants)]
    started = []
    for name, model_dir in models:
        if not (model_dir / STAGE_RECORD).is_file() or not _room_for_a_server(e, phase):
            continue
        try:
            if warm(engine, model_dir, **{**options, "log_path": Path("results") / name / "vllm-server.log"}):
                started.append(name)
        except (UserError, OSError) as exc:
            log.debug(f"warm {model_dir}: {exc}")
    if started:
        log.info(f"started the vLLM server(s) of {', '.join(started)} in the background (engine.warm_servers)")
    return started


def _room_for_a_server(e, phase: str) -> bool:
    """Whether one more server (gpu_memory_utilization of the GPU) fits now, leaving build_memory_fraction of
    it free while in-process stages may still come; servers still starting are counted at their full share.
    Without nvidia-smi (no GPU here): yes."""
    from pipeline.engines.vllm import device_memory_bytes, device_memory_free_bytes

    from pipeline.engines import shared

    total, free = device_memory_bytes(e.options("vllm")), device_memory_free_bytes()
    if total is None or free is None:
        return True
    share = e.gpu_memory_utilization * total
    starting = len(shared.starting())  # may not have taken their memory yet: counted as if they had
    keep = e.build_memory_fraction * total if phase == BUILD else 0.0
    return free - starting * share - share >= keep
