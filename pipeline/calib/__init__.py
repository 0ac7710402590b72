"""`quantize calib`: raw support logs -> calibration token blocks + held-out judge prompts.

Reads .jsonl, .jsonl.gz or .json (array); each record's shape is detected on its own
(OpenAI messages, ShareGPT conversations, turns with role aliases, prompt/response,
instruction/output, plain text). Records that cannot be used (bad ones, a system prompt alone, those
the chat template rejects) are skipped and listed; more than calib.max_bad_fraction of them fail the
run, and so does a file without a single user or assistant turn (or, with calib.holdout above 0,
without a user turn to hold out). Control characters but tab and newline (NUL included) are removed
from the text and counted (pipeline/formats/conversations.py). Personal data is redacted by default,
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
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.calib.dedup import NEAR_DUPLICATE_JACCARD, WordIds, jaccard, near_duplicates, normalised, shingles
from pipeline.calib.load import CalibStats, _letters, check_skipped, load_conversations
from pipeline.calib.pack import (
    _load_tokenizer, holdout_prompt, pack, render, split, token_counts_and_stream,
)
from pipeline.calib.redact import redact
from pipeline.errors import UserError
from pipeline.formats.calib_blocks import blocks_text, is_blocks_file, read_blocks
from pipeline.formats.conversations import MAX_LINE_BYTES, Conversation, to_conversation
from pipeline.formats.holdout import write_holdout
from pipeline.outputs import Stopwatch, atomic_dir, counted
from pipeline.params import CalibParams, with_overrides

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
            f"in {self.seconds:.1f} s"
        )


def _jsonl(rows) -> str:
    return "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows)


def _sorted(counts: dict) -> dict:
    return {key: counts[key] for key in sorted(counts) if counts[key]}


def _render_all(tokenizer, conversations: list[Conversation], stats: CalibStats,
                model_dir: Path) -> tuple[list[Conversation], list[str]]:
    """The conversations the chat template accepts, and their rendered texts."""
    from pipeline.console import progress

    rendered = []
    with progress("calib: chat template", len(conversations), "conversations") as advance:
        for conversation in conversations:
            rendered.append((conversation, render(tokenizer, conversation)))
            advance(1)
    kept = [(c, text) for c, text in rendered if text is not None]
    rejected = len(rendered) - len(kept)
    if rejected and not kept:
        raise UserError(f"{model_dir}: the chat template rejected every conversation; check the template in "
                        "tokenizer_config.json or chat_template.jinja")
    stats.dropped["rejected by chat template"] += rejected
    stats.kept -= rejected
    return [c for c, _ in kept], [text for _, text in kept]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _summary(source: Path, stats: CalibStats, *, do_redact: bool, calib_set: int, held: int, seq_len: int,
             blocks: list[list[int]], conversation_tokens: int, chat_template: bool) -> dict:
    return {
        "source": str(source),
        "source_sha256": _file_sha256(source),
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


def run(source: Path | str, out: Path | str, model_dir: Path | str, settings: CalibParams | None = None, *,
        strict: bool = False, **overrides) -> CalibResult:
    """settings: params.yaml `calib` (defaults in params.py; its source and out are the CLI's defaults,
    the paths given here are what runs); `overrides` (e.g. seq_len=64, redact=False) replace fields and
    are validated again. strict: stop at the first bad record instead of skipping it."""
    s = with_overrides(settings or CalibParams(), **overrides)
    watch, phases, lap = Stopwatch(), {}, time.perf_counter()

    def phase(name: str) -> None:
        nonlocal lap
        now = time.perf_counter()
        phases[name], lap = now - lap, now

    source, out, model_dir = Path(source), Path(out), Path(model_dir)
    conversations, stats = load_conversations(
        source, strict=strict, max_bad_fraction=s.max_bad_fraction,
        do_redact=s.redact, extra_patterns=s.redact_patterns,
    )
    phase("read+redact+dedup")
    if s.holdout and not any(m["role"] == "user" for c in conversations for m in c.messages):
        raise UserError(f"{source}: no record has a user turn, so none can be held out for the judge, kl, bench and "
                        f"ppl-chat (calib.holdout: {s.holdout}); add conversations with user turns, or set "
                        "calib.holdout: 0 to calibrate on this text alone")
    calib_set, held = split(conversations, s.holdout)
    phase("split")
    tokenizer = _load_tokenizer(model_dir)
    phase("load tokenizer")
    calib_set, texts = _render_all(tokenizer, calib_set, stats, model_dir)
    check_skipped(source, stats, s.max_bad_fraction, model_dir)
    conversation_tokens, stream = token_counts_and_stream(tokenizer, texts, s.seq_len * s.num_blocks)
    blocks = pack(stream, s.seq_len, s.num_blocks, source)
    phase("render+pack")
    summary = _summary(source, stats, do_redact=s.redact, calib_set=len(calib_set), held=len(held), seq_len=s.seq_len,
                       blocks=blocks, conversation_tokens=conversation_tokens,
                       chat_template=bool(getattr(tokenizer, "chat_template", None)))
    blocks_file = blocks_text(blocks)
    summary["blocks_sha256"] = hashlib.sha256(blocks_file.encode()).hexdigest()
    with atomic_dir(out, "calib", {"source": source, "tokenizer checkpoint": model_dir}) as tmp:
        (tmp / "calib.jsonl").write_text(blocks_file, encoding="utf-8")
        (tmp / "calib_conversations.jsonl").write_text(
            _jsonl({"where": c.where, "messages": c.messages} for c in calib_set), encoding="utf-8")
        write_holdout(tmp / "holdout.jsonl", [holdout_prompt(c) for c in held])
        (tmp / "stats.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    phase("write")
    return CalibResult(out, summary, watch.seconds, phases)
