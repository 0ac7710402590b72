import json

import pytest
import torch

from conftest import REPO
from pipeline.engines import GenRequest, vision
from pipeline.engines import hf as hf_engine

VQA_DIR = REPO / "evals" / "vqa"
EASY_VQA_ANSWERS = {"circle", "green", "red", "gray", "yes", "teal", "black", "rectangle", "yellow", "triangle",
                    "brown", "blue", "no"}
IMAGE_TOKENS = ["<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
                "<|video|>"]


def save_tiny_glm4v_with_images(path, seed: int = 0):
    """A 2-layer random Glm4vForConditionalGeneration whose tokenizer knows GLM-4.1V's image tokens,
    with a PIL image processor for 2-pixel patches (a 64x64 image -> 25 image tokens)."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    from tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    ids = dict(zip(["image_start_token_id", "image_token_id", "image_end_token_id", "video_start_token_id",
                    "video_end_token_id", "video_token_id"], tok.convert_tokens_to_ids(IMAGE_TOKENS)))
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                attention_bias=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [2, 1, 1]})
    visual = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=2,
                  image_size=8, spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(seed)
    model = Glm4vForConditionalGeneration(Glm4vConfig(text_config=text, vision_config=visual,
                                                      tie_word_embeddings=False, **ids))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    Glm4vImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2,
                           size={"shortest_edge": 16 * 16, "longest_edge": 32 * 32}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_glm4v(tmp_path_factory):
    return save_tiny_glm4v_with_images(tmp_path_factory.mktemp("glm4v") / "glm4v")


@pytest.fixture(scope="module")
def suite_utils():
    import importlib.util

    spec = importlib.util.spec_from_file_location("vqa_utils", VQA_DIR / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _task(metadata=None):
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(REPO / "evals"), include_defaults=False, metadata=metadata)
    return manager.load(["quant_vqa"])["tasks"]["quant_vqa"]


def _images(suite_utils, *ids):
    docs = {d["id"]: d for d in suite_utils.load_easy_vqa()["test"]}
    return [suite_utils.doc_to_image(docs[i])[0] for i in ids]


def test_shipped_subset_is_100_local_items_through_lm_eval():
    task = _task()
    docs = list(task.test_docs())
    assert len(docs) == 100 and len({d["id"] for d in docs}) == 100 and task.MULTIMODAL
    assert {d["answer"] for d in docs} <= EASY_VQA_ANSWERS and len({d["answer"] for d in docs}) >= 5
    for doc in docs:
        assert (VQA_DIR / doc["image"]).is_file()
    image = task.doc_to_image(docs[0])[0]
    assert image.size == (64, 64) and image.mode == "RGB"
    assert task.doc_to_text(docs[0]).startswith("<image>\n") and docs[0]["question"] in task.doc_to_text(docs[0])


def test_exact_match_on_the_short_answer(suite_utils):
    doc = {"answer": "triangle"}
    assert suite_utils.process_results(doc, ["Triangle."])["exact_match"] == 1.0
    assert suite_utils.process_results(doc, [" answer: triangle"])["exact_match"] == 1.0
    assert suite_utils.process_results(doc, ["a triangle"])["exact_match"] == 1.0  # articles dropped, as VQAv2 does
    assert suite_utils.process_results(doc, ["circle"])["exact_match"] == 0.0  # more in tests/test_scorer_corpora.py


def test_text_only_model_is_not_applicable(tiny_llama, tiny_glm4v):
    from lm_eval.tasks import TaskManager

    index = TaskManager(include_path=str(REPO / "evals"), include_defaults=False).task_index
    vqa_config, math_config = index["quant_vqa"].cfg, index["quant_gsm8k"].cfg  # raw YAML, as evaluate.py has it
    assert not vision.is_multimodal(tiny_llama) and vision.is_multimodal(tiny_glm4v)
    assert "text-only model" in vision.not_applicable(tiny_llama, vqa_config)
    assert vision.not_applicable(tiny_glm4v, vqa_config) is None
    assert vision.not_applicable(tiny_llama, math_config) is None


def test_changing_the_image_changes_the_logits(tiny_glm4v, suite_utils):
    from transformers import AutoTokenizer, Glm4vForConditionalGeneration

    model = Glm4vForConditionalGeneration.from_pretrained(tiny_glm4v, dtype=torch.float32).eval()
    prompter = vision.ImagePrompter(tiny_glm4v, AutoTokenizer.from_pretrained(tiny_glm4v))
    prompt = prompter.render("<|im_start|>user\n<image>\nwhat shape is it?<|im_end|>\n<|im_start|>assistant\n")
    first, second = _images(suite_utils, "easyvqa-test-0018", "easyvqa-test-0230")

    def last_logits(image):
        inputs = prompter.encode([prompt], [[image]])
        n_image_tokens = int(inputs["mm_token_type_ids"].sum())
        assert n_image_tokens == int(inputs["image_grid_thw"].prod()) // 4 > 1  # patches / 2x2 merge
        with torch.no_grad():
            return model(**inputs).logits[0, -1]

    assert torch.equal(last_logits(first), last_logits(first))
    assert (last_logits(first) - last_logits(second)).abs().max() > 1e-4


def test_engine_generates_from_images_in_a_batch(tiny_glm4v, suite_utils):
    engine = vision.VisionEngine(tiny_glm4v, hf_engine.Settings(batch_size=2))
    prompt = engine.apply_chat_template([{"role": "user", "content": "<image>\nwhat shape is it?"}])
    assert "<|begin_of_image|><|image|><|end_of_image|>" in prompt and "<image>" not in prompt
    images = _images(suite_utils, "easyvqa-test-0018", "easyvqa-test-0230")
    requests = [vision.VisionRequest(prompt, 6, [], images=[image]) for image in images]
    batched = engine.generate(requests)
    alone = [engine.generate([request])[0] for request in requests]
    assert [c.text for c in batched] == [c.text for c in alone]
    assert all(0 < c.n_tokens <= 6 for c in batched)
    text_only = engine.generate([GenRequest("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", 4)])
    assert 0 < text_only[0].n_tokens <= 4
    with pytest.raises(ValueError, match="1 image markers but 0 images"):
        engine.prompter.encode([prompt], [[]])


def test_lm_eval_requests_and_cache_digest(suite_utils):
    first, second = _images(suite_utils, "easyvqa-test-0018", "easyvqa-test-0230")
    request = vision.request_from_lm_eval(("p", {"max_gen_toks": 8, "until": ["\n"]}, {"visual": [first]}))
    assert isinstance(request, vision.VisionRequest) and request.images == [first] and request.stop == ["\n"]
    plain = vision.request_from_lm_eval(("p", {}))
    assert type(plain) is GenRequest and plain.max_new_tokens == 256
    assert vision.image_digest([first]) == vision.image_digest([first.copy()]) != vision.image_digest([second])


def test_vqa_runs_through_lm_eval_with_the_image_engine(tiny_glm4v, tiny_llama):
    """lm-eval builds the prompts and hands the images; the engine answers; lm-eval scores."""
    from lm_eval import simple_evaluate
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    class ImageLM(LM):  # what evaluate.PipelineLM.generate_until becomes (see the report)
        MULTIMODAL = True

        def __init__(self, engine):
            super().__init__()
            self.engine = engine

        tokenizer_name = "tiny-glm4v"

        def apply_chat_template(self, chat_history, add_generation_prompt=True):
            return self.engine.apply_chat_template(chat_history)

        def generate_until(self, requests):
            return [c.text for c in self.engine.generate([vision.request_from_lm_eval(r.args) for r in requests])]

        def loglikelihood(self, requests):
            raise NotImplementedError

        loglikelihood_rolling = loglikelihood

    manager = TaskManager(include_path=str(REPO / "evals"), include_defaults=False)
    results = simple_evaluate(model=ImageLM(vision.VisionEngine(tiny_glm4v, hf_engine.Settings(batch_size=4))), tasks=["quant_vqa"],
                              task_manager=manager, limit=4, log_samples=True, apply_chat_template=True,
                              bootstrap_iters=0, verbosity="ERROR")
    samples = results["samples"]["quant_vqa"]
    assert len(samples) == 4 and all(s["exact_match"] in (0.0, 1.0) for s in samples)
    assert "<|begin_of_image|><|image|><|end_of_image|>" in samples[0]["arguments"][0][0]
    assert 0.0 <= results["results"]["quant_vqa"]["exact_match,none"] <= 1.0
    with pytest.raises(ValueError, match="require multimodal input"):  # why evaluate.py checks first
        ImageLM.MULTIMODAL = False
        simple_evaluate(model=ImageLM(None), tasks=["quant_vqa"], task_manager=manager, limit=1,
                        bootstrap_iters=0, verbosity="ERROR")
    json.dumps(results["results"]["quant_vqa"])  # plain numbers: the summary can hold them


def test_an_engine_that_takes_no_images_is_refused_before_any_work(tiny_glm4v, tmp_path):
    """The registry says which engines take images (hf, vllm, openai); lmdeploy's here does not: the VQA suite
    on it stops with the engines that do, before the engine is made (lmdeploy need not be installed)."""
    from pipeline.stages import evaluate
    from pipeline.engines import capability
    from pipeline.errors import UserError

    assert [capability(name, "images") for name in ("hf", "vllm", "openai", "lmdeploy")] == [True, True, True, False]
    with pytest.raises(UserError, match="suite vqa: its prompts carry images, which the lmdeploy engine does not take "
                                        "here; evaluate it with hf, vllm or openai"):
        evaluate.run(tiny_glm4v, suite="vqa", variant="base", out_dir=tmp_path / "out", engine="lmdeploy",
                     task="quant_vqa", limit=2)
    assert not (tmp_path / "out" / "vqa.json").exists()
