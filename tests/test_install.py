"""The package installs as documented: each extra resolves beside the torch a GPU machine already has,
and what the code imports is what pyproject.toml declares.

The resolutions are real: uv resolves pyproject.toml against PyPI for a Linux x86-64, Python 3.12
machine (the GPU machines' platform) with torch held at the version already installed there, the
way `make gpu-install` asks pip to. Nothing is installed.
"""

import ast
import re
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
UV = Path(sys.executable).with_name("uv")
# (extras, torch already on the machine, what must come with it)
SCENARIOS = [
    ("vllm", "2.13.0", "vllm"),  # vLLM 0.27-0.33 pin torch 2.13
    ("vllm", "2.11.0", "vllm"),  # the H200 image's torch: an older vLLM that pins 2.11
    ("lmdeploy", "2.12.1", "lmdeploy"),  # lmdeploy 0.18 wants torch <= 2.12.1
    ("quantize", "2.13.0", "llmcompressor"),  # the CPU machines' torch
]


def resolve(extras: str, torch_version: str, tmp_path: Path) -> subprocess.CompletedProcess:
    constraints = tmp_path / f"torch-{extras}-{torch_version}.txt"
    constraints.write_text(f"torch=={torch_version}\n")
    command = [str(UV), "pip", "compile", str(REPO / "pyproject.toml"), "-c", str(constraints),
               "--python-version", "3.12", "--python-platform", "x86_64-manylinux_2_28",
               "--index-url", "https://pypi.org/simple", "--no-header", "--quiet"]
    for extra in extras.split(","):
        command += ["--extra", extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def pins(output: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", output, flags=re.M))


def test_each_extra_resolves_beside_the_installed_torch(tmp_path):
    with ThreadPoolExecutor(len(SCENARIOS) + 1) as pool:
        runs = list(pool.map(lambda s: resolve(s[0], s[1], tmp_path), SCENARIOS))
        both = pool.submit(resolve, "quantize,vllm", "2.13.0", tmp_path).result()
    for (extras, torch_version, package), done in zip(SCENARIOS, runs):
        assert done.returncode == 0, f".[{extras}] with torch {torch_version}:\n{done.stderr[-2000:]}"
        found = pins(done.stdout)
        assert found.get("torch") == torch_version and package in found, (extras, found)
        print(f".[{extras}] with torch {torch_version}: {package} {found[package]}, "
              f"compressed-tensors {found.get('compressed-tensors')}, transformers {found.get('transformers')}")
    # the reason they are separate extras: one environment cannot hold both (README says so)
    assert both.returncode != 0 and "compressed-tensors" in both.stderr


# import name -> distribution, where they differ
DISTRIBUTION = {"yaml": "pyyaml", "sklearn": "scikit-learn", "lm_eval": "lm-eval", "math_verify": "math-verify",
                "compressed_tensors": "compressed-tensors", "PIL": "pillow",
                "pydantic_core": "pydantic"}  # pydantic's own core, pinned exactly by pydantic
# declared, used without an import of ours: dvc runs the pipeline; transformers places weights with accelerate
USED_WITHOUT_IMPORT = {"dvc", "accelerate"}
OPTIONAL = {"llmcompressor": "quantize", "loguru": "quantize", "vllm": "vllm", "lmdeploy": "lmdeploy"}


def _imports() -> set[str]:
    names = set()
    for path in list((REPO / "pipeline").rglob("*.py")) + list((REPO / "evals").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_imports_match_the_declared_dependencies():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~;\[ ]", d)[0].lower() for d in project["dependencies"]}
    extras = {extra: {re.split(r"[<>=!~;\[ ]", d)[0].lower() for d in deps}
              for extra, deps in project["optional-dependencies"].items()}
    stdlib = set(sys.stdlib_module_names)
    third_party = {name for name in _imports() if name not in stdlib and name not in ("pipeline", "utils")}
    needed = {DISTRIBUTION.get(name, name).replace("_", "-").lower() for name in third_party}
    for name, extra in OPTIONAL.items():
        if name in needed:
            needed.discard(name)
            assert name in extras[extra], f"{name} is imported: declare it in the {extra} extra"
    undeclared = needed - declared
    assert not undeclared, f"imported but not declared in pyproject.toml: {sorted(undeclared)}"
    unused = declared - needed - USED_WITHOUT_IMPORT
    assert not unused, f"declared but never imported: {sorted(unused)}; use or drop them"
