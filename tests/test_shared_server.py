"""One engine start per checkpoint per run (pipeline/engines/shared.py), with real processes: stages are
separate Python processes (tests/shared_stage.py), the server is tests/openai_server.py started through
`vllm serve`'s command line, the run is a real process (a `dvc repro` stand-in), kills are real SIGKILLs."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.engines import shared
from pipeline.engines.http import get_ok

STAGE = [sys.executable, str(Path(__file__).with_name("shared_stage.py"))]
STAGE_SERVER = [sys.executable, str(Path(__file__).with_name("openai_server.py"))]  # vLLM's command line


@pytest.fixture
def registry(tmp_path, monkeypatch):
    folder = tmp_path / "servers"
    monkeypatch.setenv(shared.REGISTRY_ENV, str(folder))
    monkeypatch.delenv(shared.RUN_PID_ENV, raising=False)
    yield folder
    for key, entry in shared.entries(folder).items():  # never leave a server behind, even on failure
        shared.stop_entry(folder, key, entry, wait=10)


def stage(model, log, *flags, env=None, hold=False):
    """Runs a stage; returns its report (and, with hold, the still-running process)."""
    args = [*STAGE, str(model), str(log), *flags, *(["--hold"] if hold else [])]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"stage failed: {proc.stderr.read()}")
    report = json.loads(line)
    if not hold:
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        return report, None
    return report, proc


def gone(pid, seconds=15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not shared.alive(pid, None):
            return True
        time.sleep(0.2)
    return False


def test_stages_of_one_run_share_one_server_which_dies_with_the_run(tmp_path, tiny_llama, registry, run):
    env = {shared.RUN_PID_ENV: str(run.pid)}
    first, _ = stage(tiny_llama, tmp_path / "a.log", env=env)
    second, _ = stage(tiny_llama, tmp_path / "b.log", env=env)
    third, _ = stage(tiny_llama, tmp_path / "c.log", env=env)
    assert first["started"] and first["start_seconds"] > 0 and first["healthy"]
    assert not second["started"] and not third["started"] and second["start_seconds"] == 0
    assert first["port"] == second["port"] == third["port"] and first["server_pid"] == third["server_pid"]
    assert "attached to the server" in (tmp_path / "b.log").read_text()
    assert f"pid {run.pid}" in first["owner"]
    assert shared.alive(first["server_pid"], None)  # between stages: kept for the next one
    run.send_signal(signal.SIGKILL)  # the run ends (killed): its server must not outlive it
    run.wait()
    assert gone(first["server_pid"]) and not get_ok(f"http://127.0.0.1:{first['port']}/health")
    deadline = time.monotonic() + 10
    while shared.entries(registry) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert shared.entries(registry) == {}
    assert "server stopped: its run" in (tmp_path / "a.log").read_text()


def test_a_changed_checkpoint_gets_a_new_server_never_the_old_ones_answers(tmp_path, tiny_llama, registry, run):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    env = {shared.RUN_PID_ENV: str(run.pid)}
    before, _ = stage(model, tmp_path / "a.log", env=env)
    config = json.loads((model / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6) * 2  # the checkpoint changes (a rerun stage)
    (model / "config.json").write_text(json.dumps(config))
    after, _ = stage(model, tmp_path / "b.log", env=env)
    assert after["started"] and after["key"] != before["key"]
    assert gone(before["server_pid"])  # the old content's server, idle, is stopped before the new one starts
    assert list(shared.entries(registry)) == [after["key"]]


def test_a_file_linked_again_by_dvcs_cache_keeps_the_runs_server(tmp_path, tiny_llama, registry, run):
    """DVC links a later output whose content equals a cached file (a variant's tokenizer.json, equal to the base's)
    to that file's inode: the base file's link count and change time change, its content does not. The server
    the run keeps for the base is attached to, not stopped and started again (seen on the H200: a 68 s restart)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    env = {shared.RUN_PID_ENV: str(run.pid)}
    before, _ = stage(model, tmp_path / "a.log", env=env)
    changed_before = (model / "config.json").stat().st_ctime_ns
    time.sleep(0.05)
    os.link(model / "config.json", tmp_path / "variant-config.json")  # what DVC's cache does
    assert (model / "config.json").stat().st_ctime_ns != changed_before
    after, _ = stage(model, tmp_path / "b.log", env=env)
    assert not after["started"] and after["key"] == before["key"] and after["server_pid"] == before["server_pid"]


def test_a_killed_stage_outside_a_run_leaves_no_server(tmp_path, tiny_llama, registry):
    report, proc = stage(tiny_llama, tmp_path / "a.log", hold=True)
    assert report["started"] and report["owner"] == "this stage"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert gone(report["server_pid"])
    deadline = time.monotonic() + 10
    while shared.entries(registry) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert shared.entries(registry) == {}


def test_a_stage_killed_inside_a_run_releases_its_lease_and_the_idle_timeout_stops_the_server(
        tmp_path, tiny_llama, registry, run):
    env = {shared.RUN_PID_ENV: str(run.pid)}
    report, proc = stage(tiny_llama, tmp_path / "a.log", "--idle", "3", env=env, hold=True)
    time.sleep(4)  # held: not idle, however long
    assert shared.alive(report["server_pid"], None)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    nxt, _ = stage(tiny_llama, tmp_path / "b.log", "--idle", "3", env=env)  # the next stage still attaches
    assert not nxt["started"] and nxt["port"] == report["port"]
    assert gone(report["server_pid"], 15)  # then nobody holds it: stopped after 3 s idle
    assert "idle for 3 s" in (tmp_path / "a.log").read_text()


def test_max_servers_stops_the_idle_server_of_another_checkpoint(tmp_path, tiny_llama, registry, run):
    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    env = {shared.RUN_PID_ENV: str(run.pid)}
    first, _ = stage(tiny_llama, tmp_path / "a.log", env=env)
    second, _ = stage(other, tmp_path / "b.log", "--max-servers", "2", env=env)
    assert shared.alive(first["server_pid"], None) and shared.alive(second["server_pid"], None)
    third, _ = stage(tmp_path / "other", tmp_path / "c.log", "--max-servers", "1", env=env)
    assert not third["started"]  # attached to its own, and the other checkpoint's idle one was not needed
    fourth, _ = stage(tiny_llama, tmp_path / "d.log", "--max-servers", "2", env=env)
    assert not fourth["started"]
    fifth_model = tmp_path / "third"
    shutil.copytree(tiny_llama, fifth_model)
    fifth, _ = stage(fifth_model, tmp_path / "e.log", "--max-servers", "2", env=env)
    assert fifth["started"]
    running = [r for r in (first, second) if shared.alive(r["server_pid"], None)]
    assert len(running) == 1  # two at most: the least recently used idle one was stopped


def test_a_holder_that_ends_while_a_stage_looks_for_room_is_no_reason_to_refuse(tmp_path, tiny_llama, registry, run):
    """CI (2026-12-07, under load): a stage waiting for the one server engine.max_servers allows was refused "holds every
    server up" when the holder ended between stop_idle (which saw the server leased) and the refusal's check (which
    saw it leased by nobody). A server given back in between is stopped on the next round, not a refusal."""
    env = {shared.RUN_PID_ENV: str(run.pid)}
    _, holder = stage(tiny_llama, tmp_path / "a.log", env=env, hold=True)
    busy = shared.entries(registry)
    holder.kill()
    holder.wait()
    assert shared._refuse_when_all_mine(registry, busy, 1, "eval", None) is None


def test_max_servers_holds_when_every_server_is_in_use(tmp_path, tiny_llama, registry, run):
    """engine.max_servers is never passed (a run with fixes serves more models than it keeps servers): a stage that
    needs another checkpoint while every server is in use waits until one is given back, then stops it and starts
    its own; a process that holds every server itself is refused with the setting to raise."""
    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    env = {shared.RUN_PID_ENV: str(run.pid)}
    first, holder = stage(tiny_llama, tmp_path / "a.log", env=env, hold=True)  # in use until killed
    waiting = subprocess.Popen([*STAGE, str(other), str(tmp_path / "b.log")], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    deadline = time.monotonic() + 30
    while "waiting for one of the 1 servers" not in (tmp_path / "b.log").read_text(errors="replace") \
            if (tmp_path / "b.log").exists() else True:
        assert time.monotonic() < deadline and waiting.poll() is None, waiting.stderr.read() if waiting.poll() else ""
        time.sleep(0.2)
    time.sleep(1.0)
    assert len(shared.entries(registry)) == 1 and waiting.poll() is None  # no second server while the first is used
    holder.kill()  # the lease is given back (a SIGKILLed stage's lease counts as released)
    holder.wait()
    line = waiting.stdout.readline()
    assert line, waiting.stderr.read()
    second = json.loads(line)
    assert waiting.wait(timeout=60) == 0
    assert second["started"] and gone(first["server_pid"])  # the idle one was stopped for it: one server at a time
    lease = shared.acquire([*STAGE_SERVER, str(tiny_llama), "--served-model-name", "model"], "--port",
                           model_dir=tiny_llama, log_path=tmp_path / "c.log", start_timeout=120, max_servers=1)
    try:  # this process holds the only server it may keep, and asks for another at once
        with pytest.raises(shared.UserError, match=r"engine.max_servers is 1 and this stage holds every server up "
                                                   r"\(.*\) while it needs one more at once; raise engine.max_servers to 2"):
            shared.acquire([*STAGE_SERVER, str(other), "--served-model-name", "model"], "--port", model_dir=other,
                           log_path=tmp_path / "d.log", start_timeout=120, max_servers=1)
        assert [e["model_path"] for e in shared.entries(registry).values()] == [str(tiny_llama.resolve())]
    finally:
        lease.release()


def test_the_run_is_found_as_the_dvc_repro_ancestor(tmp_path, tiny_llama, registry):
    """No QUANTIZE_RUN_PID: the owner is the `dvc repro` process the stage runs under."""
    fake = tmp_path / "bin" / "dvc"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\n{' '.join(STAGE)} {tiny_llama} {tmp_path / 'a.log'} --hold\n")
    fake.chmod(0o755)
    proc = subprocess.Popen([str(fake), "repro"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    report = json.loads(proc.stdout.readline())
    assert report["owner"] == f"dvc repro (pid {proc.pid})"
    os.killpg(proc.pid, signal.SIGKILL)  # the run and its stage, killed together
    proc.wait()
    assert gone(report["server_pid"])


def test_a_server_that_fails_to_start_is_a_clear_error_and_leaves_no_entry(tmp_path, tiny_llama, registry):
    from pipeline.errors import UserError

    with pytest.raises(UserError, match="exited with code 3 while starting") as info:
        shared.acquire([*STAGE[:1], str(Path(__file__).with_name("openai_server.py")), str(tiny_llama),
                        "--fail-start"], "--port", model_dir=tiny_llama, log_path=tmp_path / "a.log",
                       start_timeout=60, name="vLLM server")
    assert "a scripted start failure" in str(info.value)
    assert shared.entries(registry) == {}


def test_an_in_process_gpu_stage_stops_idle_servers_only_when_the_gpu_lacks_room(tmp_path, tiny_llama, registry,
                                                                                  run, monkeypatch):
    """quantize and kl load a model on the GPU in-process: the servers the run keeps (idle between stages) hold
    its memory. While the GPU has room for the stage (free memory as nvidia-smi says, here stood in for) they
    stay; when it lacks room, idle ones go, least recently used first, and a server a stage holds stays."""
    from pipeline.engines import gpu_memory, gpu_room

    env = {shared.RUN_PID_ENV: str(run.pid)}
    idle, _ = stage(tiny_llama, tmp_path / "a.log", env=env)
    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    held, proc = stage(other, tmp_path / "b.log", "--max-servers", "2", env=env, hold=True)
    try:
        monkeypatch.setattr(gpu_memory, "device_memory_free_bytes", lambda: 40 << 30)
        gpu_room.make_room("kl", 30 << 30)  # room enough: nothing stops
        assert shared.alive(idle["server_pid"], None) and len(shared.entries(registry)) == 2
        gpu_room.make_room("kl", 50 << 30)  # too little: the idle one goes, the held one stays
        assert gone(idle["server_pid"]) and shared.alive(held["server_pid"], None)
        assert list(shared.entries(registry)) == [held["key"]]
    finally:
        proc.kill()
        proc.wait()


def test_making_room_stops_the_bases_server_after_every_other(tmp_path, tiny_llama, registry, run, monkeypatch):
    """A fix added to a finished run loads the base in-process while the run's idle servers hold the GPU: they go
    least recently used first, but the base's last (every variant's judge asks it), so the fix's judge finds it."""
    from pipeline.engines import gpu_memory, gpu_room

    env = {shared.RUN_PID_ENV: str(run.pid)}
    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    first, _ = stage(base, tmp_path / "a.log", "--max-servers", "3", env=env)  # the base: used first, so LRU
    others = []
    for name in ("awq", "fp8"):
        shutil.copytree(tiny_llama, tmp_path / name)
        others.append(stage(tmp_path / name, tmp_path / f"{name}.log", "--max-servers", "3", env=env)[0])
    # room once two servers have gone
    monkeypatch.setattr(gpu_memory, "device_memory_free_bytes",
                        lambda: (100 << 30) if len(shared.entries(registry)) <= 1 else 1 << 30)
    gpu_room.make_room("fix", 50 << 30, last=base)
    assert all(gone(r["server_pid"]) for r in others) and shared.alive(first["server_pid"], None)
    assert [e["model_path"] for e in shared.entries(registry).values()] == [str(base.resolve())]


@pytest.mark.parametrize("value, message", [("abc", "give the process id"), ("999999999", "no such process")])
def test_a_bad_run_pid_is_one_clear_message(monkeypatch, value, message):
    from pipeline.errors import UserError

    monkeypatch.setenv(shared.RUN_PID_ENV, value)
    with pytest.raises(UserError, match=message):
        shared.run_owner()


def test_a_warmed_server_starts_in_the_background_and_the_stage_that_asks_waits_only_for_the_rest(
        tmp_path, tiny_llama, registry, run):
    """warm (engine.warm_servers): the start goes on while the caller does other work; a stage asking for the
    server meanwhile attaches and waits only for what is left of the start; one start in all."""
    command = [*STAGE_SERVER, str(tiny_llama), "--served-model-name", "model", "--start-delay", "3"]
    env = {shared.RUN_PID_ENV: str(run.pid)}
    os.environ.update(env)
    try:
        began = time.monotonic()
        key = shared.warm(command, "--port", model_dir=tiny_llama, log_path=tmp_path / "warm.log",
                          start_timeout=120, max_servers=2)
        assert key and time.monotonic() - began < 3  # not waited for
        assert [e["state"] for e in shared.entries(registry).values()] == ["starting"]
        assert shared.warm(command, "--port", model_dir=tiny_llama, log_path=tmp_path / "warm.log",
                           start_timeout=120, max_servers=2) is None  # starting already: nothing more
        lease = shared.acquire(command, "--port", model_dir=tiny_llama, log_path=tmp_path / "stage.log",
                               start_timeout=120, max_servers=2)
        assert not lease.started and lease.waited > 0 and get_ok(lease.base_url + "/health")
        assert (tmp_path / "warm.log").read_text().count("\n$ ") + (tmp_path / "warm.log").read_text().startswith("$ ") == 1
        assert "server ready after" in (tmp_path / "warm.log").read_text()
        lease.release()
        assert shared.alive(lease.server_pid, None)  # no idle timer: the server waits for the run's end
        other = tmp_path / "other"
        shutil.copytree(tiny_llama, other)
        assert shared.warm([*STAGE_SERVER, str(other)], "--port", model_dir=other, log_path=tmp_path / "o.log",
                           max_servers=1) is None  # max_servers up already: warming never stops one for room
        assert len(shared.entries(registry)) == 1
    finally:
        for name in env:
            os.environ.pop(name, None)
    run.kill()
    run.wait()
    assert gone(lease.server_pid)


def test_warming_follows_the_run_and_leaves_room_for_in_process_stages(tmp_path, tiny_llama, registry, run,
                                                                        monkeypatch):
    """warm_run_servers: inside a run only; every checkpoint that exists (a finished stage's output) and no other;
    while the project's files say in-process stages are still to come (a variant not built, a KL not measured), a
    start must leave engine.build_memory_fraction of the GPU free; once every build is done, only max_servers bounds
    it. Read from the files when it is asked, whatever order DVC runs the stages in."""
    import yaml

    from conftest import TINY_PARAMS, write_params
    from pipeline.settings import params as params_mod
    from pipeline.cli.common import builds_to_come, warm_run_servers
    from pipeline.engines import gpu_memory

    for name in ("base", "awq-w4a16", "fp8-w8a8"):
        shutil.copytree(tiny_llama, tmp_path / "models" / name)
        (tmp_path / "models" / name / ".stage.json").write_text("{}")
    shutil.rmtree(tmp_path / "models" / "fp8-w8a8")  # not built yet
    engine = {"name": "vllm", "server_command": STAGE_SERVER, "share_server": True, "max_servers": 4,
              "kv_cache_memory": "planned", "warm_servers": True, "device_memory_gib": 1.0,
              "gpu_memory_utilization": 0.2, "non_kv_memory_gib": 0.01, "build_memory_fraction": 0.5}
    variants = {name: TINY_PARAMS["variants"][name] for name in ("awq-w4a16", "fp8-w8a8")}
    write_params(tmp_path, {**TINY_PARAMS, "variants": variants, "engine": engine})
    monkeypatch.chdir(tmp_path)
    p = params_mod.load("params.yaml")
    (tmp_path / "dvc.yaml").write_text("stages:\n  kl:\n    foreach: [awq-w4a16, fp8-w8a8]\n    do:\n"
                                       "      cmd: quantize kl models/${item}\n  evaluate:\n"
                                       "    foreach: [base, awq-w4a16, fp8-w8a8]\n    do:\n"
                                       "      cmd: quantize eval models/${item}\n")
    assert warm_run_servers(p) == []  # not inside a run: nothing to warm for
    monkeypatch.setenv(shared.RUN_PID_ENV, str(run.pid))
    monkeypatch.setattr(gpu_memory, "device_memory_free_bytes", lambda: int(0.75 * (1 << 30)))
    assert builds_to_come() == ["quantize fp8-w8a8", "kl awq-w4a16", "kl fp8-w8a8"]
    assert warm_run_servers(p) == ["base"]  # 0.75 - 0.2 >= 0.5 once; then base counts as starting
    assert warm_run_servers(p) == []  # awq-w4a16 would leave less than half the GPU to the builds to come
    for name in ("awq-w4a16", "fp8-w8a8"):  # the builds done: quantize (its checkpoint) and kl (its kl.json)
        (tmp_path / "results" / name).mkdir(parents=True)
        (tmp_path / "results" / name / "kl.json").write_text("{}")
    shutil.copytree(tiny_llama, tmp_path / "models" / "fp8-w8a8")
    assert builds_to_come() == ["quantize fp8-w8a8"]  # a checkpoint counts once its stage has finished it
    (tmp_path / "models" / "fp8-w8a8" / ".stage.json").write_text("{}")
    assert builds_to_come() == []
    assert warm_run_servers(p) == ["awq-w4a16", "fp8-w8a8"]  # serving only: no in-process stage to leave room for
    assert sorted(e["model_path"] for e in shared.entries(registry).values()) == sorted(
        str((tmp_path / "models" / n).resolve()) for n in ("base", "awq-w4a16", "fp8-w8a8"))
    argv = [e["command"] for e in shared.entries(registry).values()][0]
    assert argv[argv.index("--kv-cache-memory-bytes") + 1].isdigit()
    assert yaml.safe_load((tmp_path / "params.yaml").read_text())["engine"]["warm_servers"] is True


def test_planned_memory_decides_how_many_servers_are_up_and_the_base_stays(tmp_path, tiny_llama, registry, run):
    """engine.kv_cache_memory: fitted (pipeline/engines/server_plan.py): a server starts when its planned bytes fit
    beside the others' in the budget, whatever max_servers allows; an idle server is stopped for room, never the
    run's base; while the others are in use a stage waits (no timeout: every holder gives its server back), then
    starts."""
    base, first, second = (tmp_path / name for name in ("base", "first", "second"))
    for folder in (base, first, second):
        shutil.copytree(tiny_llama, folder)
    env = {shared.RUN_PID_ENV: str(run.pid)}
    memory = ["--max-servers", "8", "--gpu-budget", "100"]
    shared.keep_last(base)  # the run's base: every variant's judge asks it
    base_report, _ = stage(base, tmp_path / "base.log", *memory, "--gpu-bytes", "50", env=env)
    one, holder = stage(first, tmp_path / "first.log", *memory, "--gpu-bytes", "40", env=env, hold=True)
    assert len(shared.entries(registry)) == 2  # 50 + 40 of 100: side by side
    waiting = subprocess.Popen([*STAGE, str(second), str(tmp_path / "second.log"), *memory, "--gpu-bytes", "40"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    deadline = time.monotonic() + 30
    while "waiting for room in the GPU memory" not in (tmp_path / "second.log").read_text(errors="replace") \
            if (tmp_path / "second.log").exists() else True:
        assert time.monotonic() < deadline and waiting.poll() is None, waiting.stderr.read() if waiting.poll() else ""
        time.sleep(0.2)
    time.sleep(1.0)  # the base is idle, yet not stopped for room: first is in use, so second waits
    assert waiting.poll() is None and shared.alive(base_report["server_pid"], None)
    assert len(shared.entries(registry)) == 2
    holder.kill()
    holder.wait()
    two = json.loads(waiting.stdout.readline())
    assert waiting.wait(timeout=60) == 0 and two["started"]
    assert gone(one["server_pid"])  # the idle variant went for room
    assert shared.alive(base_report["server_pid"], None)  # the base stayed
    planned = sorted(e["gpu_bytes"] for e in shared.entries(registry).values())
    assert planned == [40, 50] and sum(planned) <= 100
