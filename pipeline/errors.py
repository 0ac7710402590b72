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
