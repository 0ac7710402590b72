"""End to end: `dvc repro` in a fresh copy of the repo, with a tiny params profile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import TINY_PARAMS, copy_repo, read_jsonl, write_params


def sh(cmd, cwd, env):
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


@pytest.mark.slow
def test_dvc_repro_end_to_end_then_noop_then_only_report(tmp_path, tiny_llama):
    repo = copy_repo(tmp_path / "repo")
    write_params(repo, {**TINY_PARAMS, "model": {**TINY_PARAMS["model"], "source": str(tiny_llama)}})
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    sh(["git", "init", "-q"], repo, env)
    sh(["git", "add", "-A"], repo, env)
    sh(["git", "commit", "-qm", "init"], repo, env)

    sh(["dvc", "repro"], repo, env)
    verdict = json.loads((repo / "reports" / "verdict.json").read_text())
    assert set(verdict["variants"]) == {"awq-w4a16", "fp8-w8a8", "rtn-w4a16"}
    for model in ("base", "awq-w4a16"):  # math and code run on these two (params: suites.<name>.models)
        assert len(read_jsonl(repo / "results" / model / "math.jsonl")) == 3
        assert len(read_jsonl(repo / "results" / model / "code.jsonl")) == 2
    for model in ("base", "awq-w4a16", "fp8-w8a8", "rtn-w4a16"):
        for suite in ("ppl-chat", "ppl-book", "ppl-math", "ppl-code"):
            assert [line["n_tokens"] > 0 for line in read_jsonl(repo / "results" / model / f"{suite}.jsonl")] == [True, True]
    for variant in ("awq-w4a16", "fp8-w8a8", "rtn-w4a16"):
        assert json.loads((repo / "results" / variant / "kl.json").read_text())["tokens"] > 0
    for variant in ("awq-w4a16", "fp8-w8a8"):  # the judge runs on these two only (dvc.yaml)
        assert len(read_jsonl(repo / "results" / variant / "judge.jsonl")) == 2
    assert set(verdict["variants"]["awq-w4a16"]["suites"]) == {"math", "code"}
    assert set(verdict["variants"]["rtn-w4a16"]["perplexity"]) == {"ppl-chat", "ppl-book", "ppl-math", "ppl-code"}
    assert verdict["variants"]["rtn-w4a16"]["suites"] == {}
    assert json.loads((repo / "models" / "rtn-w4a16" / "quant.json").read_text())["method"] == "rtn"
    html = (repo / "reports" / "index.html").read_text()
    assert html.count('<tr>\n    <td>awq-w4a16</td><td>math</td>') == 1
    assert html.count('<tr>\n    <td>fp8-w8a8</td><td>ppl-book</td>') == 1
    assert json.loads((repo / "models" / "awq-w4a16" / "quant.json").read_text())["group_size"] == 32

    status = sh(["dvc", "status"], repo, env)
    assert "up to date" in status
    again = sh(["dvc", "repro"], repo, env)
    assert "Running stage" not in again

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params.setdefault("verdict", {})["margins"] = {"math": 0.10}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    changed = sh(["dvc", "repro"], repo, env)
    ran = [line for line in changed.splitlines() if line.startswith("Running stage")]
    assert ran == ["Running stage 'report':"], changed
