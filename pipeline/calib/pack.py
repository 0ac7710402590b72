"""Split and pack: the deterministic calibration / holdout split by content hash, the judge's
holdout prompts, rendering with the model's chat template, tokenizing and packing into
fixed-length token blocks (read back through pipeline/formats/calib_blocks.py).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.calib.dedup import content_hash
from pipeline.formats.conversations import Conversation
from pipeline.errors import UserError

# ---------------------------------------------------------------- split and pack

def split(conversations: list[Conversation], holdout: int) -> tuple[list[Conversation], list[Conversation]]:
    """Deterministic: the `holdout` conversations with a user turn and the smallest content hashes
    are held out; the rest, in hash order, calibrate."""
    ranked = sorted(conversations, key=lambda c: c.key or content_hash(c.text()))
    held_ids: set[int] = set()
    for conversation in ranked:
        if len(held_ids) == holdout:
            break
        if any(m["role"] == "user" for m in conversation.messages):
            held_ids.add(id(conversation))
    held = [c for c in ranked if id(c) in held_ids]
    return [c for c in ranked if id(c) not in held_ids], held


def holdout_prompt(conversation: Conversation) -> dict:
    """The last user turn with the conversation before it (what the judge's models answer), and the
    real reply that followed (pipeline/formats/holdout.py)."""
    from pipeline.formats.holdout import holdout_record

    last_user = max(i for i, m in enumerate(conversation.messages) if m["role"] == "user")
    return holdout_record((conversation.key or content_hash(conversation.text()))[:16],
                          conversation.messages[: last_user + 1],
                          next((m["content"] for m in conversation.messages[last_user + 1:]
                                if m["role"] == "assistant"), None))


def render(tokenizer, conversation: Conversation) -> str | None:
    """The conversation as the model sees it (pipeline/formats/chat.py); None when the chat template
    rejects it."""
    from pipeline.formats.chat import has_template, render_chat

    if conversation.shape == "text" or not has_template(tokenizer):
        return conversation.text()
    return render_chat(tokenizer, conversation.messages)


def token_counts_and_stream(tokenizer, texts: list[str], needed: int) -> tuple[int, list[int]]:
    """Total tokens of all texts, and the first `needed` (or all) tokens of their concatenation.
    Batches through the fast (Rust) tokenizer, which uses every core."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    total, stream = 0, []
    for first in range(0, len(texts), 512):
        batch = texts[first:first + 512]
        if backend is not None:
            ids = [encoding.ids for encoding in backend.encode_batch(batch, add_special_tokens=False)]
        else:
            ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
        for row in ids:
            total += len(row)
            if len(stream) < needed:
                stream.extend(row)
    return total, stream[:needed]


def pack(stream: list[int], seq_len: int, num_blocks: int, source: Path) -> list[list[int]]:
    """Cuts the concatenated token stream into fixed-length blocks: no padding, so blocks batch."""
    needed = seq_len * num_blocks
    if len(stream) < needed:
        raise UserError(
            f"{source}: calibration set too small: {len(stream)} tokens after de-duplication and holdout, "
            f"need calib.seq_len x calib.num_blocks = {seq_len} x {num_blocks} = {needed}; "
            "add conversations or lower calib.num_blocks / calib.seq_len"
        )
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(num_blocks)]


def _load_tokenizer(model_dir: Path):
    if not model_dir.is_dir():
        raise UserError(f"{model_dir}: no such model directory; pass --model with the checkpoint whose "
                        "tokenizer and chat template render the text (e.g. models/base after `quantize resave`)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise UserError(f"{model_dir}: no usable tokenizer ({exc}); "
                        "pass --model with a checkpoint that has one") from None
