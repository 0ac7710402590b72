"""Peak memory of the streaming ChatGLM -> Glm conversion (and the export back) on a synthetic
GLM-4-9B-shaped checkpoint of about 4 GB (bf16, 4 layers, the real 151552 x 4096 embedding).

    python benchmarks/resave_memory.py [--layers 4] [--shard-gb 2] [--dir /tmp]

The source is written shard by shard with safetensors.save_file (the builder holds one shard).
The builder and each conversion run in their own child process, and each child's peak RSS
(its rusage, from os.wait4) is printed against the goal: largest source shard + 1 GB. The parent
stays small because Linux carries a forked child's pre-exec RSS into its ru_maxrss. Nothing is
asserted; the temp dir is deleted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GB = 1024**3
GLM4_9B = {
    "model_type": "chatglm", "architectures": ["ChatGLMModel"], "add_bias_linear": False, "add_qkv_bias": True,
    "apply_residual_connection_post_layernorm": False, "ffn_hidden_size": 13696, "hidden_size": 4096,
    "kv_channels": 128, "layernorm_epsilon": 1.5625e-07, "multi_query_attention": True, "multi_query_group_num": 2,
    "num_attention_heads": 32, "original_rope": True, "padded_vocab_size": 151552, "post_layer_norm": True,
    "rmsnorm": True, "rope_ratio": 500, "seq_length": 131072, "tie_word_embeddings": False,
    "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329, "torch_dtype": "bfloat16",
}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h, ffn, vocab = config["hidden_size"], config["ffn_hidden_size"], config["padded_vocab_size"]
    qkv = (config["num_attention_heads"] + 2 * config["multi_query_group_num"]) * config["kv_channels"]
    shapes = {"transformer.embedding.word_embeddings.weight": (vocab, h)}
    for i in range(config["num_layers"]):
        p = f"transformer.encoder.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attention.query_key_value.weight": (qkv, h),
                       p + "self_attention.query_key_value.bias": (qkv,), p + "self_attention.dense.weight": (h, h),
                       p + "post_attention_layernorm.weight": (h,), p + "mlp.dense_h_to_4h.weight": (2 * ffn, h),
                       p + "mlp.dense_4h_to_h.weight": (h, ffn)})
    shapes["transformer.encoder.final_layernorm.weight"] = (h,)
    shapes["transformer.output_layer.weight"] = (vocab, h)
    return shapes


def build(directory: Path, layers: int, shard_bytes: int) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    config = {**GLM4_9B, "num_layers": layers, "num_hidden_layers": layers}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    shards, current, size = [], {}, 0
    for name, shape in tensor_shapes(config).items():
        nbytes = math.prod(shape) * 2
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = shape
        size += nbytes
    shards.append(current)
    weight_map, files = {}, []
    for i, names in enumerate(shards, 1):
        file = directory / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: torch.empty(s, dtype=torch.bfloat16).uniform_(-0.05, 0.05) for n, s in names.items()}
        save_file(tensors, file)
        del tensors
        weight_map.update({n: file.name for n in names})
        files.append(file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def measure(code: str) -> tuple[float, int]:
    """Runs code in a child python; returns (seconds, that child's peak RSS in bytes)."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    _, status, usage = os.wait4(child.pid, 0)  # the rusage of this child alone
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"the child failed with exit code {child.returncode}")
    return time.perf_counter() - started, usage.ru_maxrss * 1024


def largest(paths) -> int:
    return max(p.stat().st_size for p in paths)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shard-gb", type=float, default=2.0)
    parser.add_argument("--dir", default="/tmp")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="resave-memory-", dir=args.dir))
    try:
        seconds, peak = measure(f"import sys; sys.path.insert(0, 'benchmarks'); import resave_memory as m; "
                                f"m.build(m.Path({str(root / 'chatglm')!r}), {args.layers}, {int(args.shard_gb * GB)})")
        files = sorted((root / "chatglm").glob("*.safetensors"))
        total = sum(f.stat().st_size for f in files)
        print(f"machine: {os.cpu_count()} cores, "
              f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GB:.0f} GB RAM")
        print(f"source: {total / GB:.2f} GB in {len(files)} shards, largest {largest(files) / GB:.2f} GB "
              f"(built in {seconds:.0f} s, builder peak RSS {peak / GB:.2f} GB)")
        budget = largest(files) + GB
        steps = [
            ("resave ChatGLM -> Glm (bf16 -> fp16)",
             f"from pipeline.stages import resave; print(resave.run({str(root / 'chatglm')!r}, "
             f"{str(root / 'glm')!r}, 'float16').summary())", root / "glm"),
            ("export Glm -> ChatGLM (lmdeploy)",
             f"from pipeline.checkpoints import export; print(export.run({str(root / 'glm')!r}, "
             f"{str(root / 'lmdeploy')!r}).summary())", root / "lmdeploy"),
        ]
        for label, code, out in steps:
            seconds, peak = measure(code)
            shards = list(out.glob("*.safetensors"))
            verdict = "OK" if peak <= budget else "OVER"
            print(f"{label}: {seconds:.1f} s, peak RSS {peak / GB:.2f} GB vs budget {budget / GB:.2f} GB "
                  f"(largest source shard + 1 GB): {verdict}; largest output shard {largest(shards) / GB:.2f} GB")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
