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


def free_gpu_of_idle_servers(what: str) -> None:
    """A stage that loads a model in-process (quantize, kl) first stops the vLLM servers the run keeps idle
    (pipeline/engines/shared.py): they hold most of the GPU's memory. The GPU profile's dvc.yaml runs these
    stages before any served one, so this only acts when a run resumes in another order."""
    from pipeline.engines import shared

    if not shared.entries():
        return
    with shared.locked():
        stopped = shared.stop_idle(keep=0)
    if stopped:
        log.info(f"{what}: stopped {len(stopped)} idle vLLM server(s) to free the GPU for an in-process model")
