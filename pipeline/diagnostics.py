"""`quantize kl`: how far a variant's next-token distribution drifts from the base's.

On held-out conversations (never used for calibration) both models score the same tokens;
per token we take KL(base || variant) and whether their top-1 tokens agree, the figures
llama.cpp's perplexity tool reports for its quantizations. Cheap, label-free, and sensitive
long before benchmark accuracy moves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError
from pipeline.outputs import Stopwatch, write_json


@dataclass
class KLResult:
    out: Path
    summary: dict

    def summary_line(self) -> str:
        s = self.summary
        return (f"kl: wrote {self.out} ({s['tokens']} tokens: mean KL {s['kl_mean']:.4f}, p99 {s['kl_p99']:.4f}, "
                f"top-1 agreement {s['top1_agreement']:.1%}) in {s['seconds']:.0f} s")


def holdout_texts(tokenizer, holdout: Path, max_tokens: int, max_sequences: int | None = None) -> list[list[int]]:
    """Each held-out conversation, its reference answer included, as token ids."""
    if not holdout.exists():
        raise UserError(f"{holdout}: no holdout prompts; run `quantize calib` first")
    sequences = []
    for line in holdout.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        messages = list(record["messages"])
        if record.get("reference"):
            messages.append({"role": "assistant", "content": record["reference"]})
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        else:
            text = "\n".join(m["content"] for m in messages)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
        if len(ids) >= 2:
            sequences.append(ids)
        if max_sequences and len(sequences) >= max_sequences:
            break
    if not sequences:
        raise UserError(f"{holdout}: no usable held-out conversation")
    return sequences


def _log_probs(model, batch, device):
    import torch

    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in batch], batch_first=True).to(device)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(s), dtype=torch.long) for s in batch],
                                           batch_first=True).to(device)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    return torch.log_softmax(logits, dim=-1), mask.bool()


def compare(base, variant, sequences: list[list[int]], batch_size: int = 8):
    """Per-token KL(base || variant) and top-1 agreement over every real (unpadded) position."""
    import torch

    device = next(base.parameters()).device
    kls, agree = [], []
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start:start + batch_size]
        base_lp, mask = _log_probs(base, batch, device)
        var_lp, _ = _log_probs(variant, batch, device)
        kl = (base_lp.exp() * (base_lp - var_lp)).sum(-1)
        kls.append(kl[mask].cpu())
        agree.append((base_lp.argmax(-1) == var_lp.argmax(-1))[mask].cpu())
    return torch.cat(kls), torch.cat(agree)


def run(base_dir: Path | str, variant_dir: Path | str, holdout: Path | str, out: Path | str, *,
        max_tokens: int = 512, max_sequences: int | None = None, dtype: str = "float32") -> KLResult:
    import torch
    from transformers import AutoTokenizer

    from pipeline.checkpoints import inspect
    from pipeline.engines.loading import load_for_inference

    watch = Stopwatch()
    for model_dir in (variant_dir, base_dir):  # both whole before either loads
        inspect.check(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    sequences = holdout_texts(tokenizer, Path(holdout), max_tokens, max_sequences)
    # Both models are held at once: fine for the CPU demo; on a GPU this needs memory for both.
    base = load_for_inference(base_dir, getattr(torch, dtype)).eval()
    variant = load_for_inference(variant_dir, getattr(torch, dtype)).eval()
    kl, agree = compare(base, variant, sequences)
    summary = {
        "base": str(base_dir), "variant": str(variant_dir), "holdout": str(holdout),
        "sequences": len(sequences), "tokens": int(kl.numel()),
        "kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl, 0.99)), "kl_max": float(kl.max()),
        "top1_agreement": float(agree.float().mean()), "seconds": round(watch.seconds, 2),
    }
    write_json(out, summary)
    return KLResult(Path(out), summary)
