"""Each DVC stage's pipeline/ deps are the modules its command imports, derived from the source (tools/dvc_deps.py),
in dvc.yaml and in both profiles' dvc-stages.yaml; so editing a module reruns only the stages that import it."""

import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))  # the generator lives beside the other tools, not among the tests
import dvc_deps  # noqa: E402

FILES = dvc_deps.DVC_FILES


def listed(text: str) -> dict[str, list[str]]:
    return {name: [d for d in stage["deps"] if d.startswith("pipeline/")] for name, stage in dvc_deps.stages(text).items()}


def covers(deps: list[str], path: str) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


@pytest.fixture(scope="module")
def derived():
    modules = dvc_deps.read_package()
    return {name: dvc_deps.expected((REPO / name).read_text(), modules) for name in FILES}


@pytest.mark.parametrize("name", FILES)
def test_each_stage_lists_exactly_the_modules_its_command_imports(name, derived):
    text = (REPO / name).read_text()
    have = listed(text)
    problems = []
    for stage, want in derived[name].items():
        extra, missing = sorted(set(have[stage]) - set(want)), sorted(set(want) - set(have[stage]))
        if extra or missing:
            problems.append(f"{stage}: listed but not imported {extra}; imported but not listed {missing}")
    assert not problems, f"{name} (run `python -m tools.dvc_deps --write`):\n  " + "\n  ".join(problems)
    assert dvc_deps.rewrite(text, derived[name]) == text  # the command would change nothing


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
    supervisor it starts with -m); every stage validates params.yaml's `engine` as the section its engine's module
    declares (as `variants` with the method modules), so every stage depends on the engine modules, as on the
    method modules; KL stops idle servers (engines/shared.py); the report reads the serving table."""
    deps = derived["dvc.yaml"]
    assert covers(deps["evaluate"], "pipeline/engines/hf.py") and covers(deps["evaluate"], "pipeline/engines/supervisor.py")
    for stage in deps.values():
        assert covers(stage, "pipeline/engines/__init__.py") and covers(stage, "pipeline/engines/vllm.py")
        assert covers(stage, "pipeline/engines/settings.py") and covers(stage, "pipeline/methods/awq.py")
    assert covers(deps["kl"], "pipeline/engines/shared.py")
    assert covers(deps["report"], "pipeline/checkpoints/serving.py")
    assert covers(deps["report"], "pipeline/report/template.html")  # package data beside a reached module


def _package(tmp_path, files: dict[str, str]) -> dict:
    modules = {}
    for name, source in files.items():
        path = tmp_path / (name.replace(".", "_") + ".py")
        path.write_text(textwrap.dedent(source))
        modules[name] = dvc_deps.read_module(path, name)
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
        r = dvc_deps.Reach(modules)
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


def test_rewrite_replaces_only_the_pipeline_entries_of_each_stage():
    text = (REPO / "dvc.yaml").read_text()
    current = listed(text)
    changed = {stage: (deps + ["pipeline/extra.py"] if stage == "report" else deps) for stage, deps in current.items()}
    new = dvc_deps.rewrite(text, changed)
    added = [line for line in new.splitlines() if line not in text.splitlines()]
    assert added == ["      - pipeline/extra.py"]
    assert len(new.splitlines()) == len(text.splitlines()) + 1


def test_the_command_says_what_is_stale_and_writes_nothing_without_write():
    done = subprocess.run([sys.executable, "-m", "tools.dvc_deps"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and "match" in done.stdout, done.stdout + done.stderr
