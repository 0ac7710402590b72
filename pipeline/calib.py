"""`quantize calib`: raw support logs -> calibration token blocks + held-out judge prompts.

Reads .jsonl, .jsonl.gz or .json (array); each record's shape is detected on its own
(OpenAI messages, ShareGPT conversations, turns with role aliases, prompt/response,
instruction/output, plain text). Bad records are skipped and listed; too many fail the run.
Personal data is redacted by default. Conversations are de-duplicated, split by content hash
into calibration and holdout (never sharing a conversation), rendered with the model's chat
template and packed into fixed-length token blocks.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from pipeline.errors import UserError
from pipeline.outputs import Stopwatch, atomic_dir

MAX_LINE_BYTES = 8 << 20  # a longer line is a broken export, not a conversation
ROLE_ALIASES = {
    "user": "user", "human": "user", "customer": "user", "client": "user",
    "assistant": "assistant", "agent": "assistant", "bot": "assistant", "gpt": "assistant",
    "model": "assistant", "system": "system",
}
SHAPES = ("messages", "conversations", "turns", "prompt/response", "instruction/output", "text")


class BadRecord(Exception):
    """One record that cannot be used; the message says why and how to fix it."""


@dataclass
class Conversation:
    messages: list[dict]
    shape: str
    where: str  # FILE:LINE

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
    bad_records: list = field(default_factory=list)
    turns: int = 0
    characters: int = 0
    non_latin_characters: int = 0


# ---------------------------------------------------------------- reading

def _open_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            yield number, line


def _decode(raw: bytes, where: str) -> str:
    if len(raw) > MAX_LINE_BYTES:
        raise BadRecord(f"{where}: line is {len(raw) >> 20} MB, over the {MAX_LINE_BYTES >> 20} MB limit; split or drop it")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRecord(f"{where}: bytes at {exc.start} are not UTF-8; re-export the file as UTF-8") from None
    return text.lstrip("\ufeff").rstrip("\r\n")


def iter_records(path: Path) -> Iterator[tuple[str, object]]:
    """Yields (FILE:LINE, parsed JSON or BadRecord) for every record of the file."""
    if not path.exists():
        raise UserError(f"{path}: no such file; pass a .jsonl, .jsonl.gz or .json file of conversations")
    if path.is_dir():
        raise UserError(f"{path}: is a directory; pass a .jsonl, .jsonl.gz or .json file of conversations")
    if path.suffix == ".json":
        yield from _iter_json_array(path)
        return
    for number, raw in _open_lines(path):
        where = f"{path}:{number}"
        try:
            line = _decode(raw, where)
            if not line.strip():
                continue
            yield where, json.loads(line)
        except BadRecord as exc:
            yield where, exc
        except json.JSONDecodeError as exc:
            yield where, BadRecord(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object")


def _iter_json_array(path: Path) -> Iterator[tuple[str, object]]:
    try:
        data = json.loads(path.read_bytes().decode("utf-8").lstrip("\ufeff"))
    except UnicodeDecodeError:
        raise UserError(f"{path}:1: not UTF-8; re-export the file as UTF-8") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg}); a .json file must hold one array of records") from None
    if not isinstance(data, list):
        raise UserError(f"{path}:1: the top level is not an array; a .json file must hold an array of records (or use .jsonl)")
    for index, record in enumerate(data):
        yield f"{path}:[{index}]", record


# ---------------------------------------------------------------- shapes

def _content(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise BadRecord(f"{where}: {what} is {type(value).__name__}, not text; make it a string")
    value = value.replace("\r\n", "\n").strip()
    if not value:
        raise BadRecord(f"{where}: {what} is empty; drop the turn or fill it")
    return value


def _role(value, where: str) -> str:
    role = ROLE_ALIASES.get(str(value).strip().lower())
    if role is None:
        allowed = ", ".join(sorted(ROLE_ALIASES))
        raise BadRecord(f"{where}: role {value!r} cannot be mapped; use one of {allowed}")
    return role


def _turn_list(turns, where: str, role_key: str, text_key: str, shape: str) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise BadRecord(f"{where}: '{shape}' must be a non-empty list of turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise BadRecord(f"{where}: {shape}[{i}] needs '{role_key}' and '{text_key}' keys")
        messages.append({
            "role": _role(turn[role_key], where),
            "content": _content(turn[text_key], where, f"{shape}[{i}].{text_key}"),
        })
    return messages


def to_conversation(record, where: str) -> Conversation:
    """Detects the record's shape and normalises it to OpenAI-style messages."""
    if not isinstance(record, dict):
        raise BadRecord(f"{where}: a record must be a JSON object, not {type(record).__name__}")
    if "messages" in record:
        shape, messages = "messages", _turn_list(record["messages"], where, "role", "content", "messages")
    elif "conversations" in record:
        shape, messages = "conversations", _turn_list(record["conversations"], where, "from", "value", "conversations")
    elif "turns" in record:
        shape, messages = "turns", _turn_list(record["turns"], where, "role", "content", "turns")
    elif "prompt" in record and "response" in record:
        shape = "prompt/response"
        messages = [
            {"role": "user", "content": _content(record["prompt"], where, "prompt")},
            {"role": "assistant", "content": _content(record["response"], where, "response")},
        ]
    elif "instruction" in record and "output" in record:
        shape = "instruction/output"
        prompt = _content(record["instruction"], where, "instruction")
        if isinstance(record.get("input"), str) and record["input"].strip():
            prompt += "\n\n" + record["input"].strip()
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": _content(record["output"], where, "output")},
        ]
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
    if not 15 <= len(s) <= 34:
        return False
    moved = s[4:] + s[:4]
    return int("".join(str(int(ch, 36)) for ch in moved)) % 97 == 1


REDACTORS: list[tuple[str, re.Pattern, object]] = [
    ("email", re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"), None),
    ("iban", re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b"), _iban_ok),
    # cards: 13-19 digits, written solid or in groups of four (Amex 4-6-5); Luhn-checked
    ("card", re.compile(r"(?<![\w-])(?:\d{13,19}|\d{4}(?:[ -]\d{4}){2}[ -]\d{1,7}|\d{4}[ -]\d{6}[ -]\d{5})(?![\w]|-\d)"),
     lambda s: _luhn_ok(re.sub(r"\D", "", s))),
    ("ip", re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b"
                      r"|\b(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}\b"), None),
    # phones: 9-15 digits in at most four groups; never part of a longer id (#502-2345678-...)
    ("phone", re.compile(r"(?<![\w#/+-])(?:(?:\+|00)\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,5}(?:[ .-]?\d{2,5}){1,3}(?!\w|[-./]\d)"),
     lambda s: 9 <= len(re.sub(r"\D", "", s)) <= 15),
]


def redact(text: str, counts: collections.Counter, extra: list[re.Pattern]) -> str:
    for kind, pattern, check in REDACTORS:
        def replace(match, kind=kind, check=check):
            if check is not None and not check(match.group(0)):
                return match.group(0)
            counts[kind] += 1
            return f"[{kind.upper()}]"
        text = pattern.sub(replace, text)
    for pattern in extra:
        text, n = pattern.subn("[REDACTED]", text)
        counts["custom"] += n
    return text


# ---------------------------------------------------------------- de-duplication and split

def normalised(text: str) -> str:
    """Case, punctuation, digits and spacing folded: near-duplicates collapse to one key."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = re.sub(r"\d+", "0", text)
    return " ".join(re.findall(r"\w+", text))


def content_hash(text: str) -> str:
    return hashlib.sha256(normalised(text).encode("utf-8")).hexdigest()


def _non_latin(text: str) -> int:
    return sum(1 for ch in text if ch.isalpha() and not ("a" <= ch.lower() <= "z") and ord(ch) > 0x24F)


# ---------------------------------------------------------------- loading

def load_conversations(path: Path, *, strict: bool, max_bad_fraction: float, do_redact: bool,
                       extra_patterns: list[str]) -> tuple[list[Conversation], CalibStats]:
    stats = CalibStats()
    extra = [re.compile(p) for p in extra_patterns]
    conversations, seen = [], set()
    for where, record in iter_records(path):
        stats.records_in += 1
        try:
            if isinstance(record, BadRecord):
                raise record
            conversation = to_conversation(record, where)
        except BadRecord as exc:
            if strict:
                raise UserError(f"{exc}\n(--strict stops at the first bad record)") from None
            stats.dropped["bad record"] += 1
            stats.bad_records.append(str(exc))
            continue
        if do_redact:
            for message in conversation.messages:
                message["content"] = redact(message["content"], stats.redactions, extra)
        key = content_hash(conversation.text())
        if key in seen:
            stats.dropped["duplicate"] += 1
            continue
        seen.add(key)
        stats.shapes[conversation.shape] += 1
        for message in conversation.messages:
            stats.roles[message["role"]] += 1
            stats.characters += len(message["content"])
            stats.non_latin_characters += _non_latin(message["content"])
        stats.turns += len(conversation.messages)
        conversations.append(conversation)
    _check_bad_fraction(path, stats, max_bad_fraction)
    stats.kept = len(conversations)
    return conversations, stats


def _check_bad_fraction(path: Path, stats: CalibStats, max_bad_fraction: float) -> None:
    if stats.records_in == 0:
        raise UserError(f"{path}: the file holds no records; give it one conversation per line")
    bad = stats.dropped["bad record"]
    if bad / stats.records_in > max_bad_fraction:
        shown = "\n".join(stats.bad_records[:10])
        more = f"\n... and {bad - 10} more" if bad > 10 else ""
        raise UserError(
            f"{path}: {bad} of {stats.records_in} records are bad "
            f"({bad / stats.records_in:.0%} > calib.max_bad_fraction {max_bad_fraction:.0%}):\n{shown}{more}"
        )


# ---------------------------------------------------------------- split and pack

def split(conversations: list[Conversation], holdout: int) -> tuple[list[Conversation], list[Conversation]]:
    """Deterministic: the `holdout` conversations with the smallest content hashes are held out."""
    ranked = sorted(conversations, key=lambda c: content_hash(c.text()))
    held = [c for c in ranked[:holdout] if any(m["role"] == "user" for m in c.messages)]
    held_ids = {id(c) for c in held}
    return [c for c in ranked if id(c) not in held_ids], held


def holdout_prompt(conversation: Conversation) -> dict:
    """The last user turn with the conversation before it: what the judge's models answer."""
    last_user = max(i for i, m in enumerate(conversation.messages) if m["role"] == "user")
    messages = conversation.messages[: last_user + 1]
    return {
        "id": content_hash(conversation.text())[:16],
        "messages": messages,
        "prompt": messages[-1]["content"],
        "reference": next((m["content"] for m in conversation.messages[last_user + 1:]
                           if m["role"] == "assistant"), None),
    }


def render(tokenizer, conversation: Conversation) -> str:
    if conversation.shape == "text" or not getattr(tokenizer, "chat_template", None):
        return conversation.text()
    return tokenizer.apply_chat_template(conversation.messages, tokenize=False)


def pack(tokenizer, conversations: list[Conversation], seq_len: int, num_blocks: int, source: Path) -> list[list[int]]:
    """Concatenates rendered conversations and cuts fixed-length blocks: no padding, so blocks batch."""
    needed = seq_len * num_blocks
    stream: list[int] = []
    for conversation in conversations:
        stream.extend(tokenizer(render(tokenizer, conversation), add_special_tokens=False)["input_ids"])
        if len(stream) >= needed:
            break
    if len(stream) < needed:
        raise UserError(
            f"{source}: calibration set too small: {len(stream)} tokens after de-duplication and holdout, "
            f"need calib.seq_len x calib.num_blocks = {seq_len} x {num_blocks} = {needed}; "
            "add conversations or lower calib.num_blocks / calib.seq_len"
        )
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(num_blocks)]


# ---------------------------------------------------------------- stage

@dataclass
class CalibResult:
    out: Path
    stats: dict
    seconds: float

    def summary(self) -> str:
        s = self.stats
        return (
            f"calib: wrote {self.out} ({s['blocks']} blocks x {s['seq_len']} tokens, "
            f"{s['holdout']} holdout prompts; kept {s['records_kept']} of {s['records_in']} records, "
            f"{sum(s['redactions'].values())} redactions) in {self.seconds:.1f} s"
        )


def _jsonl(rows) -> str:
    return "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows)


def run(source: Path | str, out: Path | str, model_dir: Path | str, *, seq_len: int, num_blocks: int,
        holdout: int, max_bad_fraction: float = 0.05, strict: bool = False, do_redact: bool = True,
        redact_patterns: list[str] | None = None) -> CalibResult:
    from transformers import AutoTokenizer

    watch = Stopwatch()
    source, out = Path(source), Path(out)
    conversations, stats = load_conversations(
        source, strict=strict, max_bad_fraction=max_bad_fraction,
        do_redact=do_redact, extra_patterns=redact_patterns or [],
    )
    calib_set, held = split(conversations, holdout)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    blocks = pack(tokenizer, calib_set, seq_len, num_blocks, source)
    summary = {
        "source": str(source),
        "source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        "records_in": stats.records_in,
        "records_kept": stats.kept,
        "dropped": dict(stats.dropped),
        "bad_records_first_10": stats.bad_records[:10],
        "shapes": dict(stats.shapes),
        "roles": dict(stats.roles),
        "turns": stats.turns,
        "non_latin_share": round(stats.non_latin_characters / max(stats.characters, 1), 4),
        "redaction": do_redact,
        "redactions": dict(stats.redactions),
        "calib_conversations": len(calib_set),
        "holdout": len(held),
        "seq_len": seq_len,
        "blocks": len(blocks),
        "tokens": seq_len * len(blocks),
    }
    blocks_text = _jsonl({"block": i, "input_ids": ids} for i, ids in enumerate(blocks))
    summary["blocks_sha256"] = hashlib.sha256(blocks_text.encode()).hexdigest()
    with atomic_dir(out) as tmp:
        (tmp / "calib.jsonl").write_text(blocks_text, encoding="utf-8")
        (tmp / "calib_conversations.jsonl").write_text(
            _jsonl({"where": c.where, "messages": c.messages} for c in calib_set), encoding="utf-8")
        (tmp / "holdout.jsonl").write_text(_jsonl(holdout_prompt(c) for c in held), encoding="utf-8")
        (tmp / "stats.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return CalibResult(out, summary, watch.seconds)


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
