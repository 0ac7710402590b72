"""One conversation record: its shape (OpenAI messages, ShareGPT conversations, turns with role aliases,
prompt/response, instruction/output, plain text) detected on its own and normalised to a `Conversation`; a record
that cannot be used is a `BadRecord` whose message says where it is (FILE:LINE, as pipeline/formats/conversations.py
names it) and how to fix it.

A message quotes a value from the record (a role, a key) only whole and short (QUOTE_MAX
characters), never cut, so that redaction (pipeline/calib/load.py) sees all of it: a long value is
described by its length instead.

Text rules: a turn's text must be a string; CR LF and a lone CR become LF; every other control
character (Unicode Cc: U+0000-U+001F, NUL included, and U+007F-U+009F) but tab and newline is removed
and counted per field (`Conversation.removed`); the text is then stripped and must not be empty. An
unpaired UTF-16 surrogate ("\\ud83d" alone) makes the record bad, and so does a conversation of system
turns only (`OnlySystemTurns`: nothing to calibrate on or hold out). Image parts: pipeline/formats/image_parts.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipeline.formats.image_parts import BadImage, ImageReading, content_parts

ROLE_ALIASES = {
    "user": "user", "human": "user", "customer": "user", "client": "user",
    "assistant": "assistant", "agent": "assistant", "bot": "assistant", "gpt": "assistant",
    "model": "assistant", "system": "system",
}
SHAPES = ("messages", "conversations", "turns", "prompt/response", "instruction/output", "text")
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
