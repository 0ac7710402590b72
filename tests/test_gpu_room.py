"""The run's GPU memory (pipeline/engines/gpu_room.py) with real processes: servers are tests/openai_server.py started
through the shared registry's supervisors, stages are tests/shared_stage.py, the GPU is tests/fake_nvidia_smi.py on
PATH (each process's memory from a file the test rewrites: a server that grows after it started, a server stopped
that frees what it held)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.engines import gpu_room, server_plan, shared
from pipeline.engines.server_registry import held_bytes, measured_memory, model_peak_bytes

from shared_stage import SERVER
from test_shared_server import gone, stage

GIB_MIB = 1024  # MiB in a GiB: the fake nvidia-smi speaks MiB, as the real one does
H100_MIB = 81559


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """A fake 80 GB GPU on PATH; returns a function that sets what each pid holds (MiB) and what else is in use."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").symlink_to(Path(__file__).with_name("fake_nvidia_smi.py").resolve())
    state = tmp_path / "gpu.json"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_STATE", str(state))

    def hold(pids: dict[int, float], other_gib: float = 0.0) -> None:
        state.write_text(json.dumps({"total_mib": H100_MIB, "other_mib": int(other_gib * GIB_MIB),
                                     "pids": {str(p): int(g * GIB_MIB) for p, g in pids.items()}}))

    hold({})
    return hold


@pytest.fixture
def registry(tmp_path, monkeypatch):
    folder = tmp_path / "servers"
    monkeypatch.setenv(shared.REGISTRY_ENV, str(folder))
    monkeypatch.delenv(shared.RUN_PID_ENV, raising=False)
    yield folder
    for key, entry in shared.entries(folder).items():
        shared.stop_entry(folder, key, entry, wait=10)


def _wait(test, seconds=20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if test():
            return True
        time.sleep(0.2)
    return False


def _copy(tiny_llama, tmp_path, name):
    shutil.copytree(tiny_llama, tmp_path / name)
    return tmp_path / name


def test_a_server_is_measured_once_ready_and_counted_as_it_grows_under_load(tmp_path, tiny_llama, registry, run,
                                                                             gpu):
    """A vision-language model's server grew 15 % past its plan under images (H100, 2026-12-07): its supervisor reads
    nvidia-smi once it is ready and every few seconds after, and from then on the server counts at the most it was
    seen to hold, so the next server or an in-process stage is admitted against what is really on the GPU."""
    env = {shared.RUN_PID_ENV: str(run.pid)}
    planned = 30 << 30
    report, _ = stage(tiny_llama, tmp_path / "a.log", "--gpu-bytes", str(planned), "--gpu-budget", str(73 << 30),
                      "--max-servers", "3", env=env)
    key, pid = report["key"], report["server_pid"]
    gpu({pid: 28})  # below its plan when idle
    assert _wait(lambda: measured_memory(registry, key).get("used_bytes") == 28 << 30)
    assert held_bytes(shared.entries(registry), registry) == planned  # its plan, the larger
    gpu({pid: 36})  # under images: past its plan
    assert _wait(lambda: measured_memory(registry, key).get("peak_bytes") == 36 << 30)
    assert held_bytes(shared.entries(registry), registry) == 36 << 30
    assert model_peak_bytes(tiny_llama, registry) == 36 << 30  # a restart of this checkpoint is planned at it
    assert "past its planned 30.00 GiB" in (tmp_path / "a.log").read_text()
    # a second server of 40 GiB fits the budget (73) beside the plan (30), not beside what is held (36)
    assert not gpu_room.room_for_server(40 << 30, budget_fraction=0.92, keep_fraction=0.0)
    assert gpu_room.room_for_server(35 << 30, budget_fraction=0.92, keep_fraction=0.0)
    gpu({pid: 30})  # the peak stays: the allocator keeps what it took, and the next images take it again
    time.sleep(6)
    assert held_bytes(shared.entries(registry), registry) == 36 << 30


def test_the_plan_counts_a_measured_server_at_what_it_held_and_refits_who_runs_side_by_side():
    """The run's plan (`quantize warm`) re-fits from the servers' measured peaks: a base measured at 37 GiB no longer
    leaves room for two variants beside it in an H100's budget."""
    device = H100_MIB << 20
    base = server_plan.Share("base", 20 << 30, 40960, 5 << 30, 7 << 30, 196608)
    awq = server_plan.Share("awq", 8 << 30, 40960, 5 << 30, 7 << 30, 196608)
    fp8 = server_plan.Share("fp8", 11 << 30, 20480, 5 << 30, 4 << 30, 196608)
    before = server_plan.plan([base, awq, fp8], device_bytes=device, fraction=0.92, pinned="base")
    assert before.waves == [["base", "awq", "fp8"]]
    grown = base.measured(37 << 30)
    assert grown.total_bytes == 37 << 30 and grown.planned_bytes == 32 << 30
    assert base.measured(30 << 30) is base  # measured under its plan: the plan stands
    after = server_plan.plan([grown, awq, fp8], device_bytes=device, fraction=0.92, pinned="base")
    assert after.waves == [["base", "awq"], ["base", "fp8"]]
    assert "measured 37.0 GiB: counted so" in "\n".join(after.lines())


def _job(registry: Path, model: Path, kind: str = "eval") -> subprocess.Popen:
    """A job working ahead (pipeline/scoring/ahead.py) on model's server: a process of its own group that stops on
    SIGINT, with its entry in the registry's jobs and a lease on the server it uses."""
    from pipeline.engines.server_registry import JOBS, leases_dir
    from pipeline.runs import start_time

    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                             "signal.signal(signal.SIGINT, lambda *_: sys.exit(0))\n"
                             "time.sleep(600)"], start_new_session=True)
    time.sleep(0.3)
    started = start_time(proc.pid)
    (registry / JOBS).mkdir(parents=True, exist_ok=True)
    (registry / JOBS / f"{kind}-{model.name}.json").write_text(json.dumps(
        {"kind": kind, "model": str(model), "pid": proc.pid, "started": started}))
    key = next(k for k, e in shared.entries(registry).items() if e["model_path"] == str(model.resolve()))
    (leases_dir(registry, key) / f"{proc.pid}-{started}").touch()
    return proc


def test_an_in_process_stage_gets_its_room_idle_servers_first_then_work_started_ahead_and_says_which(
        tmp_path, tiny_llama, registry, run, gpu, caplog):
    """kl --rank on the H100 was refused beside AWQ's server, which a job working ahead held ("idle servers already
    stopped", which was not true): the stage asks for the bytes its pass needs; idle servers go (the base's last),
    then the jobs working ahead (they stop as a cut stage does; their stages finish them) and their servers."""
    caplog.set_level("INFO", logger="pipeline.engines.gpu_room")
    env = {shared.RUN_PID_ENV: str(run.pid)}
    shared.keep_last(tmp_path / "base", registry)
    base, awq, fp8 = (_copy(tiny_llama, tmp_path, n) for n in ("base", "awq", "fp8"))
    pids = {}
    for model in (base, awq, fp8):
        report, _ = stage(model, tmp_path / f"{model.name}.log", "--max-servers", "3", env=env)
        pids[model.name] = report["server_pid"]
    gpu({pids["base"]: 32, pids["awq"]: 20, pids["fp8"]: 20})  # 72 of 79.6 GiB in use
    job = _job(registry, awq)
    try:
        assert gpu_room.make_room("kl", 5 << 30, last=base) == []  # 7.6 GiB free: nothing to stop
        said = gpu_room.make_room("kl --rank", 40 << 30, last=base)
        # fp8 idle: stopped first (27.6 free, short); base idle but kept last: stopped next (59.6 free) before the job
        assert said == ["fp8's server (idle)", "base's server (idle)"]
        assert gone(pids["fp8"]) and gone(pids["base"]) and shared.alive(pids["awq"], None)
        said = gpu_room.make_room("kl --rank", 70 << 30, last=base)
        assert said == ["the eval of awq started ahead (its stage finishes it)", "awq's server (idle)"]
        assert job.wait(timeout=10) == 0 and gone(pids["awq"])
        assert "stopped" in caplog.text and "free now" in caplog.text
    finally:
        job.kill()
        job.wait()


def test_a_server_still_starting_that_nothing_waits_for_goes_last_rather_than_the_stage_refusing(
        tmp_path, tiny_llama, registry, run, gpu, monkeypatch):
    """The H100 run of 2026-12-07: kl --rank of RTN was refused with 60 GiB free beside AWQ's server, started for the
    evaluation working ahead and still loading when make_room stopped that job; a starting server was never stopped
    for room. Now it goes, after the idle servers and the jobs, and its stage starts it again when it needs it."""
    monkeypatch.setenv(shared.RUN_PID_ENV, str(run.pid))
    awq = _copy(tiny_llama, tmp_path, "awq")
    key = shared.warm([*SERVER, str(awq), "--served-model-name", "model", "--start-delay", "60"], "--port",
                      model_dir=awq, log_path=tmp_path / "awq.log", max_servers=2)
    assert key and _wait(lambda: shared.entries(registry)[key].get("server_pid"))
    entry = shared.entries(registry)[key]
    assert entry["state"] == "starting"
    gpu({entry["server_pid"]: 20})  # 59.6 of 79.6 GiB free: a pass needing 65 does not fit beside it
    assert gpu_room.make_room("kl --rank", 40 << 30) == []  # it fits: a starting server is left alone
    said = gpu_room.make_room("kl --rank", 65 << 30)
    assert said == ["awq's server (starting)"]
    assert gone(entry["server_pid"]) and key not in shared.entries(registry)


def test_what_cannot_be_freed_is_said_as_it_is(tmp_path, tiny_llama, registry, run, gpu):
    """Another process holding the GPU is not the run's to stop: the words say what holds what, measured."""
    env = {shared.RUN_PID_ENV: str(run.pid)}
    report, proc = stage(tiny_llama, tmp_path / "a.log", env=env, hold=True)  # a stage holds it: not idle
    try:
        gpu({report["server_pid"]: 30}, other_gib=40)
        assert _wait(lambda: measured_memory(registry, report["key"]).get("used_bytes"))
        assert gpu_room.make_room("bench's bandwidth probe", 20 << 30) == []
        held = gpu_room.holders(registry)
        assert held.startswith("70.0 GiB of 79.6 GiB in use") and "llama's server 30.0 GiB measured" in held
    finally:
        proc.kill()
        proc.wait()


def test_the_rank_check_sizes_the_pass_it_will_run_and_names_what_holds_the_gpu(tiny_llama, monkeypatch):
    """The rank's check used the full batch and said "idle servers of this run already stopped" while a server held
    19 GiB: the batch is halved to what is free first, and a refusal at one sequence says what holds the GPU."""
    from pipeline.errors import UserError
    from pipeline.stages import kl

    sequences = [[1] * 64] * 8
    need = {b: kl.gpu_bytes_needed(tiny_llama, sequences, b, 2, True) for b in (1, 8)}
    assert need[1] < need[8]
    free = int(need[1] / 0.8)  # room for one sequence a pass, not eight
    monkeypatch.setattr(kl, "gpu_free_bytes", lambda: free)
    monkeypatch.setattr(gpu_room, "holders", lambda registry=None: "70.0 GiB of 79.6 GiB in use: awq's server")
    batch = kl.ranking_batch(tiny_llama, sequences, 8, 2, free)
    assert batch < 8
    assert kl.residency("auto", True, "cuda", tiny_llama, tiny_llama, sequences, batch, 2) == "both"
    monkeypatch.setattr(kl, "gpu_free_bytes", lambda: int(need[1] / 2))
    with pytest.raises(UserError) as info:
        kl.residency("auto", True, "cuda", tiny_llama, tiny_llama, sequences, 1, 2)
    assert "at 1 sequence(s) a pass" in str(info.value) and "awq's server" in str(info.value)
    assert "already stopped" not in str(info.value)


def test_bench_probe_asks_for_its_room_and_shrinks_to_what_is_free(monkeypatch):
    """bench's bandwidth probe ran out of memory beside three servers (H100, 2026-12-07): it asks the run's GPU
    memory for its two tensors first, and copies less where the GPU still has less."""
    from pipeline.engines import gpu_memory
    from pipeline.stages import bench

    asked = []
    monkeypatch.setattr(gpu_room, "make_room", lambda what, need, last=None: asked.append((what, need, last)) or [])
    monkeypatch.setattr(gpu_memory, "device_memory_free_bytes", lambda: 10 << 30)
    assert bench._probe_gib("cuda", Path("models/awq")) == bench.PROBE_GIB
    assert asked == [("bench's bandwidth probe", int(2.5 * (1 << 30)), Path("models/awq"))]
    monkeypatch.setattr(gpu_memory, "device_memory_free_bytes", lambda: 1 << 30)
    assert bench._probe_gib("cuda", Path("models/awq")) == 0.25
    assert bench._probe_gib("cpu", Path("models/awq")) == 0.25


def test_work_ahead_is_not_started_for_a_stage_dvc_has_recorded_with_its_outputs_unchanged(tmp_path, monkeypatch):
    """Adding a fix to a finished run reran judge@awq and judge@fp8: a job ahead of those locked stages rewrote their
    outputs (timings), so DVC ran them again. A stage the lock records with its outputs as recorded gets no job."""
    import hashlib

    from pipeline.scoring import ahead

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "results" / "awq" / "judge.json"
    out.parent.mkdir(parents=True)
    out.write_text('{"seconds": 12.5}')
    recorded = {"path": "results/awq/judge.json", "hash": "md5", "size": out.stat().st_size,
                "md5": hashlib.md5(out.read_bytes()).hexdigest()}
    (tmp_path / "dvc.lock").write_text(json.dumps({"schema": "2.0", "stages": {"judge@awq": {
        "cmd": "quantize judge models/awq", "outs": [recorded]}}}))
    assert ahead.recorded_current("judge@awq")
    assert not ahead.recorded_current("judge@fp8")  # not in the lock: a fix's stage, say
    run = subprocess.Popen(["sleep", "60"])
    try:
        monkeypatch.setenv(shared.RUN_PID_ENV, str(run.pid))
        monkeypatch.setenv(shared.REGISTRY_ENV, str(tmp_path / "servers"))
        assert ahead.start("judge", Path("models/awq"), tmp_path / "params.yaml") is None
        assert not (tmp_path / "servers" / "jobs").exists() or not list((tmp_path / "servers" / "jobs").glob("*.json"))
        out.write_text('{"seconds": 13.0}')  # its output changed since: DVC will run it, and work ahead helps
        assert not ahead.recorded_current("judge@awq")
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()


def test_a_stage_waits_for_a_server_a_job_works_on_rather_than_refusing(tmp_path, tiny_llama, registry, run):
    """evaluate@rtn-w4a16 on the H100 (2026-12-07) was refused "this stage holds every server up (base, fp8-w8a8)"
    while the judge of fp8-w8a8, working ahead, was between two requests: a server whose model a job works on is
    not the stage's own, so the stage waits for it to be given back, and starts its own once it is."""
    from test_shared_server import STAGE

    env = {**os.environ, shared.RUN_PID_ENV: str(run.pid)}
    memory = ["--gpu-bytes", str(40 << 30), "--gpu-budget", str(73 << 30), "--max-servers", "3"]
    fp8, rtn = _copy(tiny_llama, tmp_path, "fp8"), _copy(tiny_llama, tmp_path, "rtn")
    first, _ = stage(fp8, tmp_path / "fp8.log", *memory, env={shared.RUN_PID_ENV: str(run.pid)})
    job = _job(registry, fp8, kind="judge")
    for lease in (registry / f"{first['key']}.leases").glob("*"):
        lease.unlink()  # between its requests: no lease on the server, still working on its model
    waiting = subprocess.Popen([*STAGE, str(rtn), str(tmp_path / "rtn.log"), *memory], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        time.sleep(4)
        assert waiting.poll() is None, waiting.stderr.read()  # waiting, not refused
        assert "waiting for room" in (tmp_path / "rtn.log").read_text()
        job.send_signal(signal.SIGINT)
        job.wait(timeout=10)
        out, err = waiting.communicate(timeout=60)
        assert waiting.returncode == 0, err
        assert json.loads(out.splitlines()[0])["started"] and gone(first["server_pid"])
    finally:
        for proc in (job, waiting):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
