"""Per-token KL(base || variant) on the held-out conversations, the parts `quantize kl` (pipeline/stages/kl.py) and
`quantize sensitivity` (pipeline/stages/sensitivity.py) share: the held-out conversations as token ids, one batch's
log-probabilities, the KL and top-1 agreement at each real (unpadded) position."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import UserError


def holdout_texts(tokenizer, holdout: Path, max_tokens: int, max_sequences: int | None = None) -> list[list[int]]:
    """Each held-out conversation, its reference answer included, as token ids (pipeline/formats/)."""
    from pipeline.formats.chat import render_chat
    from pipeline.formats.holdout import read_holdout, with_reference

    sequences = []
    for record in read_holdout(Path(holdout), purpose="held-out conversations"):
        text = render_chat(tokenizer, with_reference(record))
        if text is None:
            continue  # the template rejects this conversation's turns
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
        if len(ids) >= 2:
            sequences.append(ids)
        if max_sequences and len(sequences) >= max_sequences:
            break
    if not sequences:
        raise UserError(f"{holdout}: no usable held-out conversation")
    return sequences


def log_probs(model, batch: list[list[int]], device, grad: bool = False):
    """Log-softmax of the model's logits (float32) over a right-padded batch, and the mask of real positions;
    `grad`: kept in autograd's graph (the sensitivity's gradient), else computed in inference mode."""
    import contextlib

    import torch

    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in batch], batch_first=True).to(device)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(s), dtype=torch.long) for s in batch],
                                           batch_first=True).to(device)
    with contextlib.nullcontext() if grad else torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    return torch.log_softmax(logits, dim=-1), mask.bool()


def token_kl(base_lp, var_lp, mask):
    """KL(base || variant) in nats and whether the top-1 tokens agree, at each real position (on the CPU)."""
    kl = (base_lp.exp() * (base_lp - var_lp)).sum(-1)
    return kl[mask].cpu(), (base_lp.argmax(-1) == var_lp.argmax(-1))[mask].cpu()
