"""One measurement of a GPU benchmark part: run it, record its result or its failure (a failure is not
fatal, so the other measurements still report), print a line, and rewrite the part's JSON under $OUT so
that a part cut short by the device's time limit still brings back what it measured."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Callable


def step(results: dict, out_file: Path, name: str, fn: Callable[[], object]) -> None:
    started = time.perf_counter()
    try:
        results[name] = fn()
        status = "ok"
    except Exception as exc:  # noqa: BLE001 - report every failure and go on
        traceback.print_exc()
        results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        status = "FAILED"
    print(f"[{status}] {name} in {time.perf_counter() - started:.0f} s: {json.dumps(results[name], default=str)[:400]}",
          flush=True)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(results, indent=1, default=str))
