"""Each DVC stage's code is the pipeline/ modules its command imports, derived from the source
(pipeline/cli/code_reach.py) and kept with their hashes in the code stage's file for that command; every `quantize`
stage of dvc.yaml and of both profiles' dvc-stages.yaml depends on its command's file; so editing a module reruns only
the stages that import it."""

import subprocess
import sys
import textwrap

import pytest

from conftest import REPO
from pipeline.cli import code_deps as dvc_deps
from pipeline.cli import code_reach
from pipeline.cli.app import app

FILES = dvc_deps.DVC_FILES


def listed(text: str) -> dict[str, list[str]]:
    return {name: [d for d in stage["deps"] if d.startswith(("pipeline", ".cache/code"))]
            for name, stage in dvc_deps.stages(text).items()}


def covers(deps: list[str], path: str) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


@pytest.fixture(scope="module")
def derived():
    modules = code_reach.read_package()
    return {name: dvc_deps.expected((REPO / name).read_text(), app, modules) for name in FILES}


@pytest.mark.parametrize("name", FILES)
def test_each_stage_depends_on_its_commands_code_file_and_the_code_stage_on_the_source(name, derived):
    text = (REPO / name).read_text()
    have = listed(text)
    stages = dvc_deps.stages(text)
    assert stages["code"]["cmd"] == "quantize code" and have["code"] == ["pipeline"] and "evals" in stages["code"]["deps"]
    for stage in derived[name]:
        command = stages[stage]["cmd"].split()[1]
        assert have[stage] == [f".cache/code/{command}.txt"], f"{name}: {stage}: {have[stage]}"
    assert dvc_deps.rewrite(text, dvc_deps.code_deps(text)) == text  # the command would change nothing


def test_the_code_files_list_exactly_what_each_command_imports_with_hashes(tmp_path, derived):
    """`quantize code` (the code stage): one file per command the stages run, each the files the derivation reaches
    (every stage running that command), with their sha256; written again unchanged, the same bytes (DVC then reruns
    no stage)."""
    import hashlib

    done = subprocess.run([sys.executable, "-m", "pipeline.cli.app", "code", "--out", str(tmp_path / "code")],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    texts = [(REPO / name).read_text() for name in FILES]
    for command, listing in dvc_deps.by_command(texts, app).items():
        path = tmp_path / "code" / f"{command}.txt"
        files = dvc_deps.read_code_file(path)
        assert files == [f.relative_to(REPO).as_posix() for f in dvc_deps.files_of(listing)]
        for stage_deps in (d for name in FILES for stage, d in derived[name].items()
                           if dvc_deps.stages((REPO / name).read_text())[stage]["cmd"].split()[1] == command):
            assert all(covers(files, f) or any(f2.startswith(f.rstrip("/") + "/") for f2 in files) for f in stage_deps)
        first = path.read_text().splitlines()[1].split()
        assert first[0] == hashlib.sha256((REPO / first[1]).read_bytes()).hexdigest()
    before = {p.name: p.read_bytes() for p in (tmp_path / "code").iterdir()}
    subprocess.run([sys.executable, "-m", "pipeline.cli.app", "code", "--out", str(tmp_path / "code")], cwd=REPO,
                   check=True, capture_output=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "code").iterdir()} == before
    eval_files = dvc_deps.read_code_file(tmp_path / "code" / "eval.txt")
    assert "pipeline/stages/quantize.py" not in eval_files and "pipeline/stages/evaluate.py" in eval_files


@pytest.mark.parametrize("name", FILES)
def test_the_planner_and_the_methods_recipes_are_deps_of_the_quantize_stages_only(name, derived):
    """Editing the planner, the stage or AWQ's search reruns `quantize` (and `fix`, which quantizes the fix through
    the quantize stage) only; every stage validates params.yaml with the method registry, so the methods'
    declarations (not their recipes' helpers) are everyone's deps."""
    quantize_only = ["pipeline/quantize/plan.py", "pipeline/stages/quantize.py", "pipeline/quantize/verify.py",
                     "pipeline/methods/awq_gram.py", "pipeline/methods/awq_mappings.py"]
    for stage, deps in derived[name].items():
        for path in quantize_only:
            assert covers(deps, path) == (stage in ("quantize", "fix")), f"{name}: {stage} and {path}"
        assert covers(deps, "pipeline/stages/fix.py") == (stage == "fix"), f"{name}: {stage}"
        assert covers(deps, "pipeline/methods/__init__.py") and covers(deps, "pipeline/settings/params.py"), stage


def test_the_derivation_follows_what_runs(derived):
    """On the real code: the engine registry's targets reach the stages that make engines (eval: hf, vLLM and the
    supervisor it starts with -m); every stage validates params.yaml's `engine` with the engines' sections
    (engines/sections.py), which import no engine's code, so a stage that runs no engine (resave, calib, quantize,
    report) does not depend on the engines' modules: an edit to vllm_server.py reruns no quantization; KL and
    quantize make their room on the GPU (engines/gpu_room.py); the report reads the serving table."""
    deps = derived["dvc.yaml"]
    engine_code = ["pipeline/engines/hf.py", "pipeline/engines/vllm.py", "pipeline/engines/vllm_server.py",
                   "pipeline/engines/lmdeploy.py", "pipeline/engines/openai.py", "pipeline/engines/supervisor.py"]
    assert all(covers(deps["evaluate"], path) for path in engine_code)
    for stage in deps.values():
        assert covers(stage, "pipeline/engines/__init__.py") and covers(stage, "pipeline/engines/sections.py")
        assert covers(stage, "pipeline/engines/settings.py") and covers(stage, "pipeline/methods/awq.py")
    for stage in ("resave", "calib", "quantize", "report"):
        assert not [path for path in engine_code if covers(deps[stage], path)], stage
    assert covers(deps["kl"], "pipeline/engines/gpu_room.py") and covers(deps["quantize"], "pipeline/engines/gpu_room.py")
    assert covers(deps["report"], "pipeline/checkpoints/serving.py")
    assert covers(deps["report"], "pipeline/report/template.html")  # package data beside a reached module


def _package(tmp_path, files: dict[str, str]) -> dict:
    modules = {}
    for name, source in files.items():
        path = tmp_path / (name.replace(".", "_") + ".py")
        path.write_text(textwrap.dedent(source))
        modules[name] = code_reach.read_module(path, name)
    return modules


def test_rules_on_a_small_package(tmp_path):
    """A lazy import counts once its function runs; registering a command runs nothing; a registry of modules
    hands its callers' duck calls (`method.recipe()`) to every registered module; a registry's import targets
    reach only the functions that import them."""
    modules = _package(tmp_path, {
        "pipeline": "", "pipeline.cli": "",
        "pipeline.cli.app": """
            from pipeline.cli import heavy as cli_heavy
            from pipeline.cli import common as cli_common
            cli_common.register(cli_heavy.command)
            def light():
                from pipeline import light
            """,
        "pipeline.cli.common": "def register(function):\n    return function\n",
        "pipeline.cli.heavy": "def command():\n    from pipeline import heavy\n",
        "pipeline.heavy": "", "pipeline.light": "", "pipeline.helper": "", "pipeline.engine": "",
        "pipeline.registry": """
            from pipeline import method_a
            METHODS = (method_a,)
            TARGETS = {"e": "pipeline.engine:Engine"}
            def get(name):
                return {m.NAME: m for m in METHODS}[name]
            def make(name):
                import importlib
                return importlib.import_module(TARGETS[name].split(":")[0])
            """,
        "pipeline.method_a": """
            NAME = "a"
            def recipe():
                from pipeline import helper
            """,
        "pipeline.stage": """
            from pipeline import registry
            def run(name):
                return registry.get(name).recipe()
            """,
        "pipeline.user": "from pipeline import registry\ndef names():\n    return [m.NAME for m in registry.METHODS]\n",
        "pipeline.maker": "from pipeline import registry\ndef go():\n    return registry.make('e')\n",
    })

    def reach(*roots):
        r = code_reach.Reach(modules)
        for root in roots:
            r.add(*root)
        return r.run()

    assert reach(("pipeline.cli.app", ""), ("pipeline.cli.app", "light")) >= {"pipeline.light", "pipeline.cli.heavy"}
    assert "pipeline.heavy" not in reach(("pipeline.cli.app", ""), ("pipeline.cli.app", "light"))
    assert "pipeline.heavy" in reach(("pipeline.cli.heavy", "command"))
    assert "pipeline.helper" in reach(("pipeline.stage", "run"))
    assert "pipeline.helper" not in reach(("pipeline.user", "names"))
    assert "pipeline.engine" in reach(("pipeline.maker", "go"))
    assert "pipeline.engine" not in reach(("pipeline.user", "names"))


def test_a_module_not_of_ours_held_as_a_value_reaches_nothing(tmp_path):
    """An evals/ file passing the standard library's `signal` as a value (`hasattr(signal, "SIGALRM")`) held a module
    the package does not have, and the reach stopped with a KeyError at the first duck call (`clock.start()`; issue 66's
    MATH-500 scorer met it)."""
    modules = _package(tmp_path, {
        "pipeline": "", "pipeline.helper": "",
        "evals_utils": """
            import signal
            from pipeline import helper
            def timer(clock):
                return hasattr(signal, "SIGALRM") and clock.start() and helper.go()
            """,
    })
    r = code_reach.Reach(modules)
    r.add("evals_utils", "timer")
    assert "pipeline.helper" in r.run()


def test_rewrite_replaces_only_the_code_entries_of_each_stage():
    text = (REPO / "dvc.yaml").read_text()
    current = dvc_deps.code_deps(text)
    changed = {stage: (deps + ["pipeline/extra.py"] if stage == "report" else deps) for stage, deps in current.items()}
    new = dvc_deps.rewrite(text, changed)
    added = [line for line in new.splitlines() if line not in text.splitlines()]
    assert added == ["      - pipeline/extra.py"]
    assert len(new.splitlines()) == len(text.splitlines()) + 1
    old_style = text.replace("      - .cache/code/report.txt\n", "      - pipeline/a.py\n      - pipeline/b\n")
    assert dvc_deps.rewrite(old_style, current) == text  # a list of modules becomes the code file


def test_the_command_says_what_is_stale_and_writes_nothing_without_write():
    done = subprocess.run([sys.executable, "-m", "tools.dvc_deps"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and "code file" in done.stdout, done.stdout + done.stderr
