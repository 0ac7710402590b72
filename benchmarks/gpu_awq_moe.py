"""AWQ calibration of a GLM-4.6V-layout MoE at real widths on the H200: where the time goes per MoE layer, and what
keeping AWQ's cached attention inputs on the device saves (issue 36).

llm-compressor's AWQModifier keeps the inputs of each module it searches by forward passes (the attention: replayed
once per scale candidate, 21 times per layer at n_grid 20) on the host when the model is an MoE (its
`offload_device` default). Our stage keeps them on the device with the activations between layers whenever the
whole model is there (pipeline/quantize/calibrate.py, keep_cached_inputs_with_activations). Configurations, side
by side in one process:

- `ours`: `quantize awq` as it is;
- `host-cache`: the same with llm-compressor's MoE default (the cached inputs on the host).

Glm4vMoeForConditionalGeneration with GLM-4.5V / 4.6V widths (hidden 4096, 96 heads / 8 KV, 128 routed experts of
1408 + 1 shared, top 8; layer 0 dense, the rest MoE), a 2-block vision tower (not quantized, not run on text),
random bf16 weights; 128 x 512 calibration tokens, batch 16, W4A16 (group size auto: 64), n_grid 20, every expert
calibrated on every token (our default). Each configuration at two depths; the per-MoE-layer cost is the slope.
Then both once more at the shallow depth with every phase timed per mapping (benchmarks/awq_phases.py).

    python benchmarks/gpu_awq_moe.py               # ~3.5 min on one H200
    python benchmarks/gpu_awq_moe.py --tiny        # tiny MoE on the CPU (activations "kept" on the CPU): checks the script

Prints a table; writes gpu_awq_moe.json into $OUT if set.
"""

from __future__ import annotations

import argparse
import contextlib
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

CONFIGS = ("ours", "host-cache")


@contextlib.contextmanager
def configured(name: str, tiny: bool):
    """`host-cache`: llm-compressor's MoE default for the cached inputs. --tiny: the activations asked to wait on
    the CPU (as they wait on the GPU there), so that both paths run."""
    import pipeline.quantize.calibrate as calibrate_module

    keep, calibrate = calibrate_module.keep_cached_inputs_with_activations, calibrate_module.calibrate
    if name == "host-cache":
        calibrate_module.keep_cached_inputs_with_activations = lambda recipe: None
    if tiny:
        calibrate_module.calibrate = lambda *a, **k: calibrate(*a, **{**k, "activations_device": "cpu"})
    try:
        yield
    finally:
        calibrate_module.keep_cached_inputs_with_activations, calibrate_module.calibrate = keep, calibrate


def build(root: Path, layers: int, tiny: bool) -> Path:
    import torch

    from gpu_glm46v_vllm import TEXT, VISION
    from tiny import save_tiny_glm4v_moe

    out = root / f"moe-{layers}"
    if not (out / "config.json").exists():
        started = time.perf_counter()
        if tiny:
            save_tiny_glm4v_moe(out, text={"num_hidden_layers": layers})
        else:
            save_tiny_glm4v_moe(out, dtype=torch.bfloat16, text={**TEXT, "num_hidden_layers": layers},
                                vision={**VISION, "depth": 2}, device="cuda")
        print(f"built {out} in {time.perf_counter() - started:.0f} s", flush=True)
    return out


def run(name: str, model: Path, depth: int, calib: Path, out: Path, args, profiled: bool = False) -> dict:
    import awq_phases
    from pipeline.stages.quantize import run as quantize_run

    shutil.rmtree(out, ignore_errors=True)
    with configured(name, args.tiny), (awq_phases.profiled() if profiled else contextlib.nullcontext()) as clock:
        info = quantize_run(model, out, calib, "awq", batch_size=args.batch, n_grid=args.n_grid).info
    errors = info["verify"]["layer_error"]["relative"]
    row = {"config": name, "calibrate_s": info["seconds"]["calibrate"], "layer_s": info["layers"]["seconds"],
           "search": info.get("search_report"), "peak_gpu_bytes": info.get("peak_gpu_bytes_calibrate"),
           "layer_error_mean": sum(errors) / len(errors), "layer_error_max": max(errors)}
    if profiled:
        row["profile"] = experts_together(awq_phases.rows(clock, depth))
    print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
    return row


def experts_together(rows: list[dict]) -> list[dict]:
    """The routed experts' rows summed into one per phase ("mlp.experts.* ..."): 128 of them otherwise."""
    import re

    together: dict[tuple, dict] = {}
    for row in rows:
        mapping = re.sub(r"experts\.\d+\.", "experts.*.", row["mapping"])
        entry = together.setdefault((mapping, row["phase"]), {"mapping": mapping, "phase": row["phase"],
                                                               "s_per_layer": 0.0, "calls_per_layer": 0.0})
        entry["s_per_layer"] += row["s_per_layer"]
        entry["calls_per_layer"] += row["calls_per_layer"]
    return list(together.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="2,4", help="text layers (layer 0 dense, the rest MoE)")
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--n-grid", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--root", type=Path, default=Path("/tmp/awq-moe"))
    args = parser.parse_args()
    if args.tiny:
        args.blocks, args.seq_len, args.batch, args.n_grid = 8, 32, 4, 4
    from awq_phases import table
    from awq_profile import same_checkpoint
    from gpu_awq_speed import write_blocks

    depths = sorted(int(d) for d in args.depths.split(","))
    times: dict[str, dict[int, dict]] = {name: {} for name in CONFIGS}
    started = time.perf_counter()
    for number, depth in enumerate(depths):
        model = build(args.root, depth, args.tiny)
        calib = write_blocks(args.root, args.blocks, args.seq_len, 380)  # ids inside the test tokenizer's vocabulary
        for name in (CONFIGS if number % 2 == 0 else CONFIGS[::-1]):
            times[name][depth] = run(name, model, depth, calib, args.root / f"out-{name}-{depth}", args)
    shallow, deep = depths[0], depths[-1]
    identical = not same_checkpoint(args.root / f"out-ours-{deep}", args.root / f"out-host-cache-{deep}")
    profile = {name: run(name, build(args.root, shallow, args.tiny), shallow, args.root / "calib.jsonl",
                         args.root / "out-profile", args, profiled=True)["profile"] for name in CONFIGS}
    slopes = {name: (t[deep]["calibrate_s"] - t[shallow]["calibrate_s"]) / (deep - shallow) for name, t in times.items()}
    print(f"\nAWQ W4A16 (group auto), n_grid {args.n_grid}, {args.blocks} x {args.seq_len} tokens, batch {args.batch}, "
          f"{'tiny' if args.tiny else 'GLM-4.6V-width'} Glm4vMoe, {time.perf_counter() - started:.0f} s in all")
    print(f"| config | calibrate {shallow} layers s | calibrate {deep} layers s | s / MoE layer (slope) | layer error "
          "mean / max |\n|---|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t[shallow]['calibrate_s']:.1f} | {t[deep]['calibrate_s']:.1f} | {slopes[name]:.2f} | "
              f"{t[deep]['layer_error_mean']:.4f} / {t[deep]['layer_error_max']:.4f} |")
    print(f"checkpoints at {deep} layers: {'bit-identical' if identical else 'DIFFERENT'}")
    print(f"\nwhere the time goes, {shallow} layers (layer 0 dense), seconds per layer:")
    print(table(profile, "s"))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_awq_moe.json").write_text(json.dumps(
            {"args": {**vars(args), "root": str(args.root)}, "times": times, "slopes": slopes,
             "identical_checkpoints": identical, "profile": profile}, indent=1))


if __name__ == "__main__":
    main()
