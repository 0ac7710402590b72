"""Any lm-eval image task a user names in params.yaml runs as a suite (pipeline/settings/lm_eval_tasks.py): lm-eval's own
ChartQA and MMMU task YAMLs, as the pinned lm-eval ships them, read a local copy of their dataset in their own format
(suites.<name>.dataset_path: parquet files laid out as the Hub's snapshot, an image column of PIL images), run through
the hf engine on the tiny VLM and through the vLLM engine against tests/openai_server.py (vLLM's command line, the
images as data URLs in the chat request), and are scored by lm-eval's own metric for the task."""

import sys
from pathlib import Path

import pytest

from conftest import read_jsonl
from pipeline.errors import UserError
from pipeline.settings import lm_eval_tasks
from tiny import save_tiny_glm4v

SERVER = [sys.executable, str(Path(__file__).with_name("openai_server.py"))]
MARKUP = "<|begin_of_image|><|image|><|end_of_image|>"


def _chart(values: list[int], colour: str):
    """A small bar chart: one bar per value (what ChartQA's items show, at a size the tiny model takes)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (64, 48), "white")
    draw = ImageDraw.Draw(image)
    for i, value in enumerate(values):
        draw.rectangle([6 + i * 14, 44 - value * 4, 14 + i * 14, 44], fill=colour)
    return image


def write_chartqa(folder: Path) -> Path:
    """ChartQA's test split as the Hub's snapshot of HuggingFaceM4/ChartQA lays it out (data/test-*.parquet; columns
    image, query, label (a list of answers), human_or_machine)."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "query": datasets.Value("string"),
                                  "label": datasets.Sequence(datasets.Value("string")),
                                  "human_or_machine": datasets.Value("int64")})
    rows = {"image": [_chart([3, 7, 5], "navy"), _chart([9, 2], "darkred"), _chart([4, 4, 8, 1], "green")],
            "query": ["Which bar is the tallest?", "What is the value of the first bar?", "How many bars are there?"],
            "label": [["7"], ["9"], ["4"]], "human_or_machine": [0, 1, 0]}
    (folder / "data").mkdir(parents=True)
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(folder / "data" / "test-00000-of-00001.parquet"))
    return folder


MMMU_README = """---
configs:
- config_name: Art
  data_files:
  - split: validation
    path: Art/validation-*
---
"""


def write_mmmu_art(folder: Path) -> Path:
    """MMMU's Art config as the Hub's snapshot of MMMU/MMMU lays it out (README's configs, Art/validation-*.parquet;
    columns id, question with <image 1>, options as a Python list's text, image_1..image_7, answer, question_type...).
    The first item has one option and answer A, the second one option and answer B: MMMU's own parser (no letter in
    a reply: a random choice among the options) makes the first right and the second wrong whatever the model says."""
    import datasets

    features = datasets.Features({"id": datasets.Value("string"), "question": datasets.Value("string"),
                                  "options": datasets.Value("string"), "explanation": datasets.Value("string"),
                                  **{f"image_{i}": datasets.Image() for i in range(1, 8)},
                                  "img_type": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "topic_difficulty": datasets.Value("string"),
                                  "question_type": datasets.Value("string"), "subfield": datasets.Value("string")})
    n = 2
    rows = {"id": ["validation_Art_1", "validation_Art_2"],
            "question": ["<image 1> Which colour are the bars?", "<image 1> How many bars are drawn?"],
            "options": ["['navy']", "['three']"], "explanation": ["", ""],
            "image_1": [_chart([3, 7, 5], "navy"), _chart([2, 6, 4], "navy")],
            **{f"image_{i}": [None] * n for i in range(2, 8)}, "img_type": ["['Charts']"] * n,
            "answer": ["A", "B"], "topic_difficulty": ["Easy"] * n, "question_type": ["multiple-choice"] * n,
            "subfield": ["Drawing"] * n}
    (folder / "Art").mkdir(parents=True)
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(folder / "Art" / "validation-00000-of-00001.parquet"))
    (folder / "README.md").write_text(MMMU_README)
    return folder


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return save_tiny_glm4v(tmp_path_factory.mktemp("vlm") / "glm4v")


def _eval(model: Path, out: Path, engine: str, suite: str, task: str, data: Path, **options):
    from pipeline.stages import evaluate

    settings = {"batch_size": 2, "dtype": "float32"}
    if engine == "vllm":
        settings.update(server_command=SERVER, start_timeout=120, log_path=out.parent / f"{out.name}.log")
    result = evaluate.run(model, suite=suite, task=task, variant=model.name, out_dir=out, engine=engine,
                          dataset_path=data, max_new_tokens=6, **settings, **options)
    return read_jsonl(out / f"{suite}.jsonl"), result.figures


def test_plain_lm_eval_tasks_read_as_suites(tmp_path):
    """Kind from the metric, card from dataset_path, images from doc_to_image (an include's counts), and a clear
    error naming the key where a task cannot run as a suite."""
    chartqa = lm_eval_tasks.plain("chartqa", name="charts")
    assert (chartqa.suite.kind, chartqa.suite.needs, chartqa.metric, chartqa.suite.name) == (
        "right-wrong", ("images",), "exact_match", "charts")
    card = chartqa.suite.card
    assert (card.dataset, card.split, card.task_type) == ("HuggingFaceM4/ChartQA", "test", "visual-question-answering")
    art = lm_eval_tasks.plain("mmmu_val_art")  # doc_to_image and acc come from the included _template_yaml
    assert (art.suite.kind, art.suite.needs, art.metric) == ("right-wrong", ("images",), "acc")
    assert (art.suite.card.dataset, art.suite.card.config, art.suite.card.split) == ("MMMU/MMMU", "Art", "validation")
    gsm8k = lm_eval_tasks.plain("gsm8k")
    assert gsm8k.suite.needs == () and gsm8k.suite.kind == "right-wrong"
    assert lm_eval_tasks.plain("no_such_task_anywhere") is None
    with pytest.raises(UserError, match=r"params.yaml: suites.mmmu.task: mmmu_val is an lm-eval group .*not a task; "
                                        r"a suite is one task: name one of its tasks \(mmmu_val_art_and_design"):
        lm_eval_tasks.plain("mmmu_val", name="mmmu")
    own = tmp_path / "tasks"
    own.mkdir()
    (own / "captions.yaml").write_text(f"include: {chartqa.yaml}\ntask: my_captions\nmetric_list:\n"
                                       "  - metric: cider\n    aggregation: mean\n    higher_is_better: true\n")
    with pytest.raises(UserError, match=r"suites.cap.task: my_captions: its first metric, 'cider', says not whether "
                                        r".*in suites.cap.tasks_dir with `include: .*captions.yaml`"):
        lm_eval_tasks.plain("my_captions", own, name="cap")
    from pipeline.report.card_header import data_of, task_type

    assert data_of("charts", {"charts": "chartqa"})[0] == "HuggingFaceM4/ChartQA"
    assert task_type("charts", {"charts": "chartqa"}) == "visual-question-answering"


def test_chartqa_through_hf_and_the_openai_server_scored_by_lm_evals_metric(vlm, tmp_path, tiny_llama):
    """The installed chartqa.yaml, its dataset_path a local parquet copy: the images reach the model through both
    engines (the same answers), each line scored as lm-eval's own chartqa metrics score the answer."""
    import importlib

    data = write_chartqa(tmp_path / "ChartQA")
    hf, summary = _eval(vlm, tmp_path / "hf", "hf", "charts", "chartqa", data)
    served, _ = _eval(vlm, tmp_path / "vllm", "vllm", "charts", "chartqa", data)
    strip = lambda rows: [(r["id"], r["prompt"], r["output"], r["target"]) for r in rows]  # noqa: E731
    assert strip(served) == strip(hf) and len(hf) == 3
    assert MARKUP in hf[0]["prompt"] and "Which bar is the tallest?" in hf[0]["prompt"]
    assert [r["target"] for r in hf] == ["7", "9", "4"]
    assert summary["metric"] == "exact_match" and {"relaxed_accuracy,none", "anywhere_accuracy,none"} <= set(
        summary["metrics"])
    utils = importlib.import_module("lm_eval.tasks.chartqa.utils")
    for row in hf:
        assert row["score"] == utils.exact_match([row["target"]], [row["output"]])["exact_match"]
    assert "1 image" in (tmp_path / "vllm.log").read_text()  # the server's access log: each request carried its chart
    # a text-only model: not applicable, never 0 %
    _, text_only = _eval(tiny_llama, tmp_path / "text", "hf", "charts", "chartqa", data)
    assert text_only["status"] == "not applicable" and "text-only model" in text_only["reason"]


def test_mmmu_scored_by_its_own_process_results(vlm, tmp_path):
    """mmmu_val_art (its doc_to_image and process_results in the included template and MMMU's utils), reading the
    README-configured local snapshot: the item MMMU's parser must count right is right, the other wrong."""
    data = write_mmmu_art(tmp_path / "MMMU")
    rows, summary = _eval(vlm, tmp_path / "hf", "hf", "mmmu-art", "mmmu_val_art", data)
    assert [(r["id"], r["correct"]) for r in rows] == [("validation_Art_1", True), ("validation_Art_2", False)]
    assert summary["metric"] == "acc" and summary["score"] == 0.5
    assert MARKUP in rows[0]["prompt"] and "(A) navy" in rows[0]["prompt"]


def test_a_dataset_path_that_cannot_be_read_is_refused_naming_the_key(vlm, tmp_path):
    from pipeline.stages import evaluate

    with pytest.raises(UserError, match=r"params.yaml: suites.charts.dataset_path: .*missing does not exist; point it "
                                        r"at a local copy of the task's dataset"):
        evaluate.run(vlm, suite="charts", task="chartqa", variant="base", out_dir=tmp_path / "a",
                     dataset_path=tmp_path / "missing")
    with pytest.raises(UserError, match=r"suites.vqa.dataset_path: task quant_vqa loads its own data"):
        evaluate.run(vlm, suite="vqa", task="quant_vqa", variant="base", out_dir=tmp_path / "b",
                     dataset_path=tmp_path)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
