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
