"""The report's page, verdict and model cards, written as one unit (`write_pair`): every file lives in one new folder
that a single rename swaps in, so a reader, or a kill at any point, sees them all from the same run. The folder holds
the stage's provenance record like every folder a stage writes (pipeline/outputs.py)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from pipeline.errors import write_refused
from pipeline.outputs import make_folders, pid_alive, read_stage_record, remove_folders, write_stage_record

PAUSE_ENV = "QUANTIZE_PAUSE_AT"  # tests only: the step name at which a writer stops and waits to be killed


def _pause(step: str) -> None:
    """When PAUSE_ENV names `step`: say so on stderr and wait (a test kills the process here)."""
    if os.environ.get(PAUSE_ENV) == step:
        import sys

        print(f"paused at {step}", file=sys.stderr, flush=True)
        while True:
            time.sleep(60)


def _pair_link_problem(out_dir: Path, link: str, name: str, target: str) -> str | None:
    path = out_dir / name
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() and os.readlink(path) == target:
        return None
    return f"{path} is not the {link} link a previous run left ({name} -> {target})"


def write_pair(out_dir: Path | str, files: dict[str, str], stage: str,
               inputs: dict[str, Path | str | None] | None = None) -> None:
    """Writes `files` (name -> text; a name may hold folders: `cards/V/README.md`) into `out_dir` as one unit. Each
    `out_dir/TOP` (a name's first part: a file, or a folder of them) is a link to `.STAGE/TOP`, and `.STAGE` a link to
    the folder `.STAGE-PID-X` that holds this run's files and its provenance record: one rename of `.STAGE` swaps
    every file at once, so a reader (or a kill at any point) sees all the files of one run. The links are made in
    the order of `files` (the last one's link last). Other files in `out_dir` are left alone; a TOP or `.STAGE`
    there that is not such a link is refused (never overwritten). Earlier runs' folders are removed."""
    from pipeline.errors import UserError

    out_dir = Path(out_dir)
    current = out_dir / f".{stage}"
    encoded = {name: text.encode("utf-8") for name, text in files.items()}  # fails before any write
    tops = list(dict.fromkeys(_top(name) for name in files))  # what out_dir holds a link to, in order
    problems = _pair_problems(out_dir, stage, tops, current)
    if problems:
        raise UserError(f"{out_dir}: " + "; ".join(problems) + f"; {stage} writes only files it wrote before: "
                        "move them away or choose another --out")
    made = make_folders(out_dir, f"the {stage}")
    new = _new_run_folder(out_dir, stage, made)
    try:
        new.chmod(0o755)
        for name, data in encoded.items():
            (new / name).parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            with open(new / name, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        write_stage_record(new, stage, inputs, sha256={name: hashlib.sha256(data).hexdigest()
                                                       for name, data in encoded.items()})
        _pause(f"{stage}:written")
        link = out_dir / f".{stage}.tmp-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        os.symlink(new.name, link)
        os.replace(link, current)  # the one step that changes what every file reads
    except BaseException as exc:
        shutil.rmtree(new, ignore_errors=True)
        remove_folders(made)
        if isinstance(exc, Exception) and (refused := write_refused(exc, out_dir, f"the {stage} into",
                                                                    sum(map(len, encoded.values())), needed=True)):
            raise refused from None
        raise
    _pause(f"{stage}:swapped")
    for index, name in enumerate(tops):
        path = out_dir / name
        if not path.is_symlink():  # first run (or after `dvc repro` removed the outputs): the stable link
            tmp = out_dir / f".{name}.tmp-{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            os.symlink(f".{stage}/{name}", tmp)
            os.replace(tmp, path)
            if index == 0:
                _pause(f"{stage}:linked-first")
    _remove_earlier_runs(out_dir, stage, new)


def _new_run_folder(out_dir: Path, stage: str, made: list[Path]) -> Path:
    """This run's folder `.STAGE-PID-X` in out_dir, after removing a killed run's half-made link; a refusal is a
    UserError (the folders `made` for out_dir removed)."""
    from pipeline.errors import UserError

    try:
        for leftover in out_dir.glob(f".{stage}.tmp-*"):  # a killed run's half-made link
            match = leftover.name.rsplit("-", 1)[-1]
            if match.isdigit() and not pid_alive(int(match)) and leftover.is_symlink():
                leftover.unlink()
        return Path(tempfile.mkdtemp(prefix=f".{stage}-{os.getpid()}-", dir=out_dir))
    except OSError as exc:
        remove_folders(made)
        if refused := write_refused(exc, out_dir, f"the {stage} into"):
            raise refused from None
        raise UserError(f"{out_dir}: cannot write the {stage} there ({exc.strerror}: {exc.filename}); "
                        "pass --out a writable directory") from None


def _top(name: str) -> str:
    """The first part of a name write_pair writes (`cards` of `cards/V/README.md`), refused when it could leave the
    run's folder."""
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or ".." in parts:
        raise ValueError(f"{name!r}: not a name inside the report's folder")
    return parts[0]


def _pair_problems(out_dir: Path, stage: str, tops: list[str], current: Path) -> list[str]:
    """Why write_pair must not write here: a TOP or `.STAGE` that is not such a link of an earlier run."""
    problems = [p for name in tops if (p := _pair_link_problem(out_dir, stage, name, f".{stage}/{name}"))]
    if current.exists() or current.is_symlink():
        target = os.readlink(current) if current.is_symlink() else ""
        ours = target.startswith(f".{stage}-") and "/" not in target
        record = read_stage_record(current) if ours else None
        if not ours or (current.exists() and (record is None or record["stage"] != stage)):
            problems.append(f"{current} is not a link to a folder of a previous {stage} run")
    return problems


def _remove_earlier_runs(out_dir: Path, stage: str, new: Path) -> None:
    """Earlier runs' folders go; a running writer's own is left alone."""
    for old in out_dir.glob(f".{stage}-*"):
        pid = old.name.removeprefix(f".{stage}-").split("-")[0]
        # by name: tempfile.mkdtemp returns an absolute path since Python 3.12, `old` is relative to out_dir
        if old.name != new.name and old.is_dir() and not old.is_symlink() and pid.isdigit() and \
                old.lstat().st_uid == os.getuid() and (int(pid) == os.getpid() or not pid_alive(int(pid))):
            shutil.rmtree(old, ignore_errors=True)
