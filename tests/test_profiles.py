"""`quantize profile`: the CPU demo and the GPU configuration, each a params.yaml with its dvc.yaml."""

import os
import subprocess
import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from conftest import REPO, copy_repo
from pipeline.settings import params as params_mod
from pipeline import profiles
from pipeline.cli.app import app

PROFILES = REPO / "pipeline" / "profiles"


def test_the_project_files_are_the_cpu_demo_profile():
    """`make demo` runs the project's own files: they must be the cpu-demo profile's, byte for byte; and no
    profile file is named dvc.yaml (DVC would take it for a pipeline: `dvc status` would list its stages)."""
    assert profiles.current(REPO) == "cpu-demo"
    assert not list(PROFILES.rglob("dvc.yaml")) and not list(PROFILES.rglob("*.dvc"))


def test_one_command_switches_to_the_gpu_profile_and_back(tmp_path, monkeypatch):
    repo = copy_repo(tmp_path / "repo")
    monkeypatch.chdir(repo)
    runner = CliRunner()
    listed = runner.invoke(app, ["profile"])
    assert listed.exit_code == 0 and "in use: cpu-demo" in listed.output and "gpu:" in listed.output
    result = runner.invoke(app, ["profile", "gpu"])
    assert result.exit_code == 0, result.output
    assert "wrote params.yaml, dvc.yaml" in result.output
    p = params_mod.load(repo / "params.yaml")  # validated, dvc.yaml's matrices included (check_against_dvc)
    assert p.engine.name == "vllm" and p.engine.share_server and p.engine.kv_cache_memory == "fitted"
    assert p.bench.engine == "vllm" and p.verdict.speed_engine == "vllm" and p.judge.backend == "vllm"
    assert all(s.limit is None for s in p.suites.values())  # every suite at full size
    assert {"math", "math-hard", "code", "long_context", "vqa", "charts", "documents", "small_text", "counting",
            "ppl-chat", "ppl-book", "ppl-math", "ppl-code"} == set(p.suites)
    assert max(p.suites["long_context"].options["lengths"]) >= 120_000 and p.engine.max_model_len == 131072
    assert p.bench.slo.ttft_ms and p.bench.slo.tpot_ms
    back = runner.invoke(app, ["profile", "cpu-demo"])
    assert back.exit_code == 0
    for name in profiles.FILES:
        assert (repo / name).read_bytes() == (REPO / name).read_bytes()


def test_local_edits_are_not_overwritten_without_force(tmp_path, monkeypatch):
    repo = copy_repo(tmp_path / "repo")
    monkeypatch.chdir(repo)
    edited = (repo / "params.yaml").read_text().replace("limit: 20 ", "limit: 30 ")
    (repo / "params.yaml").write_text(edited)
    result = CliRunner().invoke(app, ["profile", "gpu"])
    assert result.exit_code == 2 and "params.yaml" in result.output and "--force" in result.output
    assert (repo / "params.yaml").read_text() == edited
    old_name = CliRunner().invoke(app, ["profile", "gpu-h200", "--force"])  # the name it had: the same profile
    assert old_name.exit_code == 0 and "profile gpu: wrote" in old_name.output
    assert (repo / "params.yaml").read_bytes() == profiles.stored("gpu", "params.yaml").read_bytes()
    unknown = CliRunner().invoke(app, ["profile", "tpu"])
    assert unknown.exit_code == 2 and "use one of cpu-demo, gpu" in unknown.output


def planned_stages(repo, env, *args, seed=0):
    """The stages a dry run would run, in order (DVC's "Running stage" lines), at one PYTHONHASHSEED."""
    out = subprocess.run(args, cwd=repo, env={**env, "PYTHONHASHSEED": str(seed)}, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return [l.removeprefix("Running stage '").removesuffix("':") for l in out.stdout.splitlines()
            if l.startswith("Running stage")]


def test_the_gpu_dag_loads_models_in_process_before_any_server_and_benches_every_model(tmp_path):
    """DVC's plan (dvc repro --dry --force) once `quantize profile --fix` has added both W4A16 variants' fixes: every
    stage that loads a model on the GPU in-process (quantize, rank, fix, kl) comes before any stage served by vLLM
    (whose servers the run keeps, holding the GPU's memory), by dvc.yaml's order alone: no served stage depends on
    another model's files. The same plan at every PYTHONHASHSEED, and `quantize repro TARGETS` runs its part of it
    in that order (plain `dvc repro TARGETS` does not). Every suite runs on every model, each fix included; the judge
    covers every variant; bench is a stage; the report comes last."""
    repo = copy_repo(tmp_path / "repo")
    for name in profiles.FILES:
        (repo / name).write_bytes(profiles.stored("gpu", name).read_bytes())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    fixed = ["awq-w4a16", "rtn-w4a16"]  # the profile lists no fix: a verdict's offer adds them, as a user would
    assert yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]["fix"]["foreach"] == []
    for variant in fixed:
        added = subprocess.run([sys.executable, "-m", "pipeline.cli.launcher", "profile", "--fix", variant], cwd=repo,
                               env=env, capture_output=True, text=True)
        assert added.returncode == 0 and f"stages.fix.foreach: + {variant}" in added.stdout, added.stdout + added.stderr
        assert "stages.rank" not in added.stdout  # the rank stage measures it already: no stage of its own changes
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True)
    gpu = yaml.safe_load(profiles.stored("gpu", "params.yaml").read_text())
    models = ["base", *gpu["variants"], *(f"{v}-mixed" for v in fixed)]
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():  # deps are what a stage reads: its own model's files and the base's
        if "foreach" in stage and name != "quantize":
            named = {m for dep in map(str, stage["do"].get("deps", [])) for m in models + fixed
                     if dep.startswith((f"models/{m}/", f"results/{m}/")) or dep in (f"models/{m}", f"results/{m}")}
            assert named <= {"base"}, (name, named)
    planned = planned_stages(repo, env, "dvc", "repro", "--dry", "--force")
    for seed in (1, 2, 3):  # DVC walks its graph in dvc.yaml's order: Python's string hashes play no part
        assert planned_stages(repo, env, "dvc", "repro", "--dry", "--force", seed=seed) == planned, seed
    in_process = [i for i, s in enumerate(planned) if s.startswith(("quantize@", "rank@", "fix@", "kl@"))]
    served = [i for i, s in enumerate(planned) if s.startswith(("evaluate@", "judge@", "bench@"))]
    # quantize every variant; rank the W4A16 ones (KL and ranking in one pass); fix each fixed one from its ranking;
    # kl of the rest and of each fix
    assert [s for s in planned if s.startswith("rank@")] == [f"rank@{m}" for m in fixed]
    assert [s for s in planned if s.startswith("kl@")] == [f"kl@{m}" for m in models[1:] if m not in fixed]
    assert len(in_process) == 2 * len(gpu["variants"]) + 2 * len(fixed) and max(in_process) < min(served)
    assert [s for s in planned if s.startswith("evaluate@")] == [f"evaluate@{m}" for m in models]  # every suite each
    # each server starts (warm) as soon as its checkpoint exists: base's right after resave, before calibration;
    # a variant's right after its quantize stage, a fix's right after its fix stage
    order = {name: i for i, name in enumerate(planned)}
    assert order["resave"] < order["warm@base"] < order["calib"]
    for variant in models[1:]:
        built = f"quantize@{variant}" if variant in gpu["variants"] else f"fix@{variant.removesuffix('-mixed')}"
        assert order[f"warm@{variant}"] == order[built] + 1, (variant, planned)
    assert {s for s in planned if s.startswith("bench@")} == {f"bench@{m}" for m in models}
    assert {s for s in planned if s.startswith("judge@")} == {f"judge@{m}" for m in models[1:]}
    assert planned[-1] == "report"
    targets = ["warm@base", "evaluate@base", "bench@base", "kl@fp8-w8a8"]
    wanted = ["code", "resave", "warm@base", "calib", "quantize@fp8-w8a8", "kl@fp8-w8a8", "evaluate@base", "bench@base"]
    assert [s for s in planned if s in wanted] == wanted  # the whole run's order, restricted to what they need
    quantize_repro = [sys.executable, "-m", "pipeline.cli.launcher", "repro", "--dry", "--force", *targets]
    plain = set()
    for seed in range(6):
        assert planned_stages(repo, env, *quantize_repro, seed=seed) == wanted, seed
        plain.add(tuple(planned_stages(repo, env, "dvc", "repro", "--dry", "--force", *targets, seed=seed)))
    assert len(plain) > 1  # why `quantize repro` exists: DVC's own order of named targets moves with the seed


def test_gpu_stages_depend_on_at_least_what_the_demos_do():
    """The demo's dvc.yaml is checked against what each stage reads (test_dvc_pipeline.py); the GPU one
    runs the same commands, so each of its stages lists at least the demo's deps and params."""
    demo = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    gpu = yaml.safe_load(profiles.stored("gpu", "dvc.yaml").read_text())["stages"]
    body = lambda stage: stage.get("do", stage)  # noqa: E731
    pairs = [(n, n) for n in demo if n in gpu]
    fixes = tuple(f"{v}-mixed" for v in demo["fix"]["foreach"] if v not in gpu["fix"]["foreach"])
    for gpu_name, demo_name in pairs:  # the demo's own fixes aside (the GPU profile adds its with profile --fix)
        g, d = body(gpu[gpu_name]), body(demo[demo_name])
        wanted = {p for p in map(str, d.get("deps", [])) if not any(f in p for f in fixes)}
        assert wanted <= set(map(str, g.get("deps", []))), (gpu_name, demo_name)
        assert [str(p) for p in d.get("params", [])] == [str(p) for p in g.get("params", [])] or gpu_name == "judge"


def expanded_stages(dvc_yaml: Path, params_yaml: Path) -> dict[str, str]:
    """{stage name as dvc.lock names it: its command} of a dvc.yaml, `foreach` lists and `${variants}` expanded."""
    stages, params = yaml.safe_load(dvc_yaml.read_text())["stages"], yaml.safe_load(params_yaml.read_text())
    found = {}
    for name, stage in stages.items():
        if "foreach" not in stage:
            found[name] = stage["cmd"]
            continue
        items = stage["foreach"] if isinstance(stage["foreach"], list) else list(params["variants"])
        key = "item" if isinstance(stage["foreach"], list) else "key"
        for item in items:
            found[f"{name}@{item}"] = stage["do"]["cmd"].replace("${" + key + "}", item)
    return found


def test_a_clone_holds_no_lock_but_the_committed_examples_which_is_this_dvc_yamls_run():
    """Issue 52 item 5: no dvc.lock at the project's root in git (a clone starts with none: DVC writes its own); the
    committed example keeps the lock of the run that made it, whose stages and commands are this dvc.yaml's."""
    tracked = subprocess.run(["git", "ls-files", "dvc.lock", "reports/example/dvc.lock"], cwd=REPO, capture_output=True,
                             text=True).stdout.split()
    assert "dvc.lock" not in tracked
    lock = yaml.safe_load((REPO / "reports" / "example" / "dvc.lock").read_text())["stages"]
    assert {name: entry["cmd"] for name, entry in lock.items()} == expanded_stages(REPO / "dvc.yaml", REPO / "params.yaml")
