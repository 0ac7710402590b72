"""The one exception users see: a message that names the file, the problem and the fix; what a file's first bytes
say about its encoding when it is not the UTF-8 its readers take (`not_utf8`); a write the file system refused, as
that message (`write_refused`: the path, the reason, the space free and needed); and library text quoted in a message,
cut at a word (`cut`); a size as messages say it (`human_size`)."""


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
import os  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

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
        if isinstance(current, UserError):  # already the message (raised `from None` over the error it words)
            return None
        if isinstance(current, OSError) and current.errno in WRITE_ERRNOS:
            return current.errno, current.filename
        if not isinstance(current, OSError) or current.errno is None:  # shutil.copytree's Error: its files' errors as text
            text = str(current)
            for words, code in _WORDED.items():
                if words in text:
                    return code, None
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return None


def free_bytes(path: Path | str) -> int | None:
    """Bytes free for this user on the file system holding `path` (or its nearest existing ancestor)."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def refused_fix(code: int) -> str:
    """The way out of a write refused with `code` (pipeline/errors.py: WRITE_ERRNOS)."""
    return {_errno.ENOSPC: "free space there or choose another path",
            _errno.EDQUOT: "free space within your quota or choose another path",
            _errno.EFBIG: "raise the file-size limit (`ulimit -f unlimited`) or choose a file system that takes larger "
                         "files",
            _errno.EROFS: "choose a writable path"}.get(code, "make it writable for you or choose another path")


def write_refused(exc: BaseException, path: Path, what: str, size: int | None = None, *, needed: bool = False,
                  label: str | None = None):
    """The UserError for a write the file system refused (pipeline/errors.py: refused_write) while writing `what`
    at `path`, or None when `exc` is not one: the path, the reason, the space free there and what the write needed
    (`needed`) or had written when it failed (`size`), and that nothing was kept. label: what was written, said
    whole (instead of `what` and `path`)."""
    found = refused_write(exc)
    if found is None:
        return None
    code, filename = found
    reason = WRITE_ERRNOS[code]
    detail = []
    if code in (_errno.ENOSPC, _errno.EDQUOT):
        free = free_bytes(path)
        if free is not None:
            detail.append(f"{human_size(free)} free there")
        if size:
            detail.append(f"{'it needs' if needed else 'it had written'} {human_size(size)}"
                          + ("" if needed else " when the disk filled, and needs more"))
    elif code == _errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            detail.append(f"this process may write files of at most {human_size(limit)}: `ulimit -f`")
    fix = refused_fix(code)
    at = f" ({filename})" if filename and Path(filename) != path and ".tmp-" not in str(filename) else ""
    return UserError(f"cannot write {label or f'{what} {path}'}{at}: {reason}" + (f" ({'; '.join(detail)})" if detail else "")
                     + f"; nothing was kept: {fix}, then run the command again")



def human_size(n_bytes: int) -> str:
    """A size in binary units, named as such: 1 KiB is 1,024 bytes, 1 GiB 1,073,741,824 (nvidia-smi's MiB, vLLM's GiB)."""
    size = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"

def cut(text: str, limit: int) -> str:
    """`text` for a message, at most about `limit` characters: whole when it fits, else cut at the last space before
    the limit and marked " ..." (never mid-word: "use sys.set_in")."""
    text = str(text)
    if len(text) <= limit:
        return text
    head = text[:limit]
    space = head.rfind(" ")
    return (head[:space] if space > limit // 2 else head).rstrip(" ,;:") + " ..."
