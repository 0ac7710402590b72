"""The modules of this package a module imports, directly or through others, found by reading their source
(every import counts, also those inside functions): what a stage's results can depend on in code. evaluate.py
hashes them to tell whether a suite's results were computed by the code now here; dvc.yaml lists them as each
stage's deps (tests/test_dvc_pipeline.py checks what stages read).

Standard library only.
"""

from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PACKAGE = PACKAGE_DIR.name


def module_path(name: str) -> Path | None:
    """The source file of module `name` of this package (a package: its __init__.py), None when there is none."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    base = PACKAGE_DIR.joinpath(*name.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def direct_imports(name: str) -> set[str]:
    """The package's modules that module `name` names in an import statement (a `from x import y` of a
    submodule y counts as y)."""
    path = module_path(name)
    if path is None:
        return set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and module_path(target) is None:
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != name:
                found.add(target)
    return found


# params.py and the method registry validate settings: their values are in a suite's digest already, and what
# their code imports (a method's search, its mappings) computes no suite's results
SETTINGS = ("pipeline.settings.params", "pipeline.methods")
# the engine registry lists every engine module (each declares its params section): its own code counts, the engines
# it lists do not (a suite's digest names its own engine's modules: pipeline/stages/evaluate.py, code_digest)
REGISTRIES = ("pipeline.engines",)


@lru_cache(maxsize=None)
def closure(name: str, stop: tuple[str, ...] = SETTINGS) -> tuple[str, ...]:
    """`name` and every module of the package it imports, transitively (packages' __init__ included), sorted; the
    modules under `stop` (by prefix) are not followed, nor what a registry (REGISTRIES) imports."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or module_path(current) is None or (current != name and current.startswith(stop)):
            continue
        seen.add(current)
        parts = current.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b.c runs a and a.b first
        if current not in REGISTRIES or current == name:
            todo += sorted(direct_imports(current))
    return tuple(sorted(seen))


def source_digest(name: str) -> str:
    """Content hash of `name` and every module it imports (closure)."""
    digest = hashlib.sha256()
    for module in closure(name):
        digest.update(module.encode())
        digest.update(module_path(module).read_bytes())
    return digest.hexdigest()[:16]
