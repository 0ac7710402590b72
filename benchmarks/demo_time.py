"""`make demo` from a fresh clone, timed, and where its `dvc repro` spends what is not work (issue 32, item 5).

    python benchmarks/demo_time.py [--keep DIR]       # clones this checkout's HEAD, runs `make demo` there

Every stage appends what it cost to QUANTIZE_STAGE_LOG (pipeline/cli/common.py: its process's wall time from the
`quantize` launcher's start, its work, its engine start (model loads), whether it forked from the run's warm
interpreter); the time between one stage's end and the next one's start is DVC's (hashing outputs, checking
deps, writing dvc.lock). Prints a table and writes benchmarks/results/demo_time.json:

    make_demo_s, install_s (venv and the demo model), dvc_repro_s, stages [{name, wall_s, work_s,
    engine_start_s, overhead_s (wall - work - engine start: interpreter, imports, checks, writing), dvc_before_s,
    forked}], start_overhead_s and its share of dvc_repro_s (the stages' overhead; DVC's time apart)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "demo_time.json"


STAGE_LOG = Path(".cache") / "demo-commands.jsonl"  # the Makefile's STAGE_TIMES: what every command of the demo cost


def run_demo(clone: Path) -> tuple[float, str]:
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    started = time.perf_counter()
    done = subprocess.run(["make", "demo"], cwd=clone, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"make demo failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return seconds, done.stdout + done.stderr


def stages(stage_log: Path) -> list[dict]:
    rows, previous_end = [], None
    for line in stage_log.read_text().splitlines():
        r = json.loads(line)
        if r.get("event") == "begin":  # a stage's start (pipeline/cli/common.py); its end line follows
            continue
        began = r["ended_at"] - (r["wall_s"] or 0.0)
        gap = began - previous_end if previous_end is not None else 0.0
        previous_end = r["ended_at"]
        rows.append({"name": r["stage"] or " ".join(r["command"]), "stage": r["stage"], "wall_s": r["wall_s"],
                     "work_s": r["work_s"],
                     "engine_start_s": r["engine_start_s"], "forked": r.get("forked"),
                     "overhead_s": round(max(0.0, r["wall_s"] - r["work_s"] - r["engine_start_s"]), 2),
                     "dvc_before_s": round(max(0.0, gap), 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", default=None, help="clone into this folder and keep it (default: a temp folder)")
    args = parser.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="demo-time-"))
    if work.exists() and args.keep:
        shutil.rmtree(work)
    total, output = run_demo(work)
    # the demo's closing line (pipeline/cli/repro.py times_line): fetch-demo, dvc repro and show-verdict, after the install
    found = re.search(r"make demo: (?:(\d+) min )?(\d+) s", output)
    if found is None:
        raise SystemExit(f"make demo printed no closing line 'make demo: ...':\n{output[-2000:]}")
    dvc = 60.0 * int(found.group(1) or 0) + int(found.group(2))
    commands = stages(work / STAGE_LOG)
    rows = [r for r in commands if r["stage"]]  # dvc repro's stages (fetch-demo and show-verdict run outside it)
    overhead = sum(r["overhead_s"] for r in rows)
    figures = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs", "make_demo_s": round(total, 1),
        "install_s": round(total - dvc, 1), "dvc_repro_s": dvc, "stages": rows,
        "outside_dvc_repro": [r for r in commands if not r["stage"]],
        "work_s": round(sum(r["work_s"] for r in rows), 1),
        "engine_start_s": round(sum(r["engine_start_s"] for r in rows), 1),
        "start_overhead_s": round(overhead, 1), "start_overhead_share": round(overhead / dvc, 4),
        "dvc_between_stages_s": round(sum(r["dvc_before_s"] for r in rows), 1),
    }
    RESULTS.write_text(json.dumps(figures, indent=1) + "\n")
    print("| stage | wall s | work s | engine start s | overhead s | DVC before s | forked |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['wall_s']:.1f} | {r['work_s']:.1f} | {r['engine_start_s']:.1f} | {r['overhead_s']:.1f} | "
              f"{r['dvc_before_s']:.1f} | {r['forked']} |")
    print(f"\nmake demo {total:.0f} s (install and demo model {figures['install_s']:.0f} s, dvc repro {dvc:.0f} s); "
          f"start overhead {overhead:.1f} s = {overhead / dvc:.1%} of dvc repro; DVC between stages "
          f"{figures['dvc_between_stages_s']:.0f} s; {RESULTS}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
