"""De-duplication: `normalised` text (case, punctuation, digits and spacing folded) and its
content hash for exact duplicates, and near-duplicates (word 3-gram Jaccard >=
NEAR_DUPLICATE_JACCARD) found with MinHash signatures and LSH banding, each candidate pair then
checked with the exact Jaccard.
"""

from __future__ import annotations

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


WORD_IDS_KEPT = 1 << 17  # words whose ids are remembered (a log's vocabulary grows with its size; ids are recomputed)


class WordIds(dict):
    """Stable 64-bit id per word (Python's str hash changes per process); remembers at most WORD_IDS_KEPT."""

    def __missing__(self, word: str) -> int:
        if len(self) >= WORD_IDS_KEPT:
            self.clear()
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
        del hashed  # before the next chunk's is made: one (hashes x shingles) matrix at a time
        first = last
    return signatures


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    common = len(np.intersect1d(a, b, assume_unique=True))
    return common / (len(a) + len(b) - common)


def band_keys(signature: np.ndarray) -> list[bytes]:
    """The LSH bucket keys of one signature: its band's number and that band's LSH_ROWS hashes."""
    return [bytes([band]) + signature[band * LSH_ROWS:(band + 1) * LSH_ROWS].tobytes() for band in range(LSH_BANDS)]


class NearDuplicates:
    """Near-duplicate detection one conversation at a time, in input order, against the conversations kept before
    (held by a pipeline/calib/store.py ConversationStore, not in memory): `prepare` a batch's texts (MinHash in one
    numpy pass), then `check` each in order and store it (`store.add_kept` with the returned band keys, or
    `store.add_dropped`) before the next is checked."""

    def __init__(self, store) -> None:
        self.store, self.word_ids = store, WordIds()

    def prepare(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """(word 3-gram hashes, MinHash signature or None when the text has no words) per text."""
        sets = [shingles(text.split(), self.word_ids) for text in texts]
        with_shingles = [i for i, s in enumerate(sets) if len(s)]
        signatures = minhash_signatures([sets[i] for i in with_shingles])
        prepared: list[tuple[np.ndarray, np.ndarray | None]] = [(s, None) for s in sets]
        for row, index in enumerate(with_shingles):
            prepared[index] = (sets[index], signatures[row])
        return prepared

    def check(self, shingle_set: np.ndarray, signature: np.ndarray | None) -> tuple[bool, list[bytes]]:
        """(whether it overlaps a kept conversation's word 3-grams by >= NEAR_DUPLICATE_JACCARD, the buckets it
        joins when kept: those not yet holding LSH_BUCKET_CAP)."""
        if signature is None:
            return False, []
        keys = band_keys(signature)
        members = self.store.bucket_members(keys)
        candidates = sorted({row for rows in members.values() for row in rows})
        for _, other_signature, other_set in self.store.candidates(candidates) if candidates else ():
            if (other_signature == signature).mean() >= MINHASH_PREFILTER and \
                    jaccard(shingle_set, other_set) >= NEAR_DUPLICATE_JACCARD:
                return True, []
        return False, [key for key in keys if len(members.get(key, ())) < LSH_BUCKET_CAP]


def near_duplicates(texts: list[str]) -> list[bool]:
    """True for each text whose word 3-grams overlap an earlier kept text's by >= NEAR_DUPLICATE_JACCARD.
    Input order decides which of a pair is kept, so the result is deterministic."""
    from pipeline.calib.store import ConversationStore
    from pipeline.formats.conversation_shapes import Conversation

    dropped = []
    with ConversationStore() as store:
        finder = NearDuplicates(store)
        for index, (shingle_set, signature) in enumerate(finder.prepare(texts)):
            near, keys = finder.check(shingle_set, signature)
            key = index.to_bytes(8, "big")
            if near:
                store.add_dropped(key)
            else:
                store.add_kept(Conversation([], "text", str(index)), key, signature, shingle_set, keys)
            dropped.append(near)
    return dropped
