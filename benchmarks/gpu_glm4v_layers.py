"""Where GLM-4V's image path parts between transformers and vLLM, tensor by tensor (issue 35).

    python benchmarks/gpu_glm4v_layers.py kernel    # the minimal reproduction: vLLM's M-RoPE op alone
    python benchmarks/gpu_glm4v_layers.py layers [--models small,trained,real41v,real46v]
    python benchmarks/gpu_glm4v_layers.py layers --tiny   # CPU: transformers on both sides, checks the script

kernel: vLLM's MRotaryEmbedding built as vLLM builds GLM's text rotary (partial, GPT-J style for GLM-4.1V,
NeoX style for GLM-4.5V / 4.6V), on random q / k with an image prompt's 3-D positions and with text-only
positions: its CUDA path (triton_mrope, what runs while the rotary_embedding custom op is on, as under
--enforce-eager) and its PyTorch path, each against transformers' own rotary for that model.

layers: one VQA item (image + prompt as `quantize eval` renders it) through vLLM (offline LLM in its own
process, eager, hooks installed with LLM.apply_model) and through transformers on the same weights, pixel
values and token ids. Compared in the order the data flows: pixel values (ours, the hf engine's, against
vLLM's processor's), patch embedding, post-conv norm, + position embedding (the learned table interpolated
bicubically to the grid), every vision block, post-layernorm, downsample, merger, M-RoPE position ids, the
merged prompt embeddings, every decoder layer's attention and output, the final norm, and the first 4
greedy tokens. Each vLLM configuration once: `shipped` (vLLM as it ships under --enforce-eager) and
`pipeline` (with the settings our engine adds, pipeline/engines/vllm_defects.py).

Models: small (Glm4v, text 256 x 2 layers, vision 2 blocks at 128, random: the minimal model), trained (the
small Glm4v trained on easy-VQA: `gpu_glm46v_vllm.py train`, /tmp/glm46v/trained/base), real41v
(GLM-4.1V's widths: text 4096, 32 heads of 128, 2 layers; vision 1536 x 4 blocks of 24; random bf16),
real46v (GLM-4.6V's: the MoE text of gpu_glm46v_vllm.py, 2 layers; vision 1536 x 4 blocks; random bf16).

Relative error ||vLLM - hf|| / ||hf|| per tensor; a tensor "differs" above 0.02 (bf16 rounding through these
depths stays near 0.01). Writes $OUT/gpu_glm4v_layers.json (kept as benchmarks/results/) and prints the
table of the first tensor that differs per model and configuration.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = "--tiny" in sys.argv
OUT = Path(os.environ.get("OUT", "/tmp/gpu-glm4v-layers-out"))
ROOT = Path("/tmp/glm4v-layers-tiny" if TINY else "/tmp/glm4v-layers")
TRAINED = Path(os.environ.get("GLM4V_TRAINED", "/tmp/glm46v/trained/base"))
VSITE = os.environ.get("VLLM_SITE", "/tmp/vsite")
DIFFERS = 0.02
CONFIGS = {"shipped": False, "pipeline": True}  # vLLM under --enforce-eager, without / with our defect settings
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
SMALL_TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, rope_parameters={**ROPE, "mrope_section": [4, 6, 6]})
SMALL_VISION = dict(depth=2, hidden_size=128, num_heads=2, intermediate_size=512, out_hidden_size=256, patch_size=14,
                    image_size=336, spatial_merge_size=2, temporal_patch_size=2)
GLM41V_TEXT = dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=2,
                   num_attention_heads=32, num_key_value_heads=2, head_dim=128, max_position_embeddings=65536,
                   rms_norm_eps=1e-5, attention_bias=True, rope_parameters={**ROPE, "mrope_section": [8, 12, 12]})
GLM41V_VISION = dict(depth=4, hidden_size=1536, num_heads=12, intermediate_size=13696, out_hidden_size=4096,
                     patch_size=14, image_size=336, spatial_merge_size=2, temporal_patch_size=2)


def build(name: str) -> Path:
    """The model's checkpoint under ROOT (built once; `trained` comes from gpu_glm46v_vllm.py train)."""
    import torch

    from tiny import save_tiny_glm4v, save_tiny_glm4v_moe

    if name == "trained":
        if not (TRAINED / "config.json").exists():
            raise FileNotFoundError(f"{TRAINED}: run `python benchmarks/gpu_glm46v_vllm.py train` first")
        return TRAINED
    path = ROOT / name
    if (path / "config.json").exists():
        return path
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "small" or TINY:
        return save_tiny_glm4v(path, dtype=torch.bfloat16, text=SMALL_TEXT, vision=SMALL_VISION)
    if name == "real41v":
        return save_tiny_glm4v(path, dtype=torch.bfloat16, text=GLM41V_TEXT, vision=GLM41V_VISION, device=device)
    if name == "real46v":
        from gpu_glm46v_vllm import TEXT, VISION

        return save_tiny_glm4v_moe(path, dtype=torch.bfloat16, text=TEXT, vision={**VISION, "depth": 4}, device=device)
    raise ValueError(f"unknown model {name!r}")


def vqa_item(model: Path, index: int = 0) -> dict:
    """One easy-VQA item as `quantize eval` sends it: the chat-rendered prompt with the image markup, the
    image as the PNG data URL the vLLM engine posts, and the answer."""
    from transformers import AutoTokenizer

    from pipeline.engines.vision import image_data_url, image_markup, render_images
    from pipeline.formats.chat import render_prompt

    sys.path.insert(0, str(REPO / "evals" / "vqa"))
    import utils as vqa

    rows = [json.loads(line) for line in vqa.DATA.read_text().splitlines() if line.strip()]
    doc = rows[index]
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = render_prompt(tokenizer, [{"role": "user", "content": vqa.doc_to_text(doc)}])
    return {"prompt": render_images(prompt, image_markup(model, tokenizer)),
            "images": [image_data_url(image) for image in vqa.doc_to_image(doc)], "answer": doc["answer"],
            "id": doc.get("id", index)}


# ---------------------------------------------------------------- hooks: one name per tensor, both engines

def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def _keep(store: dict, name: str, value) -> None:
    if name not in store and value is not None:  # the prefill only: later decode steps are not compared
        store[name] = value.detach().to("cpu").clone()


def _keep_inputs(store: dict, kwargs: dict, positions: str) -> None:
    """The language model's inputs: its position ids (M-RoPE: t, h, w rows) and the merged prompt embeddings."""
    for name, key in (("lm.positions", positions), ("lm.inputs_embeds", "inputs_embeds")):
        if kwargs.get(key) is not None:
            _keep(store, name, kwargs[key])


def hook_vllm(model, store: dict) -> list[str]:
    """Hooks on vLLM's Glm4v / Glm4vMoe modules (vllm/model_executor/models/glm4_1v.py)."""
    while not hasattr(model, "visual") and hasattr(model, "runnable"):
        model = model.runnable
    visual, lm = model.visual, model.language_model.model

    def keep(name, fn=_first):
        return lambda module, args, output: _keep(store, name, fn(output))

    def inputs(module, args, kwargs) -> None:  # a pre-hook that returns something replaces the inputs
        _keep(store, "pixel_values", args[0])
        _keep(store, "grid_thw", kwargs.get("grid_thw", args[1] if len(args) > 1 else None))

    visual.register_forward_pre_hook(inputs, with_kwargs=True)
    visual.patch_embed.register_forward_hook(keep("visual.patch_embed"))
    visual.post_conv_layernorm.register_forward_hook(keep("visual.post_conv_layernorm"))
    visual.embeddings.register_forward_hook(keep("visual.position_table"))  # called on zeros: the table alone
    for i, block in enumerate(visual.blocks):
        block.register_forward_hook(keep(f"visual.blocks.{i}"))
    visual.post_layernorm.register_forward_hook(keep("visual.post_layernorm"))
    visual.downsample.register_forward_hook(keep("visual.downsample"))
    visual.merger.register_forward_hook(keep("visual.merger"))
    # vLLM's compile decorator calls the language model's forward without nn.Module's hooks: its inputs are
    # read where the first decoder layer's attention receives them
    lm.layers[0].register_forward_pre_hook(lambda m, args, kwargs: _keep(store, "lm.inputs_embeds", kwargs.get(
        "hidden_states", args[1] if len(args) > 1 else None)), with_kwargs=True)
    lm.layers[0].self_attn.register_forward_pre_hook(lambda m, args, kwargs: _keep(store, "lm.positions", kwargs.get(
        "positions", args[0] if args else None)), with_kwargs=True)
    for i, layer in enumerate(lm.layers):
        layer.self_attn.register_forward_hook(keep(f"lm.layers.{i}.self_attn"))
        layer.register_forward_hook(keep(f"lm.layers.{i}", lambda out: out[0].float() + out[1].float()))
    lm.norm.register_forward_hook(keep("lm.norm"))
    return sorted(store)


def hook_hf(model, store: dict) -> None:
    """The same names on transformers' Glm4vForConditionalGeneration / Glm4vMoeForConditionalGeneration."""
    visual, lm = model.model.visual, model.model.language_model

    def keep(name, fn=_first):
        return lambda module, args, output: _keep(store, name, fn(output))

    visual.patch_embed.register_forward_hook(keep("visual.patch_embed"))
    visual.post_conv_layernorm.register_forward_hook(keep("visual.post_conv_layernorm"))
    visual.embeddings.register_forward_hook(keep("visual.position_embedded"))
    for i, block in enumerate(visual.blocks):
        block.register_forward_hook(keep(f"visual.blocks.{i}"))
    visual.post_layernorm.register_forward_hook(keep("visual.post_layernorm"))
    visual.downsample.register_forward_hook(keep("visual.downsample"))
    visual.merger.register_forward_hook(keep("visual.merger"))
    lm.register_forward_pre_hook(lambda m, args, kwargs: _keep_inputs(store, kwargs, "position_ids"), with_kwargs=True)
    for i, layer in enumerate(lm.layers):
        layer.self_attn.register_forward_hook(keep(f"lm.layers.{i}.self_attn"))
        layer.register_forward_hook(keep(f"lm.layers.{i}"))
    lm.norm.register_forward_hook(keep("lm.norm"))


# ---------------------------------------------------------------- the two sides

VLLM_SIDE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[3])
sys.path.insert(0, sys.argv[3] + "/benchmarks")
import torch
from vllm import LLM, SamplingParams
from gpu_glm4v_layers import hook_vllm
spec = json.loads(sys.argv[1])
llm = LLM(model=spec["model"], seed=0, generation_config="vllm", enforce_eager=True, gpu_memory_utilization=0.3,
          dtype="bfloat16", **spec["llm"])
store = {}
names = llm.apply_model(lambda model: hook_vllm(model, store))
item = spec["item"]
messages = [{"role": "user", "content": [{"type": "text", "text": item["prompt"]}] +
             [{"type": "image_url", "image_url": {"url": url}} for url in item["images"]]}]
out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0), chat_template=spec["chat_template"],
               chat_template_content_format="string", use_tqdm=False)[0]
store["prompt_token_ids"] = torch.tensor(out.prompt_token_ids)
store["greedy"] = torch.tensor(list(out.outputs[0].token_ids))
torch.save(store, sys.argv[2])
print("RESULT " + json.dumps({"tensors": sorted(store), "text": out.outputs[0].text}))
"""


def run_vllm(model: Path, item: dict, config: str, path: Path) -> dict:
    """vLLM's tensors for the item, in its own process and PYTHONPATH (its pinned packages), saved to `path`."""
    from pipeline.checkpoints import config_json
    from pipeline.engines import vllm_defects
    from pipeline.engines.vllm import PASSTHROUGH_TEMPLATE

    args = vllm_defects.server_args(config_json.read(model), [], CONFIGS[config])
    text = config_json.read(model).get("text_config") or {}
    llm = {"max_model_len": min(4096, int(text.get("max_position_embeddings") or 4096)),
           **({"compilation_config": json.loads(args[1])} if args else {})}
    spec = {"model": str(model), "item": item, "llm": llm, "chat_template": PASSTHROUGH_TEMPLATE}
    script = ROOT / "vllm_side.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("if __name__ == '__main__':\n" + "\n".join("    " + line for line in VLLM_SIDE.splitlines()))
    env = {**os.environ, "PYTHONPATH": VSITE, "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    done = subprocess.run(["python3", str(script), json.dumps(spec), str(path), str(REPO)], capture_output=True,
                          text=True, env=env, timeout=500)
    (ROOT / f"{path.stem}.log").write_text(done.stdout[-20000:] + "\n---\n" + done.stderr[-20000:])
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vLLM side failed (code {done.returncode}):\n{done.stderr[-3000:]}")
    return {"vllm_compilation_config": llm.get("compilation_config"), **json.loads(line[len("RESULT "):])}


def run_hf(model: Path, item: dict, pixel_values=None) -> dict:
    """transformers' tensors for the item: our prompt encoding (the hf engine's), with vLLM's pixel values
    when given (so the forward passes are compared on identical inputs), and its first 4 greedy tokens."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from pipeline.engines.vision import ImagePrompter

    images = [_image(url) for url in item["images"]]
    tokenizer = AutoTokenizer.from_pretrained(model)
    inputs = ImagePrompter(model, tokenizer).encode([item["prompt"]], [images])
    store: dict = {"pixel_values_ours": inputs["pixel_values"].clone()}
    if pixel_values is not None and pixel_values.shape == inputs["pixel_values"].shape:
        inputs["pixel_values"] = pixel_values
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.bfloat16).to(device).eval()
    hook_hf(hf, store)
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    inputs = inputs.to(device)
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    store["prompt_token_ids"] = inputs["input_ids"][0].cpu()
    store["greedy"] = out[0, inputs["input_ids"].shape[1]:].cpu()
    store["pixel_values"] = inputs["pixel_values"].float().cpu()
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    return store


def _image(url: str):
    import base64
    import io

    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


# ---------------------------------------------------------------- comparison

def _error(ours, ref) -> dict:
    a, b = ours.float().reshape(-1), ref.float().reshape(-1)
    if a.numel() != b.numel():
        return {"shape": [list(ours.shape), list(ref.shape)], "rel": None}
    rel = float((a - b).norm() / b.norm().clamp_min(1e-12))
    return {"rel": round(rel, 5), "max_abs": round(float((a - b).abs().max()), 5), "n": a.numel()}


def compare(vllm: dict, hf: dict) -> list[dict]:
    """Tensor by tensor, in the order the data flows; vLLM's rows cut to the prompt (no padding)."""
    n = len(hf["prompt_token_ids"])
    rows = [{"tensor": "prompt token ids", "equal": vllm["prompt_token_ids"].tolist() == hf["prompt_token_ids"].tolist()}]
    rows.append({"tensor": "pixel values: ours (hf engine) vs vLLM's processor",
                 **_error(hf["pixel_values_ours"], vllm["pixel_values"])})
    pos = vllm.get("visual.position_table")
    if pos is not None and "visual.post_conv_layernorm" in vllm:  # vLLM adds the interpolated table after the norm
        vllm = {**vllm, "visual.position_embedded": vllm["visual.post_conv_layernorm"] + pos.to(
            vllm["visual.post_conv_layernorm"].dtype)}
    names = ["visual.patch_embed", "visual.post_conv_layernorm", "visual.position_embedded"]
    names += sorted((k for k in hf if k.startswith("visual.blocks.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    names += ["visual.post_layernorm", "visual.downsample", "visual.merger"]
    for name in names:
        if name in vllm and name in hf:
            rows.append({"tensor": name, **_error(vllm[name], hf[name])})
    if "lm.positions" in vllm and "lm.positions" in hf:
        theirs = vllm["lm.positions"].reshape(-1, vllm["lm.positions"].shape[-1])[-3:, :n]  # vLLM: (3, tokens)
        ours = hf["lm.positions"].reshape(-1, n)[-3:]  # transformers: (text, t, h, w) x batch x tokens
        rows.append({"tensor": "M-RoPE position ids (t, h, w)", "equal": theirs.tolist() == ours.tolist()})
    layers = sorted({int(k.split(".")[2]) for k in hf if k.startswith("lm.layers.")})
    lm_names = ["lm.inputs_embeds"] + [f"lm.layers.{i}{s}" for i in layers for s in (".self_attn", "")] + ["lm.norm"]
    for name in lm_names:
        if name in vllm and name in hf:
            rows.append({"tensor": name, **_error(vllm[name].reshape(-1, vllm[name].shape[-1])[:n], hf[name])})
    rows.append({"tensor": "greedy tokens (4)", "equal": vllm["greedy"].tolist() == hf["greedy"].tolist()})
    for row in rows:
        row["differs"] = (row.get("equal") is False) or (row.get("rel") is not None and row["rel"] > DIFFERS
                                                         and not row["tensor"].startswith("pixel"))
    return rows


def _same_settings(model: Path, config: str) -> str | None:
    """An earlier configuration that gives vLLM the very same settings for this model, else None."""
    from pipeline.checkpoints import config_json
    from pipeline.engines import vllm_defects

    settings = {c: vllm_defects.server_args(config_json.read(model), [], on) for c, on in CONFIGS.items()}
    return next((c for c in CONFIGS if c != config and list(CONFIGS).index(c) < list(CONFIGS).index(config)
                 and settings[c] == settings[config]), None)


def layers(names: list[str]) -> dict:
    import torch

    results = _load(OUT / "gpu_glm4v_layers.json") | {"date": time.strftime("%Y-%m-%d"), "differs_above": DIFFERS}
    for name in names:
        entry = results.setdefault("models", {}).setdefault(name, {})
        entry.pop("error", None)  # an earlier call's
        try:
            model = build(name)
            item = vqa_item(model)
            entry.update(model=str(model), item={"id": item["id"], "answer": item["answer"]},
                         arch=json.loads((model / "config.json").read_text())["architectures"][0])
            for config in CONFIGS:
                path = ROOT / f"{name}-{config}.pt"
                same = _same_settings(model, config)
                if TINY:  # no vLLM on the CPU: transformers against itself checks hooks, names and table
                    torch.save(run_hf(model, item), path)
                elif same and not path.exists():  # no defect hits this model: one vLLM run stands for both
                    shutil.copy(ROOT / f"{name}-{same}.pt", path)
                    entry[f"vllm_{config}"] = {"same_settings_as": same}
                elif not path.exists():
                    started = time.perf_counter()
                    entry[f"vllm_{config}"] = run_vllm(model, item, config, path)
                    entry[f"vllm_{config}"]["seconds"] = round(time.perf_counter() - started, 1)
                _save(results)
            theirs = {c: torch.load(ROOT / f"{name}-{c}.pt") for c in CONFIGS}
            hf = run_hf(model, item, theirs["shipped"]["pixel_values"])
            for config, tensors in theirs.items():
                rows = compare(tensors, hf)
                entry[config] = {"first_differing": next((r["tensor"] for r in rows if r["differs"]), None),
                                 "rows": rows}
        except Exception as exc:  # noqa: BLE001 - one model's failure must not lose the others'
            import traceback

            traceback.print_exc()
            entry["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        _save(results)
    return results


# ---------------------------------------------------------------- kernel: the op alone

KERNEL = r"""
import json, sys
import torch
from transformers.models.glm4v import modeling_glm4v as g41
from transformers.models.glm4v_moe import modeling_glm4v_moe as g46
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope

def hf_rotary(module, config, q, k, positions):
    rotary = (module.Glm4vTextRotaryEmbedding(config) if module is g41 else module.Glm4vMoeTextRotaryEmbedding(config)).cuda()
    cos, sin = rotary(q, positions[:, None, :])
    q4, k4 = q.view(1, -1, config.num_attention_heads, 128).transpose(1, 2), k.view(1, -1, config.num_key_value_heads, 128).transpose(1, 2)
    q4, k4 = module.apply_rotary_pos_emb(q4, k4, cos, sin) if module is g41 else module.apply_rotary_pos_emb(q4, k4, cos, sin)
    return q4.transpose(1, 2).reshape(q.shape), k4.transpose(1, 2).reshape(k.shape)

out = {}
torch.manual_seed(0)
grid = torch.stack(torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij")).reshape(2, -1)
image = torch.cat([torch.zeros(1, 36, dtype=torch.long) + 5, grid + 5])  # 5 text tokens, then a 6 x 6 image
positions = {"image (3-D)": torch.cat([torch.arange(5).expand(3, 5), image], 1),
             "text only": torch.arange(41).expand(3, 41)}
rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [8, 12, 12]}
c41 = g41.Glm4vTextConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                          rope_parameters=rope)
c46 = g46.Glm4vMoeTextConfig(hidden_size=4096, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                             rope_parameters=rope)
for label, module, neox, config in (("GLM-4.1V (GPT-J pairs)", g41, False, c41), ("GLM-4.6V (NeoX pairs)", g46, True, c46)):
    with set_current_vllm_config(VllmConfig()):
        op = get_rope(128, max_position=4096, is_neox_style=neox, rope_parameters=dict(rope), dtype=torch.float32).cuda()
    for kind, pos in positions.items():
        pos = pos.cuda()
        n = pos.shape[1]
        q = torch.randn(n, config.num_attention_heads * 128, device="cuda")
        k = torch.randn(n, config.num_key_value_heads * 128, device="cuda")
        ref_q, ref_k = hf_rotary(module, config, q, k, pos)
        row = {}
        for path in ("forward_cuda", "forward_native"):
            p2 = pos if kind.startswith("image") else pos[0]  # vLLM gets 1-D positions for text-only requests
            got_q, got_k = getattr(op, path)(p2, q.clone(), k.clone())
            row[path] = round(float((got_q - ref_q).norm() / ref_q.norm()), 6)
        out[f"{label}, {kind}"] = row
print("RESULT " + json.dumps(out))
"""


def kernel() -> dict:
    script = ROOT / "kernel.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("if __name__ == '__main__':\n" + "\n".join("    " + line for line in KERNEL.splitlines()))
    env = {**os.environ, "PYTHONPATH": VSITE, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    done = subprocess.run(["python3", str(script)], capture_output=True, text=True, env=env, timeout=300)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    results = _load(OUT / "gpu_glm4v_layers.json")
    results["kernel"] = (json.loads(line[len("RESULT "):]) if line else
                         {"error": f"code {done.returncode}: {done.stderr[-3000:]}"})
    results["kernel_reading"] = ("relative error of q after vLLM's rotary against transformers' for the model; "
                                 "forward_cuda is what runs with the rotary_embedding custom op on (--enforce-eager)")
    _save(results)
    return results


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _save(results: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_glm4v_layers.json").write_text(json.dumps(results, indent=1, default=str))


def print_tables(results: dict) -> None:
    if results.get("kernel"):
        print("\n| rotary | CUDA path (custom op on) | PyTorch path |\n|---|---|---|")
        for label, row in results["kernel"].items():
            print(f"| {label} | {row.get('forward_cuda')} | {row.get('forward_native')} |" if isinstance(row, dict)
                  else f"| {label} | {row} | |")
    print("\n| model | vLLM config | first tensor that differs | its rel. error | merger rel. error | greedy equal |")
    print("|---|---|---|---|---|---|")
    for name, entry in (results.get("models") or {}).items():
        if "error" in entry:
            print(f"| {name} | - | error: {entry['error'][:200]} | | | |")
        for config in CONFIGS:
            got = entry.get(config)
            if not got:
                continue
            by = {r["tensor"]: r for r in got["rows"]}
            first = got["first_differing"]
            print(f"| {name} | {config} | {first or 'none'} | {(by.get(first) or {}).get('rel', '')} | "
                  f"{(by.get('visual.merger') or {}).get('rel')} | {by['greedy tokens (4)']['equal']} |")


if __name__ == "__main__":  # vLLM starts processes: the guard is required
    part = sys.argv[1] if len(sys.argv) > 1 else "layers"
    models = (sys.argv[sys.argv.index("--models") + 1] if "--models" in sys.argv else
              "small" if TINY else "small,trained,real41v,real46v").split(",")
    print_tables(kernel() if part == "kernel" else layers(models))
