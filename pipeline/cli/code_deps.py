"""Each DVC stage's code: the pipeline/ modules its command imports, derived from the source, kept in one file per
command that the stage depends on (so dvc.lock holds one entry for a stage's code, not ~50).

    quantize code                       # the `code` stage: .cache/code/<command>.txt, each file a module with its hash
    python -m tools.dvc_deps            # which stages of dvc.yaml and pipeline/profiles/*/dvc-stages.yaml differ
    python -m tools.dvc_deps --write    # make every `quantize` stage depend on its command's code file

A stage's command is `quantize <subcommand> ...`; what it imports is found from the source, at the level of
functions and classes (pipeline/cli/code_reach.py says how).

The `code` stage (first in dvc.yaml; deps: pipeline/ and evals/) writes, for every `quantize` subcommand a stage of
dvc.yaml or of a profile runs, `.cache/code/<subcommand>.txt`: one line per file that command reaches (a package
directory's files, and the data files beside a reached module) with its sha256. Every `quantize` stage depends on
its command's file, so an edit reruns the `code` stage (about a second) and then exactly the stages whose file's
content changed; the others are not run. tests/test_dvc_deps.py checks dvc.yaml and the profiles against it;
tests/test_dvc_pipeline.py checks it from the other side (what `dvc repro` really reads).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from pipeline.cli.code_reach import REPO, Module, derive, read_package

DVC_FILES = ("dvc.yaml", "pipeline/profiles/cpu-demo/dvc-stages.yaml", "pipeline/profiles/gpu/dvc-stages.yaml")
CODE_DIR = ".cache/code"  # the code stage's outputs: one file per `quantize` subcommand
CODE_STAGE = "code"  # its subcommand (`quantize code`), whose deps are pipeline/ and evals/ themselves


# ---------------------------------------------------------------- dvc.yaml

def stages(text: str) -> dict[str, dict]:
    """{stage: {"cmd", "deps"}} of a dvc.yaml (foreach/matrix stages: their template)."""
    import yaml

    result = {}
    for name, stage in (yaml.safe_load(text).get("stages") or {}).items():
        body = stage.get("do", stage)
        result[name] = {"cmd": body.get("cmd", ""), "deps": [d if isinstance(d, str) else next(iter(d))
                                                             for d in body.get("deps") or []]}
    return result


def expected(text: str, app, modules: dict[str, Module] | None = None) -> dict[str, list[str]]:
    """{stage: its derived pipeline/ deps} for every stage of a dvc.yaml that runs `quantize` (but the code stage)."""
    modules = modules or read_package()
    result = {}
    for name, stage in stages(text).items():
        words = stage["cmd"].split()
        if len(words) < 2 or words[0] != "quantize" or words[1] == CODE_STAGE:
            continue
        result[name] = derive(words[1], other_deps(stage), app, modules)
    return result


def other_deps(stage: dict) -> list[str]:
    """A stage's deps that are not its code (evals/, data): the .py files under them are roots of the derivation."""
    return [d for d in stage["deps"] if not d.startswith(("pipeline/", CODE_DIR + "/")) and "$" not in d]


def code_file(subcommand: str) -> str:
    return f"{CODE_DIR}/{subcommand}.txt"


def code_deps(text: str) -> dict[str, list[str]]:
    """{stage: [its command's code file]} for every `quantize` stage of a dvc.yaml but the code stage."""
    return {name: [code_file(stage["cmd"].split()[1])] for name, stage in stages(text).items()
            if len(stage["cmd"].split()) > 1 and stage["cmd"].split()[0] == "quantize"
            and stage["cmd"].split()[1] != CODE_STAGE}


def by_command(texts: list[str], app, modules: dict[str, Module] | None = None) -> dict[str, list[str]]:
    """{subcommand: the pipeline/ files it reaches} over every `quantize` stage of the dvc.yaml texts (a command
    run by several stages, e.g. `kl` by kl and rank: what any of them reaches)."""
    modules = modules or read_package()
    found: dict[str, set[str]] = {}
    for text in texts:
        for stage in stages(text).values():
            words = stage["cmd"].split()
            if len(words) < 2 or words[0] != "quantize" or words[1] == CODE_STAGE:
                continue
            found.setdefault(words[1], set()).update(derive(words[1], other_deps(stage), app, modules))
    return {command: sorted(files) for command, files in sorted(found.items())}


def files_of(listing: list[str]) -> list[Path]:
    """The files a listing covers: a directory's files (no bytecode), each file itself."""
    out = set()
    for entry in listing:
        path = REPO / entry
        if path.is_dir():
            out.update(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                       and p.suffix != ".pyc")
        elif path.is_file():
            out.add(path)
    return sorted(out)


def write_code(out: Path, project: Path, app) -> dict[str, int]:
    """The code stage: out/<subcommand>.txt for every `quantize` subcommand that the project's dvc.yaml and the
    profiles run, each line `sha256  path` of a file it reaches, hashed in the project (the files DVC tracks as the
    code stage's deps; the package imported when the project holds none). Returns {subcommand: files}."""
    import hashlib

    root = project if (project / "pipeline").is_dir() else REPO

    texts = [(project / "dvc.yaml").read_text(encoding="utf-8")] if (project / "dvc.yaml").is_file() else []
    texts += [(REPO / relative).read_text(encoding="utf-8") for relative in DVC_FILES[1:]]
    from pipeline.outputs import write_atomic

    counts = {}
    for command, listing in by_command(texts, app).items():
        files = files_of(listing)
        lines = [f"# what `quantize {command}` runs: every pipeline/ file it imports or reads beside them "
                 "(pipeline/cli/code_deps.py), with its sha256\n"]
        names = [f.relative_to(REPO).as_posix() for f in files]
        lines += [f"{hashlib.sha256((root / name).read_bytes()).hexdigest()}  {name}\n" for name in names
                  if (root / name).is_file()]
        target = out / f"{command}.txt"
        text = "".join(lines)
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            write_atomic(target, text)  # a refused write: one message naming it, no temp file left
        counts[command] = len(files)
    return counts


def read_code_file(path: Path) -> list[str]:
    """The paths a code file lists."""
    return [line.split(None, 1)[1].strip() for line in Path(path).read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.startswith("#")]


CODE_ENTRY = re.compile(r"^(\s+)- ((?:pipeline/|" + re.escape(CODE_DIR) + r"/)\S+)")


def rewrite(text: str, wanted: dict[str, list[str]]) -> str:
    """`text` with each stage's code deps (pipeline/ entries, its code file) replaced by `wanted[stage]` in their
    place (first of the list); every other line, comment and dep kept as it was."""
    lines = text.splitlines(keepends=True)
    out, stage, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        header = re.match(r"^  ([A-Za-z0-9_.-]+):\s*(#.*)?$", line)
        if header:
            stage = header.group(1)
        deps = re.match(r"^(\s+)deps:\s*$", line)
        if not (deps and stage in wanted):
            out.append(line)
            i += 1
            continue
        out.append(line)
        indent = len(deps.group(1))
        i += 1
        items, placed = [], False
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            item = CODE_ENTRY.match(lines[i])
            if item:
                if not placed:
                    items += [f"{item.group(1)}- {dep}\n" for dep in wanted[stage]]
                    placed = True
            else:
                items.append(lines[i])
            i += 1
        if not placed:
            pad = " " * (indent + 2)
            items = [f"{pad}- {dep}\n" for dep in wanted[stage]] + items
        out += items
    return "".join(out)


def main(argv: list[str]) -> int:
    write = "--write" in argv
    stale = []
    for relative in DVC_FILES:
        path = REPO / relative
        text = path.read_text(encoding="utf-8")
        new = rewrite(text, code_deps(text))
        if new != text:
            stale.append(relative)
            if write:  # whole or not at all: a dvc.yaml cut short would stop every `dvc repro`
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(new, encoding="utf-8")
                tmp.replace(path)
    verb = "rewrote" if write else "stale (run `python -m tools.dvc_deps --write`)"
    print(f"{verb}: {', '.join(stale)}" if stale else "every quantize stage depends on its command's code file")
    return 1 if stale and not write else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
