"""The one logging setup: library chatter held back, and no progress bars written into a log."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BAR = ("import sys; from pipeline import console; console.setup(int(sys.argv[1])); from tqdm import tqdm\n"
       "for _ in tqdm(range(3), desc='grid search'): pass\n"
       "import logging; logging.getLogger('pipeline.x').info('stage says hello')\n"
       "logging.getLogger('transformers').info('library chatter')\n")


def run(verbosity: int) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    done = subprocess.run([sys.executable, "-c", BAR, str(verbosity)], capture_output=True, text=True, timeout=120,
                          env={**env, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_log_gets_the_stage_messages_but_no_library_bars_or_chatter():
    stderr = run(0)  # stderr is a pipe here, as under dvc or CI
    assert "stage says hello" in stderr
    assert "grid search" not in stderr and "library chatter" not in stderr


def test_verbose_keeps_the_library_bars():
    assert "grid search" in run(1)


# ---------------------------------------------------------------- inside dvc repro: a quiet terminal (issue 46 item 7)

STAGE = ("import logging, os, sys, warnings\n"
         "from pipeline import console\n"
         "from pipeline.cli.common import stage\n"
         "console.setup(0)\n"
         "from tqdm import tqdm\n"
         "for _ in tqdm(range(3), desc='grid search'): pass\n"
         "logging.getLogger('transformers').warning('tokenizer chatter')\n"
         "logging.getLogger('llmcompressor').info('compression lifecycle chatter')\n"
         "warnings.warn('a library deprecation')\n"
         "print('a library print')\n"
         "os.write(2, b'C-level chatter from a native library\\n')\n"
         "os.system('echo a child process says hello >&2')\n"
         "logging.getLogger('pipeline.x').info('plan: 30 layers')\n"
         "logging.getLogger('pipeline.x').warning('the judge is unreliable')\n"
         "@stage\n"
         "def work(fail):\n"
         "    if fail == 'user':\n"
         "        from pipeline.errors import UserError\n"
         "        raise UserError('data.jsonl:3: bad record; fix it')\n"
         "    if fail == 'bug':\n"
         "        raise RuntimeError('something broke')\n"
         "    console.summary('x: did it (3 items) in 0.1 s')\n"
         "import typer\n"
         "try:\n"
         "    work(sys.argv[1])\n"
         "except typer.Exit as exc:\n"
         "    sys.exit(exc.exit_code)\n")


def run_stage(tmp_path, fail: str = "no", **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    return subprocess.run([sys.executable, "-c", STAGE, fail], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**environ, "PYTHONPATH": str(REPO), "DVC_STAGE": "quantize@awq-w4a16", **env})


def test_inside_dvc_a_stage_shows_its_line_and_warnings_and_its_log_takes_the_rest(tmp_path):
    done = run_stage(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "x: did it (3 items) in 0.1 s\n"
    assert done.stderr.count("\n") == 1 and "the judge is unreliable" in done.stderr  # the stage's own warning
    log = (tmp_path / ".cache" / "logs" / "quantize@awq-w4a16.log").read_text()
    for chatter in ("tokenizer chatter", "compression lifecycle chatter", "a library deprecation", "a library print",
                    "C-level chatter from a native library", "a child process says hello", "plan: 30 layers",
                    "the judge is unreliable", "x: did it (3 items) in 0.1 s"):
        assert chatter in log, chatter
    assert "grid search" not in log  # the libraries' bars are off: a line per update is no log


def test_inside_dvc_a_failure_names_the_log_that_holds_the_traceback(tmp_path):
    log = ".cache/logs/quantize@awq-w4a16.log"
    user = run_stage(tmp_path, "user")
    assert user.returncode == 2 and user.stdout == ""
    assert f"error: data.jsonl:3: bad record; fix it (the stage's whole output: {log})" in user.stderr
    bug = run_stage(tmp_path, "bug")
    assert bug.returncode == 1 and "Traceback" not in bug.stderr
    assert f"error: quantize@awq-w4a16 failed: RuntimeError: something broke (the stage's whole output: {log})" \
        in bug.stderr
    traceback = (tmp_path / log).read_text()
    assert "Traceback (most recent call last)" in traceback and 'line 21, in work\nRuntimeError: something broke' \
        in traceback


def test_asked_for_a_stage_writes_everything_to_the_terminal(tmp_path):
    done = run_stage(tmp_path, QUANTIZE_STAGE_OUTPUT="terminal")
    assert done.returncode == 0 and "a library print" in done.stdout and "C-level chatter" in done.stderr
    assert "tokenizer chatter" in done.stderr and "a library deprecation" in done.stderr
    assert not (tmp_path / ".cache" / "logs").exists()


def test_outside_dvc_the_libraries_warnings_go_to_the_commands_log(tmp_path):
    """Issue 70.6: lm-eval's warnings (several lines each) reached the terminal on every `quantize eval` run by hand."""
    done = run_stage(tmp_path, DVC_STAGE="")
    assert done.returncode == 0 and "a library print" in done.stdout and "C-level chatter" in done.stderr
    assert "the judge is unreliable" in done.stderr  # the stage's own warning stays
    assert "tokenizer chatter" not in done.stderr and "a library deprecation" not in done.stderr
    [log] = (tmp_path / ".cache" / "logs").glob("*.log")
    assert "tokenizer chatter" in log.read_text() and "a library deprecation" in log.read_text()
    assert f"the libraries' warnings are in .cache/logs/{log.name}" in " ".join(done.stderr.split())
    verbose = subprocess.run([sys.executable, "-c", STAGE.replace("console.setup(0)", "console.setup(1)"), "no"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(REPO), "DVC_STAGE": ""})
    assert "tokenizer chatter" in verbose.stderr  # -v: on the terminal


TERMINAL_BAR = ("import sys\n"
       "from pipeline import console\n"
       "console.setup(0)\n"
       "from tqdm import tqdm\n"
       "with console.progress('quantize: calibrating', 3, 'decoder layers') as advance:\n"
       "    for _ in tqdm(range(3), desc='Applying quantization config', disable=False): pass\n"
       "    print('a library print while the bar runs')\n"
       "    advance(3)\n"
       "console.summary('x: did it in 0.1 s')\n")


def test_on_a_terminal_the_bar_runs_and_what_libraries_write_meanwhile_stays_in_the_log(tmp_path):
    """rich shows what is written to stdout and stderr above a running bar: inside dvc repro that is the log's."""
    import pty

    master, slave = pty.openpty()
    environ = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    child = subprocess.Popen([sys.executable, "-c", TERMINAL_BAR], stdin=slave, stdout=slave, stderr=slave, cwd=tmp_path,
                             env={**environ, "PYTHONPATH": str(REPO), "DVC_STAGE": "quantize@awq-w4a16",
                                  "TERM": "xterm"})
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    assert child.wait(timeout=60) == 0
    os.close(master)
    terminal = shown.decode(errors="replace")
    assert "quantize: calibrating" in terminal and terminal.rstrip().endswith("x: did it in 0.1 s"), terminal
    assert "Applying quantization config" not in terminal and "a library print" not in terminal, terminal
    log = (tmp_path / ".cache" / "logs" / "quantize@awq-w4a16.log").read_text()
    assert "a library print while the bar runs" in log and "Applying quantization config" in log


def test_an_eval_by_hand_outside_a_git_checkout_shows_only_its_own_lines(tmp_path, tiny_llama):
    """Issue 70.6, on the new paths (MATH-500's sympy scorer, an lm-eval generation task): lm-eval's warnings go to
    the command's log, and the `git describe` lm-eval runs for its records no longer prints "fatal: not a git
    repository" on the terminal of every eval run outside a git checkout."""
    from conftest import TINY_PARAMS, write_params

    assert subprocess.run(["git", "rev-parse"], cwd=tmp_path, capture_output=True).returncode != 0  # no checkout
    write_params(tmp_path, {**TINY_PARAMS, "suites": {**TINY_PARAMS["suites"], "math-hard": {
        "task": "quant_math500", "limit": 2, "max_new_tokens": 8}}})
    done = subprocess.run([sys.executable, "-m", "pipeline.cli.app", "eval", str(tiny_llama), "--suite", "math-hard",
                           "--out", "r"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "DVC_STAGE": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert not [line for line in said if "fatal" in line or "WARNING" in line or "Warning" in line], said
    assert any(line.startswith("eval: r/math-hard.jsonl (2 items") for line in said), said
    log = (tmp_path / ".cache" / "logs" / "eval.log").read_text()
    assert "lm_eval" in log  # its warnings are there instead
