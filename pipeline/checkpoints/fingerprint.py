"""A checkpoint's content fingerprint: the hash of its config, tokenizer and weights, so a changed variant
never reuses another's cached outputs (pipeline/scoring/eval_cache.py) or an old server's answers
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


def stat_signature(model_dir: Path, change_time: bool = True) -> str:
    """A hash of the checkpoint files' names, sizes, modification times and inodes, and (change_time) their change
    times: changes whenever a file is written again (in place: its modification time, or its change time when the
    modification time was put back; replaced: its inode), without reading a byte. What keys a content hash
    (model_fingerprint's memo) takes the change time. What keys a running server (pipeline/engines/shared.py) does
    not: DVC's cache links every output whose content equals a file already cached to that file's inode, so a later
    stage's output (a variant's tokenizer.json, equal to the base's) changes the base file's link count and with it
    its change time; keyed by that, the run's server for the base looked like another checkpoint's and was stopped
    and started again (seen on the H200, 2026-12-02; tests/test_shared_server.py)."""
    stats = [(path.name, path.stat()) for path in _hashed_files(model_dir)]
    return hashlib.sha256("\n".join(f"{n}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
                                     + (f":{st.st_ctime_ns}" if change_time else "")
                                     for n, st in stats).encode()).hexdigest()


def _file_digest(path: Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)  # hashlib lets go of the GIL for large updates: files hash side by side
    return digest.digest()


def model_fingerprint(model_dir: Path) -> str:
    """Hash of config and weights: a changed variant never reuses another's cached outputs.

    Each file is hashed on its own thread (a 9B checkpoint's shards side by side), and a checkpoint of a GiB or
    more (GLM-4-9B: 18.8 GB) is hashed once per stat signature (stat_signature), remembered under
    .cache/fingerprints (QUANTIZE_FINGERPRINT_DIR): a run's stages hash it once. Rewriting any file changes the
    signature, and the content is hashed again."""
    from concurrent.futures import ThreadPoolExecutor

    files = _hashed_files(model_dir)
    memo = None
    if sum(path.stat().st_size for path in files) >= MEMO_MIN_BYTES:
        signature = stat_signature(model_dir)
        folder = Path(os.environ.get("QUANTIZE_FINGERPRINT_DIR") or Path.cwd() / ".cache" / "fingerprints")
        memo = folder / (hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16] + ".json")
        try:
            known = json.loads(memo.read_text())
            if known.get("signature") == signature:
                return known["fingerprint"]
        except (OSError, ValueError, AttributeError):
            pass
    with ThreadPoolExecutor(max(1, min(8, len(files)))) as pool:
        digests = list(pool.map(_file_digest, files))
    digest = hashlib.sha256()
    for path, file_digest in zip(files, digests):
        digest.update(path.name.encode())
        digest.update(file_digest)
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
