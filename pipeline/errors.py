"""The one exception users see: a message that names the file, the problem and the fix; and what a file's first bytes
say about its encoding when it is not the UTF-8 its readers take (`not_utf8`)."""


class UserError(Exception):
    """Bad input or configuration. The CLI prints the message (no traceback) and exits 2."""

    exit_code = 2


UTF16_SAMPLE_BYTES = 4096  # the first bytes `not_utf8` looks at


def not_utf8(head: bytes) -> str | None:
    """"UTF-16" (a byte-order mark), "UTF-16-LE" or "UTF-16-BE" (none, but at least 30 % of the odd, or even,
    bytes 0 and almost none of the others: JSON or YAML, whose syntax is ASCII, exported as UTF-16), else None.
    Bytes that are all or mostly 0 are not text at all: None (their reader says what is wrong there)."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "UTF-16"
    pairs = len(head[:UTF16_SAMPLE_BYTES]) // 2
    if pairs < 4:
        return None
    even = head[0:2 * pairs:2].count(0) / pairs
    odd = head[1:2 * pairs:2].count(0) / pairs
    if odd >= 0.3 and even <= 0.05:
        return "UTF-16-LE"
    if even >= 0.3 and odd <= 0.05:
        return "UTF-16-BE"
    return None


# ---------------------------------------------------------------- a write the file system refused

import errno as _errno  # noqa: E402

# What the file system says when it takes no more of a write: no space, a file-size limit (ulimit -f), a quota, a
# read-only mount, no permission. Each is the user's environment, never a bug: one message, exit 2.
WRITE_ERRNOS = {_errno.ENOSPC: "no space left on the device", _errno.EFBIG: "file too large",
                _errno.EDQUOT: "disk quota exceeded", _errno.EROFS: "read-only file system",
                _errno.EACCES: "permission denied", _errno.EPERM: "operation not permitted"}
# The same, as libraries that are not Python's I/O word them (safetensors' Rust writer: "IoError(Os { code: 28,
# kind: StorageFull, message: \"No space left on device\" })").
_WORDED = {"No space left on device": _errno.ENOSPC, "database or disk is full": _errno.ENOSPC, "File too large": _errno.EFBIG,
           "Disk quota exceeded": _errno.EDQUOT, "Read-only file system": _errno.EROFS}


def refused_write(exc: BaseException) -> tuple[int, str | None] | None:
    """(errno, the file it names or None) when `exc`, or an exception it was raised from or while handling, is the
    file system refusing a write (WRITE_ERRNOS), else None."""
    seen, current = set(), exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in WRITE_ERRNOS:
            return current.errno, current.filename
        if not isinstance(current, OSError):
            text = str(current)
            for words, code in _WORDED.items():
                if words in text:
                    return code, None
        current = current.__cause__ or current.__context__
    return None


def cut(text: str, limit: int) -> str:
    """`text` for a message, at most about `limit` characters: whole when it fits, else cut at the last space before
    the limit and marked " ..." (never mid-word: "use sys.set_in")."""
    text = str(text)
    if len(text) <= limit:
        return text
    head = text[:limit]
    space = head.rfind(" ")
    return (head[:space] if space > limit // 2 else head).rstrip(" ,;:") + " ..."
