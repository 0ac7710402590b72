"""A run's stages fork from its warm interpreter (pipeline/cli/launcher.py, pipeline/cli/forkserver.py), with
real processes: the `quantize` console script of this environment, a process standing for the run (`dvc repro`,
named by QUANTIZE_RUN_PID), real signals."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import write_params
from pipeline.cli.forkserver import preload
from pipeline.cli.launcher import LOG_DIR, forkserver_key, socket_dir
from pipeline.runs import alive

QUANTIZE = Path(sys.executable).parent / "quantize"


@pytest.fixture
def project(tmp_path):
    write_params(tmp_path)
    return tmp_path


def quantize(project, run, *args, env=None, wait=True):
    full = {**os.environ, "QUANTIZE_RUN_PID": str(run.pid), "QUANTIZE_STAGE_LOG": str(project / "stages.jsonl"),
            **(env or {})}
    proc = subprocess.Popen([str(QUANTIZE), *args], cwd=project, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def server_up(project, seconds=120.0) -> Path:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        keys = [log.stem for log in (project / LOG_DIR).glob("*.log")]
        sockets = [socket_dir() / f"{key}.sock" for key in keys if (socket_dir() / f"{key}.sock").exists()]
        if sockets:
            return sockets[0]
        time.sleep(0.2)
    logs = "".join(p.read_text() for p in (project / LOG_DIR).glob("*.log"))
    raise AssertionError(f"no fork server came up: {logs}")


def forked_child(project, marker: str) -> int:
    """The pid of the child the fork server made for the command whose arguments hold `marker`."""
    log = next((project / LOG_DIR).glob("*.log"))
    deadline = time.monotonic() + 60
    while marker not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    return int(log.read_text().split(" child ")[-1].split(":")[0])


def records(project) -> list[dict]:
    lines = [json.loads(line) for line in (project / "stages.jsonl").read_text().splitlines()]
    return [line for line in lines if line.get("event") != "begin"]  # a stage's end record, not its start


@pytest.mark.slow
def test_a_runs_commands_fork_from_its_warm_interpreter_and_end_as_their_own_process_would(project, run, tiny_llama):
    first = quantize(project, run, "show-verdict", "missing.json")
    assert first[0] == 2 and "missing.json: no verdict yet" in first[2]
    server_up(project)
    second = quantize(project, run, "show-verdict", "missing.json")
    assert second == first  # exit code, stdout and stderr as the command gave them in a process of its own
    ok = quantize(project, run, "eval", str(tiny_llama), "--suite", "ppl-book", "--limit", "1", "--out", "r")
    assert ok[0] == 0 and "eval: r/ppl-book.jsonl (1 items" in ok[1], ok
    assert [r["forked"] for r in records(project)] == [False, True, True]
    assert [r["exit"] for r in records(project)] == [2, 2, 0]
    assert records(project)[-1]["wall_s"] > 0  # counted from when the launcher started, not the fork

    proc = quantize(project, run, "eval", str(tiny_llama), "--suite", "math", "--limit", "40", "--out", "slow",
                    wait=False)
    child = forked_child(project, "--out slow")
    assert alive(child, None)
    proc.send_signal(signal.SIGKILL)  # the launcher killed: its command must not run on without it
    proc.wait()
    deadline = time.monotonic() + 30
    while alive(child, None) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(child, None)

    sock = server_up(project)
    run.kill()  # the run ends: so does its warm interpreter
    run.wait()
    deadline = time.monotonic() + 30
    while sock.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not sock.exists()


def test_a_signal_to_the_launcher_reaches_the_forked_command(project, run, tiny_llama):
    quantize(project, run, "show-verdict", "missing.json")
    server_up(project)
    proc = quantize(project, run, "eval", str(tiny_llama), "--suite", "math", "--limit", "600", "--out", "cut",
                    wait=False)
    forked_child(project, "--out cut")
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)  # what a cut `dvc repro` does to its stage
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and not (project / "cut" / "math.jsonl").exists(), (out, err)


def test_without_a_run_or_when_disabled_commands_run_in_their_own_process(project, run):
    assert quantize(project, run, "show-verdict", "x.json", env={"QUANTIZE_FORKSERVER": "0"})[0] == 2
    outside = subprocess.run([str(QUANTIZE), "show-verdict", "x.json"], cwd=project, capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items() if k != "QUANTIZE_RUN_PID"})
    assert outside.returncode == 2
    time.sleep(1)
    assert not (project / LOG_DIR).exists()


def test_a_warm_interpreter_whose_preloading_asked_cuda_anything_does_not_fork(tmp_path, monkeypatch):
    """A child forked after CUDA was initialized cannot use the GPU: a module that asks torch.cuda anything when it
    is imported (llm-compressor does: not preloaded) stops the preloading, and the server would refuse."""
    (tmp_path / "asks_cuda.py").write_text("import torch\nGPU = torch.cuda.is_available()\n")
    (tmp_path / "plain.py").write_text("import torch\nX = torch.zeros(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert preload(("plain", "asks_cuda", "json")) == ([], "asks_cuda")
    assert preload(("plain", "no_such_module_here")) == (["no_such_module_here"], None)
    import torch

    assert torch.cuda.is_available.__module__ == "torch.cuda"  # the watch is undone


def test_the_server_is_keyed_by_the_run_and_the_environment_its_modules_saw(monkeypatch):
    key = forkserver_key(1234, 99)
    assert forkserver_key(1234, 99) == key and forkserver_key(1235, 99) != key
    monkeypatch.setenv("DVC_STAGE", "evaluate@base")  # differs per stage: not in the key
    assert forkserver_key(1234, 99) == key
    monkeypatch.setenv("QUANTIZE_AHEAD", "judge@fp8-w8a8")  # a job scoring ahead of its stage: the run's server too
    assert forkserver_key(1234, 99) == key
    monkeypatch.setenv("HF_HOME", "/elsewhere")  # read by modules at import: another server
    assert forkserver_key(1234, 99) != key


def test_make_demos_in_process_dvc_repro_is_the_run_its_stages_belong_to(tmp_path):
    """`make demo` runs `python -m pipeline.cli.repro` (dvc repro in-process, pipeline/cli/repro.py): a stage under it
    finds it as its run (so its commands fork from the run's warm interpreter), not itself."""
    import yaml

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("QUANTIZE_RUN_PID", None)
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=tmp_path, env=env, check=True)
    probe = "import json; from pipeline.runs import run_owner; print(json.dumps(run_owner()))"
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"probe": {
        "cmd": f"{sys.executable} -c '{probe}' > owner.json", "outs": ["owner.json"]}}}))
    repro = subprocess.Popen([sys.executable, "-m", "pipeline.cli.repro"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = repro.communicate(timeout=300)
    assert repro.returncode == 0, out
    pid, _, what = json.loads((tmp_path / "owner.json").read_text())
    assert pid == repro.pid and what == f"QUANTIZE_RUN_PID (pid {repro.pid})"
