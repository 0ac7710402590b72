import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# remote-code modules that tests load (trust_remote_code) go to a temp dir, not ~/.cache
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="hf-modules-"))
# shared vLLM servers' registry (pipeline/engines/shared.py): a temp dir, not the checkout's .cache
os.environ.setdefault("QUANTIZE_SERVER_DIR", tempfile.mkdtemp(prefix="quantize-servers-"))
# Under pytest-xdist (`make test`: two workers on two cores) each worker's torch, and every process it starts, gets its
# share of the cores: two OpenMP threads per worker spin against the other worker's (a quantize/KL subset: 39 s ->
# 26 s at one thread each). Set before anything imports torch; a run without workers keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

from tiny import save_tiny_llama  # noqa: E402

TINY_PARAMS = {
    "model": {"source": "tiny-hf", "base_dir": "models/base", "dtype": "float16"},
    "calib": {"source": "calib_data/support_logs.jsonl", "out": "calib_data/build",
              "seq_len": 64, "num_blocks": 8, "holdout": 4},
    "variants": {
        "awq-w4a16": {"method": "awq", "group_size": 32, "batch_size": 8, "n_grid": 4},
        "fp8-w8a8": {"method": "fp8", "activations": "static", "kv": "per-head"},
        "rtn-w4a16": {"method": "rtn", "group_size": 32},
    },
    "suites": {"math": {"task": "quant_gsm8k", "limit": 3, "max_new_tokens": 8,
                        "models": ["base", "awq-w4a16"]},
               "code": {"task": "quant_humaneval", "limit": 2, "max_new_tokens": 8,
                        "models": ["base", "awq-w4a16"]},
               "ppl-chat": {"task": "quant_ppl_chat", "limit": 2, "options": {"data": "calib_data/build/holdout.jsonl"}},
               "ppl-book": {"task": "quant_ppl_book", "limit": 2},
               "ppl-math": {"task": "quant_ppl_gsm8k", "limit": 2},
               "ppl-code": {"task": "quant_ppl_humaneval", "limit": 2}},
    "judge": {"limit": 2, "max_new_tokens": 8, "judge_max_new_tokens": 8},
    "engine": {"batch_size": 8, "dtype": "float32"},
    # DVC needs every section and key a stage declares in its params (the values are the defaults)
    "kl": {"sequences": 4, "max_tokens": 64},
    "fix": {"max_bits": 4.5, "variants": ["rtn-w4a16"]},  # as the demo's dvc.yaml: the fix of rtn-w4a16
    "verdict": {"margins": {"judge": 0.05, "suites": {"math": 0.03}}, "bootstrap": 2000, "confidence": 0.95, "seed": 0},
}


@pytest.fixture(scope="session", autouse=True)
def warm_test_servers():
    """One warm interpreter per test process for the test servers it starts (tests/warm_servers.py)."""
    import warm_servers

    warm_servers.start(os.getpid())  # it ends, its servers with it, when this process does


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer random Llama (hidden 64) with a real BPE tokenizer and chat template."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_calib(tmp_path_factory, tiny_llama) -> Path:
    from pipeline.stages import calib

    out = tmp_path_factory.mktemp("calib") / "build"
    calib.run(REPO / "calib_data" / "support_logs.jsonl", out, tiny_llama, seq_len=64, num_blocks=8, holdout=4)
    return out


@pytest.fixture(scope="session")
def tiny_variants(tmp_path_factory, tiny_llama, tiny_calib) -> dict[str, Path]:
    """AWQ and FP8 variants of the tiny Llama, built once for every test that needs them."""
    from pipeline.stages.quantize import run as quantize_run

    root = tmp_path_factory.mktemp("variants")
    quantize_run(tiny_llama, root / "awq-w4a16", tiny_calib / "calib.jsonl", "awq", group_size=32, batch_size=8, n_grid=4)
    quantize_run(tiny_llama, root / "fp8-w8a8", tiny_calib / "calib.jsonl", "fp8")
    return {"awq-w4a16": root / "awq-w4a16", "fp8-w8a8": root / "fp8-w8a8"}


def with_variants(params: dict, *names: str) -> dict:
    """`params` with RTN variants of these names added (the report reads only results/<base or variant>)."""
    return {**params, "variants": {**params["variants"], **{n: {"method": "rtn", "group_size": 32} for n in names}}}


def write_params(directory: Path, params: dict = TINY_PARAMS) -> Path:
    import yaml

    path = directory / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def copy_repo(dest: Path) -> Path:
    """The tracked project files (no .venv, models or results), as a fresh clone would have them."""
    ignore = shutil.ignore_patterns(".venv", ".git", "models", "results", "build", ".cache", "__pycache__",
                                    "*.egg-info", ".pytest_cache", "index.html", "verdict.json", "cards", ".report", ".report-*",
                                    "dvc.lock")  # a demo's run (DVC stages nothing in git: not a clone's)
    shutil.copytree(REPO, dest, ignore=ignore, dirs_exist_ok=True)
    return dest


def read_tensors(model_dir: Path) -> dict:
    """Every tensor of a checkpoint directory, by name, across shards."""
    from safetensors import safe_open

    found = {}
    for shard in Path(model_dir).glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for key in f.keys():
                found[key] = f.get_tensor(key)
    return found


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture
def bwrap_missing(monkeypatch, tmp_path):
    """bubblewrap not on PATH, as on a fresh machine (the probe is cached: cleared before and after)."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    from pipeline.scoring import sandbox

    sandbox.bwrap_problem.cache_clear()
    yield
    monkeypatch.undo()
    sandbox.bwrap_problem.cache_clear()


@pytest.fixture
def run():
    """A process standing for the run that holds the GPU (`dvc repro`), named by QUANTIZE_RUN_PID in tests."""
    import subprocess

    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


# The slowest tests first (`make test` runs the suite on two workers, pytest-xdist's worksteal: a worker that runs
# out steals from the other's queue, so the long ones must not be left for the end)
SLOWEST_FIRST = ("test_gpu_dvc_repro.py", "test_dvc_pipeline.py", "test_install.py", "test_code_suite.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
