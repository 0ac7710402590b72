"""Reading a conversation file: .jsonl, .jsonl.gz or .json (array), each record named FILE:LINE
(FILE:LINE:COLUMN in a .json array), and each record's shape (OpenAI messages, ShareGPT
conversations, turns with role aliases, prompt/response, instruction/output, plain text) detected
on its own and normalised to a `Conversation`. A record that cannot be used comes as a `BadRecord`
whose message says where it is and how to fix it; a file that cannot be read at all is a UserError.

A file is read a line (in a .json array, a record) at a time, never whole; a record over MAX_LINE_BYTES is refused.

A message quotes a value from the record (a role, a key) only whole and short (QUOTE_MAX
characters), never cut, so that redaction (pipeline/calib/load.py) sees all of it: a long value is
described by its length instead.

Text rules: a turn's text must be a string; CR LF and a lone CR become LF; every other control
character (Unicode Cc: U+0000-U+001F, NUL included, and U+007F-U+009F) but tab and newline is removed
and counted per field (`Conversation.removed`); the text is then stripped and must not be empty. An
unpaired UTF-16 surrogate ("\\ud83d" alone) makes the record bad, and so does a conversation of system
turns only (`OnlySystemTurns`: nothing to calibrate on or hold out).
"""

from __future__ import annotations

import codecs
import gzip
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from pipeline.errors import UTF16_SAMPLE_BYTES, UserError, cut, not_utf8
from pipeline.formats.image_parts import BadImage, ImageReading, content_parts
from pipeline.formats.read_watch import ReadWatch

MAX_LINE_BYTES = 8 << 20  # a longer line is a broken export, not a conversation
ROLE_ALIASES = {
    "user": "user", "human": "user", "customer": "user", "client": "user",
    "assistant": "assistant", "agent": "assistant", "bot": "assistant", "gpt": "assistant",
    "model": "assistant", "system": "system",
}
SHAPES = ("messages", "conversations", "turns", "prompt/response", "instruction/output", "text")
FORMATS = "a .jsonl, .jsonl.gz or .json file of conversations"
QUOTE_MAX = 60  # characters of a record's value a message may quote (whole, or not at all)
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # Cc but tab and newline (CR became newline first)


class BadRecord(Exception):
    """One record that cannot be used; the message says why and how to fix it."""


class OnlySystemTurns(BadRecord):
    """A conversation with no user or assistant turn: a system prompt alone."""


@dataclass
class Conversation:
    messages: list[dict]
    shape: str
    where: str  # FILE:LINE
    key: str = ""  # sha256 of the normalised text: de-duplication, split and holdout id
    removed: dict[str, dict[str, int]] = field(default_factory=dict)  # control characters taken out:
    # {"turns[1].content": {"U+0000": 2}}
    images: list = field(default_factory=list)  # image_parts.KeptImage of its turns, in order (a message names
    # its own by sha256: "images")
    images_dropped: int = 0  # image parts dropped unread (a text-only model)

    def text(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


# ---------------------------------------------------------------- reading

def _check_readable(path: Path) -> None:
    if not path.exists():
        raise UserError(f"{path}: no such file; pass {FORMATS}")
    if path.is_dir():
        raise UserError(f"{path}: is a directory; pass {FORMATS} inside it")
    if path.stat().st_size == 0:
        raise UserError(f"{path}:1: the file is empty; put one JSON conversation per line")


def _open_binary(path: Path, watch: ReadWatch):
    """Plain or gzip by content (not by name), opened once through `watch` (its bytes fingerprinted as read)."""
    try:
        handle = watch.open()
        if handle.peek(2)[:2] != b"\x1f\x8b":
            return handle
        unzipped = gzip.GzipFile(fileobj=handle, mode="rb")
        unzipped.myfileobj = handle  # closed with it, as a file gzip opened itself
        return unzipped
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions") from None


def _refuse_utf16(path: Path, head: bytes) -> None:
    """UTF-16, with a byte-order mark or without one (every other byte 0), is refused up front with its fix."""
    encoding = not_utf8(head)
    if encoding is not None:
        how = "" if encoding == "UTF-16" else " without a byte-order mark (every other byte is 0)"
        raise UserError(f"{path}:1: the file is {encoding} encoded{how}; re-export it as UTF-8")


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


BLANK = object()  # a blank line; a `null` line is a (bad) record


def _parse_line(raw: bytes | None, size: int, where: str) -> object:
    line = _decode(raw, size, where)
    if not line.strip():
        return BLANK
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadRecord(f"{where}: invalid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno}); "
                        "make the line one JSON object or remove it") from None
    except (ValueError, RecursionError) as exc:  # a 5,000-digit number, arrays nested 100,000 deep
        raise BadRecord(f"{where}: JSON that cannot be loaded ({cut(str(exc), 100)}); "
                        "make the line one plain JSON object or remove it") from None


def iter_records(path: Path, advance: Callable[[int], None] | None = None,
                 watch: ReadWatch | None = None) -> Iterator[tuple[str, object]]:
    """Yields (FILE:LINE, parsed JSON or BadRecord) for every record of the file, one line (a .json array: one
    record) at a time. advance(n), when given: n more bytes of the file (as read: decompressed) are done. The file is
    opened once, its bytes fingerprinted as they are read (`watch`, when the caller wants the fingerprint), and a
    file that changed while it was read is a UserError after its last record (pipeline/formats/read_watch.py)."""
    path = Path(path)
    _check_readable(path)
    watch = watch or ReadWatch(path, "conversation file")
    array = path.name.endswith((".json", ".json.gz"))
    try:
        yield from _iter_json_array(path, watch) if array else _iter_lines(path, advance, watch)
    except UserError:
        watch.refuse_if_changed()  # a file changed under the reader reads as broken: the change is the news
        raise
    watch.check()
    if array and advance is not None:
        advance(path.stat().st_size)


def _iter_lines(path: Path, advance: Callable[[int], None] | None, watch: ReadWatch) -> Iterator[tuple[str, object]]:
    number = 0
    with _open_binary(path, watch) as handle:
        try:
            _refuse_utf16(path, handle.peek(UTF16_SAMPLE_BYTES)[:UTF16_SAMPLE_BYTES])
            for number, (raw, size) in enumerate(_bounded_lines(handle), start=1):
                if advance is not None:
                    advance(size)
                where = f"{path}:{number}"
                try:
                    record = _parse_line(raw, size, where)
                except BadRecord as exc:
                    yield where, exc
                    continue
                if record is not BLANK:
                    yield where, record
        except (OSError, EOFError, zlib.error) as exc:
            raise UserError(f"{path}:{number + 1}: reading failed ({exc}); a gzip file here is corrupt or "
                            "truncated: compress it again or pass the plain .jsonl") from None


JSON_CHUNK = 1 << 20  # bytes of a .json array read at a time
WHITESPACE = re.compile(r"[ \t\r\n]*")


class _JsonWindow:
    """A .json file's text, decoded a chunk at a time: `text` holds what was read and not yet dropped (`compact`),
    with the lines and the column before it counted, and lines counted up to `mark` as positions are named
    (`line_col`), so that FILE:LINE:COLUMN costs no rescan."""

    def __init__(self, path: Path, handle) -> None:
        self.path, self.handle = path, handle
        self.text, self.pending, self.eof, self.first = "", b"", False, True
        self.lines_before = self.column_before = self.newline_bytes = 0
        self.mark, self.mark_lines, self.mark_last = 0, 0, -1  # position, newlines before it, the last one's index

    def more(self) -> bool:
        """Appends the next chunk's text; False at the end of the file."""
        if self.eof:
            return False
        try:
            chunk = self.handle.read(JSON_CHUNK)
        except (OSError, EOFError, zlib.error) as exc:
            raise UserError(f"{self.path}: the gzip data is corrupt or truncated ({exc}); "
                            "compress the file again") from None
        data, self.eof = self.pending + chunk, not chunk
        if self.first:
            _refuse_utf16(self.path, data[:UTF16_SAMPLE_BYTES])
        try:
            text, used = codecs.utf_8_decode(data, "strict", self.eof)
        except UnicodeDecodeError as exc:
            line = self.newline_bytes + data.count(b"\n", 0, exc.start) + 1
            raise UserError(f"{self.path}:{line}: bytes are not UTF-8; re-export the file as UTF-8") from None
        self.newline_bytes += data.count(b"\n", 0, used)
        self.pending = data[used:]
        self.text += text.lstrip("\ufeff") if self.first else text
        self.first = False
        return True

    def skip_whitespace(self, position: int) -> int:
        """The first position at or after `position` that is not whitespace (len(text) at the end of the file)."""
        while True:
            end = WHITESPACE.match(self.text, position).end()
            if end < len(self.text) or not self.more():
                return end

    def line_col(self, position: int) -> str:
        """LINE:COLUMN of `position`."""
        if position < self.mark:  # behind the mark (an error's earlier position): count again from the start
            self.mark, self.mark_lines, self.mark_last = 0, 0, -1
        newlines = self.text.count("\n", self.mark, position)
        if newlines:
            self.mark_last = self.text.rfind("\n", self.mark, position)
        self.mark, self.mark_lines = position, self.mark_lines + newlines
        column = position - self.mark_last if self.mark_last >= 0 else self.column_before + position + 1
        return f"{self.lines_before + self.mark_lines + 1}:{column}"

    def compact(self, position: int) -> int:
        """Drops the text before `position` once it is a chunk long; returns where `position` is then."""
        if position < JSON_CHUNK:
            return position
        self.line_col(position)
        self.lines_before += self.mark_lines
        self.column_before = position - self.mark_last - 1 if self.mark_last >= 0 else self.column_before + position
        self.text = self.text[position:]
        self.mark, self.mark_lines, self.mark_last = 0, 0, -1
        return 0

    def record(self, decoder: json.JSONDecoder, position: int) -> tuple[object, int]:
        """The JSON value at `position` and where it ends, reading on while it may be cut off by the window."""
        while True:
            try:
                value, end = decoder.raw_decode(self.text, position)
                if end < len(self.text) or not self.more():  # a number at the window's end may go on
                    return value, end
            except json.JSONDecodeError as exc:
                if len(self.text) - position <= MAX_LINE_BYTES and self.more():
                    continue
                line = self.lines_before + exc.lineno
                column = self.column_before + exc.colno if exc.lineno == 1 else exc.colno
                raise UserError(f"{self.path}:{line}: invalid JSON ({exc.msg.removesuffix(' at')} at column {column}); "
                                "a .json file must be one valid array, so fix it there (or use .jsonl)") from None
            except (ValueError, RecursionError) as exc:
                raise UserError(f"{self.path}:{self.line_col(position)}: JSON that cannot be loaded ({cut(str(exc), 100)}); "
                                "fix the record there (or use .jsonl, where a bad record is skipped)") from None


def _iter_json_array(path: Path, watch: ReadWatch) -> Iterator[tuple[str, object]]:
    """Records of a JSON array, each named FILE:LINE:COLUMN where it starts; read a chunk at a time, so a large
    file is never held whole."""
    with _open_binary(path, watch) as handle:
        window, decoder = _JsonWindow(path, handle), json.JSONDecoder()
        position = window.skip_whitespace(0)
        if position == len(window.text):
            raise UserError(f"{path}:1: the file holds only whitespace; a .json file must hold an array of records")
        if window.text[position] != "[":
            raise UserError(f"{path}:{window.line_col(position)}: the top level is not an array; "
                            "a .json file must hold an array of records (or use .jsonl, one record per line)")
        position = window.skip_whitespace(position + 1)
        while not window.text.startswith("]", position):
            record, end = window.record(decoder, position)
            yield f"{path}:{window.line_col(position)}", record
            position = _after_record(window, path, window.compact(end))
        after = window.skip_whitespace(position + 1)
        if after < len(window.text):
            raise UserError(f"{path}:{window.line_col(after)}: text after the closing ']'; "
                            "a .json file must hold exactly one array")


def _after_record(window: _JsonWindow, path: Path, end: int) -> int:
    """Past the ',' after the record that ends at `end`: where the next record (or the closing ']') starts."""
    position = window.skip_whitespace(end)
    if window.text.startswith(",", position):
        comma, position = position, window.skip_whitespace(position + 1)
        if window.text.startswith("]", position):  # JSON allows none; a lenient writer's slip, or a record lost
            raise UserError(f"{path}:{window.line_col(comma)}: a comma after the last record, before ']'; JSON "
                            "allows none there: delete it (or, if a record is missing after it, restore it)")
    elif not window.text.startswith("]", position):
        raise UserError(f"{path}:{window.line_col(position)}: expected ',' or ']' after a record; fix the array there")
    return position


# ---------------------------------------------------------------- shapes

JSON_TYPES = {"dict": "an object", "list": "an array", "NoneType": "null", "int": "a number",
              "float": "a number", "bool": "a boolean", "str": "text"}


def quoted(value) -> str:
    """A record's value for a message: its repr when short, whole (never cut: a cut e-mail address
    would escape redaction), else what it is and how long."""
    text = repr(value)
    if len(text) <= QUOTE_MAX:
        return text
    kind = JSON_TYPES.get(type(value).__name__, type(value).__name__)
    size = f" of {len(value)} characters" if isinstance(value, str) else f" of {len(value)} items" \
        if isinstance(value, (list, dict)) else ""
    return f"({kind}{size}, not shown)"


def _shown_key(key: str) -> str:
    return key if len(key) <= QUOTE_MAX and key.isprintable() and "," not in key else quoted(key)


def _unpaired_surrogate(text: str) -> int | None:
    """Index of the first unpaired UTF-16 surrogate (from a "\\ud83d" escape in the JSON), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def without_control_characters(text: str) -> tuple[str, dict[str, int]]:
    """text with line ends made "\\n" (CR LF and a lone CR) and every other control character (Unicode
    category Cc: U+0000-U+001F and U+007F-U+009F, NUL included) but tab and newline removed; and how
    many of each were removed, by code point ("U+0000")."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    found = CONTROL.findall(text)
    if not found:
        return text, {}
    counts: dict[str, int] = {}
    for char in found:
        name = f"U+{ord(char):04X}"
        counts[name] = counts.get(name, 0) + 1
    return CONTROL.sub("", text), counts


def _content(value, where: str, what: str, removed: dict | None = None, reading: ImageReading | None = None,
             found: list | None = None) -> str:
    """A turn's text, checked; control characters taken out (counted in `removed[what]`). A list of parts (text and
    images, pipeline/formats/image_parts.py) with `reading`: its text, an image placeholder where each image was, the
    images (or the count dropped) appended to `found`."""
    if isinstance(value, list) and reading is not None and found is not None:
        try:
            value, images, dropped = content_parts(value, what, reading)
        except BadImage as exc:
            raise BadRecord(f"{where}: {exc}") from None
        found.append((images, dropped))
        if not value.strip() and (images or dropped):
            return value.strip()  # an image alone: its placeholder (or, dropped, nothing) is the turn
    if not isinstance(value, str):
        kind = JSON_TYPES.get(type(value).__name__, type(value).__name__)
        raise BadRecord(f"{where}: {what} is {kind}, not text; make it a string")
    value, controls = without_control_characters(value)
    value = value.strip()
    if controls and removed is not None:
        removed[what] = controls
    if not value:
        raise BadRecord(f"{where}: {what} is " + ("nothing but control characters" if controls else "empty") +
                        "; drop the turn or fill it")
    if (at := _unpaired_surrogate(value)) is not None:
        raise BadRecord(f"{where}: {what} holds an unpaired UTF-16 surrogate at character {at + 1} (half of an "
                        "emoji or other character, e.g. a lone \\ud83d escape), which is not text; re-export the "
                        "file whole or drop the record")
    return value


def _role(value, where: str, what: str) -> str:
    role = ROLE_ALIASES.get(value.strip().lower()) if isinstance(value, str) else None
    if role is None:
        allowed = ", ".join(sorted(ROLE_ALIASES))
        raise BadRecord(f"{where}: {what} {quoted(value)} cannot be mapped; use one of {allowed} (any case)")
    return role


def _turn_list(turns, where: str, role_key: str, text_key: str, shape: str, removed: dict,
               reading: ImageReading | None = None, kept: list | None = None) -> list[dict]:
    """The turns as messages; with `reading`, a turn's list of parts is read (its images appended to `kept` as
    (images, dropped), the message naming its images by sha256: "images")."""
    if not isinstance(turns, list) or not turns:
        raise BadRecord(f"{where}: '{shape}' must be a non-empty list of turns; "
                        f"give it [{{\"{role_key}\": ..., \"{text_key}\": ...}}, ...]")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise BadRecord(f"{where}: {shape}[{i}] needs '{role_key}' and '{text_key}' keys; add them or drop the turn")
        own: list = []
        messages.append({
            "role": _role(turn[role_key], where, f"{shape}[{i}].{role_key}"),
            "content": _content(turn[text_key], where, f"{shape}[{i}].{text_key}", removed, reading, own),
        })
        if own and own[0][0]:
            messages[-1]["images"] = [image.sha256 for image in own[0][0]]
        if kept is not None:
            kept += own
    if all(m["role"] == "system" for m in messages):
        raise OnlySystemTurns(f"{where}: '{shape}' holds only system turns ({len(messages)}), no user or assistant "
                              "turn: nothing to calibrate on or hold out; export the conversation's turns with it, "
                              "or drop the record")
    return messages


def _pair(record: dict, where: str, ask: str, answer: str, removed: dict) -> list[dict]:
    prompt = _content(record[ask], where, ask, removed)
    if isinstance(record.get("input"), str) and without_control_characters(record["input"])[0].strip():
        prompt += "\n\n" + _content(record["input"], where, "input", removed)
    return [{"role": "user", "content": prompt},
            {"role": "assistant", "content": _content(record[answer], where, answer, removed)}]


def to_conversation(record, where: str, reading: ImageReading | None = None) -> Conversation:
    """Detects the record's shape and normalises it to OpenAI-style messages. reading: how image parts of a turn's
    content are read (`quantize calib`: pipeline/formats/image_parts.py); without it a turn must be text."""
    if not isinstance(record, dict):
        kind = JSON_TYPES.get(type(record).__name__, type(record).__name__)
        raise BadRecord(f"{where}: a record must be a JSON object, not {kind}; put one conversation object "
                        "per line (a JSON array belongs in a .json file)")
    removed: dict[str, dict[str, int]] = {}
    kept: list = []  # (images, dropped) of each turn given as parts
    if "messages" in record:
        shape, messages = "messages", _turn_list(record["messages"], where, "role", "content", "messages", removed,
                                                 reading, kept)
    elif "conversations" in record:
        shape, messages = "conversations", _turn_list(record["conversations"], where, "from", "value", "conversations",
                                                      removed)
    elif "turns" in record:
        shape, messages = "turns", _turn_list(record["turns"], where, "role", "content", "turns", removed)
    elif "prompt" in record and "response" in record:
        shape, messages = "prompt/response", _pair(record, where, "prompt", "response", removed)
    elif "instruction" in record and "output" in record:
        shape, messages = "instruction/output", _pair(record, where, "instruction", "output", removed)
    elif "text" in record:
        shape, messages = "text", [{"role": "text", "content": _content(record["text"], where, "text", removed)}]
    else:
        names = sorted(record)
        keys = ", ".join(_shown_key(k) for k in names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        keys = keys or "none"
        raise BadRecord(
            f"{where}: unknown record shape (keys: {keys}); use one of: "
            "messages, conversations, turns, prompt+response, instruction+output, text"
        )
    return Conversation(messages, shape, where, removed=removed, images=[i for images, _ in kept for i in images],
                        images_dropped=sum(dropped for _, dropped in kept))
