"""Where `quantize calib` keeps what it has read, so that its memory does not grow with the input: an SQLite
database and a spill file in a scratch folder (in $TMPDIR, removed at the end), holding each distinct
conversation once.

- `docs`: one row per conversation that is not an exact duplicate (its content hash `key`, unique: the exact
  de-duplication), with, for those kept (not near-duplicates), where its line lies in the spill file, its shape,
  whether it has a user turn, and its MinHash signature and word 3-gram hashes (what a later conversation's
  near-duplicate check compares against);
- `bands`: the LSH band buckets of the kept conversations (pipeline/calib/dedup.py), at most LSH_BUCKET_CAP each;
- the spill file: each kept conversation as the line calib_conversations.jsonl will hold
  ({"messages", "where"}, keys sorted; a message with images names them by sha256), read back by offset in
  content-hash order for the split;
- images/: each image of a kept conversation once, as the PNG its sha256 names (pipeline/formats/image_parts.py).

SQLite's page cache is bounded (CACHE_KIB), so the process holds a constant amount however large the input;
the scratch folder takes about as much disk as the input.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

from pipeline.formats.conversation_shapes import Conversation

CACHE_KIB = 32 << 10  # SQLite's page cache: 32 MB
PAGE_ROWS = 2048  # rows read per query when walking the kept conversations in hash order
SCHEMA = """
CREATE TABLE docs (row INTEGER PRIMARY KEY, key BLOB NOT NULL UNIQUE, kept INTEGER NOT NULL, has_user INTEGER,
                   shape TEXT, offset INTEGER, length INTEGER, signature BLOB, shingles BLOB);
CREATE TABLE bands (key BLOB NOT NULL, row INTEGER NOT NULL);
CREATE INDEX bands_by_key ON bands (key);
"""


def _file_size_limited() -> bool:
    import resource

    return resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY


class ConversationStore:
    """The scratch store of one calib run (a context manager: the folder goes when it closes)."""

    def __init__(self) -> None:
        try:
            self.folder = Path(tempfile.mkdtemp(prefix="quantize-calib-"))
        except OSError as exc:
            raise self._refused(exc, Path(tempfile.gettempdir())) or exc
        self.db, self.spill = None, None
        try:
            self.db = sqlite3.connect(self.folder / "conversations.sqlite", isolation_level=None)
            for pragma in ("journal_mode = OFF", "synchronous = OFF", f"cache_size = -{CACHE_KIB}",
                           "temp_store = FILE", "locking_mode = EXCLUSIVE"):
                self.db.execute(f"PRAGMA {pragma}")
            self.db.executescript(SCHEMA)
            self.db.execute("BEGIN")
            self.spill = open(self.folder / "kept.jsonl", "w+b")
        except BaseException as exc:
            self.close()
            raise self._refused(exc, self.folder) or exc
        self.kept = 0

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, kind, exc, trace) -> None:
        self.close()
        if exc is not None and (refused := self._refused(exc, self.folder)):
            raise refused from None

    @staticmethod
    def _refused(exc: BaseException, folder: Path):
        """A write to the scratch folder the file system refused (SQLite says "database or disk is full", or "disk
        I/O error" for a file-size limit), as the UserError naming it and $TMPDIR; None for any other failure."""
        import errno

        from pipeline.errors import write_refused

        if isinstance(exc, sqlite3.OperationalError) and "disk I/O error" in str(exc):
            exc = OSError(errno.EFBIG if _file_size_limited() else errno.ENOSPC, str(exc))
        refused = write_refused(exc, folder, "the calibration scratch store (in $TMPDIR)")
        if refused is not None:
            refused.args = (refused.args[0].replace("choose another path", "set TMPDIR to a folder with room"),)
        return refused

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
        if self.db is not None:
            self.db.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # ---------------------------------------------------------------- while reading

    def seen(self, key: bytes) -> bool:
        """Whether a conversation with this content hash was stored already (an exact duplicate)."""
        return self.db.execute("SELECT 1 FROM docs WHERE key = ?", (key,)).fetchone() is not None

    def bucket_members(self, band_keys: list[bytes]) -> dict[bytes, list[int]]:
        """The kept conversations (rows) in each of these LSH buckets, in the order they joined."""
        members: dict[bytes, list[int]] = {}
        marks = ",".join("?" * len(band_keys))
        for key, row in self.db.execute(f"SELECT key, row FROM bands WHERE key IN ({marks}) ORDER BY rowid", band_keys):
            members.setdefault(key, []).append(row)
        return members

    def candidates(self, rows: list[int]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(row, MinHash signature, word 3-gram hashes) of these kept conversations, in row order."""
        marks = ",".join("?" * len(rows))
        for row, signature, shingles in self.db.execute(
                f"SELECT row, signature, shingles FROM docs WHERE row IN ({marks}) ORDER BY row", rows):
            yield row, np.frombuffer(signature, dtype=np.uint32), np.frombuffer(shingles, dtype=np.uint32)

    def add_dropped(self, key: bytes) -> None:
        """A near-duplicate: its hash still makes a later exact copy a duplicate."""
        self.db.execute("INSERT INTO docs (key, kept) VALUES (?, 0)", (key,))

    def add_kept(self, conversation: Conversation, key: bytes, signature: np.ndarray | None,
                 shingles: np.ndarray | None, band_keys: list[bytes]) -> int:
        """Stores a kept conversation (its spill line, its near-duplicate data, `band_keys`: the buckets it joins);
        returns its row."""
        line = json.dumps({"where": conversation.where, "messages": conversation.messages}, ensure_ascii=False,
                          sort_keys=True).encode("utf-8") + b"\n"
        for image in conversation.images:
            self.add_image(image.sha256, image.png)
        offset = self.spill.seek(0, 2)
        self.spill.write(line)
        # held out only without images: the judge, kl, bench and ppl-chat read the held-out turns as text
        has_user = any(m["role"] == "user" for m in conversation.messages) and not conversation.images
        row = self.db.execute(
            "INSERT INTO docs (key, kept, has_user, shape, offset, length, signature, shingles) "
            "VALUES (?, 1, ?, ?, ?, ?, ?, ?)",
            (key, has_user, conversation.shape, offset, len(line),
             None if signature is None else signature.tobytes(), None if shingles is None else shingles.tobytes()),
        ).lastrowid
        self.db.executemany("INSERT INTO bands (key, row) VALUES (?, ?)", [(band, row) for band in band_keys])
        self.kept += 1
        return row

    def add_image(self, sha256: str, png: bytes) -> None:
        """Keeps an image (once) as images/<sha256>.png."""
        path = self.image_path(sha256)
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(png)

    def image_path(self, sha256: str) -> Path:
        return self.folder / "images" / f"{sha256}.png"

    # ---------------------------------------------------------------- after reading

    def reject(self, key: bytes) -> None:
        """A kept conversation the chat template rejected: no longer among those `by_hash` walks."""
        self.db.execute("UPDATE docs SET kept = 2 WHERE key = ?", (key,))

    def any_user_turn(self) -> bool:
        return self.db.execute("SELECT 1 FROM docs WHERE kept = 1 AND has_user = 1 LIMIT 1").fetchone() is not None

    def by_hash(self) -> Iterator[tuple[bytes, bool, int, int, str]]:
        """(key, has a user turn, spill offset, length, shape) of every kept conversation in content-hash order,
        read a page at a time."""
        after = b""
        while True:
            page = self.db.execute("SELECT key, has_user, offset, length, shape FROM docs WHERE key > ? AND kept = 1 "
                                   "ORDER BY key LIMIT ?", (after, PAGE_ROWS)).fetchall()
            for key, has_user, offset, length, shape in page:
                yield key, bool(has_user), offset, length, shape
            if len(page) < PAGE_ROWS:
                return
            after = page[-1][0]

    def by_input_order(self) -> Iterator[Conversation]:
        """Every kept conversation in the order the file holds them (small files: tests, `load_conversations`)."""
        rows = self.db.execute("SELECT key, offset, length, shape FROM docs WHERE kept = 1 ORDER BY row").fetchall()
        for key, offset, length, shape in rows:
            yield self.conversation(key, offset, length, shape)

    def line(self, offset: int, length: int) -> bytes:
        """The spill line: calib_conversations.jsonl's line for this conversation."""
        self.spill.seek(offset)
        return self.spill.read(length)

    def conversation(self, key: bytes, offset: int, length: int, shape: str) -> Conversation:
        record = json.loads(self.line(offset, length))
        messages = [{"role": m["role"], "content": m["content"], **({"images": m["images"]} if m.get("images") else {})}
                    for m in record["messages"]]  # the reader's order
        return Conversation(messages, shape, record["where"], key=key.hex())
