"""How `make demo` (and `quantize repro`) runs the pipeline and ends: `dvc repro` with DVC's own progress lines left
out, named targets run in the order a whole run takes, and one closing line of times.

    python -m pipeline.cli.repro [ARGS]                # dvc repro ARGS: each stage's one line (and its bar); of
                                                       # DVC's own output, its warnings and errors only
    quantize repro [ARGS]                              # the same
    python -m pipeline.cli.repro --dvc-lines [ARGS]    # the same with DVC's own lines
    python -m pipeline.cli.repro --times FILE STARTED  # the closing line: the wall time since STARTED (a Unix
                                                       # time) and the CPU time of the stages FILE records

One run of a project at a time (pipeline/cli/run_lock.py): a second `quantize repro` or `make demo` while one runs
is refused, exit 2, naming the run that holds the project (PID, start time, command).

`dvc repro` itself prints, for every stage, "Running stage 'x':", "> quantize x", "Updating lock file
'dvc.lock'" and blank lines around the stage's own line, and "Use `dvc push` ..." at the end; `dvc repro -q`
drops those and DVC's errors with them. Here DVC runs in this process with its loggers at WARNING and its
screen output (`ui`) off: a DVC error (a missing dependency, a broken dvc.lock) is still said.

The order. A whole `dvc repro` runs the stages in the order dvc.yaml lists them, each one's upstream stages first
(DVC's post-order walk of its graph, whose nodes are in dvc.yaml's order): the GPU profile lists the stages that load
a model in-process before the served ones, and relies on that order, not on deps (a dep is what a stage reads).
With named targets DVC walks a subgraph whose nodes it iterates as a set when they are fewer than half the graph's
(networkx's filtered views), so the order of independent stages changes with PYTHONHASHSEED (seen: `warm@base` 2nd
to 4th of `dvc repro warm@base evaluate@base bench@base`). Here the targets' stages (with what they need, as DVC
collects them) run in the whole run's order instead: `dvc repro --single-item` of that list, which DVC runs in the
order given (treeverse/dvc#9675), each stage still rerun only when its deps, params or command changed.

The stages' CPU time comes from QUANTIZE_STAGE_LOG (pipeline/cli/common.py `_record_stage`: one JSON line per
stage, `cpu_s` among them): the stages run in forks of the run's warm interpreter (pipeline/cli/forkserver.py),
which is not a child of `make`, so `/usr/bin/time make demo` does not count them.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

DVC_LOGGERS = ("dvc", "dvc_objects", "dvc_data")


def repro(args: list[str], quiet: bool = True) -> int:
    """`dvc repro ARGS` in this process, named targets in the whole run's order (`ordered`); quiet: DVC's warnings
    and errors, none of its info lines or screen output."""
    from dvc.cli import main
    from dvc.ui import ui

    from pipeline.runs import RUN_PID_ENV

    # this process is the run its stages belong to (they look for a `dvc repro` process, which this one is not by
    # name): their commands fork from the run's warm interpreter, its shared servers live as long as it does
    os.environ.setdefault(RUN_PID_ENV, str(os.getpid()))
    # the stages' commands (`quantize ...`) are this environment's: found without an activated venv
    # (`.venv/bin/quantize repro` in a new shell)
    here = str(Path(sys.executable).parent.absolute())
    if here not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(filter(None, (here, os.environ.get("PATH"))))
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"dvc(\.|$)")  # pygtrie's, in DVC's trie
    for name in DVC_LOGGERS:  # DVC's own handler says them (`quantize repro`'s logging would say them twice)
        logging.getLogger(name).propagate = False
    if quiet and "--dry" not in args:  # a dry run's plan is DVC's "Running stage" lines: shown
        ui.enable = lambda: None  # main() turns it on unless --quiet, which would also drop DVC's errors
        for name in DVC_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    from pipeline.cli.run_lock import held
    from pipeline.errors import UserError

    try:
        with held():  # one run of a project at a time: a second is told who holds it
            return main(["repro", *ordered(args)])
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


def ordered(args: list[str]) -> list[str]:
    """`dvc repro` arguments whose targets run in the whole run's order: the targets replaced by every stage they
    need, in the order a whole `dvc repro` takes, with --single-item (DVC runs that list in the order given). Without
    targets, or with options that pick stages another way (--downstream, --pipeline, --all-pipelines, --single-item,
    --glob, --recursive), the arguments as they are."""
    from dvc.cli import parse_args

    try:
        parsed = parse_args(["repro", *args])
    except SystemExit:  # a bad option: DVC says so when it parses them again
        return args
    targets = list(parsed.targets or [])
    if not targets or any(getattr(parsed, flag, False) for flag in
                          ("downstream", "pipeline", "all_pipelines", "single_item", "glob", "recursive")):
        return args
    rest = [arg for arg in args if arg not in targets]
    return [*rest, "--single-item", *planned(targets)]


def planned(targets: list[str], root: Path | None = None) -> list[str]:
    """The stages `dvc repro TARGETS` runs (each target and its upstream stages), in a whole run's order."""
    from dvc.repo import Repo
    from dvc.repo.reproduce import collect_stages, get_active_graph, plan_repro

    with Repo(str(root) if root else None) as repo:
        graph = get_active_graph(repo.index.graph)
        wanted = set(plan_repro(graph, collect_stages(repo, targets)))
        return [stage.addressing for stage in plan_repro(graph) if stage in wanted]


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{int(seconds // 60)} min {int(seconds % 60)} s"


def times_line(stage_log: Path, started: float, now: float | None = None) -> str:
    """`make demo: 7 min 12 s; its 15 quantize commands used 11 min 3 s of CPU (1.5 cores on average)`."""
    wall = (now or time.time()) - started
    records = []
    if stage_log.is_file():
        for line in stage_log.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    cpu = sum(r.get("cpu_s") or 0.0 for r in records)
    if not records:
        return f"make demo: {_duration(wall)} (every stage was up to date)"
    return (f"make demo: {_duration(wall)}; its {len(records)} quantize command{'s' if len(records) != 1 else ''} "
            f"used {_duration(cpu)} of CPU ({cpu / max(wall, 1e-9):.1f} cores on average)")


def main() -> None:
    if sys.argv[1:2] == ["--times"]:
        print(times_line(Path(sys.argv[2]), float(sys.argv[3])))
        return
    if sys.argv[1:2] == ["--dvc-lines"]:  # DVC's own lines kept (benchmarks/gpu_dvc_repro.py's logs)
        sys.exit(repro(sys.argv[2:], quiet=False))
    sys.exit(repro(sys.argv[1:]))


if __name__ == "__main__":
    main()
