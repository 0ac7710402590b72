"""`quantize calib`: raw support logs -> calibration token blocks + held-out judge prompts.

Reads .jsonl, .jsonl.gz or .json (array); each record's shape is detected on its own
(OpenAI messages, ShareGPT conversations, turns with role aliases, prompt/response,
instruction/output, plain text). Records that cannot be used (bad ones, a system prompt alone, those
the chat template rejects) are skipped and listed; more than calib.max_bad_fraction of them fail the
run, and so does a file without a single user or assistant turn (or, with calib.holdout above 0,
without a user turn to hold out). Control characters but tab and newline (NUL included) are removed
from the text and counted (pipeline/formats/conversation_shapes.py). Personal data is redacted by default,
before anything else looks at the text. Duplicates (identical normalised text) and near-duplicates
(word 3-gram Jaccard >= NEAR_DUPLICATE_JACCARD, found with MinHash + LSH) are dropped; the rest is split
by content hash into calibration and holdout (never sharing a conversation), rendered with the model's
chat template and packed into fixed-length token blocks.

The stage is `run` (and `CalibResult`); the pieces live in redact, dedup, load (read + redact +
de-duplicate, with the stats) and pack (split, render, pack); the files it reads and writes have
their readers in pipeline/formats (conversations: files and record shapes; calib_blocks: calib.jsonl;
holdout: holdout.jsonl). Their names used elsewhere as `calib.X` are imported here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.calib.dedup import NEAR_DUPLICATE_JACCARD, WordIds, jaccard, near_duplicates, normalised, shingles
from pipeline.calib.load import CalibStats, _letters, check_skipped, load_conversations, read_conversations
from pipeline.calib.pack import (HOLDOUT_HOW, _load_tokenizer, calibration_stream, held_out, holdout_prompt,
                                 image_sample, pack, render)
from pipeline.calib.redact import redact
from pipeline.calib.store import ConversationStore
from pipeline.console import progress
from pipeline.errors import UserError
from pipeline.formats.calib_blocks import IMAGE_SAMPLES, blocks_text, image_samples_text, is_blocks_file, read_blocks
from pipeline.formats.conversation_shapes import Conversation, to_conversation
from pipeline.formats.conversations import MAX_LINE_BYTES
from pipeline.formats.image_parts import ImageLimits, ImageReading
from pipeline.formats.holdout import write_holdout
from pipeline.outputs import Stopwatch, atomic_dir, counted
from pipeline.formats.read_watch import ReadWatch
from pipeline.settings.params import CalibParams, with_overrides

__all__ = [  # the stage, and the names other code uses as calib.X
    "CalibResult", "run", "read_blocks", "is_blocks_file", "load_conversations", "to_conversation", "Conversation",
    "redact", "render", "normalised", "near_duplicates", "jaccard", "shingles", "WordIds", "_letters",
    "MAX_LINE_BYTES", "NEAR_DUPLICATE_JACCARD",
]


# ---------------------------------------------------------------- stage

@dataclass
class CalibResult:
    out: Path
    stats: dict
    seconds: float
    phases: dict = field(default_factory=dict)  # seconds per phase (never written: not deterministic)

    def summary(self) -> str:
        s = self.stats
        dropped = ", ".join(counted(n, why) if why in ("duplicate", "near-duplicate", "bad record") else f"{n} {why}"
                            for why, n in s["dropped"].items())
        controls = s["control_characters_removed"]
        removed = (f", {controls} control characters removed (the first at "
                   f"{s['control_characters_first_10'][0].rsplit(': ', 1)[0]})") if controls else ""
        return (
            f"calib: wrote {self.out} ({counted(s['blocks'], 'block')} x {s['seq_len']} tokens, "
            f"{counted(s['holdout'], 'holdout prompt')}; kept {s['records_kept']:,} of {counted(s['records_in'], 'record')}"
            f"{f' (dropped {dropped})' if dropped else ''}, {counted(sum(s['redactions'].values()), 'redaction')}{removed}) "
            f"in {self.seconds:.1f} s" + (f"; {s['holdout_note']}" if s.get("holdout_note") else "")
            + (f"; {counted(s['image_samples'], 'image sample')} ({counted(s['image_sample_images'], 'image')}, "
               f"{s['image_sample_tokens']:,} tokens with the images)" if s.get("image_samples") else "")
            + (f"; {s['images_note']}" if s.get("images_note") else "")
        )


def _sorted(counts: dict) -> dict:
    return {key: counts[key] for key in sorted(counts) if counts[key]}


def _render_all(tokenizer, store: ConversationStore, held: list[Conversation], stats: CalibStats, model_dir: Path,
                needed: int, with_images: list[Conversation] | None = None) -> tuple[int, int, list[int]]:
    """(calibration conversations the chat template accepted, their tokens in all, the first `needed` tokens of
    their concatenation); those it rejects are counted as dropped. Conversations with images go to `with_images`."""
    count = store.kept - len(held)
    with progress("calib: chat template", count, "conversations") as advance:
        accepted, rejected, tokens, stream = calibration_stream(tokenizer, store, {bytes.fromhex(c.key) for c in held},
                                                                needed, advance, with_images)
    if rejected and not accepted:
        raise UserError(f"{model_dir}: the chat template rejected every conversation; check the template in "
                        "tokenizer_config.json or chat_template.jinja")
    stats.dropped["rejected by chat template"] += rejected
    stats.kept -= rejected
    return accepted, tokens, stream


def _summary(source: Path, source_sha256: str, stats: CalibStats, *, do_redact: bool, calib_set: int, held: int, seq_len: int,
             blocks: list[list[int]], conversation_tokens: int, chat_template: bool) -> dict:
    return {
        "source": str(source),
        "source_sha256": source_sha256,  # of the bytes read (pipeline/formats/read_watch.py), not of the file after
        "records_in": stats.records_in,
        "records_kept": stats.kept,
        "dropped": _sorted(stats.dropped),
        "bad_records": stats.dropped["bad record"],
        "bad_records_first_10": stats.bad_records,
        "shapes": _sorted(stats.shapes),
        "roles": _sorted(stats.roles),
        "turns": stats.turns,
        "turns_per_conversation": round(stats.turns / max(stats.conversations, 1), 2),
        "non_latin_share": round(stats.non_latin_letters / max(stats.letters, 1), 4),
        "control_characters_removed": sum(stats.control_characters.values()),
        "control_characters": _sorted(stats.control_characters),
        "control_characters_first_10": stats.control_character_places,
        "redaction": do_redact,
        "redactions": _sorted(stats.redactions),
        "calib_conversations": calib_set,
        "calib_conversation_tokens": conversation_tokens,
        "chat_template": chat_template,
        "holdout": held,
        "seq_len": seq_len,
        "blocks": len(blocks),
        "tokens": seq_len * len(blocks),
    }


def _folder_of(source: Path) -> Path:
    """The folder an image part's relative path starts from: the conversation file's, its symlinks followed (a link
    that loops or is broken: its own folder, and reading the file says what is wrong with it)."""
    try:
        return source.resolve().parent
    except (OSError, RuntimeError):
        return source.absolute().parent


def run(source: Path | str, out: Path | str, model_dir: Path | str, settings: CalibParams | None = None, *,
        strict: bool = False, **overrides) -> CalibResult:
    """settings: params.yaml `calib` (defaults in params.py; its source and out are the CLI's defaults,
    the paths given here are what runs); `overrides` (e.g. seq_len=64, redact=False) replace fields and
    are validated again. strict: stop at the first bad record instead of skipping it. Streams: what it has read
    waits in a scratch store on disk (pipeline/calib/store.py), so its memory does not grow with the file."""
    s = with_overrides(settings or CalibParams(), **overrides)
    source, out, model_dir = Path(source), Path(out), Path(model_dir)
    watch, phases, read = Stopwatch(), _Phases(), ReadWatch(source, "calibration file")
    vision = _has_vision(model_dir)  # a text-only model: image parts dropped unread, their turns' text kept
    reading = ImageReading(_folder_of(source), ImageLimits(s.max_image_bytes, s.max_image_pixels), keep=vision)
    with ConversationStore() as store:
        with progress("calib: reading", _readable_size(source), "bytes") as advance:
            stats = read_conversations(source, store, strict=strict, max_bad_fraction=s.max_bad_fraction,
                                       do_redact=s.redact, extra_patterns=s.redact_patterns, advance=advance,
                                       watch=read, reading=reading)
        phases("read+redact+dedup")
        if s.holdout and not store.any_user_turn():
            which = " without images (those are read as text)" if stats.image_conversations else ""
            raise UserError(f"{source}: no record{which} has a user turn, so none can be held out for the judge, kl, "
                            f"bench and ppl-chat (calib.holdout: {s.holdout}); add conversations with user turns, or "
                            "set calib.holdout: 0 to calibrate on this text alone")
        conversations = store.kept
        holdout, held_note = holdout_size(s.holdout, conversations)
        held = held_out(store, holdout)
        phases("split")
        tokenizer = _load_tokenizer(model_dir)
        phases("load tokenizer")
        with_images: list[Conversation] | None = [] if vision else None
        calib_set, conversation_tokens, stream = _render_all(tokenizer, store, held, stats, model_dir,
                                                             s.seq_len * s.num_blocks, with_images)
        samples = _image_samples(tokenizer, model_dir, store, with_images or [], s)
        check_skipped(source, stats, s.max_bad_fraction, model_dir)
        blocks = pack(stream, s.seq_len, s.num_blocks, source,
                      held=f"the holdout took {len(held)} of the {counted(conversations, 'conversation')}, "
                           f"calib.holdout {s.holdout}")
        phases("render+pack")
        summary = _summary(source, read.sha256, stats, do_redact=s.redact, calib_set=calib_set, held=len(held),
                           seq_len=s.seq_len, blocks=blocks, conversation_tokens=conversation_tokens,
                           chat_template=bool(getattr(tokenizer, "chat_template", None)))
        if held_note:
            summary["holdout_note"] = held_note
        summary.update(_image_summary(stats, samples, len(with_images or []), model_dir))
        _write(out, source, model_dir, store, held, blocks, summary, read, samples, reading)
        phases("write")
    return CalibResult(out, summary, watch.seconds, phases.seconds)


HOLDOUT_SHARE = 0.5  # at most this share of the conversations is held out: the rest is left to calibrate on


def holdout_size(requested: int, conversations: int) -> tuple[int, str]:
    """(conversations to hold out, a note when that is fewer than calib.holdout asked for). A small input would be
    held out whole (calib.holdout 32 of 30 conversations: nothing left to calibrate on): it keeps HOLDOUT_SHARE of
    them held out, at least one, and says so."""
    most = max(1, int(conversations * HOLDOUT_SHARE))
    if requested <= most:
        return requested, ""
    return most, (f"calib.holdout {requested} would leave {'none' if requested >= conversations else 'few'} of the "
                  f"{counted(conversations, 'conversation')} to calibrate on: held out {most} "
                  f"(at most {HOLDOUT_SHARE:.0%}); to choose, {HOLDOUT_HOW}")


class _Phases:
    """Seconds per phase: phases(name) ends the phase begun at the last call (or at creation)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.lap = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name], self.lap = now - self.lap, now


def _readable_size(source: Path) -> int | None:
    """The bytes the reading bar counts to: the file's size; unknown (None) for gzip, whose decompressed bytes
    it counts."""
    try:
        with open(source, "rb") as handle:
            return None if handle.read(2) == b"\x1f\x8b" else source.stat().st_size
    except OSError:
        return None  # the reader says what is wrong


def _has_vision(model_dir: Path) -> bool:
    """Whether the checkpoint takes images (a vision tower in config.json); a folder without one: the tokenizer's
    load says what is wrong."""
    from pipeline.checkpoints import checkpoint

    return (model_dir / "config.json").is_file() and checkpoint.open(model_dir).has_vision


def _image_samples(tokenizer, model_dir: Path, store: ConversationStore, conversations: list[Conversation],
                   s: CalibParams) -> list[dict]:
    """The first calib.image_samples conversations with images (hash order) as samples of their own
    (pipeline/calib/pack.py image_sample), each image's tokens counted by the model's own image processor."""
    if not conversations or not s.image_samples:
        return []
    from PIL import Image

    from pipeline.checkpoints import checkpoint
    from pipeline.checkpoints.image_processor import image_markup, image_tokens, load_image_processor

    processor, markup = load_image_processor(model_dir), image_markup(model_dir, tokenizer)
    image_token_id = checkpoint.open(model_dir).config["image_token_id"]

    def counts(shas: list[str]) -> list[int]:
        images = []
        for sha in shas:
            with Image.open(store.image_path(sha)) as image:
                images.append(image.convert("RGB"))
        return image_tokens(processor, images)

    samples = []
    for conversation in conversations:
        sample = image_sample(tokenizer, conversation, markup, image_token_id, s.seq_len, counts)
        if sample is not None:
            samples.append(sample)
        if len(samples) == s.image_samples:
            break
    return samples


def _image_summary(stats: CalibStats, samples: list[dict], with_images: int, model_dir: Path) -> dict:
    """What stats.json says of the images: those read and kept, the samples calibration takes (their images and
    tokens, each image counted as the tokens it expands to), and, for a text-only model, the images dropped."""
    if not (stats.images or stats.images_dropped):
        return {}  # a text-only file: stats.json as before
    expanded = sum(len(s["input_ids"]) - len(s["images"]) + sum(s["image_tokens"]) for s in samples)
    summary = {"images": stats.images, "image_conversations": stats.image_conversations,
               "images_dropped": stats.images_dropped, "image_samples": len(samples),
               "image_sample_images": sum(len(s["images"]) for s in samples), "image_sample_tokens": expanded}
    if stats.images_dropped:
        summary["images_note"] = (f"{counted(stats.images_dropped, 'image')} dropped: {model_dir} has no vision tower "
                                  "(no vision_config in config.json), so its calibration is the conversations' text")
    elif with_images > len(samples):
        summary["images_note"] = (f"{with_images - len(samples)} of the {counted(with_images, 'conversation')} with "
                                  "images not taken (calib.image_samples, or an image past calib.seq_len tokens)")
    return summary


def _write(out: Path, source: Path, model_dir: Path, store: ConversationStore, held: list[Conversation],
           blocks: list[list[int]], summary: dict, read: ReadWatch, samples: list[dict] | None = None,
           reading: ImageReading | None = None) -> None:
    """The stage's files, into a temp folder that replaces `out` whole (pipeline/outputs.py atomic_dir); its record
    names the source by the fingerprint of the bytes read, and a source, or an image file it names, changed since is
    refused before the rename."""
    blocks_file = blocks_text(blocks)
    summary["blocks_sha256"] = hashlib.sha256(blocks_file.encode()).hexdigest()
    held_keys = {bytes.fromhex(c.key) for c in held}
    with atomic_dir(out, "calib", {"source": source, "tokenizer checkpoint": model_dir},
                    fingerprints={"source": read.fingerprint}) as tmp:
        (tmp / "calib.jsonl").write_text(blocks_file, encoding="utf-8")
        with open(tmp / "calib_conversations.jsonl", "wb") as handle:
            for key, _, offset, length, _ in store.by_hash():
                if key not in held_keys:
                    handle.write(store.line(offset, length))
        write_holdout(tmp / "holdout.jsonl", [holdout_prompt(c) for c in held])
        if (store.folder / "images").is_dir():  # the images of calib_conversations.jsonl, their pixels alone
            shutil.copytree(store.folder / "images", tmp / "images")
        # always written (empty for a text build): the quantize stages depend on it, so new images rerun them
        (tmp / IMAGE_SAMPLES).write_text(image_samples_text(samples or []), encoding="utf-8")
        (tmp / "stats.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        read.check()  # changed since it was read: nothing is kept
        if reading is not None:
            reading.check()  # an image file read by path, the same
