"""A model card's deployment section: how to run the published checkpoint, by its repository id (a local record: by
its folder), with the engine the registry names for serving a Hub checkpoint (EngineSpec.hub_serving: vLLM, in
Python and as a server) and with transformers, whether a run of a checkpoint like it was recorded on the GPU machine
(pipeline/checkpoints/serving.py: shown, refused, or not tried), how that differs from what scored it, the GPU
memory it needs, and its speed.

The serving engine's flags are the ones the recorded run served it with (the verdict's serving entry), or, for a
verdict written before entries carried their command, those its scheme needs (serving.vllm_serve_command). An
engine that needs this project's `quantize export` first (lmdeploy) is left out. No engine is named here by a
string: its name, what people call it and how it serves come from the registry. Nothing here reads a file.
"""

from __future__ import annotations

import json
import shlex

import pipeline.verdict.figures as figures
from pipeline.checkpoints.serving import vllm_serve_command
from pipeline.outputs import human_size
from pipeline.report.card_text import md, method_module, loads_from
from pipeline.engines import ENGINES, hub_serving, shown_as
from pipeline.report.deploy import memory, served_by, speed_state

PROMPT = "Give me three tips for writing a clear bug report."


def serving_record(entry: dict) -> dict:
    """The verdict's record of the Hub-serving engine for this variant (its serving entry), {} when none."""
    engine = hub_serving()
    return ((entry.get("serving") or {}).get(engine) or {}) if engine else {}


def vllm_flags(entry: dict, source: dict | None) -> list[str]:
    """The flags the serving engine's server takes for this checkpoint: the recorded run's (or the command to try),
    else what its scheme needs."""
    command = serving_record(entry).get("command")
    if not command:
        kv = (entry.get("quant") or {}).get("kv_cache")
        command = vllm_serve_command(kv not in (None, "none"), (source or {}).get("dtype"))
    words, plain = shlex.split(command), shlex.split(vllm_serve_command(False, None))  # `<server> serve DIR`
    return words[len(plain):] if words[:len(plain)] == plain else []


def python_arguments(flags: list[str]) -> list[str]:
    """`vllm serve` flags as vllm.LLM's keyword arguments: --kv-cache-dtype fp8 -> kv_cache_dtype="fp8", a JSON
    value as the Python value it is, a flag alone as True."""
    found, i = [], 0
    while i < len(flags):
        key = flags[i].lstrip("-").replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            raw = flags[i + 1]
            try:
                value = json.loads(raw) if raw[:1] in "[{" else raw
            except ValueError:
                value = raw
            found.append(f"{key}={json.dumps(value) if isinstance(value, str) else repr(value)}")
            i += 2
        else:
            found.append(f"{key}=True")
            i += 1
    return found


def serving_name() -> str:
    """The Hub-serving engine as people call it (vLLM)."""
    engine = hub_serving()
    return shown_as(engine) if engine else "a serving engine"


def vllm_state(entry: dict, name: str) -> dict:
    """The Hub-serving engine's row of where the variant is served (pipeline/report/deploy.py: shown, refused or not
    tried)."""
    engine = hub_serving()
    return next((row for row in served_by(entry.get("serving"), name) if row["engine"] == engine),
                {"state": "not tried", "detail": ""})


def _serve_words(repo: str, flags: list[str]) -> list[str]:
    """The server command: the recorded command's words (`vllm serve DIR ...`) with the repository for DIR."""
    engine = hub_serving()
    command = shlex.split(vllm_serve_command(False, None)) if engine else []
    return [*(w for w in command if w != "DIR"), repo, *(shlex.quote(f) for f in flags)]


def _vllm(entry: dict, name: str, repo: str, source: dict | None, vision: bool) -> list[str]:
    engine = hub_serving()
    if engine is None:
        return []
    called, package = serving_name(), ENGINES[engine].package or engine
    row, record = vllm_state(entry, name), serving_record(entry)
    arch = (entry.get("quant") or {}).get("architecture")
    checkpoint = f"a {md(arch)} checkpoint" if arch else "a checkpoint of this architecture"
    if row["state"] == "refused":
        return [f"**{called}**: {md(row['detail'])}, so it is not served with {called}; transformers loads it (below)."]
    if row["state"] == "shown":
        tested = (f"{called} {md(record.get('version') or '')} served {checkpoint} in this format "
                  f"({md(record.get('date') or 'date not recorded')}).")
    else:
        tested = (f"Not yet served with {called}: no {called} run of {checkpoint} in this format was recorded. "
                  f"These are the commands {called} takes for it.")
    flags = vllm_flags(entry, source)
    arguments = ", ".join([f'model="{repo}"', *python_arguments(flags)])
    content = ('[{"type": "image_url", "image_url": {"url": "https://example.com/image.png"}}, '
               '{"type": "text", "text": "Describe the image."}]' if vision else f'"{PROMPT}"')
    return [f"**{called}**. {tested}", "",
            "```python", f"from {package} import LLM, SamplingParams", "",
            f"llm = LLM({arguments})",
            f'messages = [{{"role": "user", "content": {content}}}]',
            "outputs = llm.chat(messages, SamplingParams(temperature=0, max_tokens=256))",
            "print(outputs[0].outputs[0].text)", "```", "",
            "As an OpenAI-compatible server:", "",
            "```bash", " ".join(_serve_words(repo, flags)), "```"]


def _transformers(quant: dict, repo: str, vision: bool) -> list[str]:
    module = method_module(quant)
    what = f"its {module.CARD_WEIGHTS}" if module is not None else "its weights"
    head = (f"**transformers** (with the `compressed-tensors` package) loads it too, decompressing {what} at load: "
            "right for checking its answers, not a serving speed.")
    if vision:
        body = ["from transformers import AutoModelForImageTextToText, AutoProcessor", "",
                f'model_id = "{repo}"',
                "processor = AutoProcessor.from_pretrained(model_id)",
                'model = AutoModelForImageTextToText.from_pretrained(model_id, device_map="auto")',
                'messages = [{"role": "user", "content": [{"type": "image", "path": "image.png"}, '
                '{"type": "text", "text": "Describe the image."}]}]',
                "inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, "
                'return_dict=True, return_tensors="pt").to(model.device)',
                "outputs = model.generate(**inputs, max_new_tokens=256)",
                'print(processor.decode(outputs[0][inputs["input_ids"].shape[-1]:], skip_special_tokens=True))']
    else:
        body = ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                f'model_id = "{repo}"',
                "tokenizer = AutoTokenizer.from_pretrained(model_id)",
                'model = AutoModelForCausalLM.from_pretrained(model_id, device_map="auto")',
                f'messages = [{{"role": "user", "content": "{PROMPT}"}}]',
                "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, "
                'return_tensors="pt").to(model.device)',
                "outputs = model.generate(**inputs, max_new_tokens=256)",
                'print(tokenizer.decode(outputs[0][inputs["input_ids"].shape[-1]:], skip_special_tokens=True))']
    return [head, "", "```python", *body, "```"]


def gpu_memory(name: str, entry: dict, verdict: dict) -> list[str]:
    """What it holds on the GPU: its weights (the checkpoint's size), and what a recorded bench measured of its
    weights and KV cache pool."""
    quant = entry.get("quant") or {}
    size, base_size = quant.get("size_bytes"), quant.get("base_size_bytes")
    lines = []
    if size:
        lines.append(f"- weights: {human_size(size)}" + (f", {figures.share(size / base_size)} of the base's "
                                                          f"{human_size(base_size)}" if base_size else ""))
    row = (verdict.get("speed") or {}).get(name) or {}
    cap = row.get("capacity") or {}
    if cap.get("weight_bytes") and cap.get("kv_cache_bytes"):
        share = (row.get("engine_settings") or {}).get("gpu_memory_utilization")
        lines.append(f"- as the bench measured it (Speed, below): weights {human_size(cap['weight_bytes'])} + KV cache pool "
                     f"{human_size(cap['kv_cache_bytes'])}" + (f" ({cap['kv_cache_tokens']:,} tokens)"
                                                                 if cap.get("kv_cache_tokens") else "")
                     + (f", the server given {figures.share(share)} of the GPU's memory" if share else ""))
    lines.append(f"- the KV cache comes on top of the weights: {serving_name()} gives it what `--gpu-memory-utilization` "
                 "leaves of the GPU, and `--max-model-len` bounds what one request may hold")
    return lines


def speed(name: str, entry: dict, verdict: dict, speed_engine: str | None) -> list[str]:
    """Its speed where a bench measured it (tokens/s by requests in flight, on which device), else "not measured"."""
    state = speed_state(name, entry, verdict.get("speed") or {}, speed_engine, human_size)
    if state["state"] != "measured":
        return ["- not measured" + (f": {md(state['more'][0])}" if state["state"] == "refused" and state["more"] else "")]
    row = (verdict.get("speed") or {}).get(name) or {}
    more = [m for m in state["more"] if m != memory(row, human_size)]  # the GPU memory section says it
    lines = [f"- {md(state['text'])}" + (f" ({md('; '.join(more))})" if more else "")]
    for load in row.get("loads") or ([{"label": None, "tokens_per_s": row["tokens_per_s"]}] if row.get("tokens_per_s")
                                     else []):
        which = f" ({md(load['label'])})" if load.get("label") else ""
        lines.append(f"- output tokens/s by requests in flight{which}: "
                     + ", ".join(f"{c}: {figures.rate(v)}" for c, v in load["tokens_per_s"].items()))
    lines.append(f"- measured with {md(shown_as(row.get('engine') or ''))} {md(row.get('engine_version') or '')} on "
                 f"{md(row.get('device'))}, {md(row.get('date') or '')}, {row.get('input_len')} tokens in, "
                 f"{row.get('output_len')} out per request"
                 + "".join(f"; {md(load['label'])}: {images_sent(load)}" for load in row.get("loads") or []
                           if load.get("images_per_request")))
    return lines


def images_sent(load: dict) -> str:
    """"the same text with 1 image of 1024 x 1024 pixels (1,369 tokens each, by the model's image processor), 1,525 KV
    tokens a request"."""
    size = load.get("image_size")
    shown = f" of {size[0]} x {size[1]} pixels" if isinstance(size, list) and len(size) == 2 else ""
    tokens = load.get("image_tokens_per_image")
    each = f" ({tokens:,} tokens each, by the model's image processor)" if isinstance(tokens, int) else (
        f" ({tokens} tokens each on average, by the model's image processor)" if tokens is not None else "")
    kv = load.get("kv_tokens_per_request")
    return (f"the same text with {load['images_per_request']} image{'s' if load['images_per_request'] != 1 else ''}"
            f"{shown}{each}" + (f", {kv:,} KV tokens a request" if kv is not None else ""))


def deployment(name: str, entry: dict, verdict: dict, *, repo_id: str | None, source: dict | None, vision: bool,
               speed_engine: str | None) -> list[str]:
    """The deployment section's lines (under its heading)."""
    repo = loads_from(name, repo_id)
    quant = entry.get("quant") or {}
    lines = [*_vllm(entry, name, repo, source, vision), "", *_transformers(quant, repo, vision), "",
              "### GPU memory", "", *gpu_memory(name, entry, verdict), "",
              "### Speed", "", *speed(name, entry, verdict, speed_engine)]
    return lines



# ---------------------------------------------------------------- what scored it against what serves it; requirements

def scored_and_served(name: str, entry: dict, verdict: dict, source: dict | None, run: dict | None) -> str | None:
    """How what scored the variant differs from what serves it, in one sentence; None when the serving engine scored
    it. "Its figures were scored with transformers in float32 on the CPU (FP8 simulated: ...); served with vLLM it runs
    on vLLM's own kernels with --dtype bfloat16, which was not scored: its answers may differ slightly"."""
    from pipeline.report.card_evaluation import scored_by

    engine = hub_serving()
    used = scored_by(name, verdict) or ([run["engine"]] if (run or {}).get("engine") else [])
    if engine is None or not used or engine in used:
        return None
    dtype = (run or {}).get("dtype")
    machine = (verdict.get("environment") or {}).get("machine")
    precision = ((entry.get("serving") or {}).get(used[0]) or {}).get("precision")
    flags = vllm_flags(entry, source)
    served_dtype = flags[flags.index("--dtype") + 1] if "--dtype" in flags[:-1] else None
    return (f"its figures were scored with {', '.join(shown_as(e) for e in used)}"
            + (f" in {dtype}" if dtype else "") + (f" on {machine}" if machine else "")
            + (f" ({precision})" if precision else "")
            + f"; served with {serving_name()} it runs on {serving_name()}'s own kernels"
            + (f" in {served_dtype}" if served_dtype else "")
            + ", which was not scored: its answers may differ slightly from those scored here")


GPU_CLASS = {  # what a scheme's compute needs of an NVIDIA GPU (vLLM's kernels for compressed-tensors), by weights
    "FP8": "compute capability 8.9 or newer (Ada Lovelace, Hopper or later) for FP8 compute; older GPUs (8.0+) run "
           "FP8 weights only through a weight-only kernel",
    "W4A16": "compute capability 8.0 or newer (Ampere or later) for its 4-bit weight kernels",
    "W8A16": "compute capability 8.0 or newer (Ampere or later) for its 8-bit weight kernels",
}


def requirements(name: str, entry: dict, verdict: dict) -> list[str]:
    """The software it was built, scored and served with (the versions recorded, as minimums that were tested) and
    the GPU class its scheme needs."""
    packages = (verdict.get("environment") or {}).get("packages") or {}
    record, engine = serving_record(entry), hub_serving()
    tested = [f"{package} {packages[package]}" for package in ("transformers", "compressed-tensors")
              if packages.get(package)]
    lines = []
    if engine:
        served = record.get("version") if vllm_state(entry, name)["state"] == "shown" else None
        lines.append(f"- {serving_name()}: " + (f"{md(served)} or newer (the version that served a checkpoint like "
                                                   "it)" if served else "no version recorded serving it"))
    if tested:
        lines.append(f"- transformers loading: {md(', '.join(tested))} or newer (the versions it was built and scored "
                     "with)")
    scheme = str((entry.get("quant") or {}).get("scheme") or "")
    gpu = next((text for key, text in GPU_CLASS.items() if key in scheme), None)
    lines.append(f"- GPU: an NVIDIA GPU of {gpu}" if gpu else "- GPU: any the serving engine runs its format on")
    return lines
