"""benchmarks/gpu_dvc_repro.py on the CPU (`--tiny`): the gpu-h200 profile's DAG with a tiny Glm and
tests/openai_server.py in vLLM's place, cut by its time budget and resumed by a second call, as the
H200 run is cut by the machine's 10-minute limit. Two stages serving one checkpoint share one server."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

DRIVER = REPO / "benchmarks" / "gpu_dvc_repro.py"
TARGETS = ["evaluate@base-math", "evaluate@base-ppl-book"]


def call(work, out, *args):
    env = {**os.environ, "OUT": str(out), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("QUANTIZE_SERVER_DIR", None)
    done = subprocess.run([sys.executable, str(DRIVER), "run", "--tiny", "--work", str(work), "--grace", "60",
                           "--target", *TARGETS, *args], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "gpu_dvc_repro.json").read_text()), done.stdout


@pytest.mark.slow
def test_the_driver_cuts_resumes_and_accounts_every_stage(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    first, _ = call(work, out, "--budget", "25")
    assert not first["done"] and first["cuts"] == 1 and first["resumed"] == 0
    done_before = {s["name"] for s in first["stages"] if s["finished"]}
    second, printed = call(work, out, "--budget", "800")
    assert second["done"] and second["resumed"] == 1 and "state: done" in printed
    stages = {s["name"]: s for s in second["stages"]}
    for name in ("resave", "calib", "quantize@awq-w4a16", "kl@rtn-w4a16", *TARGETS):
        assert stages[name]["finished"] and stages[name]["wall_s"] > 0, name
    for name in done_before:  # a finished stage is never run again
        assert stages[name]["attempts"] == 1, name
    math, book = stages["evaluate@base-math"], stages["evaluate@base-ppl-book"]
    assert math["server_starts"] + book["server_starts"] == 1  # one start for the model in this run ...
    assert math["server_attaches"] + book["server_attaches"] == 1  # ... the other stage attached
    assert second["engine_start_s"] > 0 and second["wall_s"] >= second["engine_start_s"]
    assert second["server_starts"] == 1 and second["run_holders"] == 1  # the run lived through the cut
    assert not list((work / "servers").glob("*.json"))  # the run ended: its server with it
    lines = (work / "project" / "results" / "base" / "math.json").read_text()
    assert json.loads(lines)["engine"] == "vllm"
