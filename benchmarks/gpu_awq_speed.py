"""AWQ calibration speed, side by side in one process (issue 36): llm-compressor's `oneshot` at its defaults
(batch 1, n_grid 20) called directly (`default`; llm-compressor at our batch size is `llmc-batch`, on request with
--configs), our stage as it was before issue 36
(`ours-before`: the one-by-one X^T X search, activations between layers on the host; benchmarks/awq_phases.py
`old_path()`), our stage now (`ours`: X^T X candidates ranked by a bfloat16 estimate and the best 3 rescored in
float32, stacked on the GPU, activations kept on the device), and `ours-ranked`: that plus the attention's forward
search ranked on a quarter of the batches and the best 3 rescored on all (not our default; awq_phases.ranked_forward).

Same random GLM-4-9B-shaped layers (GlmForCausalLM, bf16; time does not depend on the values),
same random calibration blocks (128 x 512 tokens), same recipe (W4A16 g128 asymmetric, our GLM
mappings, duo scaling). Each run at two depths (4 and 8 layers): the per-layer cost is the slope
(t(deep) - t(shallow)) / (deep - shallow), so fixed costs (tracing, data, warm-up) drop out. At the
deep depth each variant's per-layer relative output error on two blocks is measured the same way
for all (our verify: reload the saved checkpoint, feed each layer the base's inputs), and the KL
(base || variant) per token on the same two blocks through the whole model. Then, unless --no-profile,
`ours-before`, `ours` and `ours-ranked` once more at the shallow depth with every phase timed per mapping
(awq_phases.py; synchronised, so a little slower than the timed runs).

    python benchmarks/gpu_awq_speed.py                      # the comparison, ~3.5 min on one H200 (--no-profile: ~1 min less)
    python benchmarks/gpu_awq_speed.py --layers 40 --plan-only   # our --plan for a 40-layer model
    python benchmarks/gpu_awq_speed.py --tiny               # tiny shapes, CPU: checks the script

Prints markdown tables; rows as JSON lines on the way, and `gpu_awq_speed.json` in $OUT if set
(`slopes` per configuration, `times` per configuration and depth with the layer errors and KL, `profile`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from glm_shapes import GLM4_9B  # noqa: E402 (GLM-4-9B's shapes, one copy for the GPU benchmarks)
TINY = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            partial_rotary_factor=0.5, max_position_embeddings=2048, rms_norm_eps=1e-5, attention_bias=True,
            tie_word_embeddings=False)

# GLM-4.5V / GLM-4.6V (106B, Glm4vMoeForConditionalGeneration) widths, for --plan-only --arch glm4v-moe
GLM45V_TEXT = dict(
    vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128,
    num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, num_attention_heads=96,
    num_key_value_heads=8, head_dim=128, attention_bias=True, n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=1.0, max_position_embeddings=65536, rms_norm_eps=1e-05, pad_token_id=151329,
    eos_token_id=[151329, 151336, 151338],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [8, 12, 12]},
)
GLM45V_VISION = dict(depth=24, hidden_size=1536, num_heads=12, intermediate_size=10944, out_hidden_size=4096,
                     patch_size=14, image_size=336, spatial_merge_size=2, temporal_patch_size=2)

# name -> (who, batch: "1" or "ours", search, placement); the last one is not run unless asked
CONFIGS = {
    "default": ("llm-compressor oneshot", "1", "forward", "device"),
    "llmc-batch": ("llm-compressor oneshot", "ours", "forward", "device"),
    "ours": ("quantize awq (awq.run)", "ours", "gram", "auto"),
    "ours-before": ("quantize awq before issue 36", "ours", "gram-before", "auto"),
    "ours-ranked": ("quantize awq, attention ranked on 1/4 of the batches", "ours", "gram-ranked", "auto"),
    "ours-forward": ("quantize awq, llm-compressor's search", "ours", "forward", "auto"),
    "ours-offload": ("quantize awq, offloaded (a layer at a time)", "ours", "gram", "offload"),
}
DEFAULT_CONFIGS = "default,ours-before,ours,ours-ranked"  # llmc-batch, ours-forward, ours-offload on request


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def write_config_only(root: Path, layers: int, arch: str, tiny: bool) -> Path:
    """config.json and a tokenizer, no weights: all `--plan` reads (its probe builds its own layers)."""
    from transformers import Glm4vMoeConfig, GlmConfig

    from tiny import _GLM4V_ROPE, tiny_tokenizer

    out = root / f"{arch}-{layers}-config"
    tokenizer = tiny_tokenizer()
    if arch == "glm4v-moe":
        text = {**GLM45V_TEXT, "num_hidden_layers": layers}
        if tiny:
            text.update(hidden_size=64, intermediate_size=160, moe_intermediate_size=32, n_routed_experts=8,
                        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id, rope_parameters=_GLM4V_ROPE)
        vision = {**GLM45V_VISION, **({"hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "depth": 2,
                                       "out_hidden_size": 64} if tiny else {})}
        config = Glm4vMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
        config.architectures = ["Glm4vMoeForConditionalGeneration"]
    else:
        shapes = GLM4_9B if not tiny else {**TINY, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                                            "eos_token_id": tokenizer.eos_token_id}
        config = GlmConfig(num_hidden_layers=layers, dtype="float16" if tiny else "bfloat16", **shapes)
        config.architectures = ["GlmForCausalLM"]
    config.dtype = "float16" if tiny else "bfloat16"
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_model(root: Path, layers: int, tiny: bool) -> Path:
    import torch
    from transformers import GlmConfig, GlmForCausalLM

    from tiny import tiny_tokenizer

    out = root / f"glm-{layers}"
    if (out / "config.json").exists():
        return out
    tokenizer = tiny_tokenizer()
    shapes = GLM4_9B if not tiny else {**TINY, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                                        "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    dtype = torch.float16 if tiny else torch.bfloat16
    started = time.perf_counter()
    with torch.device(device()):
        model = GlmForCausalLM(GlmConfig(num_hidden_layers=layers, dtype=str(dtype).removeprefix("torch."),
                                         **shapes)).to(dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # verify's generate needs one; ids stay in the vocabulary
    del model
    _free()
    print(f"built {out} ({layers} layers) in {time.perf_counter() - started:.0f} s", flush=True)
    return out


def write_blocks(root: Path, blocks: int, seq_len: int, vocab: int) -> Path:
    import random

    rng = random.Random(0)
    path = root / "calib.jsonl"
    low = min(1000, vocab // 4)
    with open(path, "w") as handle:
        for i in range(blocks):
            handle.write(json.dumps({"block": i, "input_ids": [rng.randrange(low, vocab) for _ in range(seq_len)]}) + "\n")
    return path


def read_tensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def work_dtype():
    import torch

    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def llmc_direct(model_dir: Path, blocks: list[list[int]], batch: int, n_grid: int, group: int,
                save_to: Path | None = None) -> dict:
    """llm-compressor's oneshot called as its README shows, the model already on the device; timed
    around the call only. Optionally saved (compressed) for the quality check."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.core import active_session
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.methods import awq
    from pipeline.quantize.calibrate import calibration_dataset
    from pipeline.quantize.compat import patch_cpu_pin_memory
    from pipeline.stages.quantize import read_target

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=work_dtype()).to(device())
    settings = awq.Params(method="awq", group_size=group, n_grid=n_grid, search="forward")
    modifiers = awq.recipe(settings, read_target(model_dir)).modifiers
    patch_cpu_pin_memory()  # without an accelerator llm-compressor's pin_memory raises; a no-op there
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _sync()
    started = time.perf_counter()
    oneshot(model=model, processor=AutoTokenizer.from_pretrained(model_dir), dataset=calibration_dataset(blocks),
            recipe=modifiers,
            num_calibration_samples=len(blocks), max_seq_length=len(blocks[0]), batch_size=batch,
            shuffle_calibration_samples=False)
    _sync()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    if save_to is not None:
        from pipeline.stages.quantize import _copy_side_files

        model.save_pretrained(save_to, save_compressed=True)
        _copy_side_files(model_dir, save_to)  # the tokenizer, for verify's generate
    del model
    active_session().reset()
    _free()
    return {"calibrate_s": seconds, "peak_gpu_bytes": peak}


def ours(model_dir: Path, calib: Path, out: Path, batch: int, n_grid: int, group: int, search: str,
         placement: str = "auto") -> dict:
    """Our stage; search "gram-before": as it was before issue 36 (awq_phases.old_path); "gram-ranked": the attention's
    search ranked on a quarter of the batches (awq_phases.ranked_forward)."""
    import contextlib

    import awq_phases
    from pipeline.stages.quantize import run as quantize_run

    variant = {"gram-before": awq_phases.old_path, "gram-ranked": awq_phases.ranked_forward}.get(search,
                                                                                                 contextlib.nullcontext)
    with variant():
        info = quantize_run(model_dir, out, calib, "awq", group_size=group, batch_size=batch, n_grid=n_grid,
                            search=search.removesuffix("-before").removesuffix("-ranked"), placement=placement).info
    errors = info["verify"]["layer_error"]["relative"]
    return {"calibrate_s": info["seconds"]["calibrate"], "peak_gpu_bytes": info.get("peak_gpu_bytes_calibrate"),
            "layer_error_mean": sum(errors) / len(errors), "layer_error_max": max(errors),
            "layer_s": info["layers"]["mean_s"]}


def layer_error(variant: Path, reference, dtype) -> tuple[float, float]:
    from pipeline.quantize import verify

    errors = verify.reload_and_check(variant, reference, dtype)["layer_error"]["relative"]
    _free()
    return sum(errors) / len(errors), max(errors)


def kl_from_base(model_dir: Path, variant: Path, probe_blocks: list[list[int]]) -> dict:
    """Per-token KL(base || variant) and top-1 agreement over the probe blocks, both models resident."""
    from pipeline.checkpoints.loading import load_for_inference
    from pipeline.stages.kl import compare

    where = device() if device() == "cuda" else None
    base = load_for_inference(model_dir, work_dtype(), where).eval()
    other = load_for_inference(variant, work_dtype(), where).eval()
    kl, agree = compare(base, other, probe_blocks)
    del base, other
    _free()
    return {"kl_mean": kl.float().mean().item(), "top1_agreement": agree.float().mean().item()}


def reference_io(model_dir: Path, probe_blocks: list[list[int]]):
    """The base model's per-layer inputs and outputs on the probe blocks (our verify's reference)."""
    from pipeline.quantize import verify
    from pipeline.checkpoints.loading import load_model

    model = load_model(model_dir, work_dtype()).to(device())
    reference = verify.capture_layer_io(model, probe_blocks)
    del model
    _free()
    return reference


def plan_only(args, root: Path) -> None:
    from pipeline.stages.quantize import run as quantize_run

    model_dir = write_config_only(root, args.layers, args.arch, args.tiny)
    calib = write_blocks(root, args.blocks, args.seq_len, _vocab(model_dir))
    started = time.perf_counter()
    layout = quantize_run(model_dir, root / "plan-out", calib, "awq", group_size=args.group, batch_size=args.batch,
                     n_grid=args.n_grid, plan_only=True)
    print(layout.summary())
    print(f"(plan and probe took {time.perf_counter() - started:.0f} s)")


def _vocab(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return (config.get("text_config") or config)["vocab_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="4,8")
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16, help="our batch size (and llm-compressor's in llmc-batch)")
    parser.add_argument("--n-grid", type=int, default=20)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"any of {', '.join(CONFIGS)}")
    parser.add_argument("--tiny", action="store_true", help="tiny GLM shapes, 16 x 64 tokens, batch 4: a CPU check")
    parser.add_argument("--layers", type=int, default=40, help="with --plan-only: depth of the model planned")
    parser.add_argument("--plan-only", action="store_true", help="print our stage's --plan (one-layer probe) and stop")
    parser.add_argument("--arch", choices=["glm", "glm4v-moe"], default="glm",
                        help="with --plan-only: GLM-4-9B shapes, or GLM-4.5V/4.6V (106B MoE) widths")
    parser.add_argument("--root", type=Path, default=Path("/tmp/awq-speed"))
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the per-mapping phase profile of ours-before, ours and ours-ranked at the shallow depth")
    args = parser.parse_args()
    if args.tiny:
        args.blocks, args.seq_len, args.group = min(args.blocks, 16), min(args.seq_len, 64), 32
        args.depths = "1,2" if args.depths == "4,8" else args.depths
        args.batch = min(args.batch, 4)  # several batches, so ours-ranked's ranking pass runs
    args.root.mkdir(parents=True, exist_ok=True)
    if args.plan_only:
        return plan_only(args, args.root)
    import torch

    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; use {', '.join(CONFIGS)}")
    depths = sorted(int(d) for d in args.depths.split(","))
    started_all = time.perf_counter()
    times, profile = run_depths(args, configs, depths)
    shallow, deep = depths[0], depths[-1]
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\nAWQ W4A16 g{args.group} asym, n_grid {args.n_grid}, {args.blocks} x {args.seq_len} calibration tokens, "
          f"{'tiny GLM' if args.tiny else 'GLM-4-9B'}-shaped random layers, {where}, "
          f"{time.perf_counter() - started_all:.0f} s in all")
    slopes = {name: (t[deep]["calibrate_s"] - t[shallow]["calibrate_s"]) / max(deep - shallow, 1)
              for name, t in times.items() if shallow in t and deep in t}
    print_table(args, times, slopes, shallow, deep)
    if "ours-forward" in slopes and "llmc-batch" in slopes:
        print(f"\nour stage vs llm-compressor at batch {args.batch}, same search: "
              f"{slopes['ours-forward'] / slopes['llmc-batch'] - 1:+.1%} per layer")
    if "ours" in slopes and "llmc-batch" in slopes:
        print(f"our stage (X^T X search) vs llm-compressor at batch {args.batch}: "
              f"{slopes['ours'] / slopes['llmc-batch'] - 1:+.1%} per layer")
    identical = {f"{other} vs ours": compare_checkpoints(args.root, deep, other, times)
                 for other in ("ours-before", "ours-ranked", "ours-offload") if other in configs and "ours" in configs}
    for leftover in args.root.glob(f"out-*-{deep}"):
        shutil.rmtree(leftover, ignore_errors=True)
    if profile:
        from awq_phases import table

        print(f"\nwhere the time goes, {shallow} layers, seconds per layer (synchronised; calls per layer):")
        print(table(profile, "GPU s" if torch.cuda.is_available() else "CPU s"))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_awq_speed.json").write_text(json.dumps(
            {"args": vars(args) | {"root": str(args.root)}, "device": where, "times": times, "slopes": slopes,
             "speedup_vs_default": {n: slopes["default"] / v for n, v in slopes.items() if "default" in slopes and v},
             "identical_checkpoints": identical, "profile": profile}, indent=1))


def run_config(args, name: str, model_dir: Path, calib: Path, blocks, depth: int, deepest: bool, reference) -> dict:
    who, batch, search, placement = CONFIGS[name]
    batch = 1 if batch == "1" else args.batch
    out = args.root / f"out-{name}-{depth}"
    if who.startswith("llm-compressor"):
        row = llmc_direct(model_dir, blocks, batch, args.n_grid, args.group, save_to=out if deepest else None)
        if deepest:
            row["layer_error_mean"], row["layer_error_max"] = layer_error(out, reference, work_dtype())
    else:
        row = ours(model_dir, calib, out, batch, args.n_grid, args.group, search, placement)
    if deepest:
        row.update(kl_from_base(model_dir, out, blocks[-2:]))
    if not (deepest and name.startswith("ours")):
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"config": name, "depth": depth, "batch": batch, **row}), flush=True)
    return row


def run_depths(args, configs: list[str], depths: list[int]) -> tuple[dict, dict]:
    """Every configuration at every depth (order alternating), and at the shallow depth the phase profile of
    ours-before, ours and ours-ranked (unless --no-profile)."""
    times: dict[str, dict[int, dict]] = {c: {} for c in configs}
    profile = {}
    for number, depth in enumerate(depths):
        model_dir = build_model(args.root, depth, args.tiny)
        calib = write_blocks(args.root, args.blocks, args.seq_len, _vocab(model_dir))
        blocks = [json.loads(line)["input_ids"] for line in calib.read_text().splitlines()]
        deepest = depth == depths[-1]
        reference = reference_io(model_dir, blocks[-2:]) if deepest else None
        if number == 0:  # warm-up on 4 blocks: CUDA context, kernels, llm-compressor's imports
            warm = args.root / "warm"
            warm.mkdir(exist_ok=True)
            ours(model_dir, write_blocks(warm, 4, args.seq_len, _vocab(model_dir)), warm / "out", 4, 4, args.group, "gram")
            shutil.rmtree(warm, ignore_errors=True)
        order = configs if number % 2 == 0 else configs[::-1]  # alternate, so drift does not favour one
        for name in order:
            times[name][depth] = run_config(args, name, model_dir, calib, blocks, depth, deepest, reference)
        if number == 0 and args.profile:
            profile = profile_phases(args, model_dir, calib, depth)
        shutil.rmtree(model_dir, ignore_errors=True)
    return times, profile


def profile_phases(args, model_dir: Path, calib: Path, depth: int) -> dict:
    """ours-before, ours and ours-ranked with every phase timed per mapping (benchmarks/awq_phases.py)."""
    import awq_phases

    profile = {}
    for name in ("ours-before", "ours", "ours-ranked"):
        with awq_phases.profiled() as clock:
            ours(model_dir, calib, args.root / "out-profile", args.batch, args.n_grid, args.group, CONFIGS[name][2])
        profile[name] = awq_phases.rows(clock, depth)
        shutil.rmtree(args.root / "out-profile", ignore_errors=True)
        print(json.dumps({"profiled": name, "calibrate_s": clock.total}), flush=True)
    return profile


def print_table(args, times: dict, slopes: dict, shallow: int, deep: int) -> None:
    print(f"| run | batch | search | calibrate {shallow} layers s | calibrate {deep} layers s | s / layer (slope) "
          "| speed-up vs default | layer error mean / max | KL mean (top-1 agreement) | peak GPU GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, t in times.items():
        who, batch, search, _ = CONFIGS[name]
        batch = 1 if batch == "1" else args.batch
        slope = slopes.get(name)
        speedup = f"{slopes['default'] / slope:.2f}x" if "default" in slopes and slope else "–"
        row = t.get(deep, {})
        error = f"{row['layer_error_mean']:.4f} / {row['layer_error_max']:.4f}" if "layer_error_mean" in row else "–"
        kl = f"{row['kl_mean']:.5f} ({row['top1_agreement']:.3f})" if "kl_mean" in row else "–"
        peak = f"{row['peak_gpu_bytes'] / 2**30:.1f}" if row.get("peak_gpu_bytes") else "–"
        print(f"| {who} | {batch} | {search} | {t[shallow]['calibrate_s']:.1f} | {row['calibrate_s']:.1f} | "
              f"{slope:.3f} | {speedup} | {error} | {kl} | {peak} |")


def compare_checkpoints(root: Path, deep: int, other: str, times: dict) -> bool:
    """Whether `other`'s checkpoint at the deep depth is bit-identical to ours' (printed); both removed after."""
    import torch

    mine, theirs = root / f"out-ours-{deep}", root / f"out-{other}-{deep}"
    if not (mine.exists() and theirs.exists()):
        return False
    a, b = read_tensors(mine), read_tensors(theirs)
    differ = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    line = f"{other} vs ours, checkpoint at {deep} layers: " + (
        "bit-identical" if not differ and len(a) == len(b) else f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}")
    if torch.cuda.is_available() and times[other][deep].get("peak_gpu_bytes"):
        line += (f"; peak GPU in calibration {times[other][deep]['peak_gpu_bytes'] / 2**30:.1f} GiB vs "
                 f"{times['ours'][deep]['peak_gpu_bytes'] / 2**30:.1f} GiB")
    print(line)
    shutil.rmtree(theirs, ignore_errors=True)
    return not differ and len(a) == len(b)


if __name__ == "__main__":
    main()
