"""`quantize kl`: how far a variant's next-token distribution drifts from the base's.

On held-out conversations (never used for calibration) both models score the same tokens;
per token we take KL(base || variant) and whether their top-1 tokens agree, the figures
llama.cpp's perplexity tool reports for its quantizations. Cheap, label-free, and sensitive
long before benchmark accuracy moves. Each sequence's per-token values go to kl.jsonl beside
kl.json (pipeline/formats/kl_lines.py), from which the report recomputes the summary.

`--rank` (the fix stage's pass: pipeline/stages/fix.py) ranks the variant's quantized groups in the same pass, by the
KL each one costs (the `taylor` measure of pipeline/scoring/group_kl.py: one backward pass of the variant per batch),
into sensitivity.json beside kl.json: the loads and the forward passes a ranking needs are the ones the KL needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints import checkpoint
from pipeline.engines import DEFAULT, EngineSettings, default_settings, gpu_room, settings_for
from pipeline.errors import UserError
from pipeline.formats.kl_lines import kl_lines_text, lines_path
from pipeline.formats.sensitivity import NAME as SENSITIVITY_FILE
from pipeline.formats.sensitivity import sensitivity_text
from pipeline.checkpoints.fingerprint import hold_weights
from pipeline.outputs import Stopwatch, json_text, write_together
from pipeline.scoring import group_kl
from pipeline.scoring.token_kl import holdout_texts, log_probs, token_kl
from pipeline.settings.params import KlParams, sections_with_overrides


@dataclass
class KLResult:
    out: Path
    figures: dict  # what the stage's JSON summary holds
    ranking: dict | None = None  # sensitivity.json, when the pass ranked the groups too

    def summary(self) -> str:
        s = self.figures
        ranked = ""
        if self.ranking:
            r, top = self.ranking, self.ranking["groups"][0]
            share = f", {r['share_of_quantize_time']:.1%} of its quantization time" if r.get(
                "share_of_quantize_time") is not None else ""
            ranked = (f"; ranked {len(r['groups'])} groups into {self.out.with_name(SENSITIVITY_FILE)} (first "
                      f"{top['name']}: restoring it removes {top['share_removed']:.0%}; the ranking added "
                      f"{r['seconds']:.1f} s{share})")
        return (f"kl: wrote {self.out} ({s['tokens']} tokens: mean KL {s['kl_mean']:.4f}, p99 {s['kl_p99']:.4f}, "
                f"top-1 agreement {s['top1_agreement']:.1%}{ranked}) in {s['seconds']:.0f} s")


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


def measure_and_rank(load, base_dir, variant_dir, sequences: list[list[int]], batch_size: int, watch: Stopwatch,
                     about: dict):
    """Both checkpoints loaded (`load` loads one), then one pass (pipeline/scoring/group_kl.py): the KL, the
    agreement and sensitivity.json's figures (pipeline/formats/sensitivity.py; `about`: the holdout, device and
    dtype; `seconds` what the ranking added to the pass, beside the variant's quantization time)."""
    base, variant = load(base_dir), load(variant_dir)
    loaded = watch.seconds
    kl, agree, second_order = group_kl.pass_with_ranking(base, variant, sequences, batch_size,
                                                         "kl: base and variant, ranking the variant's groups")
    variant_sum, restored_sums, tokens = second_order.sums()
    ranking = {"base": str(base_dir), "variant": str(variant_dir), **about, "sequences": len(sequences),
               "tokens": tokens, "kl_mean": variant_sum / tokens, "measure": "taylor",
               "measured_in": "quantize kl --rank",
               "groups": group_kl.ranked(second_order.groups, variant, variant_sum, restored_sums, tokens),
               "load_seconds": round(loaded, 2), "pass_seconds": round(watch.seconds - loaded, 2),
               **group_kl.timing(Path(variant_dir), second_order.seconds)}
    return kl, agree, ranking


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype the checkpoint's weights are meant to run in (config torch_dtype / dtype), float16 if unsaid."""
    return checkpoint.open(model_dir).dtype


def gpu_bytes_needed(base_dir: Path, sequences: list[list[int]], batch_size: int, dtype_bytes: int,
                     gradients: bool = False) -> int:
    """Two dense copies of the weights plus a batch's log-probabilities (both models, float32); `gradients` (the
    ranking): a third copy (the weights' gradients), twice the log-probabilities and what autograd keeps of every
    decoder layer for the backward pass (its inputs, q/k/v, the attention's output, the MLP's gate, up and act: ~4
    hidden-wide and 3 intermediate-wide tensors a token). Measured on the H200 (GLM-4-9B shapes, batch 8 x 512
    tokens, 2026-12-04): the ranking ran out of memory at 76 GiB and ran with ~108 GiB free; this says ~89 GiB."""
    from pipeline.checkpoints import config_json
    from pipeline.checkpoints.sizes import checkpoint_weight_bytes

    vocab = checkpoint.open(base_dir).vocab_size
    weights = checkpoint_weight_bytes(Path(base_dir)) * dtype_bytes // 2  # the base's bytes at 2 per weight
    longest = max(len(s) for s in sequences)
    activations = 4 * batch_size * longest * vocab * 4  # logits, log-softmax and the exp, both models, float32
    if not gradients:
        return 2 * weights + activations
    text = config_json.text_section(config_json.read(base_dir))
    layers = config_json.kv_cache_shape(config_json.read(base_dir))[0]
    per_token = 4 * (text.get("hidden_size") or 0) + 3 * (text.get("intermediate_size") or 0)
    kept = batch_size * longest * layers * per_token * dtype_bytes
    return 3 * weights + 2 * activations + kept


FIT_SHARE = 0.9  # of the GPU's free memory, what an in-process pass may plan to use (the rest: the allocator's slack)


def ranking_batch(base_dir: Path, sequences: list[list[int]], batch_size: int, dtype_bytes: int, free: int) -> int:
    """The ranking's sequences per pass on a GPU: `batch_size`, halved until the pass fits in 90 % of `free`
    (the KL and the ranking are sums over sequences: the batch changes their rounding, not what they sum), at
    least 1."""
    while batch_size > 1 and gpu_bytes_needed(base_dir, sequences, batch_size, dtype_bytes, True) >= FIT_SHARE * free:
        batch_size //= 2
    return batch_size


def _room_and_batch(base_dir: Path, sequences: list[list[int]], batch_size: int, dtype_bytes: int, rank: bool) -> int:
    """On a GPU: the run's GPU memory makes room for the smallest pass this stage can run (the ranking's at one
    sequence, the KL's at its batch; pipeline/engines/gpu_room.py stops idle servers, then work started ahead), and the
    ranking's batch is the largest that fits what is free then."""
    need = gpu_bytes_needed(base_dir, sequences, 1 if rank else batch_size, dtype_bytes, rank)
    gpu_room.make_room("kl --rank" if rank else "kl", int(need / FIT_SHARE), last=base_dir)
    return ranking_batch(base_dir, sequences, batch_size, dtype_bytes, gpu_free_bytes()) if rank else batch_size


def gpu_free_bytes() -> int:
    import torch

    return torch.cuda.mem_get_info()[0]


def residency(resident: str, rank: bool, device: str, base_dir: Path, variant_dir: Path, sequences: list[list[int]],
              batch_size: int, dtype_bytes: int) -> str:
    """"both" or "one": `resident` as asked, "auto" both on a CPU and where they fit on the GPU (90 % of its free
    memory); the ranking needs both, so `rank` where they do not fit is a UserError with the figures."""
    if device != "cuda" or (resident != "auto" and not rank):
        return "both" if resident == "auto" else resident
    need, free = gpu_bytes_needed(base_dir, sequences, batch_size, dtype_bytes, rank), gpu_free_bytes()
    fits = need < FIT_SHARE * free
    if rank and not fits:
        held = gpu_room.holders()
        raise UserError(f"kl --rank: {base_dir} and {variant_dir} resident together with the gradients of the "
                        f"variant's weights need ~{need / 2**30:.0f} GiB of GPU memory at {batch_size} sequence(s) a "
                        f"pass, and {free / 2**30:.0f} GiB is free, of which a pass plans on {FIT_SHARE:.0%} "
                        f"({FIT_SHARE * free / 2**30:.0f} GiB: the rest is the allocator's slack)"
                        + (f" ({held})" if held else "") + "; the "
                        "ranking needs both models resident. Free the GPU of other processes or lower params.yaml "
                        "kl.max_tokens (each batch's log-probabilities); a model whose weights do not fit three "
                        "times cannot be ranked here")
    return "both" if resident != "auto" or fits else "one"


def run(base_dir: Path | str, variant_dir: Path | str, holdout: Path | str, out: Path | str,
        settings: KlParams | None = None, engine: EngineSettings | None = None, *, device: str | None = None,
        resident: str = "auto", batch_size: int = 8, rank: bool = False, **overrides) -> KLResult:
    """settings: params.yaml `kl` (sequences and max_tokens: conversations scored and tokens per
    conversation); engine: params.yaml `engine` (the dtype an in-process engine takes from it); defaults in
    params.py. `overrides` (e.g.
    sequences=8, dtype="bfloat16") replace the field of that name, validated again. On a GPU the models
    run in the base checkpoint's dtype; on a CPU in engine.dtype (float32 holds float16 weights exactly).
    resident: "both", "one" (one model at a time) or "auto" (both when they fit); batch_size: sequences
    per forward pass (the stage's own, not engine.batch_size); rank: also rank the variant's quantized groups in
    the same pass, into sensitivity.json beside `out` (both models resident: refused where they do not fit)."""
    k, e = sections_with_overrides(settings or KlParams, engine or default_settings(), **overrides)
    dtype = settings_for(e, DEFAULT).dtype
    import torch
    from transformers import AutoTokenizer

    from pipeline.checkpoints import headers
    from pipeline.checkpoints.loading import load_for_inference

    watch = Stopwatch()
    for model_dir in (variant_dir, base_dir):  # both whole before either loads
        headers.check(model_dir)
    held = hold_weights(variant_dir)  # what it measures: checked again before the results are written
    if rank:
        group_kl.refuse_quantized_activations(Path(variant_dir), "kl --rank")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        dtype = checkpoint_dtype(Path(base_dir))
    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    sequences = holdout_texts(tokenizer, Path(holdout), k.max_tokens, k.sequences)
    place = "cuda" if device == "cuda" else None
    load = lambda path: load_for_inference(path, torch_dtype, device=place).eval()  # noqa: E731
    dtype_bytes = torch.tensor([], dtype=torch_dtype).element_size()
    if device == "cuda":
        batch_size = _room_and_batch(Path(base_dir), sequences, batch_size, dtype_bytes, rank)
    resident = residency(resident, rank, device, Path(base_dir), Path(variant_dir), sequences, batch_size, dtype_bytes)
    ranking = None
    if rank:
        kl, agree, ranking = measure_and_rank(load, base_dir, variant_dir, sequences, batch_size, watch,
                                              {"holdout": str(holdout), "device": device, "dtype": dtype})
    elif resident == "both":
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
        "checkpoint": held.checked("kl stage"),  # what it measured: the report checks the folder against it
    }
    lengths = [len(s) for s in sequences]  # the scored positions, sequence after sequence
    files = {lines_path(out): kl_lines_text([(k.tolist(), int(a.sum()))
                                             for k, a in zip(kl.split(lengths), agree.split(lengths))])}
    files |= {Path(out).with_name(SENSITIVITY_FILE): sensitivity_text(ranking)} if ranking else {}
    write_together({**files, Path(out): json_text(summary)})  # all or none; the summary beside its lines last
    return KLResult(Path(out), summary, ranking)
