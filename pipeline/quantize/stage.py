"""Shared driver for every quantization method: plan, load, calibrate with llm-compressor, save, verify.

A method module (awq.py, fp8.py) only builds its recipe (a list of modifiers) and its
`quant.json` description; everything else happens here, the same way for each method.

Placement: a model that fits on the accelerator with its calibration working set is moved there
whole (fastest); a larger one stays on the host and llm-compressor's sequential pipeline brings one
decoder layer at a time onto the accelerator (compressed-tensors offloading), so device memory is
about one layer plus its calibration activations. Every run prints its plan first (layers, memory
on device and host, placement and why); `plan_only` adds a one-layer probe on this machine
(probe.py) for the expected time and writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints import config_json
from pipeline.checkpoints.loading import load_model, meta_model
from pipeline.checkpoints.serving_names import finish_config
from pipeline.checkpoints.serving import serving_support
from pipeline.errors import UserError
from pipeline.formats.quant_json import write_quant_json
from pipeline.outputs import Stopwatch, atomic_dir, dir_size, human_size
from pipeline.quantize import plan

log = logging.getLogger(__name__)


@dataclass
class QuantResult:
    out: Path
    info: dict

    def summary(self) -> str:
        i = self.info
        return (
            f"{i['method']}: wrote {self.out} ({i['scheme']}, {human_size(i['size_bytes'])}, "
            f"{i['calibration']['blocks']} x {i['calibration']['seq_len']} calibration tokens) "
            f"in {i['seconds']['total']:.0f} s"
        )


def read_calibration(calib: Path) -> tuple[list[list[int]], str, list[dict]]:
    """The token blocks of a calib.jsonl written by `quantize calib`, their digest, and the held-out
    conversations written beside them (holdout.jsonl), if any. A raw conversation file is prepared
    into blocks by the CLI (`quantize awq --calib logs.jsonl`) before a stage runs."""
    from pipeline.formats.calib_blocks import is_blocks_file, read_blocks
    from pipeline.formats.holdout import read_holdout

    calib = Path(calib)
    if not is_blocks_file(calib):
        raise UserError(f"{calib}: not calibration blocks; build them with `quantize calib` (or pass the "
                        "conversation file to `quantize awq --calib`, which prepares it)")
    blocks = read_blocks(calib)
    held = read_holdout(calib.with_name("holdout.jsonl"), missing_ok=True)
    if not blocks:
        raise UserError(f"{calib}: no calibration blocks")
    lengths = {len(b) for b in blocks}
    if len(lengths) != 1:
        raise UserError(f"{calib}: calibration blocks differ in length ({sorted(lengths)}); rebuild with `quantize calib`")
    digest = hashlib.sha256(json.dumps(blocks).encode()).hexdigest()
    return blocks, digest, held


def check_blocks(held: list[dict], tokenizer, blocks: list[list[int]], count: int = 2) -> tuple[list[list[int]], str]:
    """Up to `count` blocks for the per-layer error check, cut from the held-out conversations
    (with their reference answers), which calibration never saw; the last calibration blocks
    when there are none."""
    seq_len = len(blocks[0])
    stream: list[int] = []
    from pipeline.formats.chat import render_chat
    from pipeline.formats.holdout import with_reference

    for row in held:
        text = render_chat(tokenizer, with_reference(row))
        if text is None:
            continue
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(stream) >= count * seq_len:
            break
    if len(stream) >= seq_len:
        return [stream[i * seq_len:(i + 1) * seq_len] for i in range(min(count, len(stream) // seq_len))], "holdout"
    if stream:
        return [stream], "holdout"
    return blocks[-count:], "calibration (no holdout.jsonl beside the blocks)"


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _copy_side_files(model_dir: Path, out: Path) -> None:
    """Tokenizer, processor and chat template files travel with every variant."""
    import shutil

    skip = {"config.json", "model.safetensors.index.json", "source.json", "quant.json", "generation_config.json"}
    for item in model_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name not in skip:
            shutil.copy2(item, out / item.name)


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _quantized_modules(model) -> dict[str, str]:
    modules = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None and scheme.weights is not None:
            modules[name] = type(module).__name__
    return modules


def _set_dtype(model, dtype, work_dtype) -> None:
    """Casts the model and records the dtype in every sub-config too: a VLM's text_config
    would otherwise keep the float32 it was calibrated in, and servers read it from there.
    No cast when it already has that dtype (an offloaded model would be walked for nothing)."""
    if dtype != work_dtype:
        model.to(dtype)
    for config in (model.config, *(getattr(model.config, key, None) for key in model.config.sub_configs)):
        if config is not None:
            config.dtype = dtype


def _free(on_gpu: bool) -> None:
    """Drops the calibrated model before the variant is reloaded: llm-compressor's session holds
    it too, and its save_pretrained wrapper makes a reference cycle."""
    import gc

    import torch
    from llmcompressor.core import active_session

    active_session().reset()
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()


def _gib(n_bytes: float | None) -> str:
    if n_bytes is None:
        return "?"
    return f"{n_bytes / 2**30:.1f} GiB" if n_bytes >= 2**29 else f"{n_bytes / 2**20:.1f} MiB"


def _millions(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"


@dataclass
class Plan:
    """What a run will do and need, before it does anything (and, with a probe, how long it takes)."""
    info: dict

    def summary(self) -> str:
        i = self.info
        lines = [f"plan: {i['method']} of {i['model_dir']} ({i['architecture']}), {i['layers']} decoder layers:"]
        for kind, k in i["kinds"].items():
            lines.append(f"  {k['count']} x {kind}: {_millions(k['params'])} parameters, {_gib(k['bytes'])} each")
        lines.append(f"  outside the layers (embeddings, lm_head, vision tower): {_millions(i['other_params'])} parameters; "
                     f"{i['quantized_linears']} Linears to quantize")
        lines.append(f"calibration: {i['blocks']} blocks x {i['seq_len']} tokens, batch {i['batch_size']}, "
                     f"{i['dtype']}, on {i['device']}" + (f" ({_gib(i['device_free_bytes'])} free)" if i["device_free_bytes"] else ""))
        lines.append(f"placement: {i['placement']} ({i['placement_why']})")
        lines.append(f"memory: device ~ {_gib(i['device_bytes'])} ({i['device_bytes_from']}), host ~ {_gib(i['host_bytes'])} "
                     f"(weights {_gib(i['weights_bytes'])}; this machine {_gib(i['host_total_bytes'])})")
        probe = i.get("probe")
        if probe:
            kinds = ", ".join(f"{kind} {k['seconds']:.2f} s" + (f" (peak {_gib(k['peak_gpu_bytes'])})" if k["peak_gpu_bytes"] else "")
                              for kind, k in probe["kinds"].items())
            e = i["expected"]
            lines.append(f"probe on {probe['device']} ({probe['placement']}, random weights, these blocks and batch): {kinds}; "
                         f"{probe['seconds']:.1f} s in all")
            parts = " + ".join(f"{k['count']} x {k['seconds']:.2f} s" + ("" if k["from"] == "probe" else f" ({k['from']})")
                               for k in e["per_kind"].values())
            lines.append(f"expected calibration: {parts} + {e['fixed_s']:.1f} s fixed + {e['other_s']:.1f} s other passes "
                         f"= {e['calibrate_s']:.0f} s ({e['calibrate_s'] / 60:.1f} min); loading, saving and verifying not included")
        return "\n".join(lines)


def _host_total_bytes() -> int | None:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def make_plan(*, method: str, recipe: list, model_dir: Path, config: dict, blocks: list[list[int]],
              batch_size: int, work_dtype, placement: str, probe_tokens: int) -> Plan:
    """The static plan, from config.json and a model built on the meta device (no weight read)."""
    import torch

    meta = meta_model(model_dir)
    shape = plan.footprint(meta)
    quantized = len(plan.expected_quantized(meta))
    dtype_bytes = torch.empty((), dtype=work_dtype).element_size()
    tokens, batch_tokens = len(blocks) * len(blocks[0]), min(batch_size, len(blocks)) * len(blocks[0])
    is_awq = any("AWQ" in type(m).__name__ for m in recipe)
    kinds = {}
    for kind, k in shape["kinds"].items():
        experts = plan._experts_in(meta.get_submodule(k["first"]))
        quantized += k["count"] * experts * 3  # fused experts load as gate/up/down Linears per expert
        kinds[kind] = {**k, "bytes": k["params"] * dtype_bytes,
                       "working_bytes": plan.working_set_bytes(config, kind, tokens, batch_tokens, dtype_bytes, is_awq)}
    weights = shape["params"] * dtype_bytes
    working = max(k["working_bytes"] for k in kinds.values()) if kinds else 0
    on_gpu = torch.cuda.is_available()
    free = torch.cuda.mem_get_info()[0] if on_gpu else None
    chosen, why = plan.choose_placement(placement, weights, working, free)
    if chosen == "offload" or not on_gpu:
        largest = max((k["bytes"] + k["working_bytes"] for k in kinds.values()), default=0)
        device_bytes = largest + shape["other_params"] * dtype_bytes if on_gpu else None
    else:
        device_bytes = weights + working
    hidden = config_json.text_section(config)["hidden_size"]
    host = plan.host_bytes(shape["params"], dtype_bytes, tokens, hidden, shape["layers"], probe_tokens,
                           offload=chosen == "offload")
    del meta
    return Plan({
        "method": method, "model_dir": str(model_dir), "architecture": config_json.architecture(config, model_dir),
        "layers": shape["layers"], "kinds": kinds, "params": shape["params"], "other_params": shape["other_params"],
        "quantized_linears": quantized, "weights_bytes": weights, "dtype": str(work_dtype).removeprefix("torch."),
        "blocks": len(blocks), "seq_len": len(blocks[0]), "tokens": tokens, "batch_size": min(batch_size, len(blocks)),
        "device": torch.cuda.get_device_name() if on_gpu else "CPU", "device_free_bytes": free,
        "placement": chosen, "placement_why": why,
        "device_bytes": device_bytes if on_gpu else None,
        "device_bytes_from": "estimate" if on_gpu else "no accelerator",
        "host_bytes": host if chosen == "offload" or not on_gpu else max(host, weights),
        "host_total_bytes": _host_total_bytes(),
    })


def add_probe(layout: Plan, recipe: list, model_dir: Path, tokenizer, blocks: list[list[int]], batch_size: int,
              work_dtype) -> Plan:
    """Times one decoder layer of each kind on this machine and multiplies out."""
    from pipeline.quantize import probe

    i = layout.info
    measured = probe.run(recipe, model_dir, tokenizer, blocks, batch_size, work_dtype, i["placement"])
    i["probe"] = measured
    per_kind = {}
    for kind, k in i["kinds"].items():
        if kind in measured["kinds"]:
            per_kind[kind] = {"count": k["count"], "seconds": measured["kinds"][kind]["seconds"], "from": "probe"}
        else:  # a kind the cut-down model does not have: the probed layers' time per parameter
            probed = sum(v["seconds"] for v in measured["kinds"].values()) / max(measured["layer_params"], 1)
            per_kind[kind] = {"count": k["count"], "seconds": probed * k["params"], "from": "scaled by parameters"}
    in_layers = sum(k["count"] * k["seconds"] for k in per_kind.values())
    full_layer_params = sum(k["count"] * k["params"] for k in i["kinds"].values())
    scale = full_layer_params / max(measured["layer_params"], 1)
    other = measured["after_layers_s"] * scale
    i["expected"] = {"calibrate_s": round(measured["before_layers_s"] + in_layers + other, 1),
                     "fixed_s": measured["before_layers_s"], "other_s": round(other, 1), "layers_s": round(in_layers, 1),
                     "per_kind": per_kind}
    peaks = {kind: k["peak_gpu_bytes"] for kind, k in measured["kinds"].items() if k["peak_gpu_bytes"]}
    if peaks:
        worst = max(peaks.values())
        # on the device the whole model stays resident: the probe model's own weights are replaced by the real ones
        i["device_bytes"] = worst if i["placement"] == "offload" else worst - measured["model_bytes"] + i["weights_bytes"]
        i["device_bytes_from"] = "probe"
    return layout


def _execution_device(on_gpu: bool) -> str:
    return "cuda" if on_gpu else "cpu"


def run(*, method: str, scheme: str, recipe: list, model_dir: Path, out: Path, calib: Path,
        batch_size: int, details: dict,
        placement: str = "auto", plan_only: bool = False, calibrate_all_experts: bool = True,
        experts_need_data: bool = True) -> QuantResult | Plan:
    """placement: auto | device | offload (see the module docstring). plan_only: print the plan with
    a one-layer probe's expected time and return it; nothing is loaded or written.
    calibrate_all_experts: False only to show what it prevents (experts left without tokens).
    experts_need_data: False where the recipe gives the experts scales that need no calibration tokens
    (FP8 with dynamic expert activations), so an expert the router never chose fails nothing."""
    import torch

    from pipeline.quantize import verify
    from pipeline.quantize.calibrate import calibrate, needs_data
    from pipeline.quantize.compat import patch_cpu_pin_memory, quiet_cpu_warning

    quiet_cpu_warning()
    if placement not in plan.PLACEMENTS:
        raise UserError(f"placement {placement!r}: use one of {', '.join(plan.PLACEMENTS)}")
    watch = Stopwatch()
    model_dir, out = Path(model_dir), Path(out)
    blocks, calib_digest, held = read_calibration(calib)
    tokenizer = _tokenizer(model_dir)
    probe_blocks, probe_source = check_blocks(held, tokenizer, blocks)
    patch_cpu_pin_memory()
    on_gpu = torch.cuda.is_available()
    # fp16 matmuls are slow on CPUs: calibrate in fp32 there, save in the base checkpoint's dtype.
    config = config_json.read(model_dir)
    base_dtype = getattr(torch, config_json.dtype(config))
    work_dtype = base_dtype if on_gpu else torch.float32
    layout = make_plan(method=method, recipe=recipe, model_dir=model_dir, config=config, blocks=blocks,
                       batch_size=batch_size, work_dtype=work_dtype, placement=placement,
                       probe_tokens=sum(len(b) for b in probe_blocks))
    if plan_only:
        layout = add_probe(layout, recipe, model_dir, tokenizer, blocks, batch_size, work_dtype)
        return layout
    print(layout.summary(), flush=True)
    offload = layout.info["placement"] == "offload"
    device = _execution_device(on_gpu)
    model = load_model(model_dir, work_dtype)
    if offload:
        from compressed_tensors.offload import set_onload_device

        set_onload_device(model, device)  # weights stay on the host; each module comes to the device to run
    elif on_gpu:
        model.to(device)
    load_s = watch.seconds
    expected = plan.expected_quantized(model)
    reference = verify.capture_layer_io(model, probe_blocks, device)
    print(f"{method}: calibrating on {len(blocks)} blocks x {len(blocks[0])} tokens, "
          f"batch {batch_size}, {'GPU' if on_gpu else 'CPU (small budget: set calib.num_blocks for more)'}"
          f"{', one layer at a time from the host' if offload else ''}")
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    calibrated = calibrate(model, tokenizer, blocks, recipe, batch_size, calibrate_all_experts=calibrate_all_experts)
    peak_calibrate = max(calibrated.layers["overall_peak_gpu_bytes"], torch.cuda.max_memory_allocated()) if on_gpu else None
    experts = verify.check_experts(calibrated.experts, needs_data(recipe) and experts_need_data)
    calibrate_s = watch.seconds - load_s
    quantized = _quantized_modules(model)
    _set_dtype(model, base_dtype, work_dtype)
    with atomic_dir(out, "quantize", {"base checkpoint": model_dir, "calibration file": calib}) as tmp:
        model.save_pretrained(tmp, save_compressed=True)
        _copy_side_files(model_dir, tmp)
        config_added = finish_config(tmp)  # keys vLLM reads, and an ignore entry in vLLM's names
        save_s = watch.seconds - load_s - calibrate_s
        del model
        _free(on_gpu)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        verification = verify.verify(tmp, model_dir, expected, quantized, reference, work_dtype, offload=offload)
        verification["layer_error"]["blocks_from"] = probe_source
        if experts is not None:
            verification["experts"] = experts
        seconds = calibrated.layers["seconds"]
        info = {
            "method": method,
            "scheme": scheme,
            **details,
            "ignored": plan.ignore_reasons(),
            "quantized_modules": len(quantized),
            "calibration": {
                "source": str(calib),
                "sha256": calib_digest,
                "blocks": len(blocks),
                "seq_len": len(blocks[0]),
                "tokens": len(blocks) * len(blocks[0]),
                "batch_size": batch_size,
                "calibrate_all_experts": calibrate_all_experts,
            },
            "device": "cuda" if on_gpu else "cpu",
            "placement": layout.info["placement"],
            "placement_why": layout.info["placement_why"],
            "threads": torch.get_num_threads(),
            "seconds": {"load": round(load_s, 2), "calibrate": round(calibrate_s, 2),
                        "save": round(save_s, 2), "verify": round(watch.seconds - load_s - calibrate_s - save_s, 2),
                        "total": round(watch.seconds, 2),
                        # llm-compressor's oneshot alone: wall and this process's CPU time
                        "oneshot": round(calibrated.seconds, 2), "oneshot_cpu": round(calibrated.cpu_seconds, 2)},
            "layers": {
                "seconds": list(seconds.values()),
                "mean_s": round(sum(seconds.values()) / max(len(seconds), 1), 3),
                "before_s": round(calibrated.before_layers_s, 2),
                "after_s": round(calibrated.after_layers_s, 2),
                "peak_gpu_bytes": list(calibrated.layers["peak_gpu_bytes"].values()) if on_gpu else None,
            },
            "peak_rss_bytes": _peak_rss_bytes(),
            # calibration: about one layer and its activations when offloaded; verify reloads the variant
            "peak_gpu_bytes_calibrate": peak_calibrate,
            "peak_gpu_bytes_verify": torch.cuda.max_memory_allocated() if on_gpu else None,
            "peak_gpu_bytes": max(peak_calibrate, torch.cuda.max_memory_allocated()) if on_gpu else None,
            "plan": {key: layout.info[key] for key in ("device_bytes", "host_bytes", "weights_bytes", "device_free_bytes")},
            "size_bytes": dir_size(tmp),
            "base_size_bytes": dir_size(model_dir),
            "verify": verification,
            "config_added": config_added,
            "serving": serving_support(tmp),  # which engines can serve it, and why not
        }
        for modifier in recipe:  # e.g. the AWQ search: mappings and seconds by how each was scored
            if hasattr(modifier, "search_report"):
                info["search_report"] = modifier.search_report()
        if calibrated.experts is not None:
            info["experts"] = {"layers": calibrated.experts["layers"], "routed": calibrated.experts["routed"]}
        write_quant_json(tmp, info)
    return QuantResult(out, info)
