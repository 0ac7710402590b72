"""The quantize stage (`quantize variant NAME`, `quantize awq|fp8|rtn|...`): any registered method
(pipeline/methods/), run the same way: read the checkpoint's config and the calibration blocks, plan, load,
calibrate with llm-compressor, save, verify, describe in quant.json.

A method module builds only its recipe (llm-compressor modifiers, the scheme in words, its settings for
quant.json) from its params section and the checkpoint's description (`Target`); everything else happens here.

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
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import methods
from pipeline.checkpoints import checkpoint, config_json, headers
from pipeline.checkpoints.loading import load_model
from pipeline.checkpoints.serving import serving_support
from pipeline.checkpoints.serving_names import finish_config
from pipeline.checkpoints.streaming import MAX_SHARD
from pipeline.errors import UserError
from pipeline.checkpoints.fingerprint import weights_fingerprint
from pipeline.formats.calib_blocks import IMAGE_SAMPLES
from pipeline.formats.quant_json import write_quant_json
from pipeline.methods.recipe import Recipe, Target
from pipeline.outputs import Stopwatch, atomic_dir, dir_size, fingerprints_of, human_size
from pipeline.quantize import compat, plan
from pipeline.quantize.layout import Plan, add_probe, make_plan

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


def _execution_device(on_gpu: bool) -> str:
    return "cuda" if on_gpu else "cpu"


def run(model_dir: Path, out: Path, calib: Path, settings, *, placement: str = "auto", plan_only: bool = False,
        calibrate_all_experts: bool = True, method_options: dict | None = None, **overrides) -> QuantResult | Plan:
    """Quantize `model_dir` into `out` with one method. settings: the method's params section (params.yaml
    `variants.<name>`; its `method` picks the module in pipeline/methods/) or a method's name (its defaults);
    `overrides` (e.g. group_size=64) replace fields and are validated again. calib: a calib.jsonl of token blocks.
    placement: auto | device | offload (see the module docstring). plan_only: print the plan with a one-layer
    probe's expected time and return it; nothing is loaded or written. calibrate_all_experts: False only to show
    what it prevents (experts left without tokens). method_options: keyword arguments of the method's `recipe`
    beyond its section (`quantize fix`: the mixed method's base_settings, the W4A16 variant's own section)."""
    from pipeline.settings.errors import with_overrides

    if isinstance(settings, str):
        method = methods.method(settings)
        settings = with_overrides(method.Params, method=method.NAME, **overrides)
    else:
        method = methods.method(settings.method)
        settings = with_overrides(settings, **overrides)
    compat.quiet_cpu_warning()  # before llm-compressor is imported (the recipe imports it)
    model_dir = Path(model_dir)
    target = read_target(model_dir)  # every check below runs before any weight is loaded
    recipe = method.recipe(settings, target, **(method_options or {}))
    recipe.details = {"architecture": target.architecture, **recipe.details}
    headers.check(model_dir)  # the weights cover config.json: read from the headers, nothing loaded
    return quantize(method, recipe, model_dir, out, calib, batch_size=settings.batch_size, placement=placement,
                    plan_only=plan_only, calibrate_all_experts=calibrate_all_experts)


def read_target(model_dir: Path) -> Target:
    """The checkpoint as a method sees it, from config.json: refused here, before any weight loads, when
    transformers cannot build it or its experts would stay unquantized."""
    config = headers.check_config(model_dir)
    architecture = plan.check_architecture(config, model_dir)
    return Target(model_dir=model_dir, config=config, architecture=architecture,
                  moe=config_json.routed_experts(config) > 0, ignore=tuple(plan.ignore_patterns()))


@dataclass
class Inputs:
    """What a run reads before it loads the model: the calibration blocks, the held-out blocks for the
    per-layer check, the tokenizer and the dtypes (calibrated in fp32 on a CPU, saved in the base's dtype)."""
    model_dir: Path
    calib: Path
    batch_size: int
    calibrate_all_experts: bool
    blocks: list[list[int]]
    digest: str
    probe_blocks: list[list[int]]
    probe_source: str
    tokenizer: object
    config: dict
    base_dtype: object
    work_dtype: object
    on_gpu: bool
    image_rows: list[dict] = field(default_factory=list)  # a VLM's image samples (calib_images.jsonl), as model inputs
    image_samples: dict = field(default_factory=dict)  # what quant.json says of them: samples, images, tokens


def read_inputs(model_dir: Path, calib: Path, batch_size: int, calibrate_all_experts: bool) -> Inputs:
    import torch

    blocks, digest, held = read_calibration(calib)
    tokenizer = _tokenizer(model_dir)
    probe_blocks, probe_source = check_blocks(held, tokenizer, blocks)
    on_gpu = torch.cuda.is_available()
    found = checkpoint.open(model_dir)  # parsed once for the process (pipeline/checkpoints/checkpoint.py)
    config, base_dtype = found.config, getattr(torch, found.dtype)
    # fp16 matmuls are slow on CPUs: calibrate in fp32 there, save in the base checkpoint's dtype.
    rows, described = _image_rows(Path(calib), model_dir, found.has_vision)
    return Inputs(model_dir, Path(calib), batch_size, calibrate_all_experts, blocks, digest, probe_blocks, probe_source,
                  tokenizer, config, base_dtype, base_dtype if on_gpu else torch.float32, on_gpu, rows, described)


def _image_rows(calib: Path, model_dir: Path, vision: bool) -> tuple[list[dict], dict]:
    """A vision-language model's image samples (calib_images.jsonl beside the blocks, `quantize calib`) as model
    inputs, each image token expanded by the checkpoint's own image processor; none for a text-only model (its
    calib stage drops images) or a build without them."""
    from pipeline.formats.calib_blocks import read_image_samples

    samples = read_image_samples(calib.parent / IMAGE_SAMPLES) if vision else []
    if not samples:
        return [], {}
    from PIL import Image

    from pipeline.checkpoints.image_processor import image_inputs, load_image_processor

    processor, token = load_image_processor(model_dir), checkpoint.open(model_dir).config["image_token_id"]
    rows = []
    for sample in samples:
        images = []
        for path in sample["images"]:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        rows.append(image_inputs(processor, sample["input_ids"], images, token))
    return rows, {"image_samples": len(rows), "image_sample_images": sum(len(s["images"]) for s in samples),
                  "image_sample_tokens": sum(len(row["input_ids"]) for row in rows)}


def quantize(method, recipe: Recipe, model_dir: Path, out: Path, calib: Path, *, batch_size: int,
             placement: str = "auto", plan_only: bool = False, calibrate_all_experts: bool = True) -> QuantResult | Plan:
    """One method's recipe, run the same way for every method: plan, load, calibrate, save, verify, describe."""
    from pipeline.quantize.compat import patch_cpu_pin_memory

    if placement not in plan.PLACEMENTS:
        raise UserError(f"placement {placement!r}: use one of {', '.join(plan.PLACEMENTS)}")
    watch = Stopwatch()
    model_dir, out, calib = Path(model_dir), Path(out), Path(calib)
    # what it reads, fingerprinted before it reads them: one changed by the end (hours of calibration) is refused
    read = {"base checkpoint": model_dir, "calibration file": calib, "calibration image samples":
            calib.parent / IMAGE_SAMPLES, "calibration images": calib.parent / "images"}
    read = {label: path for label, path in read.items() if path.exists()}
    started = fingerprints_of(read)
    inputs = read_inputs(model_dir, calib, batch_size, calibrate_all_experts)
    patch_cpu_pin_memory()
    layout = make_plan(method=method, model_dir=model_dir, config=inputs.config, blocks=inputs.blocks,
                       batch_size=batch_size, work_dtype=inputs.work_dtype, placement=placement,
                       probe_tokens=sum(len(b) for b in inputs.probe_blocks))
    if plan_only:
        return add_probe(layout, recipe.modifiers, model_dir, inputs.tokenizer, inputs.blocks, batch_size,
                         inputs.work_dtype)
    print(layout.summary(), flush=True)
    loaded = load(inputs, layout.info["placement"] == "offload", watch)
    run = calibrate_loaded(method, recipe, loaded, inputs, watch)
    with atomic_dir(out, "quantize", read, started=started) as tmp:
        saved = save(loaded, inputs, tmp, watch)
        verification = check(loaded, run, inputs, tmp)
        info = describe(method, recipe, layout, inputs, run, saved, verification, tmp, watch)
        info["checkpoint"] = weights_fingerprint(tmp)  # what the report checks the variant's results against
        write_quant_json(tmp, info)
    return QuantResult(out, info)


@dataclass
class Loaded:
    """The model as calibration receives it, and what was read off it before calibration changed it."""
    model: object
    device: str
    offload: bool
    expected: list[str]  # the plan: every Linear outside the ignore list
    reference: list  # each decoder layer's inputs and outputs on the held-out blocks (verify.capture_layer_io)
    seconds: float


def load(inputs: Inputs, offload: bool, watch: Stopwatch) -> Loaded:
    from pipeline.quantize import verify

    device = _execution_device(inputs.on_gpu)
    model = load_model(inputs.model_dir, inputs.work_dtype)
    if offload:
        from compressed_tensors.offload import set_onload_device

        set_onload_device(model, device)  # weights stay on the host; each module comes to the device to run
    elif inputs.on_gpu:
        model.to(device)
    seconds = watch.seconds
    return Loaded(model, device, offload, plan.expected_quantized(model),
                  verify.capture_layer_io(model, inputs.probe_blocks, device), seconds)


@dataclass
class CalibrationRun:
    calibrated: object  # calibrate.Calibrated: oneshot's times, per-layer figures, MoE expert counts
    experts: dict | None  # verify.check_experts: tokens each expert saw (None without routed experts)
    quantized: dict[str, str]  # module name -> class, every module that now carries a weight scheme
    peak_gpu_bytes: int | None
    seconds: float
    load_s: float  # loading before it, for quant.json's times


def calibrate_loaded(method, recipe: Recipe, loaded: Loaded, inputs: Inputs, watch: Stopwatch) -> CalibrationRun:
    """llm-compressor's oneshot with the method's modifiers (calibrate.py), timed, on the loaded model."""
    import torch

    from pipeline.quantize import verify
    from pipeline.quantize.calibrate import activations_device_for, calibrate, needs_data

    blocks, on_gpu = inputs.blocks, inputs.on_gpu
    what = "calibrating" if method.NEEDS_CALIBRATION else "quantizing (no calibration data shapes the weights)"
    print(f"{method.NAME}: {what} on {len(blocks)} blocks x {len(blocks[0])} tokens, batch {inputs.batch_size}, "
          f"{'GPU' if on_gpu else 'CPU (small budget: set calib.num_blocks for more)'}"
          f"{', one layer at a time from the host' if loaded.offload else ''}")
    if inputs.image_rows:  # `quantize calib` kept a VLM's image samples: calibrated on with the blocks
        shown = inputs.image_samples
        print(f"{method.NAME}: and on {shown['image_samples']} image samples ({shown['image_sample_images']} images, "
              f"{shown['image_sample_tokens']:,} tokens with the images), one per batch")
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    # the whole model on the accelerator: the activations between layers stay there too (the plan counts them)
    calibrated = calibrate(loaded.model, inputs.tokenizer, blocks, recipe.modifiers, inputs.batch_size,
                           calibrate_all_experts=inputs.calibrate_all_experts,
                           activations_device=activations_device_for(loaded.device, on_gpu, loaded.offload),
                           image_rows=inputs.image_rows)
    peak = max(calibrated.layers["overall_peak_gpu_bytes"], torch.cuda.max_memory_allocated()) if on_gpu else None
    experts = verify.check_experts(calibrated.experts, needs_data(recipe.modifiers) and recipe.experts_need_tokens)
    return CalibrationRun(calibrated, experts, _quantized_modules(loaded.model), peak, watch.seconds - loaded.seconds,
                          loaded.seconds)


@dataclass
class Saved:
    config_added: object  # finish_config: the keys written into config.json for vLLM
    seconds: float


def save(loaded: Loaded, inputs: Inputs, tmp: Path, watch: Stopwatch) -> Saved:
    """The variant, compressed, with the base's side files and the config keys vLLM reads; then the calibrated
    model is dropped (verify reloads the variant from disk)."""
    import torch

    started = watch.seconds
    _set_dtype(loaded.model, inputs.base_dtype, inputs.work_dtype)
    loaded.model.save_pretrained(tmp, save_compressed=True, max_shard_size=MAX_SHARD)  # DVC hashes shards side by side
    _copy_side_files(inputs.model_dir, tmp)
    config_added = finish_config(tmp)  # keys vLLM reads, and an ignore entry in vLLM's names
    saved = Saved(config_added, watch.seconds - started)
    loaded.model = None
    _free(inputs.on_gpu)
    if inputs.on_gpu:
        torch.cuda.reset_peak_memory_stats()
    return saved


def check(loaded: Loaded, run: CalibrationRun, inputs: Inputs, tmp: Path) -> dict:
    """verify.verify on the written variant: the plan, vision tensors, reload and generate, per-layer error."""
    from pipeline.quantize import verify

    verification = verify.verify(tmp, inputs.model_dir, loaded.expected, run.quantized, loaded.reference,
                                 inputs.work_dtype, offload=loaded.offload)
    verification["layer_error"]["blocks_from"] = inputs.probe_source
    if run.experts is not None:
        verification["experts"] = run.experts
    return verification


def describe(method, recipe: Recipe, layout: Plan, inputs: Inputs, run: CalibrationRun, saved: Saved,
             verification: dict, tmp: Path, watch: Stopwatch) -> dict:
    """quant.json: the method and its settings, what was ignored and why, calibration, times, memory, size,
    verification and where the variant is served."""
    import torch

    blocks = inputs.blocks
    info = {"method": method.NAME, "scheme": recipe.scheme, **recipe.details, "ignored": plan.ignore_reasons(),
            "quantized_modules": len(run.quantized),
            "calibration": {"source": str(inputs.calib), "sha256": inputs.digest, "blocks": len(blocks),
                            "seq_len": len(blocks[0]), "tokens": len(blocks) * len(blocks[0]),
                            "batch_size": inputs.batch_size, "calibrate_all_experts": inputs.calibrate_all_experts,
                            **inputs.image_samples},
            "device": "cuda" if inputs.on_gpu else "cpu", "placement": layout.info["placement"],
            "placement_why": layout.info["placement_why"], "threads": torch.get_num_threads(),
            "seconds": _seconds(run.load_s, run, saved, watch), "layers": _layer_figures(run, inputs.on_gpu),
            "peak_rss_bytes": _peak_rss_bytes(), **_peak_gpu(run, inputs.on_gpu),
            "plan": {key: layout.info[key] for key in ("device_bytes", "host_bytes", "weights_bytes", "device_free_bytes")},
            "size_bytes": dir_size(tmp), "base_size_bytes": dir_size(inputs.model_dir), "verify": verification,
            "config_added": saved.config_added, "serving_format": method.SERVING_FORMAT,
            "serving": serving_support(tmp)}  # which engines can serve it, and why not
    for modifier in recipe.modifiers:  # e.g. the AWQ search: mappings and seconds by how each was scored
        if hasattr(modifier, "search_report"):
            info["search_report"] = modifier.search_report()
    if run.calibrated.experts is not None:
        info["experts"] = {"layers": run.calibrated.experts["layers"], "routed": run.calibrated.experts["routed"]}
    return info


def _seconds(loaded_s: float, run: CalibrationRun, saved: Saved, watch: Stopwatch) -> dict:
    total = watch.seconds
    return {"load": round(loaded_s, 2), "calibrate": round(run.seconds, 2), "save": round(saved.seconds, 2),
            "verify": round(total - loaded_s - run.seconds - saved.seconds, 2), "total": round(total, 2),
            # llm-compressor's oneshot alone: wall and this process's CPU time
            "oneshot": round(run.calibrated.seconds, 2), "oneshot_cpu": round(run.calibrated.cpu_seconds, 2)}


def _layer_figures(run: CalibrationRun, on_gpu: bool) -> dict:
    layers, calibrated = run.calibrated.layers, run.calibrated
    seconds = layers["seconds"]
    return {"seconds": list(seconds.values()), "mean_s": round(sum(seconds.values()) / max(len(seconds), 1), 3),
            "before_s": round(calibrated.before_layers_s, 2), "after_s": round(calibrated.after_layers_s, 2),
            "peak_gpu_bytes": list(layers["peak_gpu_bytes"].values()) if on_gpu else None}


def _peak_gpu(run: CalibrationRun, on_gpu: bool) -> dict:
    """Calibration: about one layer and its activations when offloaded; verify reloads the variant."""
    import torch

    verify_peak = torch.cuda.max_memory_allocated() if on_gpu else None
    return {"peak_gpu_bytes_calibrate": run.peak_gpu_bytes, "peak_gpu_bytes_verify": verify_peak,
            "peak_gpu_bytes": max(run.peak_gpu_bytes, verify_peak) if on_gpu else None}
