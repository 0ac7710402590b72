"""End to end: `dvc repro` in a fresh copy of the repo, with a tiny params profile; dvc.yaml holds
every stage to what its command really reads (issue 16.6)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import TINY_PARAMS, copy_repo, read_jsonl, write_params
from pipeline.cli.code_deps import read_code_file


RECORDER = Path(__file__).resolve().parent / "access_recorder"  # its sitecustomize logs what each command reads
# Read by every command for its own bookkeeping, or tracked by DVC itself: never a stage dependency.
NOT_DEPENDENCIES = ("params.yaml", "dvc.yaml", "dvc.lock", ".dvc/", ".git/", ".venv/", "/.cache/")


def _under(name: str, declared, sep: str) -> bool:
    return any(name == d or name.startswith(d.rstrip(sep) + sep) for d in declared)


def undeclared_reads(repo: Path, access_log: Path) -> list[str]:
    """What each stage's command read (params keys, project files and pipeline/ modules) that its dvc.lock
    entry, i.e. its dvc.yaml deps, outs and params expanded, does not cover. Generic: every stage that ran."""
    stages = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    top_level = set(yaml.safe_load((repo / "params.yaml").read_text()))
    by_cmd = {entry["cmd"]: name for name, entry in stages.items()}
    problems, ran = [], set()
    for record in read_jsonl(access_log):
        cmd = " ".join(["quantize", *record["argv"][1:]])
        name = by_cmd.get(cmd)
        if name is None:
            problems.append(f"{cmd!r} ran but is no stage's cmd in dvc.lock")
            continue
        ran.add(name)
        entry = stages[name]
        declared = set((entry.get("params") or {}).get("params.yaml", {}))
        for key in record["params"]:
            whole = key == "*" and top_level <= declared
            if not whole and not _under(key, declared, "."):
                problems.append(f"{name}: reads params {key}, not in its params")
        paths = [d["path"] for d in entry.get("deps", [])] + [o["path"] for o in entry.get("outs", [])]
        for code in [p for p in paths if p.startswith(".cache/code/")]:  # the code stage's list of its modules
            paths += read_code_file(repo / code)
        for file in record["files"]:
            if any(file == n.strip("/") or file.startswith(n.lstrip("/")) or n in f"/{file}" for n in NOT_DEPENDENCIES):
                continue
            if file.endswith(".egg-info") or ".egg-info/" in file:
                continue
            if not _under(file, paths, "/"):
                problems.append(f"{name}: reads {file}, not in its deps")
    problems += [f"{name}: never ran, so what it reads is unchecked" for name in sorted(set(stages) - ran)]
    return problems


def sh(cmd, cwd, env):
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    logs = "".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in sorted(Path(cwd).glob(".cache/logs/*.log")))
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{logs}"
    return done.stdout + done.stderr


DVC_OWN = ("Running stage '", "> quantize ", "Updating lock file ", "Generating lock file ", "Use `dvc push`",
           "To track the changes with git", "\tgit add ", "To enable auto staging", "\tdvc config core.autostage")


def stage_lines(output: str) -> list[str]:
    """What the stages printed, DVC's own lines left out."""
    return [line for line in output.splitlines() if line.strip() and not line.startswith(DVC_OWN)]


@pytest.mark.slow
def test_dvc_repro_end_to_end_then_noop_then_only_report(tmp_path, tiny_llama):
    repo = copy_repo(tmp_path / "repo")
    write_params(repo, {**TINY_PARAMS, "model": {**TINY_PARAMS["model"], "source": str(tiny_llama)}})
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    access_log = tmp_path / "access.jsonl"
    # the stages fork from the run's warm interpreter as in `make demo`; the recorder keeps pipeline modules out of
    # its preload, so each stage imports, and is charged with, the pipeline modules it needs itself
    recording = {**env, "QUANTIZE_ACCESS_LOG": str(access_log),
                 "PYTHONPATH": os.pathsep.join(p for p in (str(RECORDER), os.environ.get("PYTHONPATH")) if p)}
    sh(["git", "init", "-q"], repo, env)
    sh(["git", "add", "-A"], repo, env)
    sh(["git", "commit", "-qm", "init"], repo, env)

    first = sh(["dvc", "repro"], repo, recording)
    ran = [line.removeprefix("Running stage '").removesuffix("':") for line in first.splitlines()
           if line.startswith("Running stage '")]
    # a quiet terminal (issue 46 item 7): one line per stage, no warning for a suite a model does not run
    # (math on fp8-w8a8), the libraries' chatter in each stage's log, nothing staged in git
    # (18: resave, calib, 3 quantize, 2 rank (the W4A16 variants' KL and ranking in one pass), the fix of rtn-w4a16
    # (from its ranking), 2 kl (FP8 and the fix), 2 judge, 5 evaluate, report)
    assert len(stage_lines(first)) == len(ran) == 19 and "is empty" not in first, first
    assert {"rank@awq-w4a16", "rank@rtn-w4a16", "fix@rtn-w4a16", "kl@fp8-w8a8", "kl@rtn-w4a16-mixed"} <= set(ran)
    assert "compression lifecycle" in (repo / ".cache" / "logs" / "quantize@awq-w4a16.log").read_text().lower()
    assert sorted(log.stem for log in (repo / ".cache" / "logs").glob("*.log")) == sorted(ran)
    assert sh(["git", "status", "--porcelain", "--untracked-files=no"], repo, env) == ""
    problems = undeclared_reads(repo, access_log)
    assert not problems, "dvc.yaml misses what its stages read:\n  " + "\n  ".join(problems)
    verdict = json.loads((repo / "reports" / "verdict.json").read_text())
    assert set(verdict["variants"]) == {"awq-w4a16", "fp8-w8a8", "rtn-w4a16", "rtn-w4a16-mixed"}
    for model in ("base", "awq-w4a16"):  # math and code run on these two (params: suites.<name>.models)
        assert len(read_jsonl(repo / "results" / model / "math.jsonl")) == 3
        assert len(read_jsonl(repo / "results" / model / "code.jsonl")) == 2
    for model in ("base", "awq-w4a16", "fp8-w8a8", "rtn-w4a16", "rtn-w4a16-mixed"):
        for suite in ("ppl-chat", "ppl-book", "ppl-math", "ppl-code"):
            assert [line["n_tokens"] > 0 for line in read_jsonl(repo / "results" / model / f"{suite}.jsonl")] == [True, True]
    for variant in ("awq-w4a16", "fp8-w8a8", "rtn-w4a16", "rtn-w4a16-mixed"):  # the summary, and every token's KL it comes from
        kl = json.loads((repo / "results" / variant / "kl.json").read_text())
        sequences = read_jsonl(repo / "results" / variant / "kl.jsonl")
        assert kl["tokens"] > 0 and len(sequences) == kl["sequences"]
        assert sum(len(line["kl"]) for line in sequences) == kl["tokens"]
    for model in ("fp8-w8a8", "rtn-w4a16", "rtn-w4a16-mixed"):  # math and code do not run on these (a fix runs what
        # its variant runs): recorded, with the key
        skipped = json.loads((repo / "results" / model / "math.json").read_text())
        assert skipped["status"] == "not run" and "suites.math.models" in skipped["reason"]
    for variant in ("awq-w4a16", "fp8-w8a8"):  # the judge runs on these two only (dvc.yaml)
        assert len(read_jsonl(repo / "results" / variant / "judge.jsonl")) == 2
    assert set(verdict["variants"]["awq-w4a16"]["suites"]) == {"math", "code"}
    assert set(verdict["variants"]["rtn-w4a16"]["perplexity"]) == {"ppl-chat", "ppl-book", "ppl-math", "ppl-code"}
    assert verdict["variants"]["rtn-w4a16"]["suites"] == {}
    assert json.loads((repo / "models" / "rtn-w4a16" / "quant.json").read_text())["method"] == "rtn"
    # the fix stage: rtn-w4a16's ranking, its mixed variant on its own settings, decided and set beside it
    mixed = json.loads((repo / "models" / "rtn-w4a16-mixed" / "quant.json").read_text())
    assert (mixed["method"], mixed["base_method"], mixed["group_size"]) == ("mixed", "rtn", 32)
    ranking = json.loads((repo / "results" / "rtn-w4a16" / "sensitivity.json").read_text())
    assert mixed["groups_total"] == len(ranking["groups"]) and mixed["sensitivity"] == "results/rtn-w4a16/sensitivity.json"
    fix = verdict["variants"]["rtn-w4a16"]["fix"]
    assert fix["variant"] == "rtn-w4a16-mixed" and fix["decision"] == verdict["variants"]["rtn-w4a16-mixed"]["decision"]
    assert verdict["variants"]["rtn-w4a16-mixed"]["fix_of"] == "rtn-w4a16" and fix["line"]
    # a model card per decided variant, the report stage's out beside the page; the tiny base states no licence
    assert sorted(p.parent.name for p in (repo / "reports" / "cards").glob("*/README.md")) == sorted(verdict["variants"])
    card = (repo / "reports" / "cards" / "fp8-w8a8" / "README.md").read_text()
    assert "- **License**: not stated by the base's source" in card  # a tiny local model: no licence, never a guess
    assert card.split("\n---\n", 1)[1].lstrip().startswith("# Timing only: fp8-w8a8")  # a random tiny model: at chance
    html = (repo / "reports" / "index.html").read_text()
    assert html.count('<th scope="row">math</th><td>awq-w4a16</td>') == 1
    assert html.count('<th scope="row">ppl-book</th><td>fp8-w8a8</td>') == 1
    assert json.loads((repo / "models" / "awq-w4a16" / "quant.json").read_text())["group_size"] == 32

    status = sh(["dvc", "status"], repo, env)
    assert "up to date" in status
    again = sh(["dvc", "repro"], repo, env)
    assert "Running stage" not in again
    assert_a_change_costs_what_it_touches(repo, env)

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params.setdefault("verdict", {}).setdefault("margins", {}).setdefault("suites", {})["math"] = 0.10
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    changed = sh(["dvc", "repro"], repo, env)
    ran = [line for line in changed.splitlines() if line.startswith("Running stage")]
    assert ran == ["Running stage 'report':"], changed
    # a module only the report imports, edited: the code stage writes the report's code file again and only the report
    # runs; every other command's code file is the same bytes, so no other stage does (dvc.lock: one code entry each)
    module = repo / "pipeline" / "report" / "charts.py"
    module.write_text(module.read_text() + "\n# edited\n")
    edited = sh(["dvc", "repro"], repo, env)
    assert [line for line in edited.splitlines() if line.startswith("Running stage")] == [
        "Running stage 'code':", "Running stage 'report':"], edited
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert all(not d["path"].startswith("pipeline") for name, entry in lock.items() if name != "code"
               for d in entry.get("deps", []))

    (repo / "params.yaml").write_text(yaml.safe_dump({**params, "verdict": {**params["verdict"], "floor_ceiling": 0.06}},
                                                     sort_keys=False))
    quiet = sh([sys.executable, "-m", "pipeline.cli.repro"], repo, env)  # make demo's: DVC's own lines left out
    assert quiet.startswith("report: wrote ") and quiet.count("\n") == 1, quiet


def stale(repo, env) -> set[str]:
    """The stages `dvc status` says would run (changed, or new: no dvc.lock entry)."""
    return set(json.loads(sh(["dvc", "status", "--json"], repo, env)))


def assert_a_change_costs_what_it_touches(repo, env):
    """After a finished run (issue 52 item 1): adding a fix (`quantize profile --fix V`) or a variant leaves every
    stage of every other model up to date: only the new model's stages and the report would run; removing one leaves
    only the report. Each change is undone after its check (the files as the run left them)."""
    finished = {name: (repo / name).read_text() for name in ("dvc.yaml", "params.yaml")}
    added = sh([sys.executable, "-m", "pipeline.cli.launcher", "profile", "--fix", "awq-w4a16"], repo, env)
    assert "stages.rank" not in added and "stages.kl.foreach: - " not in added  # awq-w4a16's own stages untouched
    assert stale(repo, env) == {"fix@awq-w4a16", "kl@awq-w4a16-mixed", "evaluate@awq-w4a16-mixed", "report"}
    for name, original in finished.items():
        (repo / name).write_text(original)
    taken = sh([sys.executable, "-m", "pipeline.cli.launcher", "profile", "--unfix", "rtn-w4a16"], repo, env)
    assert "params.yaml fix.variants: - rtn-w4a16" in taken  # the run's own fix out: the report reads that list
    assert stale(repo, env) == {"report"}
    params = yaml.safe_load(finished["params.yaml"])  # a variant added to params.yaml and dvc.yaml's lists
    params["variants"]["rtn-g16"] = {"method": "rtn", "group_size": 16}
    (repo / "dvc.yaml").write_text(finished["dvc.yaml"])
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    text = finished["dvc.yaml"].replace("foreach: [fp8-w8a8, rtn-w4a16-mixed]", "foreach: [fp8-w8a8, rtn-w4a16-mixed, rtn-g16]")
    text = text.replace("rtn-w4a16, rtn-w4a16-mixed]", "rtn-w4a16, rtn-w4a16-mixed, rtn-g16]")
    (repo / "dvc.yaml").write_text(text)
    assert stale(repo, env) == {"quantize@rtn-g16", "kl@rtn-g16", "evaluate@rtn-g16", "report"}
    for name, original in finished.items():
        (repo / name).write_text(original)
    assert stale(repo, env) == set()


def test_dry_run_plans_every_stage_on_a_fresh_clone(tmp_path):
    """`--force`: plain `dvc repro --dry` stops at the first stage whose dependency an earlier stage makes
    (DVC 3.67 hashes the missing dependency for its run cache: treeverse/dvc#9021), whatever dvc.yaml says."""
    repo = copy_repo(tmp_path / "repo")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    sh(["git", "init", "-q"], repo, env)
    sh(["git", "add", "-A"], repo, env)
    sh(["git", "commit", "-qm", "init"], repo, env)
    planned = [line.removeprefix("Running stage '").removesuffix("':")
               for line in sh(["dvc", "repro", "--dry", "--force"], repo, env).splitlines()
               if line.startswith("Running stage")]
    stages = sh(["dvc", "stage", "list", "--name-only"], repo, env).split()
    assert sorted(planned) == sorted(stages) and len(stages) >= 6
    assert not list(repo.glob("models")) and not (repo / "dvc.lock").exists()  # a plan, nothing run
    dag = sh(["dvc", "dag", "--dot"], repo, env)
    for upstream, downstream in (("resave", "calib"), ("calib", "quantize@"), ("quantize@", "evaluate@"),
                                 ("evaluate@", "report")):
        assert any(upstream in a and downstream in b for a, b in
                   (edge.split("->") for edge in dag.replace('"', "").splitlines() if "->" in edge)), (upstream, downstream)
    order = {name: i for i, name in enumerate(planned)}
    assert order["resave"] < order["calib"] < min(v for k, v in order.items() if k.startswith("quantize@"))
