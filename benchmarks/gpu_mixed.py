"""GPU benchmark (issue 45): the fix for a NO-GO W4A16 variant at GLM-4-9B shapes on the H200.

    python benchmarks/gpu_mixed.py build     # base (random bf16, 40 layers), RTN W4A16 / W8A16, AWQ W4A16 as the
                                             # gpu profile builds it, `quantize sensitivity` of both (its cost
                                             # beside each variant's quantization time), the mixed checkpoint
    python benchmarks/gpu_mixed.py compare   # benchmarks/mixed_choice.py's comparison at these shapes (RTN)
    python benchmarks/gpu_mixed.py serve     # vLLM serves W4A16, W8A16 and the mixed checkpoint: tok/s at 1/16/64
    python benchmarks/gpu_mixed.py cost      # AWQ W4A16 and its sensitivity twice, and the two loads alone
    python benchmarks/gpu_mixed.py rankcost  # AWQ W4A16, then side by side twice: `quantize kl`, `quantize kl
                                             # --rank` (the fix stage's pass) and `quantize sensitivity` alone
    python benchmarks/gpu_mixed.py fixstage  # `quantize fix awq-w4a16` as dvc.yaml's fix stage runs it, in a project
                                             # with the gpu profile's params.yaml; then vLLM serves AWQ W4A16
                                             # and its fix: tok/s at 1/16/64 (--build-only: no vLLM)
    python benchmarks/gpu_mixed.py table     # the short table of what the parts measured

Parts keep what they built under /tmp/gpu-mixed and skip what exists, so a call cut short is resumed by the next;
each writes $OUT/<part>.json as it goes (benchmarks/gpu_steps.py). The quantization stack runs in this process
(PYTHONPATH=/tmp/site); vLLM runs as its own server process with VLLM_SITE (/tmp/vsite) as its PYTHONPATH, as in
benchmarks/gpu_vllm.py. `--tiny` runs every part on the CPU (a tiny GLM, tests/openai_server.py for vLLM) to check
this script before it travels. The weights are random: time and memory are what these figures are; the KL figures
only show that the comparison runs at these shapes (the accuracy comparison is benchmarks/mixed_choice.py's, on
the demo model's real weights).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_steps import step as record_step  # noqa: E402
from gpu_vllm import SERVER, SERVING, free_gpu  # noqa: E402  (vLLM as its own server, VLLM_SITE its PYTHONPATH)

OUT = Path(os.environ.get("OUT", "/tmp/gpu-mixed-out"))
TINY = "--tiny" in sys.argv
ROOT = Path("/tmp/gpu-mixed-tiny" if TINY else "/tmp/gpu-mixed")
LAYERS = 40  # GLM-4-9B's depth
GROUP = 32 if TINY else 128  # the gpu profile's group size
SEQUENCES, MAX_TOKENS = (4, 64) if TINY else (32, 512)  # the gpu profile's `kl` (what `quantize fix` ranks on)
CALIB = (8, 64) if TINY else (128, 512)  # the gpu profile's calibration blocks x tokens
SERVED = {"rtn-w4a16": "w4", "rtn-w8a16": "w8", "rtn-mixed-4.5": "mixed-4.5"}  # name -> folder under ROOT


def step(results: dict, part: str, name: str, fn):
    record_step(results, OUT / f"{part}.json", name, fn)


def build_base(path: Path) -> Path:
    if TINY:
        from tiny import save_tiny_glm

        return save_tiny_glm(path)
    from benchmarks.gpu_quantize import build_model

    built = build_model(path.parent / "build", LAYERS)
    built.rename(path)
    return path


def paths(variants: bool = True) -> dict:
    from mixed_choice import prepare

    return prepare(ROOT, SEQUENCES, build_base, group_size=GROUP, seq_len=CALIB[1], num_blocks=CALIB[0],
                   variants=variants)


def build_awq(p: dict, results: dict, part: str) -> Path:
    from pipeline.stages.quantize import run as quantize_run

    awq = ROOT / "awq"
    if not (awq / "quant.json").exists():
        step(results, part, "AWQ W4A16 (the gpu profile's settings)", lambda: quantize_run(
            p["base"], awq, p["calib"] / "calib.jsonl", "awq", group_size=GROUP, batch_size=16,
            n_grid=4 if TINY else 20).summary())
        free_gpu()
    return awq


# ---------------------------------------------------------------- cost

def cost() -> dict:
    """The sensitivity of the AWQ variant, twice, beside its quantization time, and the two checkpoints' load alone.
    (A run of 2026-12-03 also loaded them at once in two threads: no faster, and it raced on torch's default dtype;
    benchmarks/results/gpu_mixed_cost.json, pipeline/stages/sensitivity.py load_both.)"""
    import torch

    from pipeline.formats.quant_json import read_quant_json
    from pipeline.stages import sensitivity

    results: dict = {"date": time.strftime("%Y-%m-%d"), "layers": LAYERS, "tiny": TINY}
    p = paths(variants=False)
    awq = build_awq(p, results, "cost")
    device = "cpu" if TINY else "cuda"

    def timed(load):
        started = time.perf_counter()
        models = load()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        del models
        free_gpu()
        return round(seconds, 2)

    for attempt in (1, 2):
        step(results, "cost", f"load one after the other ({attempt})", lambda: timed(lambda: sensitivity.load_both(
            p["base"], awq, torch.bfloat16, device)))
    for attempt in (1, 2):
        step(results, "cost", f"sensitivity of awq ({attempt})", lambda: {
            k: v for k, v in sensitivity.run(p["base"], awq, p["rank.jsonl"], ROOT / "sensitivity-awq-cost.json",
                                             sequences=SEQUENCES, max_tokens=MAX_TOKENS).figures.items()
            if k != "groups"} | {"quantize_seconds_of_variant": read_quant_json(awq)["seconds"]})
        free_gpu()
    return results


# ---------------------------------------------------------------- rankcost

def rankcost() -> dict:
    """What ranking the AWQ variant's groups costs where the fix stage ranks them: in the KL's pass (`quantize kl
    --rank`), against that pass without the ranking (`quantize kl`, which the kl stage runs for every variant) and
    against the ranking alone (`quantize sensitivity`), side by side, twice, in alternating order; each beside the
    variant's quantization time (its quant.json)."""
    from pipeline.formats.quant_json import read_quant_json
    from pipeline.stages import kl, sensitivity

    results: dict = {"date": time.strftime("%Y-%m-%d"), "layers": LAYERS, "tiny": TINY}
    p = paths(variants=False)
    awq = build_awq(p, results, "rankcost")
    results["quantize seconds of awq"] = read_quant_json(awq)["seconds"]
    size = {"sequences": SEQUENCES, "max_tokens": MAX_TOKENS}
    runs = {
        "kl": lambda: kl.run(p["base"], awq, p["rank.jsonl"], ROOT / "kl-plain" / "kl.json", **size).figures,
        "kl --rank": lambda: (lambda r: r.figures | {"ranking": r.ranking | {"groups": [
            g["name"] for g in r.ranking["groups"][:10]]}})(kl.run(
                p["base"], awq, p["rank.jsonl"], ROOT / "kl-ranked" / "kl.json", rank=True, **size)),
        "sensitivity": lambda: (lambda f: f | {"groups": [g["name"] for g in f["groups"][:10]]})(sensitivity.run(
            p["base"], awq, p["rank.jsonl"], ROOT / "sensitivity-alone.json", **size).figures),
    }
    step(results, "rankcost", "warm-up: kl, not counted (CUDA and the imports start)", lambda: runs["kl"]()["seconds"])
    free_gpu()
    for attempt, order in ((1, ["kl", "kl --rank", "sensitivity"]), (2, ["kl --rank", "kl", "sensitivity"])):
        for name in order:
            started = time.perf_counter()
            step(results, "rankcost", f"{name} ({attempt})", lambda n=name, t=started: runs[n]() | {
                "wall_seconds": round(time.perf_counter() - t, 2)})
            free_gpu()
    return results


# ---------------------------------------------------------------- fixstage

def fix_project(p: dict, awq: Path) -> Path:
    """A project folder as `dvc repro` of the gpu profile leaves it before the fix stage: its params.yaml (the
    calibration and group size of what was built here), models/base and models/awq-w4a16, the calibration blocks and
    the held-out conversations (links to what this script built)."""
    import yaml

    from pipeline import profiles

    project = ROOT / "project"
    params = yaml.safe_load(profiles.stored("gpu", "params.yaml").read_text())
    params["calib"].update({"seq_len": CALIB[1], "num_blocks": CALIB[0]})
    for variant in params["variants"].values():
        if "group_size" in variant:
            variant["group_size"] = GROUP
    params["kl"].update({"sequences": SEQUENCES, "max_tokens": MAX_TOKENS})
    build = project / params["calib"]["out"]
    build.mkdir(parents=True, exist_ok=True)
    (project / "models").mkdir(exist_ok=True)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for link, target in ((project / "models" / "base", p["base"]), (project / "models" / "awq-w4a16", awq),
                         (build / "calib.jsonl", p["calib"] / "calib.jsonl"), (build / "holdout.jsonl", p["rank.jsonl"])):
        if not link.exists():
            link.symlink_to(target)
    return project


def fixstage() -> dict:
    """`quantize fix awq-w4a16` (the console script, as dvc.yaml's fix stage runs it) at these shapes: the KL and the
    ranking in one pass, then models/awq-w4a16-mixed on the variant's own AWQ settings; then vLLM serves the AWQ
    W4A16 variant and its fix, one after the other, at the same settings as `serve`."""
    import subprocess

    from pipeline.formats.quant_json import read_quant_json

    results: dict = {"date": time.strftime("%Y-%m-%d"), "layers": LAYERS, "tiny": TINY}
    p = paths(variants=False)
    awq = build_awq(p, results, "fixstage")
    project = fix_project(p, awq)
    fixed = project / "models" / "awq-w4a16-mixed"

    def run_fix():
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pipeline.cli.launcher", "fix", "awq-w4a16"], cwd=project,
                              capture_output=True, text=True, env={**os.environ, "QUANTIZE_FORKSERVER": "0"})
        if done.returncode:
            raise RuntimeError(f"quantize fix exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}")
        return {"wall_seconds": round(time.perf_counter() - started, 2), "said": done.stdout.strip().splitlines()[-1]}

    if not (fixed / "quant.json").exists():
        step(results, "fixstage", "quantize fix awq-w4a16", run_fix)
        free_gpu()
    info = read_quant_json(fixed) or {}
    ranking = json.loads((project / "results" / "awq-w4a16" / "sensitivity.json").read_text())
    results["the fix"] = {k: info.get(k) for k in ("base_method", "max_bits", "groups_in_8_bits", "groups_total",
                                                   "bits_per_weight", "size_bytes", "seconds")}
    results["its ranking"] = {k: v for k, v in ranking.items() if k != "groups"} | {
        "first": [g["name"] for g in ranking["groups"][:5]]}
    results["awq's kl.json"] = json.loads((project / "results" / "awq-w4a16" / "kl.json").read_text())
    if "--build-only" in sys.argv:  # vLLM not there yet (it travels to the machine in parts, in later calls)
        return results
    bench_each(results, "fixstage", {"awq-w4a16": awq, "awq-w4a16-mixed": fixed}, prefix="fixstage_")
    return results


# ---------------------------------------------------------------- build

def build() -> dict:
    from pipeline.formats.quant_json import read_quant_json
    from pipeline.stages import sensitivity
    from pipeline.stages.quantize import run as quantize_run

    results: dict = {"date": time.strftime("%Y-%m-%d"), "layers": LAYERS, "tiny": TINY}
    step(results, "build", "base, calibration, RTN W4A16 and W8A16", lambda: {
        k: str(v) for k, v in paths().items()})
    p = paths()
    awq = build_awq(p, results, "build")
    for name, variant in (("awq", awq), ("rtn", p["w4"])):
        step(results, "build", f"sensitivity of {name} (taylor)", lambda v=variant, n=name: sensitivity.run(
            p["base"], v, p["rank.jsonl"], ROOT / f"sensitivity-{n}.json", sequences=SEQUENCES,
            max_tokens=MAX_TOKENS).figures | {"groups": None, "quantize_seconds_of_variant": read_quant_json(v)
                                             ["seconds"]})
        free_gpu()
    mixed = ROOT / "mixed-4.5"
    if not (mixed / "quant.json").exists():
        step(results, "build", "mixed RTN at 4.5 bits", lambda: quantize_run(
            p["base"], mixed, p["calib"] / "calib.jsonl", "mixed", base="rtn", max_bits=4.5, group_size=GROUP,
            sensitivity=ROOT / "sensitivity-rtn.json").summary())
        free_gpu()
    results["mixed quant.json"] = {k: read_quant_json(mixed).get(k) for k in ("scheme", "sizes", "seconds")}
    details = read_quant_json(mixed).get("details", {})
    results["mixed details"] = {k: v for k, v in details.items() if k != "groups"}
    kept = [g["name"].rpartition(".")[2] for g in details.get("groups", []) if g["scheme"] == "W8A16"]
    results["mixed kept kinds"] = {kind: kept.count(kind) for kind in sorted(set(kept))}
    step(results, "build", "done", lambda: True)
    return results


# ---------------------------------------------------------------- compare

def compare() -> dict:
    from mixed_choice import compare as run_compare
    from mixed_choice import table

    results: dict = {"date": time.strftime("%Y-%m-%d"), "layers": LAYERS, "tiny": TINY}
    step(results, "compare", "rankings and choices (RTN, 4.25 and 4.5 bits)", lambda: run_compare(
        paths(), [4.25, 4.5], 8 if TINY else 16, 64 if TINY else 256, device="cpu" if TINY else "cuda",
        with_peer=False))
    found = results["rankings and choices (RTN, 4.25 and 4.5 bits)"]
    if "rows" in found:
        print(table(found["rows"]))
    return results


# ---------------------------------------------------------------- serve

def bench_each(results: dict, part: str, checkpoints: dict[str, Path], prefix: str = "") -> None:
    """`quantize bench --engine vllm` of each checkpoint, one after the other (kept: a bench already written is
    read back); its JSON and the tail of vLLM's log go to $OUT."""
    from pipeline.stages import bench

    for name, folder in checkpoints.items():
        out = ROOT / f"bench-{name}.json"
        if out.exists():
            results[f"bench {name}"] = json.loads(out.read_text())
            continue
        step(results, part, f"bench {name}", lambda f=folder, o=out: bench.run(
            f, o, engine="vllm", concurrency=[1, 2] if TINY else [1, 16, 64], input_len=16 if TINY else 128,
            output_len=8 if TINY else 256, requests_per_level=2, holdout=None, request_rates=[],
            **SERVING, **SERVER).figures)
        free_gpu()
        for kept in (out, out.with_suffix(".vllm.log")):
            if kept.exists():
                OUT.mkdir(parents=True, exist_ok=True)
                data = kept.read_bytes()
                (OUT / f"{prefix}{kept.name}").write_bytes(data if kept.suffix == ".json" else data[-200_000:])


def serve() -> dict:
    results: dict = {"date": time.strftime("%Y-%m-%d"), "tiny": TINY}
    paths()  # the checkpoints SERVED names
    bench_each(results, "serve", {name: ROOT / folder for name, folder in SERVED.items()})
    return results


# ---------------------------------------------------------------- table

def table() -> None:
    def read(part):
        path = OUT / f"{part}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    built, costs, ranked = read("build"), read("cost"), read("rankcost")
    total = (ranked.get("quantize seconds of awq") or {}).get("total")
    if total:
        print(f"\n| AWQ W4A16 quantization {total} s | wall s | of which ranking | extra over `quantize kl` | "
              f"share of quantization |\n|---|---|---|---|---|")
        for attempt in (1, 2):
            plain = (ranked.get(f"kl ({attempt})") or {}).get("wall_seconds")
            for name in ("kl", "kl --rank", "sensitivity"):
                found = ranked.get(f"{name} ({attempt})") or {}
                wall = found.get("wall_seconds")
                if wall is None:
                    continue
                own = (found.get("ranking") or {}).get("seconds") if name == "kl --rank" else (
                    found.get("seconds") if name == "sensitivity" else None)
                extra = wall - plain if plain and name == "kl --rank" else None
                cost = extra if extra is not None else (wall if name == "sensitivity" else None)
                print(f"| {name} ({attempt}) | {wall} | {own if own is not None else ''} | "
                      f"{f'{extra:.2f}' if extra is not None else ''} | {f'{cost / total:.1%}' if cost else ''} |")
    print("\n| what | seconds | share of the variant's quantization |\n|---|---|---|")
    for key, value in costs.items():
        if key.startswith("load"):
            print(f"| {key} | {value} | |")
    for name, s in [(n, built.get(f"sensitivity of {n} (taylor)") or {}) for n in ("awq", "rtn")] + [
            (k.removeprefix("sensitivity of "), v) for k, v in costs.items() if k.startswith("sensitivity")]:
        if "seconds" in s:
            print(f"| sensitivity of {name} (taylor, {s.get('sequences')} x {MAX_TOKENS} tokens) | {s['seconds']} "
                  f"(load {s.get('load_seconds')}, measure {s.get('measure_seconds')}) | "
                  f"{s.get('share_of_quantize_time')} of {s.get('quantize_seconds')} s |")
    print("\n| checkpoint | c=1 tok/s | c=16 tok/s | c=64 tok/s |\n|---|---|---|---|")
    for name in [*SERVED, "awq-w4a16", "awq-w4a16-mixed"]:
        path = ROOT / f"bench-{name}.json"
        if path.exists():
            levels = json.loads(path.read_text())["workloads"]["fixed"]["levels"]
            print(f"| {name} | " + " | ".join(f"{lv['output_tokens_per_s']:.0f}" for lv in levels) + " |")


if __name__ == "__main__":
    parts = {"build": build, "compare": compare, "serve": serve, "cost": cost, "rankcost": rankcost, "fixstage": fixstage,
             "table": table}
    chosen = [a for a in sys.argv[1:] if not a.startswith("--")]
    for part in chosen or list(parts):
        parts[part]()
    if "table" not in (chosen or parts):
        table()
