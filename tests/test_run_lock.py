"""A second run of the same project is told who holds it, exit 2 (issue 70.5), not DVC's "`.cache/code` is busy ...
blocked by PID" (exit 255): `quantize repro` and `make demo` (python -m pipeline.cli.repro) hold .cache/run.lock for
the whole run."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO

HOLD = ("import sys, time; sys.argv = ['quantize', 'repro', 'evaluate@base']\n"
        "from pipeline.cli.run_lock import held\n"
        "with held():\n    print('held', flush=True); time.sleep(120)\n")


@pytest.fixture
def first_run(tmp_path):
    """A run holding the project: the lock `quantize repro` takes, held by another process."""
    (tmp_path / ".dvc").mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-c", HOLD], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    yield process
    process.kill()
    process.wait()


@pytest.mark.parametrize("command", [["-m", "pipeline.cli.repro"], ["-m", "pipeline.cli.app", "repro"]])
def test_a_second_run_is_told_which_run_holds_the_project(tmp_path, first_run, command):
    done = subprocess.run([sys.executable, *command], cwd=tmp_path / ".dvc", capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2, done.stderr
    assert f"error: another run holds this project: PID {first_run.pid}, started 20" in done.stderr
    assert "(quantize repro evaluate@base)" in done.stderr and f"kill {first_run.pid}" in done.stderr
    assert "Traceback" not in done.stderr and "busy" not in done.stderr


def test_the_lock_goes_with_the_run_that_held_it(tmp_path, first_run):
    from pipeline.cli.run_lock import held

    first_run.kill()
    first_run.wait()
    with held(tmp_path):  # a killed run leaves nothing that blocks the next
        record = json.loads((tmp_path / ".cache" / "run.lock").read_text())
    assert record["pid"] == os.getpid()


def test_a_plain_dvc_repro_holding_outputs_is_named_too(tmp_path):
    from pipeline.cli.run_lock import held
    from pipeline.errors import UserError

    (tmp_path / ".dvc" / "tmp").mkdir(parents=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        (tmp_path / ".dvc" / "tmp" / "rwlock").write_text(json.dumps(
            {"write": {str(tmp_path / ".cache" / "code"): {"pid": other.pid, "cmd": "dvc repro"}}, "read": {}}))
        with pytest.raises(UserError) as refused:
            with held(tmp_path):
                pass
    finally:
        other.kill()
        other.wait()
    assert f"another run holds this project: PID {other.pid}, started " in str(refused.value)
    assert "(dvc repro)" in str(refused.value)


@pytest.mark.parametrize("code", ["EROFS", "EACCES", "ENOSPC"])
def test_a_project_where_the_lock_cannot_be_written_is_one_message(tmp_path, monkeypatch, code):
    """The run lock is the first thing a run writes: a project on a read-only file system, not writable for the run,
    or full, is our message naming the lock (exit 2 from `quantize repro`), not a traceback (issue 70.1). The
    refusal is injected where the lock is opened, or written."""
    import errno

    from pipeline.cli import run_lock
    from pipeline.errors import UserError

    (tmp_path / ".dvc").mkdir()
    refusal = OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
    if code == "ENOSPC":
        class Full:
            def __init__(self, *args, **kwargs):
                self.handle = open(*args, **kwargs)

            def write(self, text):
                raise refusal

            def __getattr__(self, name):
                return getattr(self.handle, name)
        monkeypatch.setattr(run_lock, "open", Full, raising=False)
    else:
        monkeypatch.setattr(run_lock, "open", lambda *args, **kwargs: (_ for _ in ()).throw(refusal), raising=False)
    with pytest.raises(UserError) as refused:
        with run_lock.held(tmp_path):
            pass
    said = {"EROFS": "read-only file system", "EACCES": "permission denied", "ENOSPC": "no space left on the device"}
    assert str(refused.value).startswith(f"cannot write the run lock {tmp_path / '.cache' / 'run.lock'}: {said[code]}")
