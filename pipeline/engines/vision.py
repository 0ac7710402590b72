"""Images for the in-process engine (GLM-4.1V style: Glm4vForConditionalGeneration and kin).

A multimodal lm-eval task writes `<image>` where an image goes and hands the images beside the
prompt. The engine renders the chat as for text, swaps each `<image>` for the model's image markup
(<|begin_of_image|><|image|><|end_of_image|>), and at generation expands each image token to
as many as the vision tower yields for that image (grid t*h*w / merge^2), as the model's own
processor does. The processor is not used as a whole: GLM's bundles a video processor that needs
torchvision, which images do not; the image processor is loaded with the PIL backend.

`quantize bench` times requests with images too (`PromptImages`: a request's images beside its token ids, each
image token expanded by the same rule, `image_tokens`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.checkpoints import checkpoint
from pipeline.checkpoints.image_processor import (image_markup, image_tokens,  # noqa: F401 (engines' names)
                                               load_image_processor, tokens_per_grid)
from pipeline.engines.base import Completion, GenRequest
from pipeline.engines.hf import HFEngine, row_sampling

IMAGE_PLACEHOLDER = "<image>"  # lm-eval's placeholder in a multimodal task's prompt


@dataclass
class VisionRequest(GenRequest):
    images: list = field(default_factory=list)  # PIL images, in the order of the prompt's markup


@dataclass(frozen=True)
class PromptImages:
    """What a timed request with images (`quantize bench`) carries beside its token ids, whose image markup holds
    one image token per image: the images (PIL, for an in-process engine), the same images as PNG data URLs (for a
    server; encoded once, before any clock starts), the rendered prompt text, markup in place (a server tokenizes
    it), and the prompt's tokens with each image token expanded as the model's processor expands it."""

    images: tuple
    urls: tuple[str, ...]
    text: str
    prompt_tokens: int


def is_multimodal(model_dir: Path | str) -> bool:
    """True when the checkpoint has a vision tower and an image token to feed it through."""
    return checkpoint.open(model_dir).has_vision


def not_applicable(model_dir: Path | str, task_config: dict) -> str | None:
    """Why a suite cannot be scored on this model (an image task on a text-only model), else None."""
    if task_config.get("doc_to_image") and not is_multimodal(model_dir):
        return f"{Path(model_dir).name}: text-only model (no vision_config in config.json); the suite needs images"
    return None


def image_digest(images) -> str:
    """Content hash of the images: the resume cache must not serve one image's answer for another."""
    digest = hashlib.sha256()
    for image in images or []:
        digest.update(f"{image.mode}{image.size}".encode())
        digest.update(image.tobytes())
    return digest.hexdigest()[:16]


def request_from_lm_eval(args: tuple, max_new_tokens_default: int = 256) -> GenRequest:
    """lm-eval's generate_until args, (context, gen_kwargs[, {"visual": images}]), as a request."""
    context, kwargs, *extra = args
    max_new, stop = int(kwargs.get("max_gen_toks", max_new_tokens_default)), list(kwargs.get("until") or [])
    images = (extra[0] or {}).get("visual") if extra else None
    if not images:
        return GenRequest(context, max_new, stop)
    return VisionRequest(context, max_new, stop, images=list(images) if isinstance(images, (list, tuple)) else [images])


def render_images(prompt: str, markup: str) -> str:
    """lm-eval's `<image>` placeholders as the model's image markup: one rendering for every engine."""
    return prompt.replace(IMAGE_PLACEHOLDER, markup)


def image_data_url(image) -> str:
    """A PIL image as a PNG data URL (lossless: the server decodes the very pixels)."""
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class ImagePrompter:
    """Image markup in prompts, and prompts + images -> model inputs."""

    def __init__(self, model_dir: Path | str, tokenizer):
        config = checkpoint.open(model_dir).config
        self.tokenizer = tokenizer
        self.image_processor = load_image_processor(model_dir)
        self.image_token_id = config["image_token_id"]
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.markup = image_markup(model_dir, tokenizer)

    def render(self, prompt: str) -> str:
        return render_images(prompt, self.markup)

    def encode(self, prompts: list[str], images: list[list]):
        """Tokenized, left-padded inputs with pixel values, grids and image token types."""
        for prompt, own in zip(prompts, images):
            if prompt.count(self.image_token) != len(own):
                raise ValueError(f"prompt has {prompt.count(self.image_token)} image markers but {len(own)} images")
        flat = [image for own in images for image in own]
        pixels = self.image_processor(images=flat, return_tensors="pt")
        counts = iter(tokens_per_grid(pixels["image_grid_thw"], self.image_processor.merge_size))
        expanded = []
        for prompt in prompts:
            head, *rest = prompt.split(self.image_token)
            expanded.append(head + "".join(self.image_token * next(counts) + part for part in rest))
        inputs = self.tokenizer(expanded, return_tensors="pt", padding=True, add_special_tokens=False)
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.image_token_id).long()
        inputs.update(pixels)
        return inputs

    def encode_ids(self, prompts: list[list[int]], images: list[list]):
        """encode for prompts already tokenized (one image token per image): left-padded inputs with pixel values,
        and each prompt's length with its image tokens expanded."""
        for ids, own in zip(prompts, images):
            if ids.count(self.image_token_id) != len(own):
                raise ValueError(f"prompt has {ids.count(self.image_token_id)} image tokens but {len(own)} images")
        flat = [image for own in images for image in own]
        pixels = self.image_processor(images=flat, return_tensors="pt")
        counts = iter(tokens_per_grid(pixels["image_grid_thw"], self.image_processor.merge_size))
        expanded = [[t for token in ids for t in ([token] * next(counts) if token == self.image_token_id else [token])]
                    for ids in prompts]
        inputs = self.tokenizer.pad({"input_ids": expanded}, return_tensors="pt")
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.image_token_id).long()
        inputs.update(pixels)
        return inputs, [len(ids) for ids in expanded]


class VisionEngine(HFEngine):
    """HFEngine that also takes images (VisionRequest); text requests go the plain way."""

    name = "hf"
    accepts_images = True
    fast_decoding = False  # its vision tower and M-RoPE positions are left to transformers' own path

    def __init__(self, model_dir: Path | str, settings=None, **stage):
        super().__init__(model_dir, settings, **stage)
        self._prompter: ImagePrompter | None = None

    @property
    def prompter(self) -> ImagePrompter:
        """Built on first use: text suites on a vision model need no image processor."""
        if self._prompter is None:
            self._prompter = ImagePrompter(self.model_dir, self.tokenizer)
        return self._prompter

    def apply_chat_template(self, messages: list[dict], enable_thinking: bool | None = None) -> str:
        prompt = super().apply_chat_template(messages, enable_thinking)
        return self.prompter.render(prompt) if IMAGE_PLACEHOLDER in prompt else prompt

    def _generate_batch(self, requests: list[GenRequest], on_done=None) -> list[Completion]:
        import torch

        if not any(getattr(r, "images", None) for r in requests):
            return super()._generate_batch(requests, on_done)
        started = time.perf_counter()
        inputs = self.prompter.encode([r.prompt for r in requests], [getattr(r, "images", []) for r in requests])
        inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        inputs = inputs.to(self.device)
        with torch.inference_mode():
            output = self.model.generate(**inputs, max_new_tokens=max(r.max_new_tokens for r in requests),
                                         do_sample=False, pad_token_id=self.tokenizer.pad_token_id,
                                         **row_sampling(requests, self.device))
        seconds = (time.perf_counter() - started) / len(requests)
        completions = self._decode(requests, output[:, inputs["input_ids"].shape[1]:].tolist(), seconds)
        for row, completion in enumerate(completions if on_done else []):  # image batches: all at their end
            on_done(row, completion)
        return completions

    def _timed_inputs(self, prompts: list[list[int]], images: list[PromptImages] | None):
        """`quantize bench`'s requests with images: pixel values and each image token expanded (the processor runs
        inside the request's clock, as a server's does)."""
        if not images:
            return super()._timed_inputs(prompts, images)
        inputs, lengths = self.prompter.encode_ids(prompts, [list(own.images) for own in images])
        inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        return inputs.to(self.device), lengths
