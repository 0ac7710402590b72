"""A checkpoint's content fingerprint: the hash of its config, tokenizer and weights, so a changed variant
never reuses another's cached outputs (pipeline/scoring/eval_cache.py) or an old server's answers
(pipeline/engines/shared.py); and its weights' fingerprint (`weights_fingerprint`: config.json and the weight files),
which quant.json and every <suite>.json record, so that the report checks a variant's results were scored on the
checkpoint now in its folder (pipeline/report/checkpoint_match.py). A stage that scores a checkpoint takes that
files' stat signature as it starts (`hold_weights`) and refuses weights changed by the time it writes (`HeldWeights.checked`):
what it records is what it scored, never what is in the folder after it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
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


_DIGESTS: dict[tuple, bytes] = {}  # this process's file digests, by path and stat: the two fingerprints share them


def _file_digest(path: Path) -> bytes:
    info = path.stat()
    key = (str(Path(path).resolve()), info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = _hash_file(path)
    return _DIGESTS[key]


def _hash_file(path: Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)  # hashlib lets go of the GIL for large updates: files hash side by side
    return digest.digest()


def _weight_files(model_dir: Path) -> list[Path]:
    return [path for path in _hashed_files(model_dir) if path.suffix == ".safetensors" or path.name == "config.json"]


def weights_fingerprint(model_dir: Path) -> str | None:
    """Hash of the checkpoint's config.json and weight files (*.safetensors), by content: what its results were
    scored on. Not its records (quant.json, .stage.json), so quant.json can hold it. None without weights."""
    files = _weight_files(model_dir) if Path(model_dir).is_dir() else []
    if not any(path.suffix == ".safetensors" for path in files):
        return None
    return "weights:" + _combined(model_dir, files, "weights")


def model_fingerprint(model_dir: Path) -> str:
    """Hash of config and weights: a changed variant never reuses another's cached outputs.

    Each file is hashed on its own thread (a 9B checkpoint's shards side by side), and a checkpoint of a GiB or
    more (GLM-4-9B: 18.8 GB) is hashed once per stat signature (stat_signature), remembered under
    .cache/fingerprints (QUANTIZE_FINGERPRINT_DIR): a run's stages hash it once. Rewriting any file changes the
    signature, and the content is hashed again."""
    return _combined(model_dir, _hashed_files(model_dir), "model")


def _combined(model_dir: Path, files: list[Path], kind: str) -> str:
    """One hash of `files` (names and contents), remembered per stat signature for a large checkpoint."""
    from concurrent.futures import ThreadPoolExecutor

    memo = None
    if sum(path.stat().st_size for path in files) >= MEMO_MIN_BYTES:
        signature = stat_signature(model_dir)
        folder = Path(os.environ.get("QUANTIZE_FINGERPRINT_DIR") or Path.cwd() / ".cache" / "fingerprints")
        named = str(Path(model_dir).resolve()) + ("" if kind == "model" else f"\0{kind}")
        memo = folder / (hashlib.sha256(named.encode()).hexdigest()[:16] + ".json")
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
        except OSError:  # a read-only project, a full disk: hashed again next time
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    return fingerprint


@dataclass
class HeldWeights:
    """A checkpoint's weights as a stage found them when it started (`hold_weights`): their files' stat signature,
    taken then; their content hashed once, when the stage writes (`checked`), as before it held them."""
    model_dir: Path
    signature: str  # stat_signature without change times (DVC's links move those: stat_signature's docstring)

    def changed(self) -> bool:
        return stat_signature(self.model_dir, change_time=False) != self.signature

    def checked(self, stage: str) -> str | None:
        """weights_fingerprint, once the files are shown to be those the stage started with (after it is taken: a
        change while they are hashed shows too); a UserError when they changed (written to, replaced)."""
        fingerprint = weights_fingerprint(self.model_dir)
        if self.changed():
            from pipeline.errors import UserError

            raise UserError(f"the checkpoint {self.model_dir} changed while the {stage} ran (written to, or replaced); "
                            "its results could mix two versions, so none were kept: run the command again once it "
                            "stays put")
        return fingerprint


def hold_weights(model_dir: Path | str) -> HeldWeights:
    """The checkpoint's weights as they are now (their files' names, sizes, modification times, inodes: no byte read)."""
    model_dir = Path(model_dir)
    return HeldWeights(model_dir, stat_signature(model_dir, change_time=False))
