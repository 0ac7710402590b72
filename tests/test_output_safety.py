"""No command deletes or moves what it did not write (issue 20.1, 20.6): an output path that is,
contains or lies inside an input is refused before any work; a directory output replaces only a
previous stage output; a killed stage's temp dir is removed by the next run of that stage."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY_PARAMS, write_params


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_llama, tiny_calib):
    root = tmp_path_factory.mktemp("project")
    write_params(root, TINY_PARAMS)
    data = root / "data"
    data.mkdir()
    shutil.copy(REPO / "calib_data" / "support_logs.jsonl", data / "conversations.jsonl")
    (data / "notes.txt").write_text("the user's own notes, beside the source\n")
    shutil.copytree(tiny_llama, root / "models" / "m")
    shutil.copytree(tiny_calib, root / "calib")
    (root / "results" / "base").mkdir(parents=True)
    (root / "results" / "base" / "math.jsonl").write_text("")
    return root


# stage -> (its command with --out OUT, the input file the cases aim at)
def _stages(root: Path) -> dict:
    model, conversations, holdout = root / "models" / "m", root / "data" / "conversations.jsonl", root / "calib" / "holdout.jsonl"
    return {
        "calib": (lambda out: ["calib", str(conversations), "--model", str(model), "--out", str(out)], conversations),
        "resave": (lambda out: ["resave", str(model), "--out", str(out)], model / "config.json"),
        "export": (lambda out: ["export", str(model), "--out", str(out)], model / "config.json"),
        "awq": (lambda out: ["awq", "--model", str(model), "--calib", str(conversations), "--out", str(out)], conversations),
        "fp8": (lambda out: ["fp8", "--model", str(model), "--calib", str(conversations), "--out", str(out)], conversations),
        "eval": (lambda out: ["eval", str(model), "--suite", "math", "--out", str(out)], model / "config.json"),
        "kl": (lambda out: ["kl", str(model), "--base", str(model), "--holdout", str(holdout), "--out", str(out)], holdout),
        "judge": (lambda out: ["judge", str(model), "--base", str(model), "--prompts", str(holdout), "--out", str(out)],
                  holdout),
        "bench": (lambda out: ["bench", str(model), "--holdout", str(holdout), "--out", str(out)], holdout),
        "report": (lambda out: ["report", "--results", str(root / "results"), "--models", str(root / "models"),
                                "--out", str(out)], root / "results" / "base" / "math.jsonl"),
    }


CASES = {"the input file": lambda x: x, "its folder": lambda x: x.parent, "a parent of it": lambda x: x.parent.parent}


@pytest.mark.parametrize("stage", list(_stages(Path("."))))
def test_out_over_an_input_is_refused_before_any_work(project, stage, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    monkeypatch.chdir(project)
    command, target = _stages(project)[stage]
    for case, pick in CASES.items():
        out = pick(target)
        before = _listing(project)
        result = CliRunner().invoke(app, command(out))
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (case, result.output)
        message = result.output
        assert f"--out {out}:" in message and "a command never writes over what it reads" in message, (case, message)
        assert any(how in message for how in ("is the", "contains the", "lies inside the")), (case, message)
        assert "Traceback" not in message
        assert _listing(project) == before, (case, "something was written, moved or deleted")


def test_calib_out_over_its_source_folder_keeps_every_file(project, monkeypatch):
    """The reported case: `quantize calib DIR/conversations.jsonl --out DIR` used to replace DIR."""
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    monkeypatch.chdir(project)
    data = project / "data"
    result = CliRunner().invoke(app, ["calib", str(data / "conversations.jsonl"), "--model", str(project / "models" / "m"),
                                      "--out", str(data)])
    assert result.exit_code == 2
    assert f"contains the source {data / 'conversations.jsonl'}" in result.output
    assert sorted(p.name for p in data.iterdir()) == ["conversations.jsonl", "notes.txt"]


def test_a_directory_no_stage_wrote_is_never_replaced(project, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli.app import app
    from pipeline.outputs import atomic_dir
    from pipeline.errors import UserError

    monkeypatch.chdir(project)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("months of work")
    args = ["calib", str(project / "data" / "conversations.jsonl"), "--model", str(project / "models" / "m")]
    result = CliRunner().invoke(app, [*args, "--out", str(mine)])
    assert result.exit_code == 2 and "a folder no calib stage wrote" in result.output
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"]
    with pytest.raises(UserError, match="no calib stage wrote"):  # the rename itself refuses too
        with atomic_dir(mine, "calib") as tmp:
            (tmp / "stats.json").write_text("{}")
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mine")]

    build = tmp_path / "build"  # a stage's own output is replaced on the next run, as before
    for _ in range(2):
        result = CliRunner().invoke(app, [*args, "--out", str(build)])
        assert result.exit_code == 0, result.output
    assert (build / "stats.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build", "mine"]


def _calib(project: Path, out: Path) -> list[str]:
    return ["calib", str(project / "data" / "conversations.jsonl"), "--model", str(project / "models" / "m"),
            "--out", str(out)]


def test_calib_never_replaces_a_folder_whose_record_files_anyone_could_write(project, tmp_path):
    """The reported case (issue 26): `quantize calib --out COPY` replaced a copy of a quantized model,
    because it held a quant.json; any of the old record names let any stage replace a folder."""
    for record in ("quant.json", "stats.json", "source.json", "export.json"):
        copy = tmp_path / f"copy-{record}"
        shutil.copytree(project / "models" / "m", copy)
        (copy / record).write_text('{"method": "awq"}')
        before = _listing(copy)
        done = subprocess.run([sys.executable, "-m", "pipeline.cli.app", *_calib(project, copy)], cwd=project,
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 2, (record, done.stdout, done.stderr)
        assert f"--out {copy}: a folder no calib stage wrote" in done.stderr and "Traceback" not in done.stderr
        assert f"its {record} may be from an earlier version" in done.stderr or record != "quant.json"
        assert "nothing was changed" in done.stderr
        assert _listing(copy) == before, record
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{copy.name}.")]


def test_a_stage_replaces_only_its_own_output_and_only_what_it_wrote(project, tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli.app import app
    from pipeline.outputs import STAGE_RECORD, read_stage_record

    build = tmp_path / "build"
    assert CliRunner().invoke(app, _calib(project, build)).exit_code == 0
    record = read_stage_record(build)
    assert record["stage"] == "calib"
    assert record["files"] == sorted(p.name for p in build.iterdir() if p.name != STAGE_RECORD)
    assert record["inputs"]["source"]["fingerprint"].startswith("sha256:")
    assert record["inputs"]["tokenizer checkpoint"]["fingerprint"].startswith("tree:")

    (build / "my-notes.txt").write_text("mine")  # a file the stage did not write, put into its output
    before = _listing(build)
    result = CliRunner().invoke(app, _calib(project, build))
    assert result.exit_code == 2
    assert "holds 1 file the calib stage did not write (my-notes.txt)" in result.output
    assert _listing(build) == before
    (build / "my-notes.txt").unlink()

    other = tmp_path / "other"  # another stage's output, with its own record
    shutil.copytree(build, other)
    data = read_stage_record(other) | {"stage": "quantize"}
    (other / STAGE_RECORD).write_text(json.dumps(data))
    before = _listing(other)
    result = CliRunner().invoke(app, _calib(project, other))
    assert result.exit_code == 2 and "the output of the quantize stage (its .stage.json says so), not of calib" in result.output
    assert _listing(other) == before


def test_removing_an_outdated_export_goes_through_the_same_check(tmp_path):
    from pipeline.errors import UserError
    from pipeline.outputs import atomic_dir, remove_output

    cache = tmp_path / "exports"
    with atomic_dir(cache / "m-1", "export") as tmp:
        (tmp / "export.json").write_text("{}")
    (cache / "m-2").mkdir()
    (cache / "m-2" / "export.json").write_text("{}")  # no provenance record: not removed
    with pytest.raises(UserError, match="no export stage wrote"):
        remove_output(cache / "m-2", "export")
    assert (cache / "m-2" / "export.json").exists()
    remove_output(cache / "m-1", "export")
    assert not (cache / "m-1").exists()


def test_the_lmdeploy_export_cache_removes_only_exports_it_wrote(tmp_path, caplog):
    from pipeline.engines.lmdeploy import remove_stale_exports
    from pipeline.outputs import atomic_dir

    model, cache = tmp_path / "model", tmp_path / "exports"
    model.mkdir()
    record = json.dumps({"source": str(model.resolve())})
    with atomic_dir(cache / "model-old", "export", {"checkpoint": model}) as tmp:
        (tmp / "export.json").write_text(record)
    (cache / "copied").mkdir()  # names the same source in its export.json, but no stage recorded writing it
    (cache / "copied" / "export.json").write_text(record)
    (cache / "copied" / "weights.safetensors").write_bytes(b"x")
    (cache / "model-new").mkdir()
    remove_stale_exports(model, cache / "model-new", cache)
    assert sorted(p.name for p in cache.iterdir()) == ["copied", "model-new"]
    assert (cache / "copied" / "weights.safetensors").exists()
    assert "left" in caplog.text and "no export stage wrote" in caplog.text


def test_stale_temp_outputs_are_removed_only_when_provably_a_dead_runs(tmp_path):
    from pipeline.outputs import atomic_dir, write_atomic

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = [tmp_path / f".out.tmp-{dead_pid}-abc123", tmp_path / f".out.old-{dead_pid}"]
    for path in stale:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"x" * 1000)
    kept = [tmp_path / f".out.tmp-{os.getpid()}-live01",  # a running process's (this one)
            tmp_path / ".out.tmp-notapid", tmp_path / f".other.tmp-{dead_pid}-abc123", tmp_path / "out.tmp-1-x"]
    for path in kept:
        path.mkdir()
    (tmp_path / f".kl.json.tmp-{dead_pid}").write_text("{")
    with atomic_dir(tmp_path / "out", "calib") as tmp:
        (tmp / "stats.json").write_text("{}")
    write_atomic(tmp_path / "kl.json", "{}")
    assert not any(p.exists() for p in stale) and not (tmp_path / f".kl.json.tmp-{dead_pid}").exists()
    assert all(p.exists() for p in kept)


_HANG_IN_VERIFY = """
import sys, time
from pipeline.quantize import verify
from pipeline.stages.quantize import run

def hang(*args, **kwargs):
    print("verifying", flush=True)
    time.sleep(600)

verify.verify = hang  # stands still where `quantize awq` was killed in the report: save done, verify running
run(sys.argv[1], sys.argv[2], sys.argv[3], "awq", group_size=32, batch_size=8, n_grid=4)
"""


@pytest.mark.slow
def test_awq_killed_during_verify_leaves_a_temp_dir_the_next_run_removes(tiny_llama, tiny_calib, tmp_path):
    from pipeline.stages.quantize import run as quantize_run

    out = tmp_path / "models" / "awq"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _HANG_IN_VERIFY, str(tiny_llama), str(out), str(tiny_calib / "calib.jsonl")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path)
    try:
        for line in proc.stdout:
            if line.strip() == "verifying":
                break
        else:
            pytest.fail("the subprocess ended before verifying")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    leftovers = [p for p in out.parent.iterdir() if p.name.startswith(f".awq.tmp-{proc.pid}-")]
    assert len(leftovers) == 1 and (leftovers[0] / "model.safetensors").exists() and not out.exists()

    quantize_run(tiny_llama, out, tiny_calib / "calib.jsonl", "awq", group_size=32, batch_size=8, n_grid=4)
    assert sorted(p.name for p in out.parent.iterdir()) == ["awq"]
    assert (out / "quant.json").exists()


# ---------------------------------------------------------------- verdict.json and index.html: one run's pair

def _report(root: Path, pause: str | None = None) -> subprocess.Popen:
    from test_bad_inputs import report_args

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if pause:
        env["QUANTIZE_PAUSE_AT"] = pause
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli.app", *map(str, report_args(root))], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kill_at(root: Path, step: str) -> None:
    proc = _report(root, f"report:{step}")
    try:
        line = proc.stderr.readline()
        assert line.strip() == f"paused at report:{step}", line + proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()


def _pair(reports: Path) -> tuple[bytes | None, bytes | None]:
    """The page and verdict a reader sees, checked to come from one run with the model cards beside them: one
    folder, its record's digests."""
    import hashlib

    from pipeline.outputs import read_stage_record

    files = {name: reports / name for name in ("index.html", "verdict.json")}
    files.update({str(card.relative_to(reports)): card for card in sorted((reports / "cards").glob("*/README.md"))})
    seen = {name: path.read_bytes() if path.exists() else None for name, path in files.items()}
    record = read_stage_record(reports / ".report")
    for name, data in seen.items():
        if data is not None:
            assert Path(os.path.realpath(files[name])).parent.is_relative_to(os.path.realpath(reports / ".report"))
            assert hashlib.sha256(data).hexdigest() == record["sha256"][name], f"{name} is not the run's"
    if seen["verdict.json"] is not None:  # every variant it decided has its card, of this run
        decided = [name for name, v in json.loads(seen["verdict.json"])["variants"].items() if "coverage" in v]
        assert decided and sorted(decided) == sorted(p.parent.name for p in (reports / "cards").glob("*/README.md"))
    return seen["index.html"], seen["verdict.json"]


@pytest.mark.parametrize("step", ["written", "swapped", "linked-first"])
def test_report_killed_at_any_step_leaves_page_and_verdict_of_one_run(tmp_path, step):
    """SIGKILL between the report's steps (issue 26): the page and the verdict a reader finds are
    always the same run's: the previous run's until the one rename, the new run's after it."""
    from test_bad_inputs import build_results

    root = tmp_path / "project"
    build_results(root)
    reports = root / "reports"
    first_run = step == "linked-first"  # no report yet (or `dvc repro` removed it): the links are made
    if not first_run:
        assert _report(root).wait(timeout=300) == 0
    old = _pair(reports)
    params = root / "params.yaml"
    params.write_text(params.read_text().replace("math: 0.03", "math: 0.25"))  # another verdict
    _kill_at(root, step)
    page, verdict = _pair(reports)
    if step == "written":  # the new pair is complete but not swapped in: the old one stands
        assert (page, verdict) == old
    elif step == "swapped":
        assert page != old[0] and verdict != old[1] and page and verdict
        assert json.loads(verdict)["variants"]["awq-w4a16"]["suites"]["math"]["margin"] == 0.25
    else:  # the page's link is made, the verdict's not yet: no verdict a gate could read against the page
        assert old == (None, None) and page and verdict is None
    # the next run completes the pair and removes what the killed one left
    assert _report(root).wait(timeout=300) == 0
    page, verdict = _pair(reports)
    assert json.loads(verdict)["variants"]["awq-w4a16"]["suites"]["math"]["margin"] == 0.25
    current = os.readlink(reports / ".report")
    assert sorted(p.name for p in reports.iterdir()) == sorted([".report", current, "cards", "index.html", "verdict.json"])


def test_the_report_pair_survives_a_relative_folder_and_an_absolute_temp_path(tmp_path, monkeypatch):
    """Python 3.12's tempfile.mkdtemp returns an absolute path even for a relative `dir`: the run's own folder must
    not be taken for an earlier run's and removed (seen on the H200, Python 3.12: every link of the report dangled)."""
    import os
    import tempfile

    from pipeline.report import publish

    monkeypatch.chdir(tmp_path)
    real = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: os.path.abspath(real(*a, **k)))
    for run in ("first", "second"):
        publish.write_pair("reports", {"index.html": f"{run} page", "verdict.json": f"{run} verdict"}, "report")
        assert (tmp_path / "reports" / "index.html").read_text() == f"{run} page"
        assert (tmp_path / "reports" / "verdict.json").read_text() == f"{run} verdict"
    assert len(list((tmp_path / "reports").glob(".report-*"))) == 1  # the earlier run's folder went, this one stayed
