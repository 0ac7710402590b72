"""`quantize kl`: how far a variant's next-token distribution drifts from the base's.

On held-out conversations (never used for calibration) both models score the same tokens;
per token we take KL(base || variant) and whether their top-1 tokens agree, the figures
llama.cpp's perplexity tool reports for its quantizations. Cheap, label-free, and sensitive
long before benchmark accuracy moves. Each sequence's per-token values go to kl.jsonl beside
kl.json (pipeline/formats/kl_lines.py), from which the report recomputes the summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints import checkpoint
from pipeline.engines import DEFAULT, EngineSettings, default_settings, settings_for
from pipeline.formats.kl_lines import lines_path, write_kl_lines
from pipeline.outputs import Stopwatch, write_json
from pipeline.scoring.token_kl import holdout_texts, log_probs, token_kl
from pipeline.settings.params import KlParams, sections_with_overrides


@dataclass
class KLResult:
    out: Path
    figures: dict  # what the stage's JSON summary holds

    def summary(self) -> str:
        s = self.figures
        return (f"kl: wrote {self.out} ({s['tokens']} tokens: mean KL {s['kl_mean']:.4f}, p99 {s['kl_p99']:.4f}, "
                f"top-1 agreement {s['top1_agreement']:.1%}) in {s['seconds']:.0f} s")


def compare(base, variant, sequences: list[list[int]], batch_size: int = 8):
    """Per-token KL(base || variant) and top-1 agreement over every real (unpadded) position,
    both models resident."""
    import torch

    from pipeline.console import progress

    device = next(base.parameters()).device
    kls, agree = [], []
    with progress("kl: base and variant", len(sequences), "sequences") as advance:
        for start in range(0, len(sequences), batch_size):
            batch = sequences[start:start + batch_size]
            base_lp, mask = log_probs(base, batch, device)
            var_lp, _ = log_probs(variant, batch, device)
            kl, same = token_kl(base_lp, var_lp, mask)
            kls.append(kl)
            agree.append(same)
            advance(len(batch))
    return torch.cat(kls), torch.cat(agree)


def compare_one_at_a_time(load_base, load_variant, sequences: list[list[int]], device: str, batch_size: int = 8):
    """The same figures with one model resident at a time: the base's log-probabilities of the real
    positions are kept in host memory (float32) while the variant is loaded in its place."""
    import gc

    import torch

    from pipeline.console import progress

    model = load_base()
    kept = []
    with progress("kl: base", len(sequences), "sequences") as advance:
        for start in range(0, len(sequences), batch_size):
            lp, mask = log_probs(model, sequences[start:start + batch_size], device)
            kept.append((lp.cpu(), mask.cpu()))
            advance(len(sequences[start:start + batch_size]))
    del model, lp
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    model = load_variant()
    kls, agree = [], []
    with progress("kl: variant", len(sequences), "sequences") as advance:
        for index, start in enumerate(range(0, len(sequences), batch_size)):
            var_lp, _ = log_probs(model, sequences[start:start + batch_size], device)
            base_lp, mask = kept[index]
            kl, same = token_kl(base_lp.to(device), var_lp, mask.to(device))
            kls.append(kl)
            agree.append(same)
            advance(len(sequences[start:start + batch_size]))
    return torch.cat(kls), torch.cat(agree)


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype the checkpoint's weights are meant to run in (config torch_dtype / dtype), float16 if unsaid."""
    return checkpoint.open(model_dir).dtype


def both_fit_on_gpu(base_dir: Path, sequences: list[list[int]], batch_size: int, dtype_bytes: int) -> bool:
    """Two dense copies of the weights plus a batch's log-probabilities (both models, float32) within 90 %
    of the GPU's free memory."""
    import torch

    from pipeline.checkpoints.sizes import checkpoint_weight_bytes

    vocab = checkpoint.open(base_dir).vocab_size
    weights = checkpoint_weight_bytes(Path(base_dir)) * dtype_bytes // 2  # the base's bytes at 2 per weight
    longest = max(len(s) for s in sequences)
    activations = 4 * batch_size * longest * vocab * 4  # logits, log-softmax and the exp, both models, float32
    free, _ = torch.cuda.mem_get_info()
    return 2 * weights + activations < 0.9 * free


def run(base_dir: Path | str, variant_dir: Path | str, holdout: Path | str, out: Path | str,
        settings: KlParams | None = None, engine: EngineSettings | None = None, *, device: str | None = None,
        resident: str = "auto", batch_size: int = 8, **overrides) -> KLResult:
    """settings: params.yaml `kl` (sequences and max_tokens: conversations scored and tokens per
    conversation); engine: params.yaml `engine` (the dtype an in-process engine takes from it); defaults in
    params.py. `overrides` (e.g.
    sequences=8, dtype="bfloat16") replace the field of that name, validated again. On a GPU the models
    run in the base checkpoint's dtype; on a CPU in engine.dtype (float32 holds float16 weights exactly).
    resident: "both", "one" (one model at a time) or "auto" (both when they fit); batch_size: sequences
    per forward pass (the stage's own, not engine.batch_size)."""
    k, e = sections_with_overrides(settings or KlParams, engine or default_settings(), **overrides)
    dtype = settings_for(e, DEFAULT).dtype
    import torch
    from transformers import AutoTokenizer

    from pipeline.checkpoints import headers
    from pipeline.checkpoints.loading import load_for_inference

    watch = Stopwatch()
    for model_dir in (variant_dir, base_dir):  # both whole before either loads
        headers.check(model_dir)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        dtype = checkpoint_dtype(Path(base_dir))
    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    sequences = holdout_texts(tokenizer, Path(holdout), k.max_tokens, k.sequences)
    place = "cuda" if device == "cuda" else None
    load = lambda path: load_for_inference(path, torch_dtype, device=place).eval()  # noqa: E731
    if resident == "auto":
        resident = "both" if device != "cuda" or both_fit_on_gpu(
            Path(base_dir), sequences, batch_size, torch.tensor([], dtype=torch_dtype).element_size()) else "one"
    if resident == "both":
        kl, agree = compare(load(base_dir), load(variant_dir), sequences, batch_size)
    else:
        kl, agree = compare_one_at_a_time(lambda: load(base_dir), lambda: load(variant_dir), sequences, device,
                                          batch_size)
    summary = {
        "base": str(base_dir), "variant": str(variant_dir), "holdout": str(holdout),
        "sequences": len(sequences), "tokens": int(kl.numel()),
        "kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl.float(), 0.99)), "kl_max": float(kl.max()),
        "top1_agreement": float(agree.float().mean()), "device": device, "dtype": dtype,
        "models_resident": resident, "seconds": round(watch.seconds, 2),
    }
    lengths = [len(s) for s in sequences]  # the scored positions, sequence after sequence
    write_kl_lines(lines_path(out), [(k.tolist(), int(a.sum())) for k, a in zip(kl.split(lengths), agree.split(lengths))])
    write_json(out, summary)  # last: a summary beside its lines
    return KLResult(Path(out), summary)
