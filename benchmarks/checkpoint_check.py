"""Time of the checkpoint check every stage runs first (pipeline/checkpoints/headers.py) on GLM-4-9B-
shaped checkpoints: the Glm base (bf16) and its AWQ W4A16 variant (compressed-tensors pack-quantized,
group 128), each in 4 shards with an index.

    python benchmarks/checkpoint_check.py [--layers 40] [--dir /tmp]

The weight files are sparse: a real safetensors header, then a hole as long as the data (no disk
space used), which is all the check may read. Each check runs in a fresh process, so the first
column includes importing transformers; the second is a second check in the same process. Nothing
is asserted; the temp dir is deleted.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, GROUP = 4096, 13696, 32, 2, 128, 151552, 128
ITEMSIZE = {"BF16": 2, "I32": 4, "I64": 8}
AWQ = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
    "config_groups": {"group_0": {"format": "pack-quantized", "targets": ["Linear"], "input_activations": None,
                                  "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP,
                                              "symmetric": False, "dynamic": False, "observer": "memoryless_minmax"}}},
}


def config(layers: int, quantized: bool) -> dict:
    out = {"architectures": ["GlmForCausalLM"], "model_type": "glm", "vocab_size": VOCAB, "hidden_size": HIDDEN,
           "intermediate_size": FFN, "num_hidden_layers": layers, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "attention_bias": True, "rms_norm_eps": 1.5625e-07,
           "max_position_embeddings": 131072, "tie_word_embeddings": False, "dtype": "bfloat16",
           "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}}
    return {**out, "quantization_config": AWQ} if quantized else out


def tensors(layers: int, quantized: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    def linear(name, rows, cols, bias=False):
        if not quantized:
            found = {f"{name}.weight": ("BF16", (rows, cols))}
        else:
            found = {f"{name}.weight_packed": ("I32", (rows, cols // 8)), f"{name}.weight_scale": ("BF16", (rows, cols // GROUP)),
                     f"{name}.weight_zero_point": ("I32", (rows // 8, cols // GROUP)), f"{name}.weight_shape": ("I64", (2,))}
        return found | ({f"{name}.bias": ("BF16", (rows,))} if bias else {})

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    found = {"model.embed_tokens.weight": ("BF16", (VOCAB, HIDDEN)), "model.norm.weight": ("BF16", (HIDDEN,)),
             "lm_head.weight": ("BF16", (VOCAB, HIDDEN))}
    for i in range(layers):
        p = f"model.layers.{i}."
        found |= {p + "input_layernorm.weight": ("BF16", (HIDDEN,)), p + "post_attention_layernorm.weight": ("BF16", (HIDDEN,))}
        found |= linear(p + "self_attn.q_proj", q, HIDDEN, True) | linear(p + "self_attn.k_proj", kv, HIDDEN, True)
        found |= linear(p + "self_attn.v_proj", kv, HIDDEN, True) | linear(p + "self_attn.o_proj", HIDDEN, q)
        found |= linear(p + "mlp.gate_up_proj", 2 * FFN, HIDDEN) | linear(p + "mlp.down_proj", HIDDEN, FFN)
    return found


def write_sparse(path: Path, entries: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in entries.items():
        size = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)  # the data: a hole
    return offset


def build(directory: Path, layers: int, quantized: bool, shards: int = 4) -> int:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config(layers, quantized)))
    names = list(tensors(layers, quantized).items())
    weight_map, total = {}, 0
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = dict(names[i::shards])
        total += write_sparse(directory / file, part)
        weight_map |= {name: file for name in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                         "weight_map": weight_map}))
    return total


CHILD = """
import sys, time
start = time.perf_counter()
from pipeline.checkpoints import headers
found = headers.check(sys.argv[1])
first = time.perf_counter() - start
start = time.perf_counter()
headers.check(sys.argv[1])
print(found.tensors, round(first, 2), round(time.perf_counter() - start, 2))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="check-", dir=args.dir))
    try:
        print(f"| checkpoint ({args.layers} layers) | weights | tensors | check, fresh process (s) | check again (s) |")
        print("|---|---|---|---|---|")
        for label, quantized in (("Glm bf16", False), ("AWQ W4A16 g128", True)):
            size = build(root / label.replace(" ", "-"), args.layers, quantized)
            done = subprocess.run([sys.executable, "-c", CHILD, str(root / label.replace(" ", "-"))], cwd=REPO,
                                  capture_output=True, text=True, check=True)
            count, first, again = done.stdout.split()[-3:]
            print(f"| {label} | {size / 1e9:.1f} GB | {count} | {first} | {again} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
