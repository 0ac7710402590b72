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
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

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


def _encoded(source: str, base_dir: Path, limits: ImageLimits) -> bytes:
    """The image's encoded bytes from a data URL or a file, at most limits.max_bytes."""
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
        size = path.stat().st_size
        if not path.is_file():
            raise BadImage(f"image {path.name!r} is not a file; name an image file")
        if size > limits.max_bytes:
            raise BadImage(f"image file {path.name!r} is {size:,} bytes, over calib.max_image_bytes "
                           f"{limits.max_bytes:,}; scale it down or raise the limit")
        return path.read_bytes()
    except FileNotFoundError:
        raise BadImage(f"image file {path.name!r} not found (paths are relative to the conversation file's "
                       "folder); put it there or fix the path") from None
    except PermissionError:
        raise BadImage(f"image file {path.name!r} cannot be read (permission denied); check its permissions") from None


def keep_image(source: str, base_dir: Path, limits: ImageLimits) -> KeptImage:
    """The image a part names, checked and re-encoded (module docstring); BadImage says why not."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    data = _encoded(source, base_dir, limits)
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
            images.append(keep_image(source, reading.base_dir, reading.limits))
        except BadImage as exc:
            raise BadImage(f"{at}: {exc}") from None
        pieces.append(IMAGE_PLACEHOLDER)
    return "\n".join(p for p in pieces if p), images, dropped
