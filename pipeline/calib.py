"""`quantize calib`: raw support logs -> calibration token blocks + held-out judge prompts.

Reads .jsonl, .jsonl.gz or .json (array); each record's shape is detected on its own
(OpenAI messages, ShareGPT conversations, turns with role aliases, prompt/response,
instruction/output, plain text). Bad records are skipped and listed; too many fail the run.
Personal data is redacted by default, before anything else looks at the text. Duplicates
(identical normalised text) and near-duplicates (word 3-gram Jaccard >= NEAR_DUPLICATE_JACCARD,
found with MinHash + LSH) are dropped; the rest is split by content hash into calibration and
holdout (never sharing a conversation), rendered with the model's chat template and packed into
fixed-length token blocks.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import ipaddress
import json
import re
import time
import unicodedata
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from pipeline.errors import UserError
from pipeline.outputs import Stopwatch, atomic_dir

MAX_LINE_BYTES = 8 << 20  # a longer line is a broken export, not a conversation
ROLE_ALIASES = {
    "user": "user", "human": "user", "customer": "user", "client": "user",
    "assistant": "assistant", "agent": "assistant", "bot": "assistant", "gpt": "assistant",
    "model": "assistant", "system": "system",
}
SHAPES = ("messages", "conversations", "turns", "prompt/response", "instruction/output", "text")
FORMATS = "a .jsonl, .jsonl.gz or .json file of conversations"
BAD_RECORDS_LISTED = 10


class BadRecord(Exception):
    """One record that cannot be used; the message says why and how to fix it."""


@dataclass
class Conversation:
    messages: list[dict]
    shape: str
    where: str  # FILE:LINE
    key: str = ""  # sha256 of the normalised text: de-duplication, split and holdout id

    def text(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


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
    turns: int = 0
    letters: int = 0
    non_latin_letters: int = 0


# ---------------------------------------------------------------- reading

def _check_readable(path: Path) -> None:
    if not path.exists():
        raise UserError(f"{path}: no such file; pass {FORMATS}")
    if path.is_dir():
        raise UserError(f"{path}: is a directory; pass {FORMATS} inside it")
    if path.stat().st_size == 0:
        raise UserError(f"{path}:1: the file is empty; put one JSON conversation per line")


def _open_binary(path: Path):
    """Plain or gzip by content (not by name); UTF-16 is refused up front with its fix."""
    try:
        with open(path, "rb") as probe:
            head = probe.read(2)
        if head in (b"\xff\xfe", b"\xfe\xff"):
            raise UserError(f"{path}:1: the file is UTF-16 encoded; re-export it as UTF-8")
        return gzip.open(path, "rb") if head == b"\x1f\x8b" else open(path, "rb")
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions") from None


def _bounded_lines(handle) -> Iterator[tuple[bytes | None, int]]:
    """(line, size) per line; a line over MAX_LINE_BYTES comes as (None, size) and is
    skipped in 1 MB steps, so it is never held whole in memory nor parsed."""
    while True:
        line = handle.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line, len(line)
            continue
        size = len(line)
        while not line.endswith(b"\n"):
            line = handle.readline(1 << 20)
            if not line:
                break
            size += len(line)
        yield None, size


def _decode(raw: bytes | None, size: int, where: str) -> str:
    if raw is None:
        raise BadRecord(f"{where}: line is {size / 2**20:.0f} MB, over the {MAX_LINE_BYTES >> 20} MB limit for "
                        "one record; split the conversation or drop the line")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRecord(f"{where}: bytes at {exc.start} are not UTF-8; re-export the file as UTF-8") from None
    return text.lstrip("\ufeff").rstrip("\r\n")


def _parse_line(raw: bytes | None, size: int, where: str) -> object:
    line = _decode(raw, size, where)
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadRecord(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); "
                        "make the line one JSON object or remove it") from None
    except (ValueError, RecursionError) as exc:  # a 5,000-digit number, arrays nested 100,000 deep
        raise BadRecord(f"{where}: JSON that cannot be loaded ({str(exc)[:100]}); "
                        "make the line one plain JSON object or remove it") from None


def iter_records(path: Path) -> Iterator[tuple[str, object]]:
    """Yields (FILE:LINE, parsed JSON or BadRecord) for every record of the file."""
    path = Path(path)
    _check_readable(path)
    if path.name.endswith((".json", ".json.gz")):
        yield from _iter_json_array(path)
        return
    number = 0
    with _open_binary(path) as handle:
        try:
            for number, (raw, size) in enumerate(_bounded_lines(handle), start=1):
                where = f"{path}:{number}"
                try:
                    record = _parse_line(raw, size, where)
                except BadRecord as exc:
                    yield where, exc
                    continue
                if record is not None:
                    yield where, record
        except (OSError, EOFError, zlib.error) as exc:
            raise UserError(f"{path}:{number + 1}: reading failed ({exc}); a gzip file here is corrupt or "
                            "truncated: compress it again or pass the plain .jsonl") from None


def _read_text(path: Path) -> str:
    with _open_binary(path) as handle:
        try:
            data = handle.read()
        except (OSError, EOFError, zlib.error) as exc:
            raise UserError(f"{path}: the gzip data is corrupt or truncated ({exc}); "
                            "compress the file again") from None
    try:
        return data.decode("utf-8").lstrip("\ufeff")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{path}:{line}: bytes are not UTF-8; re-export the file as UTF-8") from None


def _iter_json_array(path: Path) -> Iterator[tuple[str, object]]:
    """Records of a JSON array, each named FILE:LINE:COLUMN where it starts."""
    text = _read_text(path)
    decoder, whitespace = json.JSONDecoder(), re.compile(r"[ \t\r\n]*")
    position = whitespace.match(text, 0).end()
    if position == len(text):
        raise UserError(f"{path}:1: the file holds only whitespace; a .json file must hold an array of records")
    if text[position] != "[":
        raise UserError(f"{path}:{_line_col(text, position)}: the top level is not an array; "
                        "a .json file must hold an array of records (or use .jsonl, one record per line)")
    position = whitespace.match(text, position + 1).end()
    while not text.startswith("]", position):
        try:
            record, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno}); "
                            "a .json file must be one valid array, so fix it there (or use .jsonl)") from None
        except (ValueError, RecursionError) as exc:
            raise UserError(f"{path}:{_line_col(text, position)}: JSON that cannot be loaded ({str(exc)[:100]}); "
                            "fix the record there (or use .jsonl, where a bad record is skipped)") from None
        yield f"{path}:{_line_col(text, position)}", record
        position = whitespace.match(text, end).end()
        if text.startswith(",", position):
            position = whitespace.match(text, position + 1).end()
        elif not text.startswith("]", position):
            raise UserError(f"{path}:{_line_col(text, position)}: expected ',' or ']' after a record; "
                            "fix the array there")
    after = whitespace.match(text, position + 1).end()
    if after < len(text):
        raise UserError(f"{path}:{_line_col(text, after)}: text after the closing ']'; "
                        "a .json file must hold exactly one array")


def _line_col(text: str, position: int) -> str:
    line = text.count("\n", 0, position) + 1
    return f"{line}:{position - text.rfind(chr(10), 0, position)}"


# ---------------------------------------------------------------- shapes

JSON_TYPES = {"dict": "an object", "list": "an array", "NoneType": "null", "int": "a number",
              "float": "a number", "bool": "a boolean"}


def _content(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        kind = JSON_TYPES.get(type(value).__name__, type(value).__name__)
        raise BadRecord(f"{where}: {what} is {kind}, not text; make it a string")
    value = value.replace("\r\n", "\n").strip()
    if not value:
        raise BadRecord(f"{where}: {what} is empty; drop the turn or fill it")
    return value


def _role(value, where: str, what: str) -> str:
    role = ROLE_ALIASES.get(value.strip().lower()) if isinstance(value, str) else None
    if role is None:
        allowed = ", ".join(sorted(ROLE_ALIASES))
        raise BadRecord(f"{where}: {what} {repr(value)[:40]} cannot be mapped; use one of {allowed} (any case)")
    return role


def _turn_list(turns, where: str, role_key: str, text_key: str, shape: str) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise BadRecord(f"{where}: '{shape}' must be a non-empty list of turns; "
                        f"give it [{{\"{role_key}\": ..., \"{text_key}\": ...}}, ...]")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise BadRecord(f"{where}: {shape}[{i}] needs '{role_key}' and '{text_key}' keys; add them or drop the turn")
        messages.append({
            "role": _role(turn[role_key], where, f"{shape}[{i}].{role_key}"),
            "content": _content(turn[text_key], where, f"{shape}[{i}].{text_key}"),
        })
    return messages


def _pair(record: dict, where: str, ask: str, answer: str) -> list[dict]:
    prompt = _content(record[ask], where, ask)
    if isinstance(record.get("input"), str) and record["input"].strip():
        prompt += "\n\n" + record["input"].strip()
    return [{"role": "user", "content": prompt},
            {"role": "assistant", "content": _content(record[answer], where, answer)}]


def to_conversation(record, where: str) -> Conversation:
    """Detects the record's shape and normalises it to OpenAI-style messages."""
    if not isinstance(record, dict):
        kind = JSON_TYPES.get(type(record).__name__, type(record).__name__)
        raise BadRecord(f"{where}: a record must be a JSON object, not {kind}; put one conversation object "
                        "per line (a JSON array belongs in a .json file)")
    if "messages" in record:
        shape, messages = "messages", _turn_list(record["messages"], where, "role", "content", "messages")
    elif "conversations" in record:
        shape, messages = "conversations", _turn_list(record["conversations"], where, "from", "value", "conversations")
    elif "turns" in record:
        shape, messages = "turns", _turn_list(record["turns"], where, "role", "content", "turns")
    elif "prompt" in record and "response" in record:
        shape, messages = "prompt/response", _pair(record, where, "prompt", "response")
    elif "instruction" in record and "output" in record:
        shape, messages = "instruction/output", _pair(record, where, "instruction", "output")
    elif "text" in record:
        shape, messages = "text", [{"role": "text", "content": _content(record["text"], where, "text")}]
    else:
        keys = ", ".join(sorted(record)[:6]) or "none"
        raise BadRecord(
            f"{where}: unknown record shape (keys: {keys}); use one of: "
            "messages, conversations, turns, prompt+response, instruction+output, text"
        )
    return Conversation(messages, shape, where)


# ---------------------------------------------------------------- redaction
#
# Each kind is a loose candidate pattern plus a check that says how much of the candidate to
# redact (0: none, and the search goes on after the candidate, as re.sub would).

IBAN_COUNTRIES = frozenset(
    "AD AE AL AT AZ BA BE BG BH BI BR BY CH CR CY CZ DE DJ DK DO EE EG ES FI FK FO FR GB GE GI GL GR GT HN HR "
    "HU IE IL IQ IS IT JO KW KZ LB LC LI LT LU LV LY MC MD ME MK MN MR MT MU NI NL NO OM PK PL PS PT QA RO RS "
    "RU SA SC SD SE SI SK SM SO ST SV TL TN TR UA VA VG XK YE".split()
)
# An order, tracking or transaction label right before a bare number: an identifier, not a phone or card.
ID_LABEL = re.compile(
    r"\b(?:order|tracking|transaction|txn|ref|reference|invoice|awb|arn|utr|imei|serial|ticket|complaint"
    r"|pnr|booking|shipment|consignment|sku|asin|isbn)\W{0,3}(?:(?:id|no|num|number|code|is|was)\b\W{0,3}){0,3}$",
    re.IGNORECASE,
)


def _luhn_ok(digits: str) -> bool:
    total, parity = 0, len(digits) % 2
    for i, ch in enumerate(digits):
        d = int(ch)
        if i % 2 == parity:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _iban_ok(candidate: str) -> bool:
    s = candidate.replace(" ", "").upper()
    if not 15 <= len(s) <= 34 or s[:2] not in IBAN_COUNTRIES:
        return False
    moved = s[4:] + s[:4]
    return int("".join(str(int(ch, 36)) for ch in moved)) % 97 == 1


def _card_ok(candidate: str) -> bool:
    digits = re.sub(r"\D", "", candidate)
    issuer = digits[0] in "3456" or "2221" <= digits[:4] <= "2720" or digits[:2] in ("81", "82")
    return 13 <= len(digits) <= 19 and issuer and _luhn_ok(digits)


def _phone_ok(candidate: str) -> bool:
    digits = sum(ch.isdigit() for ch in candidate)
    international = candidate.startswith(("+", "00"))
    return (8 if international else 9) <= digits <= 15


def _ipv6_ok(candidate: str) -> bool:
    try:
        ipaddress.IPv6Address(candidate)
    except ValueError:
        return False
    return sum(1 for group in candidate.split(":") if group) >= 2  # "::1" and "::" name no one


def _ipv4_ok(candidate: str) -> bool:
    return all(int(octet) <= 255 for octet in candidate.split("."))


def _after_id_label(text: str, start: int) -> bool:
    return ID_LABEL.search(text, max(0, start - 40), start) is not None


def _checked(is_valid: Callable[[str], bool], *, cut_at_spaces: bool = False, after_id_label_ok: bool = True):
    """A check for one kind. cut_at_spaces: also try the candidate's prefixes that end before a
    space (a card followed by its CVV, an IBAN followed by a capitalised word). after_id_label_ok
    False: a bare number right after 'order #', 'tracking no.' and the like is an identifier."""
    def check(candidate: str, text: str, start: int) -> int:
        if not after_id_label_ok and not candidate.startswith("+") and _after_id_label(text, start):
            return 0
        ends = [len(candidate)]
        if cut_at_spaces:
            ends += [i for i in range(len(candidate) - 1, 0, -1) if candidate[i] == " "]
        return next((end for end in ends if is_valid(candidate[:end])), 0)
    return check


@dataclass(frozen=True)
class Redactor:
    kind: str
    pattern: re.Pattern
    check: Callable[[str, str, int], int]  # (candidate, text, start) -> characters to redact
    needs: str  # a key of PRE_CHECKS: a cheap test that skips texts that cannot match


REDACTORS = [
    Redactor("email", re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"),
             lambda candidate, text, start: len(candidate), "at sign"),
    Redactor("iban", re.compile(r"\b[A-Za-z]{2}\d{2}(?: ?[A-Za-z0-9]{4}){2,7}(?: ?[A-Za-z0-9]{1,4})?\b"),
             _checked(_iban_ok, cut_at_spaces=True), "long number"),
    # cards: 13-19 digits, solid or in groups (4-4-4-4[-3], Amex 4-6-5, Diners 4-6-4); Luhn and issuer checked
    Redactor("card", re.compile(r"(?<![\w-])(?:\d{13,19}|\d{4}(?:[ -]\d{4}){2,3}(?:[ -]\d{1,4})?|\d{4}[ -]\d{6}[ -]\d{4,5})"
                                r"(?!\w|-\d)"),
             _checked(_card_ok, cut_at_spaces=True, after_id_label_ok=False), "long number"),
    Redactor("ip", re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|\d{1,3}(?:\.\d{1,3}){3})?"
                              r"(?![\w:]|\.\d)"), _checked(_ipv6_ok), "hex colon"),
    Redactor("ip", re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?!\w|\.\d)"), _checked(_ipv4_ok), "dotted number"),
    # phones: 8-15 digits (9+ without a country code) in up to six groups, optionally +CC and (area);
    # never the continuation of a longer number such as order #502-2345678-9012345 or a date
    Redactor("phone", re.compile(r"(?<![\w#+])(?<!\d[-/.])(?:(?:\+|\b00)\d{1,3}[ .-]?)?(?:\(\d{1,5}\)[ .-]?)?"
                                 r"\d{1,5}(?:[ .-]?\d{1,5}){0,5}(?!\w|[-/.]\d)"),
             _checked(_phone_ok, after_id_label_ok=False), "long number"),
]
PRE_CHECKS: dict[str, Callable[[str], object]] = {
    "at sign": lambda text: "@" in text,
    "long number": re.compile(r"\d[\d ().+/-]{6,}\d").search,  # every IBAN, card and phone has one
    "dotted number": re.compile(r"\d\.\d").search,
    "hex colon": re.compile(r"[0-9A-Fa-f]:[0-9A-Fa-f:]|::").search,
}


def _redact_kind(text: str, redactor: Redactor, counts: collections.Counter) -> str:
    pieces, copied, position = [], 0, 0
    while (match := redactor.pattern.search(text, position)) is not None:
        length = redactor.check(match.group(0), text, match.start())
        if not length:
            position = max(match.end(), match.start() + 1)
            continue
        pieces += [text[copied:match.start()], f"[{redactor.kind.upper()}]"]
        copied = position = match.start() + length
        counts[redactor.kind] += 1
    return "".join(pieces) + text[copied:] if pieces else text


def redact(text: str, counts: collections.Counter, extra: list[re.Pattern]) -> str:
    """Replaces personal data by [EMAIL], [PHONE], [CARD], [IBAN], [IP] and user patterns by [REDACTED]."""
    for pattern in extra:
        text, n = pattern.subn("[REDACTED]", text)
        counts["custom"] += n
    possible: dict[str, bool] = {}
    for redactor in REDACTORS:
        if redactor.needs not in possible:
            possible[redactor.needs] = bool(PRE_CHECKS[redactor.needs](text))
        if possible[redactor.needs]:
            text = _redact_kind(text, redactor, counts)
    return text


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


def _redacted_message(message: str, do_redact: bool) -> str:
    """A bad record's message quotes its input (a role, keys): redact that part too."""
    if not do_redact:
        return message
    where, _, rest = message.partition(": ")
    return f"{where}: {redact(rest, collections.Counter(), [])}"


def _read_unique(path: Path, stats: CalibStats, *, strict: bool, do_redact: bool,
                 extra: list[re.Pattern]) -> tuple[list[Conversation], list[str]]:
    """Valid, redacted conversations without exact duplicates, and the normalised text of their
    non-system turns (for near-duplicates: a long shared system prompt would make all texts alike)."""
    conversations, texts, seen = [], [], set()
    for where, record in iter_records(path):
        stats.records_in += 1
        try:
            if isinstance(record, BadRecord):
                raise record
            conversation = to_conversation(record, where)
        except BadRecord as exc:
            _note_bad(stats, _redacted_message(str(exc), do_redact), strict)
            continue
        stats.shapes[conversation.shape] += 1
        if do_redact:
            for message in conversation.messages:
                message["content"] = redact(message["content"], stats.redactions, extra)
        words = [normalised(m["content"]) for m in conversation.messages]
        conversation.key = hashlib.sha256(" ".join(w for w in words if w).encode("utf-8")).hexdigest()
        if conversation.key in seen:
            stats.dropped["duplicate"] += 1
            continue
        seen.add(conversation.key)
        conversations.append(conversation)
        texts.append(" ".join(w for w, m in zip(words, conversation.messages) if w and m["role"] != "system"))
    return conversations, texts


def _count_kept(stats: CalibStats, conversations: list[Conversation]) -> None:
    for conversation in conversations:
        stats.turns += len(conversation.messages)
        for message in conversation.messages:
            stats.roles[message["role"]] += 1
            letters, non_latin = _letters(message["content"])
            stats.letters += letters
            stats.non_latin_letters += non_latin
    stats.kept = stats.conversations = len(conversations)


def load_conversations(path: Path, *, strict: bool, max_bad_fraction: float, do_redact: bool,
                       extra_patterns: list[str]) -> tuple[list[Conversation], CalibStats]:
    """Read, check, redact, and drop duplicates and near-duplicates; fails on too many bad records."""
    stats = CalibStats()
    path = Path(path)
    extra = [re.compile(p) for p in extra_patterns]
    conversations, texts = _read_unique(path, stats, strict=strict, do_redact=do_redact, extra=extra)
    _check_bad_fraction(path, stats, max_bad_fraction)
    near = near_duplicates(texts)
    stats.dropped["near-duplicate"] += sum(near)
    conversations = [c for c, dropped in zip(conversations, near) if not dropped]
    _count_kept(stats, conversations)
    return conversations, stats


def _check_bad_fraction(path: Path, stats: CalibStats, max_bad_fraction: float) -> None:
    if stats.records_in == 0:
        raise UserError(f"{path}:1: no records (the file holds only blank lines or an empty array); "
                        "put one JSON conversation per line")
    bad = stats.dropped["bad record"]
    if bad / stats.records_in > max_bad_fraction:
        shown = "\n".join(stats.bad_records)
        more = f"\n... and {bad - len(stats.bad_records)} more" if bad > len(stats.bad_records) else ""
        raise UserError(
            f"{path}: {bad} of {stats.records_in} records are bad "
            f"({bad / stats.records_in:.0%} > calib.max_bad_fraction {max_bad_fraction:.0%}); "
            f"fix them, or raise calib.max_bad_fraction in params.yaml:\n{shown}{more}"
        )


# ---------------------------------------------------------------- split and pack

def split(conversations: list[Conversation], holdout: int) -> tuple[list[Conversation], list[Conversation]]:
    """Deterministic: the `holdout` conversations with a user turn and the smallest content hashes
    are held out; the rest, in hash order, calibrate."""
    ranked = sorted(conversations, key=lambda c: c.key or content_hash(c.text()))
    held_ids: set[int] = set()
    for conversation in ranked:
        if len(held_ids) == holdout:
            break
        if any(m["role"] == "user" for m in conversation.messages):
            held_ids.add(id(conversation))
    held = [c for c in ranked if id(c) in held_ids]
    return [c for c in ranked if id(c) not in held_ids], held


def holdout_prompt(conversation: Conversation) -> dict:
    """The last user turn with the conversation before it: what the judge's models answer."""
    last_user = max(i for i, m in enumerate(conversation.messages) if m["role"] == "user")
    messages = conversation.messages[: last_user + 1]
    return {
        "id": (conversation.key or content_hash(conversation.text()))[:16],
        "messages": messages,
        "prompt": messages[-1]["content"],
        "reference": next((m["content"] for m in conversation.messages[last_user + 1:]
                           if m["role"] == "assistant"), None),
    }


def _strict_turns(messages: list[dict]) -> list[dict]:
    """The same text shaped for templates that demand user/assistant alternation starting with
    the user: system folded into the first user turn, leading assistant turns dropped, and
    consecutive turns of one role merged."""
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    turns: list[dict] = []
    for message in messages:
        if message["role"] == "system" or (not turns and message["role"] != "user"):
            continue
        if turns and turns[-1]["role"] == message["role"]:
            turns[-1] = {"role": message["role"], "content": turns[-1]["content"] + "\n" + message["content"]}
        else:
            turns.append(dict(message))
    if turns and system:
        turns[0] = {"role": "user", "content": system + "\n\n" + turns[0]["content"]}
    return turns


def render(tokenizer, conversation: Conversation) -> str | None:
    """The conversation as the model sees it; None when the chat template rejects it."""
    from jinja2 import TemplateError

    if conversation.shape == "text" or not getattr(tokenizer, "chat_template", None):
        return conversation.text()
    for messages in (conversation.messages, _strict_turns(conversation.messages)):
        if not messages:  # no user turn to start from
            continue
        try:
            # a fixed date: Llama 3 templates otherwise print today's, and outputs must not change by day
            return tokenizer.apply_chat_template(messages, tokenize=False, date_string="26 Jul 2024")
        except TemplateError:
            continue
    return None


def token_counts_and_stream(tokenizer, texts: list[str], needed: int) -> tuple[int, list[int]]:
    """Total tokens of all texts, and the first `needed` (or all) tokens of their concatenation.
    Batches through the fast (Rust) tokenizer, which uses every core."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    total, stream = 0, []
    for first in range(0, len(texts), 512):
        batch = texts[first:first + 512]
        if backend is not None:
            ids = [encoding.ids for encoding in backend.encode_batch(batch, add_special_tokens=False)]
        else:
            ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
        for row in ids:
            total += len(row)
            if len(stream) < needed:
                stream.extend(row)
    return total, stream[:needed]


def pack(stream: list[int], seq_len: int, num_blocks: int, source: Path) -> list[list[int]]:
    """Cuts the concatenated token stream into fixed-length blocks: no padding, so blocks batch."""
    needed = seq_len * num_blocks
    if len(stream) < needed:
        raise UserError(
            f"{source}: calibration set too small: {len(stream)} tokens after de-duplication and holdout, "
            f"need calib.seq_len x calib.num_blocks = {seq_len} x {num_blocks} = {needed}; "
            "add conversations or lower calib.num_blocks / calib.seq_len"
        )
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(num_blocks)]


def _load_tokenizer(model_dir: Path):
    if not model_dir.is_dir():
        raise UserError(f"{model_dir}: no such model directory; pass --model with the checkpoint whose "
                        "tokenizer and chat template render the text (e.g. models/base after `quantize resave`)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise UserError(f"{model_dir}: no usable tokenizer ({exc}); "
                        "pass --model with a checkpoint that has one") from None


# ---------------------------------------------------------------- stage

@dataclass
class CalibResult:
    out: Path
    stats: dict
    seconds: float
    phases: dict = field(default_factory=dict)  # seconds per phase (never written: not deterministic)

    def summary(self) -> str:
        s = self.stats
        dropped = ", ".join(f"{n} {why}" for why, n in s["dropped"].items())
        return (
            f"calib: wrote {self.out} ({s['blocks']} blocks x {s['seq_len']} tokens, "
            f"{s['holdout']} holdout prompts; kept {s['records_kept']} of {s['records_in']} records"
            f"{f' (dropped {dropped})' if dropped else ''}, {sum(s['redactions'].values())} redactions) "
            f"in {self.seconds:.1f} s"
        )


def _jsonl(rows) -> str:
    return "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows)


def _sorted(counts: dict) -> dict:
    return {key: counts[key] for key in sorted(counts) if counts[key]}


def _render_all(tokenizer, conversations: list[Conversation], stats: CalibStats,
                model_dir: Path) -> tuple[list[Conversation], list[str]]:
    """The conversations the chat template accepts, and their rendered texts."""
    rendered = [(c, render(tokenizer, c)) for c in conversations]
    kept = [(c, text) for c, text in rendered if text is not None]
    rejected = len(rendered) - len(kept)
    if rejected and not kept:
        raise UserError(f"{model_dir}: the chat template rejected every conversation; check the template in "
                        "tokenizer_config.json or chat_template.jinja")
    stats.dropped["rejected by chat template"] += rejected
    stats.kept -= rejected
    return [c for c, _ in kept], [text for _, text in kept]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _summary(source: Path, stats: CalibStats, *, do_redact: bool, calib_set: int, held: int, seq_len: int,
             blocks: list[list[int]], conversation_tokens: int, chat_template: bool) -> dict:
    return {
        "source": str(source),
        "source_sha256": _file_sha256(source),
        "records_in": stats.records_in,
        "records_kept": stats.kept,
        "dropped": _sorted(stats.dropped),
        "bad_records": stats.dropped["bad record"],
        "bad_records_first_10": stats.bad_records,
        "shapes": _sorted(stats.shapes),
        "roles": _sorted(stats.roles),
        "turns": stats.turns,
        "turns_per_conversation": round(stats.turns / max(stats.conversations, 1), 2),
        "non_latin_share": round(stats.non_latin_letters / max(stats.letters, 1), 4),
        "redaction": do_redact,
        "redactions": _sorted(stats.redactions),
        "calib_conversations": calib_set,
        "calib_conversation_tokens": conversation_tokens,
        "chat_template": chat_template,
        "holdout": held,
        "seq_len": seq_len,
        "blocks": len(blocks),
        "tokens": seq_len * len(blocks),
    }


def run(source: Path | str, out: Path | str, model_dir: Path | str, *, seq_len: int, num_blocks: int,
        holdout: int, max_bad_fraction: float = 0.05, strict: bool = False, do_redact: bool = True,
        redact_patterns: list[str] | None = None) -> CalibResult:
    watch, phases, lap = Stopwatch(), {}, time.perf_counter()

    def phase(name: str) -> None:
        nonlocal lap
        now = time.perf_counter()
        phases[name], lap = now - lap, now

    source, out, model_dir = Path(source), Path(out), Path(model_dir)
    conversations, stats = load_conversations(
        source, strict=strict, max_bad_fraction=max_bad_fraction,
        do_redact=do_redact, extra_patterns=redact_patterns or [],
    )
    phase("read+redact+dedup")
    calib_set, held = split(conversations, holdout)
    phase("split")
    tokenizer = _load_tokenizer(model_dir)
    phase("load tokenizer")
    calib_set, texts = _render_all(tokenizer, calib_set, stats, model_dir)
    conversation_tokens, stream = token_counts_and_stream(tokenizer, texts, seq_len * num_blocks)
    blocks = pack(stream, seq_len, num_blocks, source)
    phase("render+pack")
    summary = _summary(source, stats, do_redact=do_redact, calib_set=len(calib_set), held=len(held), seq_len=seq_len,
                       blocks=blocks, conversation_tokens=conversation_tokens,
                       chat_template=bool(getattr(tokenizer, "chat_template", None)))
    blocks_text = _jsonl({"block": i, "input_ids": ids} for i, ids in enumerate(blocks))
    summary["blocks_sha256"] = hashlib.sha256(blocks_text.encode()).hexdigest()
    with atomic_dir(out) as tmp:
        (tmp / "calib.jsonl").write_text(blocks_text, encoding="utf-8")
        (tmp / "calib_conversations.jsonl").write_text(
            _jsonl({"where": c.where, "messages": c.messages} for c in calib_set), encoding="utf-8")
        (tmp / "holdout.jsonl").write_text(_jsonl(holdout_prompt(c) for c in held), encoding="utf-8")
        (tmp / "stats.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    phase("write")
    return CalibResult(out, summary, watch.seconds, phases)


def read_blocks(path: Path) -> list[list[int]]:
    """Token blocks written by `run` (calib.jsonl)."""
    blocks = []
    for where, record in iter_records(path):
        if isinstance(record, BadRecord) or not isinstance(record, dict) or "input_ids" not in record:
            raise UserError(f"{where}: not a calibration block; build blocks with `quantize calib`")
        blocks.append(record["input_ids"])
    return blocks


def is_blocks_file(path: Path) -> bool:
    for _, record in iter_records(path):
        return isinstance(record, dict) and "input_ids" in record
    return False
