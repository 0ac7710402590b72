"""What a quantization run will do and need, decided before it loads the model: layers, the memory on the
accelerator and the host, where the model goes and why (`Plan`, printed first by every run), and with a probe
(probe.py: one layer calibrated on this machine) how long it will take (`quantize <method> --plan`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints import config_json
from pipeline.checkpoints.loading import meta_model
from pipeline.quantize import plan


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


def make_plan(*, method, model_dir: Path, config: dict, blocks: list[list[int]], batch_size: int, work_dtype,
              placement: str, probe_tokens: int) -> Plan:
    """The static plan, from config.json and a model built on the meta device (no weight read); `method` (its
    module, pipeline/methods/) says what it holds per layer while calibrating."""
    import torch

    meta = meta_model(model_dir)
    shape = plan.footprint(meta)
    quantized = len(plan.expected_quantized(meta))
    dtype_bytes = torch.empty((), dtype=work_dtype).element_size()
    tokens, batch_tokens = len(blocks) * len(blocks[0]), min(batch_size, len(blocks)) * len(blocks[0])
    kinds = {}
    for kind, k in shape["kinds"].items():
        experts = plan._experts_in(meta.get_submodule(k["first"]))
        quantized += k["count"] * experts * 3  # fused experts load as gate/up/down Linears per expert
        # plus what the method's search holds at once beyond that (AWQ: its stacked scale candidates)
        kinds[kind] = {**k, "bytes": k["params"] * dtype_bytes,
                       "working_bytes": plan.working_set_bytes(config, kind, tokens, batch_tokens, dtype_bytes,
                                                                 method.CALIBRATION_STATE)
                       + getattr(method, "SEARCH_PASS_BYTES", 0)}
    weights = shape["params"] * dtype_bytes
    working = max(k["working_bytes"] for k in kinds.values()) if kinds else 0
    on_gpu = torch.cuda.is_available()
    free = torch.cuda.mem_get_info()[0] if on_gpu else None
    hidden = config_json.text_section(config)["hidden_size"]
    # whole-model placement keeps the activations between layers on the device too (stage.calibrate_loaded)
    between = plan.between_layers_bytes(tokens, hidden, dtype_bytes)
    chosen, why = plan.choose_placement(placement, weights, working + between, free)
    if chosen == "offload" or not on_gpu:
        largest = max((k["bytes"] + k["working_bytes"] for k in kinds.values()), default=0)
        device_bytes = largest + shape["other_params"] * dtype_bytes if on_gpu else None
    else:
        device_bytes = weights + working + between
    host = plan.host_bytes(shape["params"], dtype_bytes, tokens, hidden, shape["layers"], probe_tokens,
                           offload=chosen == "offload")
    del meta
    return Plan({
        "method": method.NAME, "model_dir": str(model_dir), "architecture": config_json.architecture(config, model_dir),
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
