"""Split and pack: the deterministic calibration / holdout split by content hash, the judge's
holdout prompts, rendering with the model's chat template, tokenizing and packing into
fixed-length token blocks (read back through pipeline/formats/calib_blocks.py).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.calib.dedup import content_hash
from pipeline.calib.store import ConversationStore
from pipeline.errors import UserError
from pipeline.formats.conversation_shapes import Conversation

TOKENIZE_BATCH = 512  # rendered conversations tokenized at once
HOLDOUT_HOW = "--holdout N on `quantize calib`, or calib.holdout in params.yaml"  # how to change the holdout

# ---------------------------------------------------------------- split and pack

def held_out(store: ConversationStore, holdout: int) -> list[Conversation]:
    """Deterministic: the `holdout` conversations with a user turn and the smallest content hashes; the rest, in
    hash order, calibrate (`calibration_stream`)."""
    held = []
    for key, has_user, offset, length, shape in store.by_hash():
        if len(held) == holdout:
            break
        if has_user:
            held.append(store.conversation(key, offset, length, shape))
    return held


def calibration_stream(tokenizer, store: ConversationStore, held: set[bytes], needed: int,
                       advance, with_images: list[Conversation] | None = None) -> tuple[int, int, int, list[int]]:
    """Every calibration conversation (hash order, the held-out ones left out) rendered with the chat template
    and tokenized: (conversations the template accepted, those it rejected (marked in the store), their tokens in
    all, the first `needed` tokens of their concatenation). Tokenizes TOKENIZE_BATCH texts at a time through the
    fast (Rust) tokenizer, which uses every core; holds one batch. A conversation with images is not cut into the
    stream (an image is not text): it goes to `with_images`, each one a sample of its own (`image_sample`)."""
    accepted = rejected = total = 0
    stream: list[int] = []
    batch: list[str] = []
    for key, _, offset, length, shape in store.by_hash():
        if key in held:
            continue
        advance(1)
        conversation = store.conversation(key, offset, length, shape)
        if with_images is not None and any(m.get("images") for m in conversation.messages):
            with_images.append(conversation)
            continue
        text = render(tokenizer, conversation)
        if text is None:
            store.reject(key)
            rejected += 1
            continue
        accepted += 1
        batch.append(text)
        if len(batch) == TOKENIZE_BATCH:
            total += _tokenize(tokenizer, batch, stream, needed)
            batch = []
    total += _tokenize(tokenizer, batch, stream, needed)
    return accepted, rejected, total, stream


def _tokenize(tokenizer, texts: list[str], stream: list[int], needed: int) -> int:
    """Tokens of all texts; the first of them extend `stream` up to `needed`."""
    if not texts:
        return 0
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        ids = [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]
    else:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for row in ids:
        if len(stream) < needed:
            stream.extend(row[:needed - len(stream)])
    return sum(len(row) for row in ids)


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
    rejects it. An image stands as IMAGE_PLACEHOLDER in its turn's text (`image_sample` puts the model's markup
    there)."""
    from pipeline.formats.chat import has_template, render_chat

    if conversation.shape == "text" or not has_template(tokenizer):
        return conversation.text()
    return render_chat(tokenizer, [{"role": m["role"], "content": m["content"]} for m in conversation.messages])


def image_sample(tokenizer, conversation: Conversation, markup: str, image_token_id: int, seq_len: int,
                 image_tokens) -> dict | None:
    """A conversation with images as one calibration sample ({"input_ids": one image token per image, "images":
    ["images/<sha256>.png", ...], "image_tokens": [each image's tokens as the processor expands it]}): rendered with
    the chat template, each image placeholder made the model's image markup, cut to `seq_len` tokens after its last
    image; None when the template rejects it or an image lies past `seq_len` tokens. image_tokens(shas) -> counts."""
    from pipeline.formats.image_parts import IMAGE_PLACEHOLDER

    text = render(tokenizer, conversation)
    if text is None:
        return None
    ids = tokenizer(text.replace(IMAGE_PLACEHOLDER, markup), add_special_tokens=False)["input_ids"]
    shas = [sha for m in conversation.messages for sha in m.get("images", ())]
    places = [i for i, token in enumerate(ids) if token == image_token_id]
    if len(places) != len(shas) or places[-1] >= seq_len:
        return None
    return {"input_ids": ids[:seq_len], "images": [f"images/{sha}.png" for sha in shas],
            "image_tokens": image_tokens(shas)}


def pack(stream: list[int], seq_len: int, num_blocks: int, source: Path, held: str = "") -> list[list[int]]:
    """Cuts the concatenated token stream into fixed-length blocks: no padding, so blocks batch. `held`: what the
    holdout took, said when the set is too small."""
    needed = seq_len * num_blocks
    if len(stream) < needed:
        raise UserError(
            f"{source}: calibration set too small: {len(stream):,} tokens after de-duplication and holdout"
            f"{f' ({held})' if held else ''}, need calib.seq_len x calib.num_blocks = {seq_len} x {num_blocks} = "
            f"{needed:,}; add conversations or lower calib.num_blocks / calib.seq_len"
            f"{f', or hold out fewer ({HOLDOUT_HOW})' if held else ''}"
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
