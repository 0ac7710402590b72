"""De-duplication: `normalised` text (case, punctuation, digits and spacing folded) and its
content hash for exact duplicates, and near-duplicates (word 3-gram Jaccard >=
NEAR_DUPLICATE_JACCARD) found with MinHash signatures and LSH banding, each candidate pair then
checked with the exact Jaccard.
"""

from __future__ import annotations

import collections
import hashlib
import re
import unicodedata

import numpy as np

# ---------------------------------------------------------------- de-duplication

NEAR_DUPLICATE_JACCARD = 0.8  # word 3-gram Jaccard at or above which two conversations count as one
SHINGLE_WORDS = 3
# 16 bands of 4 MinHash rows: a pair at Jaccard 0.8 shares a band with p > 0.999, at 0.5 with
# p ~ 0.64, at 0.3 with p ~ 0.12; every candidate pair is then checked with the exact Jaccard.
LSH_BANDS, LSH_ROWS = 16, 4
SHINGLES_PER_CHUNK = 1 << 17  # bounds the (shingles x hashes) matrix to 32 MB
# Exact Jaccard only for candidates whose signatures agree on >= 60 % of hashes (a pair at 0.8
# falls below that with p ~ 1e-4), and at most 64 texts per band bucket: texts sharing long
# boilerplate would otherwise make every pair a candidate (quadratic time).
MINHASH_PREFILTER = NEAR_DUPLICATE_JACCARD - 0.2
LSH_BUCKET_CAP = 64


def _hash_constants(count: int, salt: str, dtype) -> np.ndarray:
    digests = (hashlib.blake2b(f"{salt}{i}".encode(), digest_size=8).digest() for i in range(count))
    return np.array([int.from_bytes(d, "little") & np.iinfo(dtype).max for d in digests], dtype=dtype)


# MinHash in 32-bit multiply-add hashing (odd multipliers): half the memory traffic of 64-bit
MINHASH_MULTIPLIERS = _hash_constants(LSH_BANDS * LSH_ROWS, "minhash-a", np.uint32) | np.uint32(1)
MINHASH_OFFSETS = _hash_constants(LSH_BANDS * LSH_ROWS, "minhash-b", np.uint32)
SHINGLE_MIXERS = _hash_constants(SHINGLE_WORDS, "shingle", np.uint64) | np.uint64(1)


def normalised(text: str) -> str:
    """Case, punctuation, digits and spacing folded: texts that differ only there are duplicates."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.findall(r"\w+", re.sub(r"\d+", "0", text)))


def content_hash(text: str) -> str:
    return hashlib.sha256(normalised(text).encode("utf-8")).hexdigest()


class WordIds(dict):
    """Stable 64-bit id per word (Python's str hash changes per process)."""

    def __missing__(self, word: str) -> int:
        value = self[word] = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
        return value


def shingles(words: list[str], word_ids: WordIds) -> np.ndarray:
    """Sorted unique 32-bit hashes of the word 3-grams (the whole text when it is shorter)."""
    ids = np.fromiter(map(word_ids.__getitem__, words), dtype=np.uint64, count=len(words))
    if not len(ids):
        return np.empty(0, dtype=np.uint32)
    width = min(SHINGLE_WORDS, len(ids))
    span = len(ids) - width + 1
    mixed = ids[:span] * SHINGLE_MIXERS[0]
    for i in range(1, width):
        mixed += ids[i:i + span] * SHINGLE_MIXERS[i]
    return np.unique((mixed >> np.uint64(32)).astype(np.uint32))


def minhash_signatures(shingle_sets: list[np.ndarray]) -> np.ndarray:
    """(documents x LSH_BANDS*LSH_ROWS) MinHash signatures; every set must be non-empty."""
    signatures = np.empty((len(shingle_sets), len(MINHASH_MULTIPLIERS)), dtype=np.uint32)
    first = 0
    while first < len(shingle_sets):
        last, total = first, 0
        while last < len(shingle_sets) and (last == first or total + len(shingle_sets[last]) <= SHINGLES_PER_CHUNK):
            total += len(shingle_sets[last])
            last += 1
        chunk = np.concatenate(shingle_sets[first:last])
        hashed = np.multiply(MINHASH_MULTIPLIERS[:, None], chunk[None, :])  # hashes x shingles: rows reduce fast
        hashed += MINHASH_OFFSETS[:, None]
        starts = np.cumsum([0] + [len(s) for s in shingle_sets[first:last - 1]])
        signatures[first:last] = np.minimum.reduceat(hashed, starts, axis=1).T
        first = last
    return signatures


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    common = len(np.intersect1d(a, b, assume_unique=True))
    return common / (len(a) + len(b) - common)


def near_duplicates(texts: list[str]) -> list[bool]:
    """True for each text whose word 3-grams overlap an earlier kept text's by >= NEAR_DUPLICATE_JACCARD.
    Input order decides which of a pair is kept, so the result is deterministic."""
    word_ids = WordIds()
    sets = [shingles(text.split(), word_ids) for text in texts]
    with_shingles = [i for i, s in enumerate(sets) if len(s)]
    signatures = minhash_signatures([sets[i] for i in with_shingles])
    buckets: dict[tuple[int, bytes], list[int]] = collections.defaultdict(list)  # band key -> signature rows
    dropped = [False] * len(texts)
    for row, index in enumerate(with_shingles):
        keys = [(band, signatures[row, band * LSH_ROWS:(band + 1) * LSH_ROWS].tobytes()) for band in range(LSH_BANDS)]
        candidates = sorted({other for key in keys for other in buckets.get(key, ())})
        if candidates:
            agreement = (signatures[candidates] == signatures[row]).mean(axis=1)
            likely = [other for other, share in zip(candidates, agreement) if share >= MINHASH_PREFILTER]
            if any(jaccard(sets[index], sets[with_shingles[other]]) >= NEAR_DUPLICATE_JACCARD for other in likely):
                dropped[index] = True
                continue
        for key in keys:
            if len(buckets[key]) < LSH_BUCKET_CAP:
                buckets[key].append(row)
    return dropped
