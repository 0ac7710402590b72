"""The GPU run as a whole: `dvc repro` with the gpu profile on GLM-4-9B shapes, cut by the machine's
10-minute command limit and resumed, and what it cost per stage (issue 24, item 3).

On the GPU machine, from the project root, once the vLLM bundle is unpacked in /tmp/vsite (see
the team's device notes) and with `.device` carried (wheels.sh (device notes), then
benchmarks/gpu_dvc_wheels.sh for DVC), call this again and again until it prints `state: done`:

    python3 benchmarks/gpu_dvc_repro.py run [--budget 540] [--suite-limit N]

Each call (the machine keeps /tmp between calls while warm) sets the run up the first time: a copy of the
project under /tmp/gpu-dvc/project with `quantize profile gpu` applied and this machine's settings on top
(model.source: a GlmForCausalLM with GLM-4-9B's shapes and random bf16 weights, built here; vLLM started
from /tmp/vsite), then runs `dvc repro` there. A call that reaches --budget seconds stops `dvc repro`
(SIGINT, as a cut would) and the next call runs `dvc repro` again: DVC skips the finished stages, the eval
caches skip the scored items. The run holding the GPU is a small process of this script's (QUANTIZE_RUN_PID)
that outlives a cut call by --grace seconds, so the vLLM servers of a cut call serve the next call's stages if
the machine keeps processes between calls (and restart, counted, if it does not); it ends with the run. Every stage
appends its wall time and engine start to a log
(QUANTIZE_STAGE_LOG, written by pipeline/cli/app.py); each call writes $OUT/gpu_dvc_repro.json:

    stages: [{name, wall_s, engine_start_s, attempts, server_starts}]   (a cut stage's attempts add up)
    wall_s, engine_start_s, engine_start_fraction: the whole matrix (dvc repro's time over all calls)
    resumed: how many times the run was cut and resumed; calls; setup_s (building the random base: not a stage)
    model: the base (name, architecture, shapes, results_file; a vision base's planned and built depth, disk plan)
    variants: per variant its scheme, group, experts' scheme and the vision tower's tensors verify found changed

`--tiny` runs the same on the CPU: a tiny Glm, tests/openai_server.py in vLLM's place, a few items per suite
(tests/test_gpu_dvc_repro.py). `--target STAGE...` runs `quantize repro STAGE...` (and what they need, in the whole
run's order) only.

The base (`--model`, at the first call; BASES): `glm4-9b` (the default: GlmForCausalLM at GLM-4-9B's shapes),
`glm46v-flash` (Glm4vForConditionalGeneration at GLM-4.6V-Flash's published text and vision widths and depths) or
`glm46v-moe` (Glm4vMoeForConditionalGeneration at GLM-4.6V's widths: 128 routed experts top-8 and a shared expert,
at the depth the machine's disk holds for the run's four checkpoints, computed at setup: disk_plan; AWQ and RTN at
group 64; FP8 with its experts dynamic, as the fp8 method does for every MoE). A vision base gets random bf16
weights built on the GPU with tests/tiny.py's builders (GLM's image tokens, processors and chat template), and the
same DAG: the vqa suite and the generated visual suites (charts, documents, small_text, counting: evals/visual/),
which a text-only base records as not applicable, are scored on every model through vLLM (images in OpenAI chat
format, pipeline/engines/vllm.py), each timed per model and suite (`suites`), and every variant's verify checks its vision tower
bit-identical (`variants` in the JSON). Its runs default to 16 items per suite (one 30-minute lease); the JSON
names the model (`model`: its shapes, planned and built depth, the disk plan, `results_file`, where its figures are
kept once run). `--tiny --model glm46v-flash|glm46v-moe` runs it on the CPU with save_tiny_glm4v / _moe.

The fix loop (issue 52): `--fix V` (repeatable) at the first call adds V's fix to the run before it starts (`quantize
profile --fix V`, as a user would after a NO-GO); `--fix V` on a run that is done adds V's fix to the finished run and
runs again: a new phase, whose stages, servers and seconds are counted apart (`phases`), the run's servers kept from
the phase before (the holder, QUANTIZE_RUN_PID, lives through a finished phase for --grace seconds, as through a
cut), so a fix costs its own stages and its own server start. Each phase also records which stages ran (`ran`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from glm_shapes import GLM46V_FLASH_TEXT, GLM46V_FLASH_VISION, GLM46V_MOE_TEXT, GLM46V_MOE_VISION  # beside this script

REPO = Path(__file__).resolve().parent.parent
# the environment this script was started with: what the run's commands get (torch, once this script imports it to
# build a base, adds its own variables, and commands started with those had another key for the run's warm
# interpreter than those of the call before: a second one started)
STARTED_ENV = dict(os.environ)
OUT = Path(os.environ.get("OUT", "/tmp/gpu-dvc-out"))
VSITE = os.environ.get("VLLM_SITE", "/tmp/vsite")
_IGNORED = shutil.ignore_patterns(".git", ".venv", ".device", ".gpu-carry", ".vllm-*", "models", "results", ".cache", "__pycache__",
                                "*.egg-info", ".pytest_cache", "build", "index.html", "verdict.json", "dvc.lock")


def IGNORE(folder: str, names: list[str]) -> set[str]:  # noqa: N802 - copytree's ignore, as shutil's own
    """What the run's copy of the checkout leaves out: the patterns above, and a report a `make demo` here left in
    reports/ (its links, followed by the copy, would be plain folders the run's report stage refuses to replace)."""
    left = set(_IGNORED(folder, names))
    if Path(folder).name == "reports" and Path(folder).parent == REPO:
        left |= {n for n in names if n.startswith(".report") or n == "cards"}
    return left


# ------------------------------------------------------------ the base the run is built on (--model)

@dataclass(frozen=True)
class BaseModel:
    """A base the run can be built on: random bf16 weights at a published model's shapes on the GPU machine, the
    matching fixture of tests/tiny.py with --tiny."""
    name: str
    architecture: str
    words: str  # what the results JSON and the table say it is
    results_file: str  # where its run's $OUT/gpu_dvc_repro.json is kept in the repo once run
    tiny_builder: str  # tests/tiny.py's function for --tiny
    text: dict | None = None  # the published text and vision configs (None: the text run's, glm_shapes.GLM4_9B)
    vision: dict | None = None
    depth_from_disk: bool = False  # text layers: as many as the machine's disk holds (all four checkpoints)
    suite_limit: int | None = None  # items per suite unless --suite-limit says otherwise (the run must fit one lease)
    group_size: int | None = None  # the W4A16 variants' group (every quantized width must divide by it)


BASES = {b.name: b for b in (
    BaseModel("glm4-9b", "GlmForCausalLM", "GLM-4-9B shapes (GlmForCausalLM), random bf16 weights",
              "benchmarks/results/gpu_dvc_repro.json", "save_tiny_glm"),
    BaseModel("glm46v-flash", "Glm4vForConditionalGeneration",
              "GLM-4.6V-Flash shapes (Glm4vForConditionalGeneration: 40 text layers, 24-block vision tower), random "
              "bf16 weights", "benchmarks/results/gpu_dvc_repro_glm46v.json", "save_tiny_glm4v",
              GLM46V_FLASH_TEXT, GLM46V_FLASH_VISION, suite_limit=16),
    BaseModel("glm46v-moe", "Glm4vMoeForConditionalGeneration",
              "GLM-4.6V widths (Glm4vMoeForConditionalGeneration: 128 routed experts top-8 and a shared expert, "
              "24-block vision tower) at the depth the disk holds, random bf16 weights",
              "benchmarks/results/gpu_dvc_repro_glm46v_moe.json", "save_tiny_glm4v_moe",
              GLM46V_MOE_TEXT, GLM46V_MOE_VISION, depth_from_disk=True, suite_limit=16,
              group_size=64),  # 128 does not divide the dense MLP's 10944 (= 64 x 171)
)}
DEFAULT_BASE = "glm4-9b"
# disk the run needs beside its checkpoints: calibration, results, logs, vLLM's compile cache, DVC's state
DISK_RESERVE_GIB = 6.0


def checkpoint_bytes(text: dict, vision: dict, layers: int, group_size: int) -> dict[str, float]:
    """Bytes on disk of each checkpoint a run writes of a Glm4v / Glm4vMoe base with `layers` text layers, from the
    model built on the meta device (no memory, no weights): bf16 everywhere for the base; every decoder Linear
    (experts included, the router not) at 1 byte for FP8 and at 4 bits plus a bf16 scale and a 4-bit zero point per
    `group_size` weights for AWQ and RTN; embeddings, lm_head, norms and the vision tower stay bf16 in all."""
    import torch
    from transformers import (Glm4vConfig, Glm4vForConditionalGeneration, Glm4vMoeConfig,
                              Glm4vMoeForConditionalGeneration)

    moe = "n_routed_experts" in text
    config_class, model_class = ((Glm4vMoeConfig, Glm4vMoeForConditionalGeneration) if moe else
                                 (Glm4vConfig, Glm4vForConditionalGeneration))
    config = config_class(text_config={**text, "num_hidden_layers": layers}, vision_config=vision,
                          tie_word_embeddings=False)
    with torch.device("meta"):
        model = model_class(config)
    quantized = kept = 0
    for name, param in model.named_parameters():
        in_layer = ".layers." in name and "visual" not in name
        if in_layer and param.ndim >= 2 and not name.endswith("mlp.gate.weight"):
            quantized += param.numel()
        else:
            kept += param.numel()
    w4a16 = 0.5 + (2 + 0.5) / group_size
    return {"base": 2.0 * (quantized + kept), "fp8-w8a8": 1.0 * quantized + 2.0 * kept,
            "awq-w4a16": w4a16 * quantized + 2.0 * kept, "rtn-w4a16": w4a16 * quantized + 2.0 * kept}


def disk_plan(spec: BaseModel, free_bytes: int, cache_copies: int, depth: int | None = None) -> dict:
    """The text depth of the run and the disk it needs: the base, its random source (until resave has made
    models/base), AWQ, FP8 and RTN, and DVC's copy of each when its cache copies (`cache_copies`); for a base whose
    depth comes from the disk (glm46v-moe), the deepest that leaves DISK_RESERVE_GIB free, at least one dense and
    one MoE layer. `depth` given: that depth, checked."""
    group = spec.group_size or 128
    full = spec.text["num_hidden_layers"]
    dense = spec.text.get("first_k_dense_replace", full)

    def need(layers: int) -> tuple[float, dict]:
        sizes = checkpoint_bytes(spec.text, spec.vision, layers, group)
        after_resave = sum(sizes.values()) * (1 + cache_copies)  # base + the three variants: the source is gone
        during_resave = sizes["base"] * (2 + cache_copies)  # the random source (no DVC output) and models/base
        return max(after_resave, during_resave), sizes

    room = free_bytes - DISK_RESERVE_GIB * 2**30
    if depth is None and spec.depth_from_disk:
        one, two = need(dense + 1)[0], need(dense + 2)[0]
        per_layer = two - one  # one more MoE layer, in every checkpoint
        depth = dense + 1 + int(max(0.0, room - one) // per_layer) if room >= one else dense + 1
        depth = min(depth, full)
        why = (f"{per_layer / 1e9:.2f} GB per MoE layer over the checkpoints (base, AWQ, FP8, RTN"
               f"{', and DVC copying each' if cache_copies else '; DVC links them into its cache'}), "
               f"{one / 1e9:.1f} GB at {dense + 1} layers; {free_bytes / 1e9:.1f} GB free, {DISK_RESERVE_GIB} GiB "
               f"kept for the rest of the run")
    else:
        depth = depth or full
        why = "the published depth" if depth == full else "--depth"
    total, sizes = need(depth)
    return {"layers": depth, "published_layers": full, "why": why, "free_bytes": free_bytes,
            "reserve_bytes": int(DISK_RESERVE_GIB * 2**30), "cache_copies": cache_copies,
            "checkpoint_bytes": {k: int(v) for k, v in sizes.items()}, "peak_bytes": int(total),
            "fits": total <= room}


def gpu_name() -> str | None:
    """nvidia-smi's name and memory of the first GPU (e.g. "NVIDIA H100 80GB HBM3, 81559 MiB"), None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                          capture_output=True, text=True)
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def sh(cmd: list[str], cwd: Path, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done


def config_text_section(model_dir: Path) -> dict:
    """The text tower's settings in a checkpoint's config.json (pipeline/checkpoints/config_json.py reads it)."""
    sys.path.insert(0, str(REPO))
    from pipeline.checkpoints import config_json

    return config_json.text_section(config_json.read(model_dir))


class Run:
    def __init__(self, work: Path, tiny: bool):
        self.work, self.tiny = work, tiny
        self.project, self.state_file = work / "project", work / "state.json"
        self.stage_log, self.bin = work / "stages.jsonl", work / "bin"
        self.state = json.loads(self.state_file.read_text()) if self.state_file.exists() else {
            "calls": [], "cuts": 0, "done": False, "setup_s": None, "phases": [{"name": "run", "fixes": []}]}
        self.state.setdefault("phases", [{"name": "run", "fixes": []}])
        self.state.setdefault("model", {"name": DEFAULT_BASE})  # a run set up before --model: the text run

    @property
    def base_model(self) -> BaseModel:
        return BASES[self.state["model"]["name"]]

    def save(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(self.state, indent=1))

    # ------------------------------------------------------------ setting up (first call)

    def build_base(self) -> Path:
        sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]
        spec = self.base_model
        if self.tiny:
            import tiny

            base = self.work / ("glm-tiny" if spec.name == DEFAULT_BASE else f"{spec.name}-tiny")
            if not (base / "config.json").exists():
                getattr(tiny, spec.tiny_builder)(base)
            return base
        if spec.text is None:
            from gpu_quantize import build_model

            return build_model(self.work, 40)  # GLM-4-9B shapes, random bf16, on the GPU
        return self.build_vision_base(spec)

    def build_vision_base(self, spec: BaseModel) -> Path:
        """The published widths at the planned depth, random bf16 weights, built on the GPU with tests/tiny.py's
        builder (GLM's image and video tokens, processors and chat template over the tiny tokenizer; ids stay in the
        vocabulary), marked `synthetic_weights` so the report says its accuracy figures time the pipeline only."""
        import torch

        import tiny

        layers = self.state["model"]["layers"]
        base = self.work / f"{spec.name}-random"
        if (base / "config.json").exists():
            return base
        started = time.perf_counter()
        why = f"random bf16 weights at {spec.name} widths, {layers} text layers (benchmarks/gpu_dvc_repro.py)"
        getattr(tiny, spec.tiny_builder)(base, dtype=torch.bfloat16, text={**spec.text, "num_hidden_layers": layers},
                                         vision=spec.vision, device="cuda", synthetic_weights=why)
        torch.cuda.empty_cache()
        print(f"built {base} ({layers} text layers) in {time.perf_counter() - started:.0f} s", flush=True)
        return base

    def plan_depth(self, depth: int | None) -> None:
        """A vision base's text depth and the disk its run needs (disk_plan), recorded in the state and printed; a
        run that would not fit stops here, before anything is built (exit 2). With --tiny: the plan at the real
        widths on this machine's disk, for the record; the tiny fixture is built."""
        spec = self.base_model
        if spec.text is None:
            return
        self.work.mkdir(parents=True, exist_ok=True)
        config = (REPO / ".dvc" / "config").read_text()
        copies = 0 if any(kind in config for kind in ("hardlink", "symlink", "reflink")) else 1
        plan = disk_plan(spec, shutil.disk_usage(self.work).free, copies, depth)
        if self.tiny:
            plan["note"] = "--tiny: the plan at the published widths on this machine's disk; tests/tiny.py's fixture is built"
        self.state["model"].update(layers=plan["layers"], disk=plan)
        print(f"{spec.name}{' (the plan at the published widths; --tiny builds the fixture)' if self.tiny else ''}: "
              f"{plan['layers']} text layers ({plan['why']}); the run's checkpoints need "
              f"{plan['peak_bytes'] / 1e9:.1f} GB at most: " + ", ".join(
                  f"{name} {size / 1e9:.1f} GB" for name, size in plan["checkpoint_bytes"].items()), flush=True)
        if not plan["fits"] and not self.tiny:
            print(f"cannot run {spec.name}: {plan['peak_bytes'] / 1e9:.1f} GB of checkpoints at {plan['layers']} text "
                  f"layers do not fit in {plan['free_bytes'] / 1e9:.1f} GB free less {DISK_RESERVE_GIB} GiB kept for "
                  "the run; free disk, or give --depth N (fewer text layers)", file=sys.stderr)
            raise SystemExit(2)

    def settings(self, base: Path, suite_limit: int | None, share: bool = True) -> dict:
        """This machine's settings over the gpu profile."""
        import yaml

        params = yaml.safe_load((self.project / "params.yaml").read_text())
        params["model"]["source"] = str(base)
        engine = params["engine"]
        if self.tiny:
            # the test server pretends a 1 GiB device (its --device-memory-gib default): planned KV pools fit in it
            engine.update(server_command=[sys.executable, str(REPO / "tests" / "openai_server.py")],
                          max_model_len=512, batch_size=8, device_memory_gib=1.0, non_kv_memory_gib=0.01,
                          vision_memory_gib=0.01)
            params["model"]["dtype"] = "float16"
            params["calib"].update(seq_len=64, num_blocks=8, holdout=8)
            for variant in params["variants"].values():  # the tiny Glm is 64 wide: every grouped method at 32
                if "group_size" in variant:
                    variant.update(group_size=32)
                if "n_grid" in variant:  # AWQ's scale candidates
                    variant.update(n_grid=4, batch_size=8)
            for name, suite in params["suites"].items():
                suite["limit"] = 2
                suite["max_new_tokens"] = 4
            params["suites"]["long_context"]["options"] = {"lengths": [128, 256], "depths": [50], "kinds": ["niah"],
                                                           "repeats": 1}
            params["judge"].update(limit=2, max_new_tokens=4, judge_max_new_tokens=4)
            params["kl"].update(sequences=2, max_tokens=64)
            params["bench"].update(concurrency=[1, 2], request_rates=[4], rate_seconds=1, input_len=16, output_len=8,
                                   holdout=False)  # the held-out conversations pass the tiny model's 512 tokens
        else:
            engine.update(server_command=["python3", "-m", "vllm.entrypoints.cli.main", "serve"],
                          server_env={"PYTHONPATH": VSITE, "VLLM_USE_FLASHINFER_SAMPLER": "0"})
            for variant in params["variants"].values():  # e.g. GLM-4.6V's 10944-wide dense MLP: group 64
                if "group_size" in variant and self.base_model.group_size:
                    variant.update(group_size=self.base_model.group_size)
        engine["share_server"] = share  # --no-share: every stage starts its own server (the before of item 2)
        if suite_limit:  # items per suite, and prompts the judge judges
            for suite in params["suites"].values():
                suite["limit"] = suite_limit
            params["judge"]["limit"] = suite_limit
        if not shutil.which("bwrap"):  # random weights write no real code; the report marks it unsandboxed
            params["suites"]["code"]["allow_unsandboxed"] = True
        return params

    def setup(self, suite_limit: int | None, share: bool = True, fixes: list[str] | None = None,
              model: str = DEFAULT_BASE, depth: int | None = None) -> None:
        import yaml

        started = time.perf_counter()
        spec = BASES[model]
        self.state["model"] = {"name": model, "architecture": spec.architecture, "shapes": spec.words,
                               "results_file": spec.results_file}
        if suite_limit is None and spec.suite_limit and not self.tiny:  # tiny: 2 items per suite (settings)
            suite_limit = spec.suite_limit
            self.state["model"]["suite_limit_why"] = (f"{spec.name}'s default: the whole run (carry, setup and dvc "
                                                      "repro) in one 30-minute lease")
        self.plan_depth(depth)  # a vision base: its depth and disk, before anything is built
        if self.project.exists():
            shutil.rmtree(self.project)
        shutil.copytree(REPO, self.project, ignore=IGNORE)
        self.bin.mkdir(parents=True, exist_ok=True)
        wrapper = self.bin / "quantize"  # what dvc.yaml's commands call
        wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -m pipeline.cli.launcher \"$@\"\n")
        wrapper.chmod(0o755)
        sh([str(wrapper), "profile", "gpu"], self.project,
           {k: v for k, v in self.env().items() if k != "QUANTIZE_STAGE_LOG"})  # not a stage of the run
        self.compile_bytecode()
        base = self.build_base()
        text = config_text_section(base)
        self.state["model"]["built"] = {key: text.get(key) for key in (  # what the base really is (tiny: the fixture)
            "num_hidden_layers", "hidden_size", "n_routed_experts", "num_experts_per_tok", "first_k_dense_replace")
            if text.get(key) is not None}
        (self.project / "params.yaml").write_text(yaml.safe_dump(self.settings(base, suite_limit, share), sort_keys=False))
        for variant in fixes or []:  # as a user adds a NO-GO's fix (the profile lists none)
            self.add_fix(variant)
        self.state["phases"][0]["fixes"] = list(fixes or [])
        # the H200 machine has 64 GiB of disk: the project's .dvc/config links checkpoints into DVC's cache
        # (cache.type hardlink,symlink) instead of copying them, and the random source goes once resave has made
        # models/base (drop_source_once_resaved)
        config = self.project / ".dvc" / "config"
        if "hardlink" not in config.read_text():
            raise SystemExit(f"{config}: expected cache.type hardlink,symlink (the project's own setting)")
        if not shutil.which("git"):
            config.write_text(config.read_text().replace("[core]\n", "[core]\n    no_scm = true\n", 1))
        if shutil.which("git"):
            git_env = {**self.env(), "GIT_AUTHOR_NAME": "run", "GIT_AUTHOR_EMAIL": "run@localhost",
                       "GIT_COMMITTER_NAME": "run", "GIT_COMMITTER_EMAIL": "run@localhost"}
            for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "gpu run"]):
                sh(cmd, self.project, git_env)
        self.state["setup_s"] = round(time.perf_counter() - started, 1)
        self.state["base"] = str(base)
        self.state["suite_limit"] = suite_limit
        self.save()

    def add_fix(self, variant: str) -> str:
        """`quantize profile --fix VARIANT` in the project (dvc.yaml edited in place), as a user would; its words."""
        done = sh([str(self.bin / "quantize"), "profile", "--fix", variant], self.project,
                  {k: v for k, v in self.env().items() if k != "QUANTIZE_STAGE_LOG"})
        return done.stdout.strip()

    def new_phase(self, fixes: list[str]) -> None:
        """A finished run gets more fixes: a phase of its own (its calls, stages and servers counted apart)."""
        for variant in fixes:
            print(self.add_fix(variant), flush=True)
        self.state["phases"].append({"name": "fix " + ", ".join(fixes), "fixes": list(fixes),
                                     "first_call": len(self.state["calls"])})
        self.state["done"] = False
        self.save()

    def compile_bytecode(self) -> None:
        """The GPU machine's image sets PYTHONDONTWRITEBYTECODE=1 and holds its packages (torch, transformers) without
        bytecode, and the project's travel as wheels installed with --no-compile and vLLM as a tarball: every process
        would compile every module it imports (seen: importing torch, transformers and lm-eval took 19 s, 8 s once
        compiled). A pip install compiles them once; done once here, on every core, and timed apart from the run
        (`bytecode_s`)."""
        started = time.perf_counter()
        folders = [p for p in (os.environ.get("PYTHONPATH") or "").split(os.pathsep) if p and Path(p).is_dir()]
        folders += [p for p in sys.path if "packages" in p and Path(p).is_dir()]  # the image's torch, transformers
        folders += [VSITE] if Path(VSITE).is_dir() and not self.tiny else []
        folders = [f for f in dict.fromkeys(folders) if f != str(self.project)] + [str(self.project / "pipeline")]
        if not self.tiny:
            sh([sys.executable, "-m", "compileall", "-q", "-j", "0", *folders], self.work, check=False)
        self.state["bytecode_s"] = round(time.perf_counter() - started, 1)
        self.state["python_dont_write_bytecode"] = os.environ.get("PYTHONDONTWRITEBYTECODE")

    # ------------------------------------------------------------ the run across calls

    HOLDER = ("import os, sys, time\n"
              "path = sys.argv[1]\n"
              "while True:\n"
              "    try:\n"
              "        deadline = float(open(path).read())\n"
              "    except (OSError, ValueError):\n"
              "        deadline = 0.0\n"
              "    if time.time() > deadline:\n"
              "        sys.exit(0)\n"
              "    time.sleep(1)\n")

    def hold(self, seconds: float) -> int:
        """The run that holds the GPU across calls: a small process named to every stage as QUANTIZE_RUN_PID,
        so the vLLM servers a cut call leaves up serve the next call's stages (pipeline/engines/shared.py).
        It ends `seconds` from now unless the next call extends it, when the run is done, or with the machine;
        its servers end with it."""
        sys.path.insert(0, str(REPO))
        from pipeline.engines.shared import alive, start_time

        deadline = self.work / "holder.deadline"
        deadline.write_text(str(time.time() + seconds))
        holder = self.state.get("holder") or {}
        if alive(holder.get("pid"), holder.get("started")):
            return holder["pid"]
        proc = subprocess.Popen([sys.executable, "-c", self.HOLDER, str(deadline)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.state["holder"] = {"pid": proc.pid, "started": start_time(proc.pid)}
        self.state["holders"] = self.state.get("holders", 0) + 1
        self.save()
        return proc.pid

    def release(self) -> None:
        (self.work / "holder.deadline").write_text("0")
        holder = self.state.get("holder") or {}
        sys.path.insert(0, str(REPO))
        from pipeline.engines.shared import alive

        deadline = time.monotonic() + 10
        while alive(holder.get("pid"), holder.get("started")) and time.monotonic() < deadline:
            time.sleep(0.2)

    def env(self) -> dict:
        return {**STARTED_ENV, "PATH": f"{self.bin}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
                                       f"{STARTED_ENV.get('PATH', '')}",
                "PYTHONPATH": os.pathsep.join(p for p in (STARTED_ENV.get("PYTHONPATH"), str(self.project)) if p),
                "QUANTIZE_STAGE_LOG": str(self.stage_log), "QUANTIZE_SERVER_DIR": str(self.work / "servers"),
                "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    # ------------------------------------------------------------ one call

    def call(self, budget: float, targets: list[str], grace: float, keep: bool = False) -> str:
        started, began_at = time.perf_counter(), time.time()
        # named targets through `quantize repro`: in the whole run's order (plain `dvc repro TARGETS` orders them by
        # Python's string hashes); DVC's own lines kept in the log
        cmd = ([sys.executable, "-m", "pipeline.cli.repro", "--dvc-lines", *targets] if targets
               else [sys.executable, "-m", "dvc", "repro"])
        log = self.work / f"dvc-{len(self.state['calls']) + 1}.log"
        holder = self.hold(budget + grace)
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=self.project, env={**self.env(), "QUANTIZE_RUN_PID": str(holder)},
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                while True:
                    try:
                        code = proc.wait(timeout=min(5.0, max(0.1, budget - (time.perf_counter() - started))))
                        break
                    except subprocess.TimeoutExpired:
                        self.drop_source_once_resaved()
                        if time.perf_counter() - started >= budget:
                            raise
                outcome = "done" if code == 0 else f"failed ({code})"
            except subprocess.TimeoutExpired:
                outcome = "cut"
                os.killpg(proc.pid, signal.SIGINT)  # what a cut does: DVC and the running stage stop
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        wall = time.perf_counter() - started
        self.state.setdefault("gpu_samples", []).append(self.sample_gpu())  # the servers are still up here
        if outcome == "cut" or (outcome == "done" and keep):  # the run goes on in the next call (a fix added to the
            self.hold(grace)                                  # finished run): its servers wait `grace` seconds
        else:
            self.release()
            self.wait_servers_gone()
        self.state["calls"].append({"dvc_repro_s": round(wall, 1), "outcome": outcome, "log": str(log),
                                    "began_at": round(began_at, 2), "ended_at": round(began_at + wall, 2),
                                    "phase": len(self.state["phases"]) - 1})
        if outcome == "cut":
            self.state["cuts"] += 1
        self.state["done"] = outcome == "done"
        self.save()
        return outcome

    def sample_gpu(self) -> dict | None:
        """What each of the run's servers holds on the GPU now (nvidia-smi's per-process memory, summed over the
        server's process group: pipeline/engines/gpu_memory.py) beside its plan (the registry's gpu_bytes) and the
        most its supervisor measured (server_registry.measured_memory), and the GPU's total use; None without
        nvidia-smi."""
        if not shutil.which("nvidia-smi"):
            return None
        sys.path.insert(0, str(REPO))
        from pipeline.engines.gpu_memory import used_by_process_group
        from pipeline.engines.server_registry import entries, measured_memory

        registry = self.work / "servers"
        used = used_by_process_group() or {}
        total = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True).stdout.split(",")
        servers = {Path(e.get("model_path") or "?").name: {"planned_bytes": e.get("gpu_bytes"),
                                                            "used_bytes": used.get(e.get("server_pid")),
                                                            "peak_bytes": measured_memory(registry, k).get("peak_bytes")}
                   for k, e in entries(registry).items()}
        return {"at": round(time.time(), 1), "servers": servers,
                "gpu_used_bytes": int(total[0]) << 20 if total and total[0].strip().isdigit() else None,
                "gpu_total_bytes": int(total[1]) << 20 if len(total) > 1 and total[1].strip().isdigit() else None}

    def drop_source_once_resaved(self) -> None:
        """The random source checkpoint is resave's input only (model.source is a param, not a file dep: DVC
        does not rerun resave without it); once dvc.lock records resave it goes, freeing 18.8 GB of disk."""
        source = Path(self.state.get("base") or "")
        lock = self.project / "dvc.lock"
        if self.tiny or not source.name or not source.exists() or not lock.exists():
            return
        try:
            import yaml

            done = "resave" in (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
        except (OSError, ValueError, yaml.YAMLError):
            return
        if done:
            shutil.rmtree(source, ignore_errors=True)
            self.state["source_dropped"] = True
            self.save()

    def locked_stages(self) -> set[str]:
        """The stages dvc.lock records (DVC writes each once its outputs are hashed)."""
        lock = self.project / "dvc.lock"
        try:
            import yaml

            return set((yaml.safe_load(lock.read_text()) or {}).get("stages", {}))
        except (OSError, ValueError, ImportError):
            return set()
        except Exception:  # noqa: BLE001 - a lock torn by the cut: nothing is recorded as finished
            return set()

    def wait_servers_gone(self, seconds: float = 60.0) -> None:
        """The run is over (or cut): its servers stop with it (pipeline/engines/shared.py); wait for the GPU."""
        sys.path.insert(0, str(REPO))
        from pipeline.engines import shared

        os.environ[shared.REGISTRY_ENV] = str(self.work / "servers")
        deadline = time.monotonic() + seconds
        while shared.entries() and time.monotonic() < deadline:
            time.sleep(0.5)

    # ------------------------------------------------------------ the figures

    def records(self) -> list[dict]:
        return [json.loads(l) for l in self.stage_log.read_text().splitlines() if l.strip()] \
            if self.stage_log.exists() else []

    def phase_figures(self) -> list[dict]:
        """Per phase (the run, then each fix added to it when it was done): its calls' figures, as `figures` gives
        them for the whole run, the stages that ran in it and the servers they started."""
        phases, records = [], self.records()
        for index, phase in enumerate(self.state["phases"]):
            calls = [c for c in self.state["calls"] if c.get("phase", 0) == index]
            inside = [r for r in records if any(c["began_at"] - 1 <= (r.get("ended_at") or r.get("began_at") or 0)
                                                <= c["ended_at"] + 1 for c in calls)]
            figures = self.figures(calls, inside)
            ran = sorted({s["name"] for s in figures["stages"] if s["attempts"]})
            figures["suites"] = [r for r in figures["suites"] if f"evaluate@{r['model']}" in ran]
            starts = {s["name"]: s["server_starts"] for s in figures["stages"] if s["server_starts"]}
            phases.append({"name": phase["name"], "fixes": phase.get("fixes", []), "ran": ran,
                           "server_starts_by_stage": starts, **{k: v for k, v in figures.items()
                                                                if k not in ("servers", "calls", "model", "variants")}})
        return phases

    def figures(self, calls: list[dict] | None = None, records: list[dict] | None = None) -> dict:
        """The run's figures (or, given a phase's calls and stage records, the phase's)."""
        calls = self.state["calls"] if calls is None else calls
        records = self.records() if records is None else records
        stages = self.stage_figures(records)
        wall = sum(c["dvc_repro_s"] for c in calls)
        start = sum(s["engine_start_s"] for s in stages.values())
        work = sum(s["work_s"] + s["ahead_work_s"] for s in stages.values())  # ahead of a stage or in it
        suites = self.suite_figures(stages)
        servers = self.server_figures()
        stalls, lost = self.stall_figures(records)
        ahead_work = sum(s["ahead_work_s"] for s in stages.values())
        return {
            "batch_size": self.batch_size(), "stalls": stalls, "lost_requests": lost,
            "ahead_work_s": round(ahead_work, 1),
            "date": time.strftime("%Y-%m-%d"), "tiny": self.tiny,
            "done": bool(calls) and calls[-1]["outcome"] == "done" and (calls is not self.state["calls"]
                                                                         or self.state["done"]),
            "stages": list(stages.values()), "wall_s": round(wall, 1),
            # engine start visible in the wall time: what stages waited for a model to load or a server to be
            # ready (a server started early, while other stages worked, costs only what is left of its start)
            "engine_start_s": round(start, 1), "engine_start_fraction": round(start / wall, 4) if wall else None,
            "work_s": round(work, 1), "wall_over_work": round(wall / work, 3) if work else None,
            "dvc_between_stages_s": round(sum(s.get("dvc_gap_s") or 0.0 for s in stages.values()), 1),
            "stage_wall_s": round(sum(s["wall_s"] for s in stages.values()), 1),
            "suites": suites, "fixed_cost_per_model_suite": self.fixed_costs(stages, suites),
            "servers": servers, "server_starts": sum(len(v["starts_s"]) for v in servers.values()),
            # what the stages' own records say they started (a phase's: `servers` reads the whole run's logs)
            "server_starts_in_stages": sum(s["server_starts"] for s in stages.values()),
            "resumed": sum(c["outcome"] == "cut" for c in calls[:-1]),  # a call after a cut resumes the run
            "cuts": sum(c["outcome"] == "cut" for c in calls), "calls": calls, "setup_s": self.state["setup_s"],
            "bytecode_s": self.state.get("bytecode_s"),
            "python_dont_write_bytecode": self.state.get("python_dont_write_bytecode"),
            # 1: the run's holder (and so its servers) lived through every cut; more: the machine ended them
            "run_holders": self.state.get("holders", 0),
            "model": self.state["model"], "suite_limit": self.state.get("suite_limit"),
            # this script's calls, each from its start to the end of its dvc repro (setup included): what they hold
            # of a lease, beside the carries, the unpacking and the machine's start
            "calls_s": round(sum(c.get("call_s") or 0.0 for c in calls), 1),
            "variants": self.variant_figures(),
            # the servers' plan on this GPU as `quantize warm` printed it (engine.kv_cache_memory: fitted), and the GPU
            "server_plan": self.server_plan(), "gpu": gpu_name(),
            # at the end of each call: each server's GPU memory (nvidia-smi) beside its plan's
            "gpu_samples": self.state.get("gpu_samples", []),
        }

    def server_plan(self) -> dict | None:
        try:
            return json.loads((self.work / "servers" / "plan" / "servers.json").read_text())
        except (OSError, ValueError):
            return None

    def variant_figures(self) -> dict:
        """Per built variant, from its quant.json: the scheme (FP8 of a MoE: its experts' own), the W4A16 group, and
        what verify found of the vision tower (every tensor bit-identical to the base's, or the stage refused)."""
        out = {}
        for quant in sorted((self.project / "models").glob("*/quant.json")):
            try:
                info = json.loads(quant.read_text())
            except (OSError, ValueError):
                continue
            vision = (info.get("verify") or {}).get("vision") or {}
            out[quant.parent.name] = {"scheme": info.get("scheme"), "group_size": info.get("group_size"),
                                      "expert_scheme": info.get("expert_scheme"),
                                      "quantized_modules": info.get("quantized_modules"),
                                      "size_bytes": info.get("size_bytes"),
                                      "vision_tensors": vision.get("vision_tensors"),
                                      "vision_mismatched": vision.get("mismatched")}
        return out

    def stage_figures(self, records: list[dict]) -> dict[str, dict]:
        """Per stage, every attempt: its process's wall time, engine start (waits), work, and the time DVC took
        between the previous stage's end and this one's start (hashing, locking, checks). A cut attempt that could
        not record its end (killed) counts from its start to the end of the call that cut it (`cut_attempts`).
        Work started ahead of the stage (pipeline/scoring/ahead.py) is counted apart: `ahead_*`, each job's wall and work."""
        stages: dict[str, dict] = {}
        previous_end, open_begins = None, {}
        for r in records:
            name = r.get("stage") or " ".join(r["command"])
            s = stages.setdefault(name, self._new_stage(name))
            if r.get("event") == "begin":
                if not r.get("ahead"):
                    open_begins.setdefault(name, []).append(r["began_at"])
                continue
            starts = sum(e.get("server") == "started" for e in r.get("engines", []))
            if r.get("ahead"):
                s["ahead_jobs"] += 1
                s["ahead_wall_s"] = round(s["ahead_wall_s"] + (r.get("wall_s") or 0.0), 2)
                s["ahead_work_s"] = round(s["ahead_work_s"] + (r.get("work_s") or 0.0), 2)
                s["server_starts"] += starts
                continue
            if open_begins.get(name):
                open_begins[name].pop()
            s["attempt_walls_s"].append(round(r.get("wall_s") or 0.0, 2))
            s["wall_s"] = round(s["wall_s"] + (r.get("wall_s") or 0.0), 2)
            s["engine_start_s"] = round(s["engine_start_s"] + (r.get("engine_start_s") or 0.0), 2)
            s["work_s"] = round(s["work_s"] + (r.get("work_s") or 0.0), 2)
            s["ahead_wait_s"] = round(s["ahead_wait_s"] + (r.get("ahead_wait_s") or 0.0), 2)
            began = (r.get("ended_at") or 0.0) - (r.get("wall_s") or 0.0)
            if previous_end is not None and r.get("ended_at") and 0 <= began - previous_end < 120:
                s["dvc_gap_s"] = round(s["dvc_gap_s"] + began - previous_end, 2)  # the same call's DVC time
            previous_end = r.get("ended_at")
            s["attempts"] += 1
            s["server_starts"] += starts
            s["server_attaches"] += sum(e.get("server") == "attached" for e in r.get("engines", []))
            s["exited_0"] = s.get("exited_0", False) or r.get("exit") == 0
        self._cut_attempts(stages, open_begins)
        # finished: recorded in dvc.lock. A stage whose command ended but whose outputs DVC had not yet hashed and
        # recorded when the cut came is run again by the next `dvc repro`, as DVC must: it is not finished.
        locked = self.locked_stages()
        for name, s in stages.items():
            s["finished"] = name in locked
        return stages

    @staticmethod
    def _new_stage(name: str) -> dict:
        return {"name": name, "wall_s": 0.0, "engine_start_s": 0.0, "work_s": 0.0, "dvc_gap_s": 0.0, "attempts": 0,
                "attempt_walls_s": [], "cut_attempts": 0, "server_starts": 0, "server_attaches": 0,
                "ahead_wait_s": 0.0, "ahead_jobs": 0, "ahead_wall_s": 0.0, "ahead_work_s": 0.0, "finished": False}

    def _cut_attempts(self, stages: dict, open_begins: dict) -> None:
        """A begin without its end: the stage was killed by a cut; it ran until the end of the call it began in."""
        calls = [c for c in self.state["calls"] if c.get("began_at")]
        for name, begins in open_begins.items():
            for began in begins:
                call = next((c for c in calls if c["began_at"] - 1 <= began <= c["ended_at"]), None)
                if call is None:
                    continue
                wall = round(call["ended_at"] - began, 2)
                s = stages[name]
                s["attempt_walls_s"].append(wall)
                s["wall_s"] = round(s["wall_s"] + wall, 2)
                s["attempts"] += 1
                s["cut_attempts"] += 1

    def suite_figures(self, stages: dict) -> list[dict]:
        """Per model and suite, from its results/<model>/<suite>.json: items, time split, items/s."""
        rows = []
        for path in sorted((self.project / "results").glob("*/*.json")):
            try:
                summary = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(summary, dict) or "suite" not in summary or path.stem != summary.get("suite"):
                continue
            work = summary.get("work_seconds")
            rows.append({"model": path.parent.name, "suite": path.stem, "n": summary.get("n"),
                         "status": summary.get("status") or "scored", "seconds": summary.get("seconds"),
                         "setup_s": summary.get("setup_seconds"), "work_s": work,
                         "engine_start_s": summary.get("engine_start_s"),
                         "items_per_s": round(summary["n"] / work, 3) if work and summary.get("n") else None,
                         "lengths": sorted({int(i.split("-")[1]) for i in self.item_ids(path)})
                         if path.stem == "long_context" else None})
        return rows

    def item_ids(self, summary_path: Path) -> list[str]:
        lines = summary_path.with_suffix(".jsonl")
        return [json.loads(l)["id"] for l in lines.read_text().splitlines() if l.strip()] if lines.exists() else []

    @staticmethod
    def fixed_costs(stages: dict, suites: list[dict]) -> dict:
        """The time a suite costs beyond scoring its items and starting engines: its setup in the stage (the task,
        its documents and requests), plus its share of the stage's process (start, imports, checks, writing) and
        of DVC's time before the stage. Per model: the evaluate stage's fixed cost over its suites."""
        out = {}
        for model in sorted({r["model"] for r in suites}):
            stage = stages.get(f"evaluate@{model}")
            rows = [r for r in suites if r["model"] == model]
            if not stage or not rows:
                continue
            inside = sum((r["seconds"] or 0.0) for r in rows)
            process = max(0.0, stage["wall_s"] - inside)
            setup = sum((r["setup_s"] or 0.0) for r in rows)
            out[model] = {"suites": len(rows), "process_s": round(process, 2), "dvc_s": stage["dvc_gap_s"],
                          "setup_s": round(setup, 2),
                          "per_suite_s": round((process + stage["dvc_gap_s"] + setup) / len(rows), 2)}
        return out

    def server_figures(self) -> dict:
        """Per model: each server start's duration (the supervisor's note in the server's log) and the most requests
        it held, from its own periodic stats lines (vLLM's `Running: N reqs, Waiting: M reqs`, every 10 s)."""
        import re

        out = {}
        for log in sorted((self.project / "results").glob("*/vllm-server.log")):
            text = log.read_text(errors="replace")
            starts = [float(m) for m in re.findall(r"\[quantize\] server ready after ([0-9.]+) s", text)]
            loads = [(int(r), int(w)) for r, w in re.findall(r"Running: (\d+) reqs, Waiting: (\d+) reqs", text)]
            out[log.parent.name] = {"starts_s": starts, "starts": len(starts),
                                    "commands": text.count("\n$ ") + text.startswith("$ "),
                                    "peak_in_flight": max((r for r, _ in loads), default=0),
                                    "peak_waiting": max((w for _, w in loads), default=0),
                                    "stats_lines": len(loads)}
        return out

    def batch_size(self) -> int | None:
        """engine.batch_size of the run: the requests its engine keeps in flight."""
        try:
            import yaml

            return int(yaml.safe_load((self.project / "params.yaml").read_text())["engine"]["batch_size"])
        except (OSError, KeyError, TypeError, ValueError):
            return None

    @staticmethod
    def stall_figures(records: list[dict]) -> tuple[list[dict], list[dict]]:
        """(stalls: every wait on an idle server longer than 30 s; lost: every time the watchdog asked again what a
        server had lost, pipeline/engines/inflight.py), from the stage log (each process records its own)."""
        seen = {}
        for r in records:
            for stall in r.get("stalls") or []:
                seen[(stall["server"], stall["at"])] = {**stall, "stage": r.get("stage"), "ahead": r.get("ahead")}
        lost = sorted(seen.values(), key=lambda stall: stall["at"])
        return [stall for stall in lost if stall["idle_s"] > 30], lost

    def report(self, final: bool = True) -> dict:
        """$OUT/gpu_dvc_repro.json (the figures), $OUT/report/ (the page and the verdict the run rendered, links
        followed) and $OUT/run.tar.gz (the stage log, the DVC logs, the servers' logs, every bench.json and results
        summary, params.yaml and dvc.lock): few files, as the GPU machine sends back at most eight."""
        import tarfile

        figures = self.figures()
        figures["phases"] = self.phase_figures()
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "gpu_dvc_repro.json").write_text(json.dumps(figures, indent=1))
        report = OUT / "report"
        for name in ("index.html", "verdict.json"):
            page = self.project / "reports" / name
            if page.exists():
                report.mkdir(parents=True, exist_ok=True)
                (report / name).write_bytes(page.read_bytes())
        results = self.project / "results"
        kept = [self.stage_log, self.project / "params.yaml", self.project / "dvc.lock",
                *(Path(c["log"]) for c in self.state["calls"]), *sorted(results.glob("*/*.json")),
                *sorted(results.glob("*/*.log")), *sorted((self.project / ".cache" / "forkserver").glob("*.log"))]
        with tarfile.open(OUT / "run.tar.gz", "w:gz") as bundle:
            for path in kept:
                if path.is_file():
                    bundle.add(path, arcname=str(path.relative_to(self.work if self.work in path.parents else
                                                                   path.parent.parent)))
        if self.state["done"] and final:  # xz on ~50 MB of results takes a while: once, at the end (not before a
            # fix is added to the finished run: --keep)
            self.report_inputs(OUT / "report_inputs.tar.xz")
        return figures

    def report_inputs(self, out: Path) -> None:
        """Everything `quantize report` read, with paths as in the project, and the run's environment, xz
        compressed (benchmarks/report_bundle.py pack): kept in the repo, it lets the GPU example report be
        rendered again on the CPU when the report changes (`make example-gpu-report`)."""
        sys.path.insert(0, str(REPO / "benchmarks"))
        from report_bundle import pack

        pack(self.project, out)

NEEDED = {"dvc": "benchmarks/gpu_dvc_wheels.sh (.device/dvc-wheels)", "typer": "benchmarks/gpu_dvc_wheels.sh",
          "aiohttp": "the image",
          "scipy": "benchmarks/gpu_dvc_wheels.sh --scipy (.device-scipy, a call of its own)",
          "httpx": "wheels.sh (device notes)", "jinja2": "the image", "yaml": "the image",
          "lm_eval": "wheels.sh (device notes)", "llmcompressor": "wheels.sh (device notes)",
          "math_verify": "wheels.sh (device notes)"}


def preflight(tiny: bool, vllm: bool = True) -> None:
    """Everything the run needs is importable, and (vllm) vLLM is unpacked: one message listing what is not, exit 2.
    `setup` needs no vLLM: it can run in the call that carries the first parts."""
    import importlib.util

    missing = [f"{name} (from {where})" for name, where in NEEDED.items() if importlib.util.find_spec(name) is None]
    if vllm and not tiny and not (Path(VSITE) / "vllm").is_dir():
        missing.append(f"vLLM in {VSITE} (the five .vllm-k parts of the team's device notes)")
    if missing:
        print("cannot run: missing " + "; ".join(missing), file=sys.stderr)
        raise SystemExit(2)


def print_table(figures: dict) -> None:
    model = figures.get("model") or {}
    built = model.get("built") or {}
    print(f"\nbase: {model.get('name')} ({model.get('shapes')}; built with {built.get('num_hidden_layers')} text layers"
          + (f"; planned {model['layers']}: {model['disk']['why']}" if model.get("layers") else "") + ")")
    for name, v in (figures.get("variants") or {}).items():
        print(f"  {name}: {v['scheme']}" + (f", vision tower: {v['vision_tensors']} tensors, "
                                            f"{len(v['vision_mismatched'] or [])} changed" if v["vision_tensors"] else ""))
    print("\n| stage | wall s | work s | ahead work s | engine start s | DVC before s | attempts (cut) |\n"
          "|---|---|---|---|---|---|---|")
    for s in figures["stages"]:
        print(f"| {s['name']} | {s['wall_s']:.0f} | {s['work_s']:.0f} | {s.get('ahead_work_s', 0):.0f} | "
              f"{s['engine_start_s']:.1f} | {s['dvc_gap_s']:.1f} | {s['attempts']} ({s.get('cut_attempts', 0)}) |")
    fixed = figures["fixed_cost_per_model_suite"]
    if fixed:
        print("\nfixed cost per (model, suite): " + ", ".join(f"{m} {f['per_suite_s']:.2f} s" for m, f in fixed.items()))
    print(f"server starts: {figures['server_starts']} " + ", ".join(
        f"{m} {v['starts_s']} (peak {v.get('peak_in_flight', 0)} running)" for m, v in figures["servers"].items()))
    print(f"batch_size {figures.get('batch_size')}; stalls over 30 s: {len(figures.get('stalls') or [])}; requests "
          f"asked again after a server lost them: {sum(x['requests'] for x in figures.get('lost_requests') or [])}")
    ratio = figures["wall_over_work"]
    print(f"\nwhole matrix: {figures['wall_s']:.0f} s of dvc repro over {len(figures['calls'])} call(s), work "
          f"{figures['work_s']:.0f} s (of it ahead of its stage {figures.get('ahead_work_s', 0):.0f} s; wall / work "
          f"{ratio or 0:.2f}), engine start visible {figures['engine_start_s']:.0f} s "
          f"({(figures['engine_start_fraction'] or 0):.1%}), DVC between stages {figures['dvc_between_stages_s']:.0f} s, "
          f"cut and resumed {figures['resumed']} time(s); setup {figures['setup_s']} s (bytecode {figures['bytecode_s']} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["setup", "run", "report", "reset"],
                        help="setup: only set the run up (the random base, bytecode), e.g. in the call that unpacks vLLM")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds of dvc repro in this call")
    parser.add_argument("--tiny", action="store_true", help="CPU check: tiny Glm, tests/openai_server.py as vLLM")
    parser.add_argument("--suite-limit", type=int, default=None, help="items per suite (default: every item)")
    parser.add_argument("--target", nargs="*", default=[], help="run `dvc repro TARGET...` only (and what they need)")
    parser.add_argument("--no-share", action="store_true", help="every stage starts its own server (to compare)")
    parser.add_argument("--grace", type=float, default=180.0,
                        help="seconds the run (and its vLLM servers) waits for the next call after a cut")
    parser.add_argument("--work", default=None, help="where the run lives (default /tmp/gpu-dvc[-tiny])")
    parser.add_argument("--fix", action="append", default=[], metavar="VARIANT",
                        help="add VARIANT's fix (quantize profile --fix): at setup, before the run; on a finished run, "
                             "as a new phase that runs only what it adds (repeatable)")
    parser.add_argument("--keep", action="store_true",
                        help="a finished run keeps its servers --grace seconds (for a fix added next, `run --fix`)")
    parser.add_argument("--model", choices=sorted(BASES), default=None,
                        help=f"the base, at the first call (default {DEFAULT_BASE}; later calls keep the run's): "
                             + "; ".join(f"{b.name}: {b.words}" for b in BASES.values()))
    parser.add_argument("--depth", type=int, default=None,
                        help="text layers of a vision base (default: glm46v-flash the published 40, glm46v-moe as many "
                             "as the disk holds)")
    args = parser.parse_args()
    work = Path(args.work or ("/tmp/gpu-dvc-tiny" if args.tiny else "/tmp/gpu-dvc"))
    if args.action == "reset":
        if work.exists():
            Run(work, args.tiny).release()
        shutil.rmtree(work, ignore_errors=True)
        print(f"removed {work}")
        return
    run = Run(work, args.tiny)
    if args.action in ("setup", "run"):
        started = time.perf_counter()
        preflight(args.tiny, vllm=args.action == "run")
        fresh = run.state["setup_s"] is None
        if not fresh and args.model and args.model != run.base_model.name:
            print(f"--model {args.model}: the run in {work} is {run.base_model.name}'s; `reset` it first (or give "
                  "another --work)", file=sys.stderr)
            raise SystemExit(2)
        if args.depth is not None and (args.depth < 2 or BASES[args.model or DEFAULT_BASE].text is None):
            print("--depth: a vision base's text layers (--model glm46v-flash or glm46v-moe), at least 2", file=sys.stderr)
            raise SystemExit(2)
        if fresh:
            run.setup(args.suite_limit, share=not args.no_share, fixes=args.fix, model=args.model or DEFAULT_BASE,
                      depth=args.depth)
            print(f"set up {run.project} in {run.state['setup_s']} s", flush=True)
        if args.action == "setup":
            print("state: set up; `run` starts dvc repro")
            return
        applied = {v for phase in run.state["phases"] for v in phase.get("fixes", [])}
        added = [v for v in dict.fromkeys(args.fix) if v not in applied]
        if added and run.state["done"]:
            run.new_phase(added)
        elif added and not fresh:
            raise SystemExit(f"--fix {' '.join(added)}: the run is not done yet; finish it first (or give --fix at setup)")
        if run.state["done"]:
            print("state: done (nothing to run; `run --fix V` adds a fix to it, `reset` starts over)")
        else:
            outcome = run.call(args.budget - (time.perf_counter() - started), args.target, args.grace, keep=args.keep)
            run.state["calls"][-1]["call_s"] = round(time.perf_counter() - started, 1)  # setup included: the lease's
            run.save()
            print(f"dvc repro: {outcome}", flush=True)
            if outcome.startswith("failed"):
                print(Path(run.state["calls"][-1]["log"]).read_text()[-4000:])
    figures = run.report(final=not args.keep)
    print_table(figures)
    print(f"state: {'done' if figures['done'] else 'call again to resume'}; figures in {OUT / 'gpu_dvc_repro.json'}")


if __name__ == "__main__":
    main()
