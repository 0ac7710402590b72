"""Image parts of a calibration conversation's turns, read and made safe to keep.

A turn's `content` may be a list of parts, as OpenAI's chat API and transformers' chat templates take them:

    {"type": "text", "text": "What does this error say?"}
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR..."}}     a data URL
    {"type": "image_url", "image_url": {"url": "screens/0042.png"}}                   a file, relative to the file
    {"type": "image", "url" | "path" | "image": <a data URL or a file>}                transformers' form

Each image is read whole (at most `max_bytes` of encoded data, at most `max_pixels` pixels, both checked before the
pixels are decoded), turned as its EXIF orientation says, and re-encoded as a plain RGB PNG: what is kept is the
pixels alone, never the EXIF (camera, GPS, time) or any other metadata, nor the file's path or name; an image is
known by the sha256 of that PNG. An image that is missing, unreadable, over a limit, or named by a URL that would
be fetched (http, https: calibration reads no network) makes the record bad, with FILE:LINE, the part and the fix.
The turn's text keeps IMAGE_PLACEHOLDER where each image was (the engines' and lm-eval's placeholder).

An image file is read through one descriptor and known by what it was when read (device, inode, size, modification
and change time: `ImageReading.files`): one written to or replaced while it is read, between two parts that name it,
or before the stage ends (`ImageReading.check`), stops the stage with a UserError naming it, never kept as a mix.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import UserError

IMAGE_PLACEHOLDER = "<image>"
DATA_URL = re.compile(r"data:(image/[\w.+-]+)?(;[\w=.+-]+)*;base64,", re.I)
PART_TYPES = ("text", "image_url", "image")


class BadImage(ValueError):
    """An image part that cannot be kept; the message says why and how to fix it (without FILE:LINE)."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int


@dataclass(frozen=True)
class ImageReading:
    """How a file's image parts are read: paths relative to `base_dir`, within `limits`; keep False (a text-only
    model) drops every image part unread, leaving its turn's text."""
    base_dir: Path
    limits: ImageLimits
    keep: bool = True
    # every image file read: its path -> what it was when read (`_identity`); `check` compares them with the files
    files: dict = field(default_factory=dict, compare=False)

    def check(self) -> None:
        """A UserError when an image file read is no longer what it was when read (written to, or replaced)."""
        for path, read in self.files.items():
            try:
                now = _identity(os.stat(path))
            except OSError as exc:
                _changed(path, f"it is no longer there: {exc.strerror}")
            if now != read:
                _changed(path, _how(read, now))


def _identity(info: os.stat_result) -> tuple:
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def _how(before: tuple, now: tuple) -> str:
    if before[:2] != now[:2]:
        return "another file was put in its place"
    if before[2] != now[2]:
        return f"its size went from {before[2]:,} to {now[2]:,} bytes"
    return "it was written to"


def _changed(path: Path, how: str):
    raise UserError(f"{path}: the image file changed while the calibration read it ({how}); nothing was written "
                    "from it: run the command again once nothing writes to the image (copy it first if something "
                    "keeps writing to it)")


@dataclass(frozen=True)
class KeptImage:
    """An image as calibration keeps it: its pixels as a PNG without metadata, named by the PNG's sha256."""
    sha256: str
    png: bytes
    width: int
    height: int


def image_source(part: dict) -> str | None:
    """Where an image part's image is: a data URL or a file path (None: the part names none)."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
    else:
        url = next((part[k] for k in ("url", "path", "image") if isinstance(part.get(k), str)), None)
    return url if isinstance(url, str) and url.strip() else None


def _encoded(source: str, base_dir: Path, limits: ImageLimits, files: dict | None = None) -> bytes:
    """The image's encoded bytes from a data URL or a file, at most limits.max_bytes; `files`: what each image file
    was when read (ImageReading.files), a file changed under the reader or since an earlier read refused."""
    if (match := DATA_URL.match(source)) is not None:
        payload = source[match.end():]
        if len(payload) * 3 // 4 > limits.max_bytes:
            raise BadImage(f"the data URL holds about {len(payload) * 3 // 4:,} bytes, over calib.max_image_bytes "
                           f"{limits.max_bytes:,}; scale the image down or raise the limit")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise BadImage("the data URL's base64 is broken; encode the image again") from None
    if source.startswith("data:"):
        raise BadImage("a data URL must be base64 (data:image/png;base64,...); encode the image so")
    if re.match(r"[a-z][a-z0-9+.-]*://", source, re.I) and not source.startswith("file://"):
        raise BadImage("an image named by a URL would be fetched, and calibration reads no network; save it beside "
                       "the file and name its path, or inline it as a data URL")
    path = Path(source.removeprefix("file://"))
    path = path if path.is_absolute() else base_dir / path
    try:
        if not path.is_file():  # checked before it is opened: a FIFO would block the open
            path.stat()  # FileNotFoundError for one that is not there
            raise BadImage(f"image {path.name!r} is not a file; name an image file")
        with open(path, "rb") as handle:  # one descriptor: the size checked is that of the bytes read
            before = _identity(os.fstat(handle.fileno()))
            if before[2] > limits.max_bytes:
                raise BadImage(f"image file {path.name!r} is {before[2]:,} bytes, over calib.max_image_bytes "
                               f"{limits.max_bytes:,}; scale it down or raise the limit")
            data = handle.read(limits.max_bytes + 1)
            after = _identity(os.fstat(handle.fileno()))
    except FileNotFoundError:
        raise BadImage(f"image file {path.name!r} not found (paths are relative to the conversation file's "
                       "folder); put it there or fix the path") from None
    except PermissionError:
        raise BadImage(f"image file {path.name!r} cannot be read (permission denied); check its permissions") from None
    try:
        now = _identity(os.stat(path))
    except OSError as exc:
        _changed(path, f"it is no longer there: {exc.strerror}")
    for seen in (now[:2] == before[:2] and after or now, now):  # replaced (another inode at the path), written to
        if seen != before:
            _changed(path, _how(before, seen))
    if len(data) != before[2]:
        _changed(path, f"{len(data):,} bytes were read of its {before[2]:,}")
    if files is not None and (first := files.setdefault(path, before)) != before:  # a part before read another file
        _changed(path, _how(first, before))
    return data


def keep_image(source: str, base_dir: Path, limits: ImageLimits, files: dict | None = None) -> KeptImage:
    """The image a part names, checked and re-encoded (module docstring); BadImage says why not."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    data = _encoded(source, base_dir, limits, files)
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size  # read from the header: the pixels are not decoded yet
            if width * height > limits.max_pixels:
                raise BadImage(f"the image is {width} x {height} = {width * height:,} pixels, over "
                               f"calib.max_image_pixels {limits.max_pixels:,}; scale it down or raise the limit")
            image.load()
            upright = ImageOps.exif_transpose(image) or image  # as it is shown; the EXIF then goes
            pixels = upright.convert("RGB")
    except BadImage:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise BadImage(f"the image cannot be read ({type(exc).__name__}); export it again as PNG or JPEG") from None
    clean = Image.frombytes("RGB", pixels.size, pixels.tobytes())  # the pixels alone: no info, no EXIF, no ICC
    buffer = io.BytesIO()
    clean.save(buffer, format="PNG", optimize=False)
    png = buffer.getvalue()
    return KeptImage(hashlib.sha256(png).hexdigest(), png, clean.width, clean.height)


def content_parts(parts: list, what: str, reading: ImageReading) -> tuple[str, list[KeptImage], int]:
    """A turn's list of parts as (its text with IMAGE_PLACEHOLDER where each kept image was, the images in order,
    the image parts dropped unread: reading.keep False); BadImage (naming `what` and the part) on one that cannot
    be kept."""
    pieces: list[str] = []
    images: list[KeptImage] = []
    dropped = 0
    for i, part in enumerate(parts):
        at = f"{what}[{i}]"
        if not isinstance(part, dict) or part.get("type") not in PART_TYPES:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadImage(f"{at}: a part of type {str(kind)[:40]!r} cannot be read; give "
                           "{\"type\": \"text\", \"text\": ...} or an image part (image_url, image)")
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise BadImage(f"{at}.text: must be text; make it a string")
            pieces.append(part["text"].replace(IMAGE_PLACEHOLDER, ""))  # only images stand there
            continue
        source = image_source(part)
        if source is None:
            raise BadImage(f"{at}: an image part names no image; give image_url.url (a data URL or a path)")
        if not reading.keep:
            dropped += 1
            continue
        try:
            images.append(keep_image(source, reading.base_dir, reading.limits, reading.files))
        except BadImage as exc:
            raise BadImage(f"{at}: {exc}") from None
        pieces.append(IMAGE_PLACEHOLDER)
    return "\n".join(p for p in pieces if p), images, dropped
