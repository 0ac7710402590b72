"""Profiles: a params.yaml and its dvc.yaml that go together, switched with one command.

    quantize profile              # which profile the project's files are, and the ones there are
    quantize profile gpu          # GLM-4-9B-class model on one GPU with vLLM (an 80 GB H100 or a 141 GB H200: its
                                  # servers fitted to the card found), full suites, bench, vLLM judge
    quantize profile cpu-demo     # back to the CPU demo (`make demo`)
    quantize profile --fix V      # dvc.yaml in use: build, measure and decide the fix of W4A16 variant V (fix.py)

Both files are written together (params.yaml's suites and variants must match dvc.yaml's matrices,
which DVC cannot derive from params for `foreach` lists of stage names). Files edited since a profile
wrote them are not overwritten without --force: the command says which file differs. DVC reruns what the
new files change on the next `dvc repro`; results of unchanged stages stay.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import UserError

PROFILES = Path(__file__).resolve().parent
FILES = ("params.yaml", "dvc.yaml")
# a profile's file -> the project's; not named dvc.yaml here, or DVC would take each for a pipeline of its own
STORED = {"params.yaml": "params.yaml", "dvc.yaml": "dvc-stages.yaml"}


def stored(name: str, file: str) -> Path:
    return PROFILES / name / STORED[file]
SUMMARIES = {
    "cpu-demo": "the CPU demo: SmolLM2-135M, hf engine, small suites, one fix stage (rtn-w4a16), ~13 minutes on 2 cores",
    "gpu": "a GLM-4-9B-class model on one GPU of 80 GB or more (H100, H200): vLLM, each server sized from what it "
           "holds and as many resident at once as the card fits (`quantize warm --plan`), every suite at full size, "
           "long context to 128k, quantize bench in the DAG, the judge through vLLM",
}
ALIASES = {"gpu-h200": "gpu"}  # the GPU profile's name before it fitted its servers to the card (issue 59)


def names() -> list[str]:
    return sorted(p.name for p in PROFILES.iterdir() if p.is_dir() and all((p / STORED[f]).is_file() for f in FILES))


def current(root: Path) -> str | None:
    """The profile whose files the project holds unchanged, else None."""
    here = {f: (root / f).read_bytes() if (root / f).is_file() else None for f in FILES}
    for name in names():
        if all(here[f] == stored(name, f).read_bytes() for f in FILES):
            return name
    return None


def describe(root: Path) -> str:
    active = current(root)
    lines = [f"{'*' if n == active else ' '} {n}: {SUMMARIES.get(n, '')}" for n in names()]
    state = f"in use: {active}" if active else "params.yaml / dvc.yaml hold local edits (no profile matches them)"
    from pipeline.profiles.fix import offers_in

    return "\n".join([state, *lines, *(f"  {offer}" for offer in offers_in(root))])


def switch(name: str, root: Path, force: bool = False) -> list[str]:
    """Writes the profile's files into root; returns the files that changed."""
    name = ALIASES.get(name, name)
    if name not in names():
        raise UserError(f"profile {name!r}: use one of {', '.join(names())}")
    if not force and current(root) is None:
        edited = [f for f in FILES if (root / f).is_file()
                  and not any((root / f).read_bytes() == stored(n, f).read_bytes() for n in names())]
        if edited:
            raise UserError(f"{', '.join(edited)} in {root} differ from every profile (local edits); keep a copy "
                            f"and rerun with --force to replace them with the {name} profile")
    new = {f: stored(name, f).read_bytes() for f in FILES}
    changed = [f for f in FILES if not (root / f).is_file() or (root / f).read_bytes() != new[f]]
    from pipeline.outputs import write_together

    write_together({root / f: new[f] for f in changed})  # both or neither: a refused write changes none
    return changed
