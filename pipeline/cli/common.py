"""What every `quantize` subcommand shares: the --params option, the `stage` wrapper (a UserError becomes a
message and exit code 2; QUANTIZE_STAGE_LOG records what the stage cost), loading params.yaml, the
checks made before any work (outputs that overlap inputs, a checkpoint no stage could load), and freeing
the GPU of idle vLLM servers before an in-process model loads. pipeline/cli/app.py registers the commands."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import sys
from pathlib import Path

import typer

from pipeline.settings import params as params_mod
from pipeline.errors import UserError, cut

log = logging.getLogger("pipeline.cli.app")

PARAMS_OPTION = typer.Option(Path("params.yaml"), "--params", help="Parameter file every default comes from.")


def stage(func):
    """Turns UserError into a clean message and exit code 2; inside dvc repro, where the stage's output goes to its
    log (pipeline/console.py), any other failure into one line naming the log (the traceback is there) and exit
    code 1; with QUANTIZE_STAGE_LOG set, appends what the stage cost to that file (one JSON line: _record_stage)."""
    from pipeline import console

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        code = 1
        _record_begin()
        try:
            result = func(*args, **kwargs)
            code = 0
            return result
        except UserError as exc:
            code = exc.exit_code
            console.error(f"error: {exc}")
            raise typer.Exit(exc.exit_code) from None
        except typer.Exit as exc:
            code = exc.exit_code
            raise
        except Exception as exc:
            if (refused := _refused_write_message(exc)) is not None:  # a full disk, a file-size limit, no permission
                code = UserError.exit_code
                console.error(f"error: {refused}")
                raise typer.Exit(code) from None
            if console.log_path() is None:
                raise  # the traceback on the terminal, as Python prints it
            import traceback

            traceback.print_exc()  # into the log
            first = cut((str(exc).strip().splitlines() or [""])[0], 200)
            console.error(f"error: {os.environ.get('DVC_STAGE') or 'quantize'} failed: {type(exc).__name__}: {first}")
            raise typer.Exit(1) from None
        finally:
            _record_stage(code)
    return wrapper


def _refused_write_message(exc: BaseException) -> str | None:
    """The one line for a write the file system refused that no writer of pipeline/outputs.py named (a log, a cache,
    a library's own file): the file, the reason and the way out; None for any other failure."""
    from pipeline.errors import WRITE_ERRNOS, refused_fix, refused_write, write_refused

    found = refused_write(exc)
    if found is None:
        return None
    code, filename = found
    if filename and code in (errno.EACCES, errno.EPERM):  # a read or a write: the file, either way
        return (f"{filename}: {WRITE_ERRNOS[code]}; make it readable (and, for an output, writable) for you or "
                "choose another path, then run the command again")
    if filename:
        return str(write_refused(exc, Path(filename), "the file"))
    said = cut(str(exc).strip().splitlines()[0], 200) if str(exc).strip() else type(exc).__name__
    return (f"{os.environ.get('DVC_STAGE') or 'the command'} stopped: a write was refused ({WRITE_ERRNOS[code]}): "
            f"{said}; {refused_fix(code).replace(' there', ' where it writes')}, then run the command again")


WORK_SECONDS = [0.0]  # what this command spent working (quantizing, scoring, judging, benchmarking ...)
AHEAD_WAIT = [0.0]  # what this stage spent waiting for the job working ahead of it (pipeline/scoring/ahead.py)


@contextlib.contextmanager
def collecting_ahead(kind: str, model_dir: Path, p, params_file: Path):
    """A whole-model evaluate or judge stage's work. In a stage: the run's servers are warmed and, for the other
    models, their work started ahead of their stages (pipeline/scoring/ahead.py); then a job working ahead of this stage is
    waited for (its results are then current and kept); yields True. In a job: yields whether the work is its own
    (False: its stage or another job has it, nothing to do); the job ends with the run."""
    from pipeline.scoring import ahead

    if not ahead.in_job():
        warm_run_servers(p)
        start_ahead(p, params_file, exclude=(kind, model_dir))
    with ahead.owned(kind, model_dir, wait=not ahead.in_job()) as waited:
        if waited is None:
            typer.echo(f"{kind}: {model_dir} is being worked on by its stage or another job: nothing to do here")
            yield False
            return
        AHEAD_WAIT[0] += waited
        if ahead.in_job():
            ahead.end_with_the_run()
        yield True


@contextlib.contextmanager
def working():
    """Counts the enclosed stage call as work, less any engine start in it (a model load, a server start or
    the wait for one): QUANTIZE_STAGE_LOG's `work_s`, against which a run's fixed costs are measured."""
    import time

    from pipeline.engines import STARTS, engine_start_seconds

    before, began = len(STARTS), time.perf_counter()
    try:
        yield
    finally:
        WORK_SECONDS[0] += max(0.0, time.perf_counter() - began - engine_start_seconds(before))


def _append_stage_log(line: dict) -> None:
    import os

    path = os.environ.get("QUANTIZE_STAGE_LOG")
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps(line) + "\n")
    except OSError as exc:
        logging.getLogger("pipeline.cli.app").warning(f"QUANTIZE_STAGE_LOG={path}: cannot append ({exc.strerror})")


def _record_begin() -> None:
    """{"event": "begin", "stage", "command", "began_at"}: a stage cut before it could record its end (SIGKILL)
    still counts, from here to the end of the call that cut it (benchmarks/gpu_dvc_repro.py)."""
    import os
    import time

    if os.environ.get("QUANTIZE_STAGE_LOG"):
        started = os.environ.get("QUANTIZE_STAGE_STARTED")  # the `quantize` launcher's start, in a forked stage
        _append_stage_log({"event": "begin", "stage": os.environ.get("DVC_STAGE") or os.environ.get("QUANTIZE_AHEAD"),
                           "ahead": bool(os.environ.get("QUANTIZE_AHEAD")), "command": sys.argv[1:],
                           "began_at": round(float(started) if started else time.time(), 3)})


def _record_stage(code: int) -> None:
    """{"stage" (DVC's stage name, under dvc repro), "command", "wall_s" (since the process started, imports
    included; in a fork of the run's warm interpreter, since the `quantize` launcher started), "engine_start_s"
    (model loads and server starts, and waits for a server another stage or warm started; 0 for an attach to
    one that was up), "engines", "work_s" (working: `working`), "cpu_s" (_cpu_seconds), "exit"}."""
    import os
    import time

    if not os.environ.get("QUANTIZE_STAGE_LOG"):
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
    from pipeline.engines import PEAK_IN_FLIGHT, STALLS

    ahead_of = os.environ.get("QUANTIZE_AHEAD")  # a job working ahead of this stage (pipeline/scoring/ahead.py)
    line = {"stage": os.environ.get("DVC_STAGE") or ahead_of, "ahead": bool(ahead_of),
            "ahead_wait_s": round(AHEAD_WAIT[0], 2), "command": sys.argv[1:], "wall_s": round(wall, 2) if wall else None,
            "engine_start_s": engine_start_seconds(), "engines": [{**s, "seconds": round(s["seconds"], 2)}
                                                                   for s in STARTS],
            "work_s": round(WORK_SECONDS[0], 2), "cpu_s": _cpu_seconds(),
            "forked": bool(os.environ.get("QUANTIZE_STAGE_STARTED")),  # from the run's warm interpreter
            "in_flight": dict(PEAK_IN_FLIGHT), "stalls": list(STALLS),  # pipeline/engines/inflight.py
            "exit": code, "ended": time.strftime("%Y-%m-%dT%H:%M:%S"), "ended_at": round(time.time(), 3)}
    _append_stage_log(line)


def _cpu_seconds() -> float:
    """CPU seconds (user and system) this process and the children it waited for used: in a fork of the run's
    warm interpreter, since the fork."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return round(own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime, 2)


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


def make_room_on_gpu(what: str, models: list[Path], factor: float, last: Path | None = None) -> None:
    """Before a stage loads models in-process on the GPU: the run's GPU memory (pipeline/engines/gpu_room.py) makes
    room for `factor` x the models' weights, stopping idle servers (`last`'s, the base's, after every other) and
    then work started ahead, and saying which."""
    from pipeline.engines import gpu_room

    gpu_room.room_for_models(what, models, factor, last)


def builds_to_come(root: Path | None = None) -> list[str]:
    """What the run still has to load on the GPU in-process, read from the project's files when asked, not from DVC's
    order: each model dvc.yaml's evaluate stage lists (every variant, each fix its fix stage lists) without its
    checkpoint, and each one whose KL its kl and rank stages measure without results/<model>/kl.json; e.g.
    ["quantize rtn-w4a16", "kl fp8-w8a8"]. Empty once every build is done: the run serves only. It reads no params.yaml
    key (a served stage's params are what its results depend on, not when it runs)."""
    from pipeline import safe_yaml
    from pipeline.outputs import STAGE_RECORD
    from pipeline.settings import fixes
    from pipeline.settings.checks import evaluates_every_suite, fix_items, runs_command

    root = root or Path(".")
    try:
        data, _ = safe_yaml.load(root / "dvc.yaml", "a dvc.yaml")
        stages = data.get("stages") if isinstance(data, dict) else None
    except (UserError, OSError):
        stages = None
    stages = stages if isinstance(stages, dict) else {}
    listed = lambda test: [str(item) for stage in stages.values() if test(stage)  # noqa: E731
                           and isinstance(stage.get("foreach"), list) for item in stage["foreach"]]
    built_by_fix = {fixes.fix_name(v): v for v in fix_items(stages)}
    models = [m for m in dict.fromkeys(listed(evaluates_every_suite)) if m != "base"]
    measured = dict.fromkeys(listed(lambda stage: runs_command(stage, "kl")))  # the kl and rank stages
    return ([f"fix {built_by_fix[m]}" if m in built_by_fix else f"quantize {m}" for m in models
             if not (root / "models" / m / STAGE_RECORD).is_file()]
            + [f"kl {m}" for m in measured if not (root / "results" / m / "kl.json").is_file()])


def warm_run_servers(p) -> list[str]:
    """engine.warm_servers, inside a run: start in the background the shared server of every checkpoint under
    models/ that a stage has finished (its .stage.json), as warm_server does for one. Returns the models whose
    server it started. (It reads no params.yaml key but `engine`: the served stages that call it declare that.)"""
    from pipeline.outputs import STAGE_RECORD

    if not getattr(p.engine, "warm_servers", False):  # a setting of the engines that start servers (vllm)
        return []
    models = sorted((record.parent for record in Path("models").glob(f"*/{STAGE_RECORD}")),
                    key=lambda model: (model.name != "base", model.name))  # the base first: every judge needs it
    pending = builds_to_come()
    return [m.name for m in models if warm_server(p, m, pending).startswith("started")]


def warm_server(p, model_dir: Path, pending: list[str] | None = None, name: str | None = None) -> str:
    """engine.warm_servers, inside a run (a `dvc repro` above this stage, or QUANTIZE_RUN_PID): start the run's
    shared server for this checkpoint in the background, up to engine.max_servers, so that its start overlaps
    the stages that run meanwhile instead of the stage that needs it; the stage that asks for it attaches. While
    the run has builds to come (`builds_to_come`, or `pending` when the caller has it: stages that load a model on
    the GPU in-process) a start must leave engine.build_memory_fraction of the GPU free; each server takes
    gpu_memory_utilization of it (a planned KV pool: pipeline/engines/vllm.py). Says what it did; never fails a
    stage: the stage that asks for the server says what is wrong with it."""
    import os

    from pipeline.engines import capability, shared, warm
    from pipeline.outputs import STAGE_RECORD

    e, name = p.engine, name or Path(model_dir).name
    if not getattr(e, "warm_servers", False):  # a setting of the engines that start servers (vllm)
        return "not started: engine.warm_servers is false"
    if not capability(e.name, "starts_server"):
        return f"not started: engine {e.name} starts no server"
    if shared.run_owner()[0] == os.getpid():
        return "not started: not inside a run (a server started now would end with this command)"
    if not (Path(model_dir) / STAGE_RECORD).is_file():
        return f"not started: {model_dir} is not built yet"
    if Path(model_dir).name == "base":  # its server, idle, is stopped for room after every other
        shared.keep_last(model_dir)
    pending = builds_to_come() if pending is None else pending
    if not _room_for_a_server(p, Path(model_dir), building=bool(pending)):
        return (f"not started: the GPU has no room for it yet, leaving engine.build_memory_fraction free for "
                f"{', '.join(pending[:3])}{' ...' if len(pending) > 3 else ''} (its stages start it when they need it)"
                if pending else "not started: the GPU has no room for it yet (its stages start it when they need it)")
    try:
        key = warm(e.name, model_dir, e, log_path=Path("results") / name / "vllm-server.log")
    except (UserError, OSError) as exc:
        return f"not started: {exc}"
    if key is None:
        return "not started: its server is up or starting already, or engine.max_servers are up"
    log.info(f"started the vLLM server of {name} in the background (engine.warm_servers)")
    return f"started the vLLM server of {model_dir} in the background (key {key})"


def start_ahead(p, params_file: Path, exclude: tuple[str, Path] | None = None) -> list[str]:
    """engine.score_ahead, inside a run: for the base and every variant whose server is up or starting, start its
    evaluation, and for every variant whose server and the base's are, its judging (a base-judged pairwise judge
    on that engine), in the background (pipeline/scoring/ahead.py), but `exclude` (the work this stage does itself). Jobs
    use servers already up or starting only: none starts a server, so the GPU's room is what warm left it.
    Returns what it started, e.g. ["eval base", "judge awq-w4a16"]."""
    from pipeline.scoring import ahead
    from pipeline.engines import capability, shared
    from pipeline.outputs import STAGE_RECORD
    from pipeline.settings import fixes

    e = p.engine
    if not (getattr(e, "score_ahead", False) and capability(e.name, "starts_server")) or ahead.in_job():
        return []
    served = {Path(entry.get("model_path") or "") for entry in shared.entries().values()}
    base = Path(p.model.base_dir)
    models = [base] + [Path("models") / name for name in fixes.models(p)[1:]]  # the variants and their fixes
    jobs = [("eval", m) for m in models if (m / STAGE_RECORD).is_file() and m.resolve() in served]
    judging = (capability(p.judge.backend, "starts_server") and p.judge.model == "base" and base.resolve() in served
               and (p.calib.out / "holdout.jsonl").is_file())
    jobs += [("judge", m) for kind, m in list(jobs) if judging and m != base]
    skip = (exclude[0], Path(exclude[1]).resolve()) if exclude else None
    return [f"{kind} {m.name}" for kind, m in jobs
            if (kind, m.resolve()) != skip and ahead.start(kind, m, params_file)]


def _room_for_a_server(p, model_dir: Path, building: bool) -> bool:
    """Whether this checkpoint's server fits now (pipeline/engines/gpu_room.py), leaving build_memory_fraction of the
    GPU free while in-process stages are still to come (building): its planned memory (fitted), else
    gpu_memory_utilization of the GPU."""
    from pipeline.engines import gpu_memory, gpu_room
    from pipeline.engines.vllm_server import server_memory

    e = p.engine
    total = gpu_memory.device_memory_bytes(e.device_memory_gib)
    if total is None:
        return True
    share = server_memory(model_dir, e)["gpu_bytes"] or e.gpu_memory_utilization * total
    return gpu_room.room_for_server(int(share), budget_fraction=e.gpu_memory_utilization,
                                    keep_fraction=e.build_memory_fraction if building else 0.0,
                                    device_memory_gib=e.device_memory_gib)
