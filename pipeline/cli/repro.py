"""How `make demo` runs the pipeline and ends: `dvc repro` with DVC's own progress lines left out, and one closing
line of times.

    python -m pipeline.cli.repro [ARGS]                # dvc repro ARGS: each stage's one line (and its bar); of
                                                       # DVC's own output, its warnings and errors only
    python -m pipeline.cli.repro --times FILE STARTED  # the closing line: the wall time since STARTED (a Unix
                                                       # time) and the CPU time of the stages FILE records

`dvc repro` itself prints, for every stage, "Running stage 'x':", "> quantize x", "Updating lock file
'dvc.lock'" and blank lines around the stage's own line, and "Use `dvc push` ..." at the end; `dvc repro -q`
drops those and DVC's errors with them. Here DVC runs in this process with its loggers at WARNING and its
screen output (`ui`) off: a DVC error (a missing dependency, a broken dvc.lock) is still said.

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
from pathlib import Path

DVC_LOGGERS = ("dvc", "dvc_objects", "dvc_data")


def repro(args: list[str]) -> int:
    """`dvc repro ARGS` in this process: DVC's warnings and errors, none of its info lines or screen output."""
    from dvc.cli import main
    from dvc.ui import ui

    from pipeline.runs import RUN_PID_ENV

    # this process is the run its stages belong to (they look for a `dvc repro` process, which this one is not by
    # name): their commands fork from the run's warm interpreter, its shared servers live as long as it does
    os.environ.setdefault(RUN_PID_ENV, str(os.getpid()))
    ui.enable = lambda: None  # main() turns it on unless --quiet, which would also drop DVC's errors
    for name in DVC_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    return main(["repro", *args])


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
    sys.exit(repro(sys.argv[1:]))


if __name__ == "__main__":
    main()
