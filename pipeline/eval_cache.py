"""The resume cache of `quantize eval` (and the judge's answers): an append-only JSONL beside the
results, one line per finished generation or scored token request, keyed by the model's
fingerprint and the request, so a killed run resumes where it stopped and a rerun of an
unchanged model costs nothing.

A kill can land at any byte of an append: the file is a keyed JSONL (pipeline/formats/keyed_jsonl.py),
whose next open drops a torn last line, counts it (`dropped`) and cuts it off the file; the requests
it held are simply computed again. Any other broken line is an error naming the file and line.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from pipeline.engines import Completion, GenRequest
from pipeline.formats.checked_json import unpaired_surrogate
from pipeline.formats.keyed_jsonl import KeyedJsonl


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


def score_key(context: list[int], continuation: list[int]) -> str:
    """Key of a token-level scoring request: the same tokens score the same on any engine."""
    return "ll:" + hashlib.sha256(json.dumps([list(context), list(continuation)]).encode()).hexdigest()


def is_entry(entry: dict) -> bool:
    """A line as put_many (a generation: its text, writable as UTF-8, tokens, seconds) or put_scores (a token
    score: a finite log-probability, greedy or not, tokens) writes it."""
    def count(value) -> bool:
        return type(value) is int and value >= 0

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if "logprob" in entry:
        return number(entry["logprob"]) and type(entry.get("greedy")) is bool and count(entry.get("n_tokens"))
    text = entry.get("text")
    return isinstance(text, str) and unpaired_surrogate(text) is None and count(entry.get("n_tokens")) \
        and number(entry.get("seconds")) and entry["seconds"] >= 0


class GenerationCache(KeyedJsonl):
    """Finished generations and token scores of one model, read at open and appended one line per item."""

    def __init__(self, path: Path, fingerprint: str):
        self.fingerprint = fingerprint
        super().__init__(path, keep=lambda entry: entry.get("model") == fingerprint, valid=is_entry)

    @staticmethod
    def key(request: GenRequest) -> str:
        parts = [request.prompt, request.max_new_tokens, request.stop]
        if getattr(request, "images", None):  # same question, other image: another answer
            from pipeline.engines.vision import image_digest

            parts.append(image_digest(request.images))
        raw = json.dumps(parts)
        return hashlib.sha256(raw.encode()).hexdigest()

    def get(self, request: GenRequest) -> Completion | None:
        entry = self.entries.get(self.key(request))
        return Completion(entry["text"], entry["n_tokens"], entry["seconds"]) if entry else None

    def put(self, request: GenRequest, completion: Completion) -> None:
        self.put_many([request], [completion])

    def put_many(self, requests: list[GenRequest], completions: list[Completion]) -> None:
        self.append([{"model": self.fingerprint, "key": self.key(request), "text": completion.text,
                      "n_tokens": completion.n_tokens, "seconds": completion.seconds}
                     for request, completion in zip(requests, completions)])

    # ---------------------------------------------------------------- token scores (likelihood suites)

    def get_score(self, key: str) -> tuple[float, bool] | None:
        entry = self.entries.get(key)
        return (entry["logprob"], entry["greedy"]) if entry and "logprob" in entry else None

    def put_scores(self, keys: list[str], scores: list[tuple[float, bool]], n_tokens: list[int]) -> None:
        self.append([{"model": self.fingerprint, "key": key, "logprob": float(logprob), "greedy": bool(greedy),
                      "n_tokens": n} for key, (logprob, greedy), n in zip(keys, scores, n_tokens)])
