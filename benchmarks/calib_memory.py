"""Peak memory and time of `quantize calib` by input size (issue 46 item 5: bounded by a constant plus what the kept
blocks and holdout need, whatever the file's size), and whether near-duplicate detection still finds what was
planted at that size.

    python benchmarks/calib_memory.py [--sizes 50,200,1000] [--model models/base] [--code DIR] [--save NAME]

Each size (MB) is a generated .jsonl of distinct synthetic support conversations (~2.3 KB each, like
calib_data/support_logs.jsonl: six turns from a 20,000-word vocabulary, a ticket code unique to each
conversation, e-mail addresses to redact), with an exact duplicate (case and punctuation changed) planted every
50 records and a near-duplicate (one word changed: word 3-gram Jaccard ~0.97) every 50 records, each of an
earlier original. Files are generated once into .cache/bench-calib/. Each run is the real CLI in its own
process (`quantize calib FILE --out ... --model ...`, the demo's calib settings: 16 blocks x 256 tokens, 32
held out); its peak RSS and CPU time are the process's own (wait4's rusage). --code DIR runs the pipeline of
another checkout (e.g. `git archive main | tar -x -C /tmp/old`) for a before/after table.
Prints a table; --save NAME writes benchmarks/results/NAME.json and .md. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "bench-calib"
PLANT_EVERY = 50  # an exact duplicate and a near-duplicate per this many records
PARAMS = {"calib": {"seq_len": 256, "num_blocks": 16, "holdout": 32}}


def _vocabulary(rng: random.Random, size: int = 20_000) -> list[str]:
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
    return sorted({"".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(size * 2)})[:size]


def _conversation(rng: random.Random, words: list[str], weights: list[float], number: int) -> dict:
    ticket = "tk" + "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=8))
    turns = []
    for turn in range(6):
        text = " ".join(rng.choices(words, cum_weights=weights, k=rng.randint(40, 70)))
        if turn == 0:
            text = f"ticket {ticket}: {text}"
        if number % 7 == 0 and turn == 2:
            text += f" write to {rng.choice(words)}.{rng.choice(words)}@example.com"
        turns.append({"role": "user" if turn % 2 == 0 else "agent", "content": text.capitalize() + "."})
    return {"id": f"c{number}", "turns": turns}


def _near_copy(rng: random.Random, record: dict) -> dict:
    turns = [dict(t) for t in record["turns"]]
    words = turns[3]["content"].split()
    words[len(words) // 2] = "zz" + "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=10))  # every copy its own
    turns[3]["content"] = " ".join(words)
    return {"id": record["id"] + "-near", "turns": turns}


def _exact_copy(record: dict) -> dict:
    return {"id": record["id"] + "-copy", "turns": [dict(t, content=t["content"].upper() + "!!") for t in record["turns"]]}


def generate(megabytes: int) -> tuple[Path, dict]:
    """The file of about `megabytes` MB (made once) and what was planted in it."""
    path, planted_path = CACHE / f"logs_{megabytes}mb.jsonl", CACHE / f"logs_{megabytes}mb.planted.json"
    if path.is_file() and planted_path.is_file():
        return path, json.loads(planted_path.read_text())
    CACHE.mkdir(parents=True, exist_ok=True)
    rng = random.Random(megabytes)
    words = _vocabulary(rng)
    weights, total = [], 0.0
    for rank in range(len(words)):  # Zipf
        total += 1.0 / (rank + 1)
        weights.append(total)
    recent: list[dict] = []
    planted = {"records": 0, "duplicates": 0, "near_duplicates": 0}
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        while handle.tell() < megabytes << 20:
            number = planted["records"]
            if number % PLANT_EVERY == PLANT_EVERY - 1 and recent:
                record, kind = _exact_copy(rng.choice(recent)), "duplicates"
            elif number % PLANT_EVERY == PLANT_EVERY // 2 and recent:
                record, kind = _near_copy(rng, rng.choice(recent)), "near_duplicates"
            else:
                record, kind = _conversation(rng, words, weights, number), None
                recent = (recent + [record])[-1000:]
            if kind:
                planted[kind] += 1
            handle.write(json.dumps(record) + "\n")
            planted["records"] += 1
    tmp.replace(path)
    planted_path.write_text(json.dumps(planted))
    return path, planted


def measure(source: Path, model: Path, code: Path, scratch: Path) -> dict:
    """One `quantize calib` in its own process: its wall time, peak RSS and stats.json."""
    import yaml

    (scratch / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    out = scratch / "build"
    launcher = f"import sys; sys.path.insert(0, {str(code)!r}); from pipeline.cli.app import main; main()"
    command = [sys.executable, "-c", launcher, "--quiet", "calib", str(source), "--out", str(out), "--model", str(model),
               "--params", str(scratch / "params.yaml")]
    began = time.perf_counter()
    child = subprocess.Popen(command, cwd=scratch, env={**os.environ, "QUANTIZE_FORKSERVER": "0"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = child.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"quantize calib failed on {source}:\n{output}")
    stats = json.loads((out / "stats.json").read_text())
    return {"seconds": round(seconds, 1), "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_mb": round(usage.ru_maxrss / 1024), "stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,200,1000", help="input sizes in MB, comma-separated")
    parser.add_argument("--model", default=str(REPO / "models" / "base"), help="tokenizer checkpoint")
    parser.add_argument("--code", default=str(REPO), help="the checkout whose pipeline/ runs")
    parser.add_argument("--save", default=None, help="write benchmarks/results/NAME.json and .md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from calib_prepare import model_dir  # the tokenizer: the demo's, else the tests' tiny one

        model, model_name = model_dir(args.model, Path(scratch))
        for megabytes in [int(size) for size in args.sizes.split(",")]:
            source, planted = generate(megabytes)
            run_dir = Path(scratch) / f"run{megabytes}"
            run_dir.mkdir()
            result = measure(source, model, Path(args.code).resolve(), run_dir)
            stats = result.pop("stats")
            rows.append({"input_mb": round(source.stat().st_size / 2**20), "records": planted["records"], **result,
                         "duplicates": f"{stats['dropped'].get('duplicate', 0)} of {planted['duplicates']}",
                         "near_duplicates": f"{stats['dropped'].get('near-duplicate', 0)} of {planted['near_duplicates']}",
                         "kept": stats["records_kept"], "blocks": stats["blocks"], "holdout": stats["holdout"]})
            print(rows[-1], flush=True)
    table = _table(rows)
    print("\n" + table)
    machine = f"{platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}"
    print(f"\n{machine}; tokenizer {model_name}; code {args.code}")
    if args.save:
        results = REPO / "benchmarks" / "results"
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": machine, "tokenizer": model_name, "code": args.code,
                "settings": PARAMS["calib"], "rows": rows}
        (results / f"{args.save}.json").write_text(json.dumps(meta, indent=2) + "\n")
        (results / f"{args.save}.md").write_text(f"# quantize calib: peak memory by input size ({meta['date']})\n\n"
                                                 f"{machine}; tokenizer {model_name}\n\n{table}\n")


def _table(rows: list[dict]) -> str:
    lines = ["| input MB | records | peak RSS MB | wall s | CPU s | duplicates found | near-duplicates found | kept |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['input_mb']} | {r['records']:,} | {r['peak_rss_mb']} | {r['seconds']} | {r['cpu_seconds']} "
                     f"| {r['duplicates']} | {r['near_duplicates']} | {r['kept']:,} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
