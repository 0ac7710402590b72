"""Seconds `quantize calib` takes per phase on a conversation file (goal: 6,000 conversations in <= 20 s on 2 cores).

    python benchmarks/calib_prepare.py [FILE] [--model models/base] [--seq-len 256] [--num-blocks 16] [--holdout 32]

FILE defaults to calib_data/support_logs.jsonl (500 conversations); pass the full 6,000-conversation
CuCom file for the goal. Without a model dir the tiny tokenizer of tests/tiny.py is used.
Prints a table; nothing is asserted (performance goals live here, not in tests).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def model_dir(requested: str, scratch: Path) -> tuple[Path, str]:
    if Path(requested).is_dir():
        return Path(requested), requested
    sys.path.insert(0, str(REPO / "tests"))
    from tiny import tiny_tokenizer

    tiny_tokenizer().save_pretrained(scratch / "tiny")
    return scratch / "tiny", f"tests/tiny.py tokenizer ({requested} not found)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", default=str(REPO / "calib_data" / "support_logs.jsonl"))
    parser.add_argument("--model", default=str(REPO / "models" / "base"))
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=16)
    parser.add_argument("--holdout", type=int, default=32)
    args = parser.parse_args()

    from pipeline.stages import calib

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir, tokenizer_name = model_dir(args.model, Path(scratch))
        cpu = time.process_time()
        result = calib.run(args.source, Path(scratch) / "build", tokenizer_dir, seq_len=args.seq_len,
                           num_blocks=args.num_blocks, holdout=args.holdout)
        cpu = time.process_time() - cpu
    process = time.perf_counter() - STARTED
    s, p = result.stats, result.phases
    print("\n| records | kept | read+redact+dedup s | split s | load tokenizer s | render+pack s | write s "
          "| total s (calib.run) | process s |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {s['records_in']} | {s['records_kept']} | {p['read+redact+dedup']:.2f} | {p['split']:.2f} "
          f"| {p['load tokenizer']:.2f} | {p['render+pack']:.2f} | {p['write']:.2f} | {result.seconds:.2f} | {process:.2f} |")
    print(f"\n{args.source}: {s['calib_conversation_tokens']} tokens in {s['calib_conversations']} calibration "
          f"conversations, {s['blocks']} x {s['seq_len']} blocks, dropped {s['dropped']}, redactions {s['redactions']}")
    print(f"tokenizer {tokenizer_name} (its load includes importing transformers); {os.cpu_count()} cores; "
          f"calib.run used {cpu:.1f} s of CPU ({cpu / max(result.seconds, 1e-9):.1f} cores busy on average)")


if __name__ == "__main__":
    main()
