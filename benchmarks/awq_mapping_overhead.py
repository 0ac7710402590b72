"""The fixed cost of each X^T X mapping in an MoE model, and how it grows with depth (issue 36).

GLM-4.6V has 129 up_proj -> down_proj mappings per MoE layer (128 routed experts and the shared one), each searched
from X^T X. Until 2026-12-02 each of them entered llm-compressor's calibration_forward_context(model), which walks
every module of the model: a cost per mapping that grows with the model's depth, so the whole grows with its square.
This script measures it where it is pure overhead: a Glm4vMoe with 128 experts at tiny widths (hidden 64, experts of
32) on the CPU, at two depths, with our stage as it is (`now`) and with that context entered again around each
mapping (`before`): the seconds of the X^T X search per mapping, and whether the checkpoints are the same.

    python benchmarks/awq_mapping_overhead.py [--depths 4,8]

Prints a table; writes awq_mapping_overhead.json into $OUT if set.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))


@contextlib.contextmanager
def context_per_mapping():
    """The code before: llm-compressor's calibration_forward_context(model) entered around every X^T X mapping."""
    from llmcompressor.utils.helpers import calibration_forward_context

    from pipeline.methods.awq_gram import GramAWQModifier

    original = GramAWQModifier._smooth_from_gram

    def entered(self, model, mapping):
        with calibration_forward_context(model):
            return original(self, model, mapping)
    GramAWQModifier._smooth_from_gram = entered
    try:
        yield
    finally:
        GramAWQModifier._smooth_from_gram = original


def run(root: Path, depth: int, name: str) -> dict:
    from gpu_awq_speed import write_blocks
    from pipeline.stages.quantize import run as quantize_run
    from tiny import save_tiny_glm4v_moe

    model = root / f"moe-{depth}"
    if not (model / "config.json").exists():
        save_tiny_glm4v_moe(model, text={"n_routed_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": depth})
    calib = write_blocks(root, 8, 32, 380)
    with context_per_mapping() if name == "before" else contextlib.nullcontext():
        info = quantize_run(model, root / f"out-{name}-{depth}", calib, "awq", batch_size=8, n_grid=4).info
    gram = info["search_report"]["gram"]
    row = {"config": name, "depth": depth, "mappings": gram["mappings"], "gram_s": gram["seconds"],
           "ms_per_mapping": 1000 * gram["seconds"] / gram["mappings"], "calibrate_s": info["seconds"]["calibrate"]}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="4,8")
    parser.add_argument("--root", type=Path, default=Path("/tmp/awq-mapping-overhead"))
    args = parser.parse_args()
    from awq_profile import same_checkpoint

    rows = [run(args.root, int(depth), name) for depth in args.depths.split(",") for name in ("before", "now")]
    print("\n| depth (text layers) | X^T X mappings | before: s (ms per mapping) | now: s (ms per mapping) | "
          "calibration before / now s | checkpoints |\n|---|---|---|---|---|---|")
    for before, now in zip(rows[::2], rows[1::2]):
        differ = same_checkpoint(args.root / f"out-before-{now['depth']}", args.root / f"out-now-{now['depth']}")
        now["identical_to_before"] = not differ
        print(f"| {now['depth']} | {now['mappings']} | {before['gram_s']:.2f} ({before['ms_per_mapping']:.1f}) | "
              f"{now['gram_s']:.2f} ({now['ms_per_mapping']:.1f}) | {before['calibrate_s']:.1f} / "
              f"{now['calibrate_s']:.1f} | {'bit-identical' if not differ else f'{len(differ)} tensors differ'} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "awq_mapping_overhead.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
