"""Loading: a conversation file read, checked, redacted and freed of duplicates and
near-duplicates, with the counts that go into stats.json (`CalibStats`). Bad records are skipped
and listed (the first BAD_RECORDS_LISTED); too many of them, or any with --strict, fail the run.
"""

from __future__ import annotations

import collections
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.calib.dedup import NearDuplicates, normalised
from pipeline.formats.conversation_shapes import BadRecord, Conversation, OnlySystemTurns, to_conversation
from pipeline.formats.conversations import iter_records
from pipeline.formats.image_parts import ImageReading
from pipeline.calib.redact import redact
from pipeline.calib.store import ConversationStore
from pipeline.errors import UserError
from pipeline.outputs import counted
from pipeline.formats.read_watch import ReadWatch

BAD_RECORDS_LISTED = 10
DEDUP_BATCH = 1024  # conversations whose MinHash signatures are computed in one numpy pass


@dataclass
class CalibStats:
    records_in: int = 0
    kept: int = 0
    dropped: dict = field(default_factory=collections.Counter)
    shapes: dict = field(default_factory=collections.Counter)
    roles: dict = field(default_factory=collections.Counter)
    redactions: dict = field(default_factory=collections.Counter)
    bad_records: list = field(default_factory=list)  # the first BAD_RECORDS_LISTED messages
    conversations: int = 0  # the ones turns, roles and letters were counted over
    only_system: int = 0  # bad records that held system turns only
    only_system_first: str = ""  # FILE:LINE of the first
    control_characters: dict = field(default_factory=collections.Counter)  # removed, by code point ("U+0000")
    control_character_places: list = field(default_factory=list)  # the first BAD_RECORDS_LISTED, FILE:LINE: field
    turns: int = 0
    letters: int = 0
    non_latin_letters: int = 0
    images: int = 0  # image parts of the kept conversations (each kept as its pixels alone)
    image_conversations: int = 0  # kept conversations with at least one image
    images_dropped: int = 0  # image parts dropped unread: a text-only model (their turns' text kept)


# ---------------------------------------------------------------- loading

ASCII_NON_LETTERS = bytes(b for b in range(128) if not chr(b).isalpha())
LETTER = re.compile(r"[^\W\d_]")
NON_LATIN_LETTER = re.compile(r"[^\W\d_a-zA-Z\u00aa-\u024f\u1e00-\u1eff]")


def _letters(text: str) -> tuple[int, int]:
    """(letters, letters outside the Latin script)."""
    if text.isascii():
        return len(text.encode("ascii").translate(None, ASCII_NON_LETTERS)), 0
    return len(LETTER.findall(text)), len(NON_LATIN_LETTER.findall(text))


def _note_bad(stats: CalibStats, message: str, strict: bool) -> None:
    if strict:
        raise UserError(f"{message}\n(--strict stops at the first bad record; without it bad records are "
                        "skipped and listed)")
    stats.dropped["bad record"] += 1
    if len(stats.bad_records) < BAD_RECORDS_LISTED:
        stats.bad_records.append(message)


def _note_removed(stats: CalibStats, conversation: Conversation) -> None:
    """Counts the control characters the reader took out of the record's text, and lists where (the first ones)."""
    for what, counts in conversation.removed.items():
        stats.control_characters.update(counts)
        if len(stats.control_character_places) < BAD_RECORDS_LISTED:
            codes = ", ".join(f"{code} x{n}" if n > 1 else code for code, n in sorted(counts.items()))
            stats.control_character_places.append(f"{conversation.where}: {what}: {codes}")


def _redacted_message(message: str, where: str, do_redact: bool, extra: list[re.Pattern]) -> str:
    """A bad record's message may quote its input (a role, keys; whole, never cut: read.quoted):
    redact all of it but the FILE:LINE it starts with, with the user's patterns too, before it is
    printed, raised or written to stats.json."""
    if not do_redact or not message.startswith(where):
        return redact(message, collections.Counter(), extra) if do_redact else message
    return where + redact(message[len(where):], collections.Counter(), extra)


def _record(where: str, record, stats: CalibStats, *, strict: bool, do_redact: bool,
            extra: list[re.Pattern], reading: ImageReading | None = None) -> Conversation | None:
    """The record as a checked, redacted conversation (its images re-encoded as their pixels alone); None (counted,
    listed) when it is bad."""
    stats.records_in += 1
    try:
        if isinstance(record, BadRecord):
            raise record
        conversation = to_conversation(record, where, reading)
    except BadRecord as exc:
        if isinstance(exc, OnlySystemTurns):
            stats.only_system += 1
            stats.only_system_first = stats.only_system_first or where
        _note_bad(stats, _redacted_message(str(exc), where, do_redact, extra), strict)
        return None
    _note_removed(stats, conversation)
    stats.shapes[conversation.shape] += 1
    if do_redact:
        for message in conversation.messages:
            message["content"] = redact(message["content"], stats.redactions, extra)
    return conversation


def _read_unique(path: Path, stats: CalibStats, store: ConversationStore, *, strict: bool, do_redact: bool,
                 extra: list[re.Pattern], advance=None, watch: ReadWatch | None = None,
                 reading: ImageReading | None = None) -> None:
    """Reads the file into `store`: valid, redacted conversations without exact duplicates (identical normalised
    text) or near-duplicates (the normalised text of their non-system turns: a long shared system prompt would make
    all texts alike), a batch of DEDUP_BATCH at a time."""
    finder, batch, batch_keys = NearDuplicates(store), [], set()
    for where, record in iter_records(path, advance, watch):
        conversation = _record(where, record, stats, strict=strict, do_redact=do_redact, extra=extra, reading=reading)
        if conversation is None:
            continue
        # its images count as words: the same question on another screenshot is another conversation
        words = [normalised(m["content"]) + "".join(f" {sha}" for sha in m.get("images", ()))
                 for m in conversation.messages]
        key = hashlib.sha256(" ".join(w for w in words if w).encode("utf-8")).digest()
        if key in batch_keys or store.seen(key):
            stats.dropped["duplicate"] += 1
            continue
        conversation.key = key.hex()
        batch_keys.add(key)
        batch.append((conversation, key, " ".join(w for w, m in zip(words, conversation.messages)
                                                  if w and m["role"] != "system")))
        if len(batch) == DEDUP_BATCH:
            _settle(batch, finder, store, stats)
            batch, batch_keys = [], set()
    _settle(batch, finder, store, stats)


def _settle(batch: list, finder: NearDuplicates, store: ConversationStore, stats: CalibStats) -> None:
    """Each conversation of the batch, in input order, dropped as a near-duplicate of one kept before or kept."""
    for (conversation, key, _), (shingle_set, signature) in zip(batch, finder.prepare([t for *_, t in batch])):
        near, band_keys = finder.check(shingle_set, signature)
        if near:
            stats.dropped["near-duplicate"] += 1
            store.add_dropped(key)
            continue
        store.add_kept(conversation, key, signature, shingle_set, band_keys)
        _count_kept(stats, conversation)


def _count_kept(stats: CalibStats, conversation: Conversation) -> None:
    stats.turns += len(conversation.messages)
    for message in conversation.messages:
        stats.roles[message["role"]] += 1
        letters, non_latin = _letters(message["content"])
        stats.letters += letters
        stats.non_latin_letters += non_latin
    stats.kept += 1
    stats.conversations += 1
    stats.images += len(conversation.images)
    stats.image_conversations += bool(conversation.images)
    stats.images_dropped += conversation.images_dropped


def read_conversations(path: Path, store: ConversationStore, *, strict: bool, max_bad_fraction: float,
                       do_redact: bool, extra_patterns: list[str], advance=None,
                       watch: ReadWatch | None = None, reading: ImageReading | None = None) -> CalibStats:
    """Reads, checks and redacts the file into `store`, dropping duplicates and near-duplicates; fails on too many
    bad records, and on a file changed while it was read. advance(n): n more bytes read (a progress bar); watch: the
    fingerprint of the bytes read, for the caller (pipeline/formats/read_watch.py); reading: how image parts are
    read (pipeline/formats/image_parts.py; without it a turn must be text)."""
    stats = CalibStats()
    path = Path(path)
    extra = [re.compile(p) for p in extra_patterns]
    _read_unique(path, stats, store, strict=strict, do_redact=do_redact, extra=extra, advance=advance, watch=watch,
                 reading=reading)
    _check_usable(path, stats, store.kept, max_bad_fraction)
    return stats


def load_conversations(path: Path, *, strict: bool, max_bad_fraction: float, do_redact: bool,
                       extra_patterns: list[str]) -> tuple[list[Conversation], CalibStats]:
    """read_conversations, the kept conversations returned in input order (for a small file: they are held in
    memory)."""
    with ConversationStore() as store:
        stats = read_conversations(path, store, strict=strict, max_bad_fraction=max_bad_fraction,
                                   do_redact=do_redact, extra_patterns=extra_patterns)
        return list(store.by_input_order()), stats


def _check_usable(path: Path, stats: CalibStats, usable: int, max_bad_fraction: float) -> None:
    """Refuses a file from which nothing (or too little) can be used, saying what is missing."""
    if stats.records_in == 0:
        raise UserError(f"{path}:1: no records (the file holds only blank lines or an empty array); "
                        "put one JSON conversation per line")
    if stats.only_system == stats.records_in:
        raise UserError(f"{path}: no record has a user or assistant turn: all {stats.records_in} hold only system "
                        f"messages (from {stats.only_system_first} on), nothing to calibrate on or hold out; export "
                        "the conversations' user and assistant turns with their system prompt")
    check_skipped(path, stats, max_bad_fraction)
    if not usable:  # calib.max_bad_fraction 1: every record may be bad, but one must be usable
        raise UserError(f"{path}: none of its {counted(stats.records_in, 'record')} can be used; fix them:\n"
                        + _listed(stats.bad_records, stats.dropped["bad record"]))


def _listed(messages: list[str], total: int) -> str:
    more = f"\n... and {total - len(messages)} more" if total > len(messages) else ""
    return "\n".join(messages) + more


def check_skipped(path: Path, stats: CalibStats, max_bad_fraction: float, model_dir: Path | None = None) -> None:
    """Refuses the file when the records skipped for any reason (bad, system turns only, rejected by the
    chat template) are more than calib.max_bad_fraction of those read. Duplicates are not skipped records:
    they are dropped on purpose."""
    bad, rejected = stats.dropped["bad record"], stats.dropped["rejected by chat template"]
    skipped = bad + rejected
    if skipped / stats.records_in <= max_bad_fraction:
        return
    one = skipped == 1
    why = ("is bad" if one else "are bad") if not rejected else \
        f"{'was' if one else 'were'} skipped ({bad} bad, {rejected} rejected by the chat template of {model_dir})"
    listed = f":\n{_listed(stats.bad_records, bad)}" if bad else ""
    raise UserError(
        f"{path}: {skipped} of {counted(stats.records_in, 'record')} {why} "
        f"({skipped / stats.records_in:.0%} > calib.max_bad_fraction {max_bad_fraction:.0%}); "
        f"fix them, or raise calib.max_bad_fraction in params.yaml{listed}"
    )
