"""Reading a conversation file: .jsonl, .jsonl.gz or .json (array), each record named FILE:LINE
(FILE:LINE:COLUMN in a .json array); each record's shape is pipeline/formats/conversation_shapes.py's. A record that
cannot be used comes as a `BadRecord` whose message says where it is and how to fix it; a file that cannot be read at
all is a UserError.

A file is read a line (in a .json array, a record) at a time, never whole; a record over MAX_LINE_BYTES is refused.
"""

from __future__ import annotations

import codecs
import gzip
import json
import re
import zlib
from pathlib import Path
from typing import Callable, Iterator

from pipeline.errors import UTF16_SAMPLE_BYTES, UserError, cut, not_utf8
from pipeline.formats.conversation_shapes import BadRecord
from pipeline.formats.read_watch import ReadWatch

MAX_LINE_BYTES = 8 << 20  # a longer line is a broken export, not a conversation
FORMATS = "a .jsonl, .jsonl.gz or .json file of conversations"


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
