"""The one call into llm-compressor every run makes (the real run and the `--plan` probe alike):
token blocks in (and a vision-language model's image samples: `quantize calib`'s calib_images.jsonl), the recipe
applied to the model in place, per-layer times and MoE expert counts out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Calibrated:
    seconds: float
    cpu_seconds: float  # this process's CPU time: on a shared CPU machine, steadier than wall time
    layers: dict  # monitor.LayerTimer.close()
    experts: dict | None  # monitor.ExpertCounter.close(); None without routed experts
    before_layers_s: float  # tracing, data, embeddings: from the call to the first layer's first input
    after_layers_s: float  # the rest: between layers, lm_head, data-free passes (RTN, AWQ's weight step), finalize


IMAGE_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")  # what an image sample adds to a row


def calibration_dataset(blocks: list[list[int]], image_rows: list[dict] | None = None):
    """The blocks as llm-compressor's dataset; with image rows (pipeline/checkpoints/image_processor.py image_inputs)
    those first, each block then with None for what an image adds: llm-compressor's sequential pipeline traces the
    model once, on the first batch, so that batch carries images, and every batch names the same inputs (measured:
    a text batch without the image keys fails, one with them None runs the text path)."""
    from datasets import Dataset

    if not image_rows:
        return Dataset.from_dict({
            "input_ids": blocks,
            "attention_mask": [[1] * len(b) for b in blocks],
        })
    text = [{"input_ids": b, "attention_mask": [1] * len(b), **dict.fromkeys(IMAGE_KEYS)} for b in blocks]
    return Dataset.from_list([*image_rows, *text])


def collate_one(batch: list[dict]) -> dict:
    """A batch of one row (rows with images differ in length) as tensors; an image key a text row lacks stays None."""
    import torch

    (row,) = batch
    out = {}
    for key, value in row.items():
        tensor = None if value is None else torch.tensor(value)
        out[key] = tensor.unsqueeze(0) if tensor is not None and key in ("input_ids", "attention_mask",
                                                                          "mm_token_type_ids") else tensor
    return out


def needs_data(recipe: list) -> bool:
    """Whether any modifier calibrates on data (AWQ, static activation scales, a KV cache scheme);
    a data-free recipe (RTN, dynamic activations) runs no tokens through the model."""
    return any(getattr(modifier, "requires_calibration_data", False) for modifier in recipe)


def activations_device_for(device: str, on_gpu: bool, offload: bool) -> str | None:
    """Where calibrate() keeps the activations between layers (its `activations_device`): on the execution device
    when the whole model is there, else llm-compressor's default (None: the host). The run and `--plan`'s probe
    both ask here, so that the probe times what the run will do."""
    return device if on_gpu and not offload else None


def keep_cached_inputs_with_activations(recipe: list) -> None:
    """AWQ's cached inputs of each searched module (replayed once per scale candidate: 21 times per layer at n_grid
    20) stay on the execution device with the activations between layers. llm-compressor's default for an MoE model
    is the host (AWQModifier.offload_device), which moves a layer's attention inputs across the bus 21 times; a
    modifier whose recipe names its own offload_device keeps it. The values are the same either way; the device
    memory is in `--plan`'s working set (plan.working_set_bytes)."""
    from llmcompressor.sentinel import Sentinel

    for modifier in recipe:
        if getattr(modifier, "offload_device", None) == Sentinel("not_provided"):
            modifier.offload_device = None


def calibrate(model, tokenizer, blocks: list[list[int]], recipe: list, batch_size: int,
              calibrate_all_experts: bool = True, activations_device: str | None = None,
              image_rows: list[dict] | None = None) -> Calibrated:
    """llm-compressor's oneshot with its default (independent -> sequential) pipeline: each decoder
    layer is calibrated in turn, brought onto the accelerator first if the model sits on the host.
    `calibrate_all_experts` runs every MoE expert on every token (only the routed ones contribute
    to the layer's output), so no expert is left without statistics. `activations_device`: where the
    activations between decoder layers wait (None: llm-compressor's default, the host; the execution
    device when the model and they fit there, which spares moving every layer's activations across
    the bus three times per layer: in for each of its two passes, out after the second; the values
    are the same either way), and AWQ's cached inputs wait there too (keep_cached_inputs_with_activations).
    A progress bar counts the decoder layers done. image_rows: a vision-language model's image samples, calibrated
    on with the blocks, one row per batch (`calibration_dataset`)."""
    from llmcompressor import oneshot

    from pipeline.console import progress
    from pipeline.quantize import plan
    from pipeline.quantize.monitor import ExpertCounter, LayerTimer

    if activations_device:
        keep_cached_inputs_with_activations(recipe)
    with progress("quantize: calibrating", len(plan.decoder_layers(model)) or None, "decoder layers") as advance:
        return _calibrate(oneshot, model, tokenizer, blocks, recipe, batch_size, calibrate_all_experts,
                          activations_device, LayerTimer(model, advance), ExpertCounter(model), image_rows or [])


def _calibrate(oneshot, model, tokenizer, blocks, recipe, batch_size, calibrate_all_experts, activations_device,
               timer, counter, image_rows) -> Calibrated:
    """calibrate's run of oneshot, timed per layer (`timer`) and per expert (`counter`)."""
    import time

    started, cpu_started = time.perf_counter(), time.process_time()
    first_input: list[float] = []
    first_hook = timer.layers[0][1].register_forward_pre_hook(
        lambda module, args: first_input.append(time.perf_counter()) if not first_input else None) \
        if timer.layers else None
    try:
        oneshot(
            model=model,
            # The blocks are already token ids: the tokenizer is all llm-compressor needs, and it spares
            # loading a multimodal processor (GLM-4.1V's video processor wants torchvision).
            processor=tokenizer,
            dataset=calibration_dataset(blocks, image_rows),
            recipe=recipe,
            num_calibration_samples=len(blocks) + len(image_rows),
            max_seq_length=max(len(row["input_ids"]) for row in [*image_rows, {"input_ids": blocks[0]}]),
            batch_size=1 if image_rows else min(batch_size, len(blocks)),
            **({"data_collator": collate_one} if image_rows else {}),
            shuffle_calibration_samples=False,
            moe_calibrate_all_experts=calibrate_all_experts,
            **({"sequential_offload_device": activations_device} if activations_device else {}),
        )
        ended, cpu_ended = time.perf_counter(), time.process_time()
    finally:
        if first_hook is not None:
            first_hook.remove()
        layers, experts = timer.close(), counter.close()
    in_layers = sum(layers["seconds"].values())
    before = (first_input[0] - started) if first_input else 0.0
    return Calibrated(seconds=ended - started, cpu_seconds=cpu_ended - cpu_started, layers=layers, experts=experts, before_layers_s=before,
                      after_layers_s=max(0.0, ended - started - before - in_layers))
