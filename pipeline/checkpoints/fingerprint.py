"""A checkpoint's content fingerprint: the hash of its config, tokenizer and weights, so a changed variant
never reuses another's cached outputs (pipeline/eval_cache.py) or an old server's answers
(pipeline/engines/shared.py)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


MEMO_MIN_BYTES = 1 << 30  # checkpoints this large are hashed once per file-stat signature, not in every stage


def _hashed_files(model_dir: Path) -> list[Path]:
    return [path for path in sorted(Path(model_dir).iterdir())
            if path.suffix in {".json", ".safetensors", ".jinja"} and path.name != "source.json"]


def model_fingerprint(model_dir: Path) -> str:
    """Hash of config and weights: a changed variant never reuses another's cached outputs.

    A checkpoint of a GiB or more (GLM-4-9B: 18 GB, ~12 s to hash) is hashed once per signature of its
    files' names, sizes, modification times and inodes, remembered under .cache/fingerprints
    (QUANTIZE_FINGERPRINT_DIR): a run's 30-odd stages hash it once. Rewriting any file changes the
    signature, and the content is hashed again."""
    files = _hashed_files(model_dir)
    stats = [(path.name, path.stat()) for path in files]
    memo = None
    if sum(st.st_size for _, st in stats) >= MEMO_MIN_BYTES:
        signature = hashlib.sha256("\n".join(f"{n}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
                                             for n, st in stats).encode()).hexdigest()
        folder = Path(os.environ.get("QUANTIZE_FINGERPRINT_DIR") or Path.cwd() / ".cache" / "fingerprints")
        memo = folder / (hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16] + ".json")
        try:
            known = json.loads(memo.read_text())
            if known.get("signature") == signature:
                return known["fingerprint"]
        except (OSError, ValueError, AttributeError):
            pass
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    fingerprint = digest.hexdigest()[:16]
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"signature": signature, "fingerprint": fingerprint}))
            tmp.replace(memo)
        except OSError:
            pass  # a read-only project: hashed again next time
    return fingerprint
