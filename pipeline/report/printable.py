"""No control character reaches the page: whatever a model wrote or a folder is called, index.html holds no
character of Unicode's control category but newline and tab, and no lone surrogate (which no UTF-8 file can hold).

Each is shown, not dropped, so a reviewer sees that the output held one: C0 controls as their Unicode control
pictures (NUL -> ␀, ESC -> ␛, CR -> ␍; a CR before a newline goes), DEL as ␡, C1 controls (U+0080..U+009F,
NEL U+0085 among them) and lone surrogates as U+FFFD.
"""

from __future__ import annotations

import re

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
PICTURES = 0x2400  # U+2400 SYMBOL FOR NULL: the C0 control pictures follow in order
DELETE_PICTURE, REPLACEMENT = "\u2421", "\ufffd"


def _shown(match: re.Match) -> str:
    code = ord(match.group())
    if code < 0x20:
        return chr(PICTURES + code)
    return DELETE_PICTURE if code == 0x7F else REPLACEMENT


def printable(text: str) -> str:
    """`text` with every control character but newline and tab (and every lone surrogate) made visible."""
    return CONTROL.sub(_shown, text.replace("\r\n", "\n"))
