"""Issue 67 (items 1 and 4): the generated visual suites (evals/visual/: charts, documents, small text, counting). Each
is its generator and seed: the same seed gives the same images and answers; each item's difficulty is in its doc,
its result line and the report's table per suite; an exact answer scores right and anything else wrong; a perfect
answerer (served over HTTP, reading each image it is sent) scores 100 % and a blind one the chance floor."""

import base64
import hashlib
import io
import json
import shutil
from decimal import Decimal

import pytest

from conftest import REPO, TINY_PARAMS, read_jsonl, write_params
from pipeline.settings import suites as registry

TASKS = {"charts": "quant_charts", "documents": "quant_documents", "small_text": "quant_small_text",
         "counting": "quant_counting"}
AXES = {"charts": "elements", "documents": "font_px", "small_text": "font_px", "counting": "count"}


def own(suite: str):
    """The suite's own module (its utils.py, which its YAML names as its hooks), loaded by the registry."""
    return registry.shipped()[TASKS[suite]].hooks


def pixels(image) -> str:
    return hashlib.sha256(image.convert("RGB").tobytes() + repr(image.size).encode()).hexdigest()


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from tiny import save_tiny_glm4v

    return save_tiny_glm4v(tmp_path_factory.mktemp("vlm") / "glm4v")


@pytest.mark.parametrize("suite", list(TASKS))
def test_each_suite_is_its_generator_and_seed(suite):
    utils = own(suite)
    first, again, other = (utils.common.generate(suite, utils.make, 12, seed) for seed in (0, 0, 1))
    assert first == again and [r["spec"] for r in first] != [r["spec"] for r in other]
    images = [utils.doc_to_image(row)[0] for row in first]
    assert [pixels(i) for i in images] == [pixels(utils.doc_to_image(row)[0]) for row in again]
    assert len({pixels(i) for i in images}) == 12  # every item its own picture
    # an item does not change when the count around it does (each seeded by its own index)
    assert utils.common.generate(suite, utils.make, 5, 0) == first[:5]
    bins = utils.__dict__.get("ELEMENTS") or utils.__dict__.get("FONT_PX") or utils.__dict__.get("COUNTS")
    for row, image in zip(first, images):
        assert image.mode == "RGB" and list(image.size) == [row["difficulty"]["width"], row["difficulty"]["height"]]
        assert row["answer_type"] in ("number", "text") and row["answer"] and row["question"]
    # the first items cover every bin of the table's axis in turn: a limit keeps each
    assert [row["difficulty"][AXES[suite]] for row in first[:len(bins)]] == list(bins)


def test_lm_eval_builds_the_tasks_with_their_images_and_options():
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(REPO / "evals"), include_defaults=False, metadata={"n_items": 6, "seed": 3})
    loaded = manager.load(list(TASKS.values()))["tasks"]
    for suite, task in TASKS.items():
        docs = list(loaded[task].test_docs())
        assert len(docs) == 6 and loaded[task].MULTIMODAL and docs[0]["id"] == f"{suite}-3-0000"
        image = loaded[task].doc_to_image(docs[0])[0]
        assert list(image.size) == [docs[0]["difficulty"]["width"], docs[0]["difficulty"]["height"]]
        assert loaded[task].doc_to_text(docs[0]).startswith("<image>\n" + docs[0]["question"] + "\nAnswer with the ")
    shipped = registry.shipped()
    assert all(shipped[t].kind == "right-wrong" and shipped[t].needs == ("images",) and shipped[t].hook("summarize")
               and shipped[t].hook("bench_images") for t in TASKS.values())
    assert own("charts").options_problem({"n_items": 0}).startswith("n_items: give items to generate")
    assert own("charts").options_problem({"depth": 1}) == "depth: unknown option; use n_items, seed"


def test_an_exact_answer_scores_right_and_anything_else_wrong():
    score = own("counting").process_results
    number, price, code = ({"answer_type": "number", "answer": "7"}, {"answer_type": "number", "answer": "4.75"},
                           {"answer_type": "text", "answer": "XK-4821"})
    for doc, right, wrong in ((number, ["7", "Answer: 7.", "There are 7 red circles.", "**7**"], ["8", "seven", "", "70"]),
                              (price, ["4.75", "$4.75", "The answer is 4.750"], ["4.7", "475", "5"]),
                              (code, ["XK-4821", "xk-4821.", '"XK-4821"', "The text reads: XK-4821"],
                               ["XK4821", "XK-4821 and more", "XK-482"])):
        assert [score(doc, [r])["exact_match"] for r in right] == [1.0] * len(right), (doc, right)
        assert [score(doc, [w])["exact_match"] for w in wrong] == [0.0] * len(wrong), (doc, wrong)
    # the number read agrees with a peer's (Python's own Decimal of the digits lm-eval's GSM8K regex takes)
    import re

    for text in ("12.50", "1,234", "-3", "0.05"):
        peer = Decimal(re.search(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", text).group().replace(",", "").replace("$", ""))
        assert own("charts").common.number_in(text) == peer


def test_the_table_by_difficulty_from_the_lines():
    utils = own("small_text")
    lines = [{"id": f"s{i}", "score": float(px > 8), "difficulty": {"font_px": px}}
             for i, px in enumerate((24, 6, 8, 12, 24, 6))]
    assert utils.table_from_lines(lines) == utils.summarize(lines, {}) == {"by_difficulty": {"axis": "font_px", "bins": {
        "6": {"n": 2, "score": 0.0}, "8": {"n": 1, "score": 0.0}, "12": {"n": 1, "score": 1.0},
        "24": {"n": 2, "score": 1.0}}}}
    with pytest.raises(ValueError, match="line 'gsm8k-1' has no difficulty.font_px"):
        utils.table_from_lines([{"id": "gsm8k-1", "score": 1.0}])


def test_the_suites_score_on_the_tiny_vlm_through_hf_with_the_difficulty_in_each_line(tmp_path, tiny_vlm):
    from pipeline.stages import evaluate

    for suite, task in TASKS.items():
        result = evaluate.run(tiny_vlm, suite=suite, task=task, variant="base", out_dir=tmp_path, limit=3,
                              max_new_tokens=4, batch_size=3)
        lines = read_jsonl(tmp_path / f"{suite}.jsonl")
        assert len(lines) == 3 and all(l["correct"] in (True, False) and AXES[suite] in l["difficulty"] for l in lines)
        assert result.figures["table"] == own(suite).table_from_lines(lines)
        assert sum(cell["n"] for cell in result.figures["table"]["by_difficulty"]["bins"].values()) == 3


class Answerer:
    """What a served model answers for each image it is sent: the item's answer (perfect), or one fixed guess
    (blind: it never looks)."""

    def __init__(self, n_items: int, blind: str | None = None):
        self.blind, self.answers = blind, {}
        for suite in TASKS:
            utils = own(suite)
            for row in utils.common.generate(suite, utils.make, n_items, 0):
                self.answers[pixels(utils.doc_to_image(row)[0]) + row["question"]] = row["answer"]

    def __call__(self, body: dict) -> str:
        from PIL import Image

        parts = body["messages"][-1]["content"]
        [url] = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        text = " ".join(p["text"] for p in parts if p["type"] == "text")
        found = [a for key, a in self.answers.items() if key[:64] == pixels(image) and key[64:] in text]
        return self.blind if self.blind is not None else f"The answer is {found[0]}."


def test_a_perfect_answerer_scores_100_and_a_blind_one_the_chance_floor_and_the_report_shows_the_bins(tmp_path,
                                                                                                        tiny_vlm,
                                                                                                        monkeypatch):
    from typer.testing import CliRunner

    from chat_server import ChatServer
    from conftest import with_variants
    from pipeline.cli.app import app
    from pipeline.settings.params import Params
    from pipeline.stages import report

    n = 14  # counting: every count of COUNTS twice, so a blind "5" is right on 2 of 14 (1 / len(COUNTS))
    settings = with_variants(json.loads(json.dumps(TINY_PARAMS)), "blind")
    settings["suites"] = {s: {"task": t, "max_new_tokens": 8, "options": {"n_items": n}} for s, t in TASKS.items()}
    settings["verdict"]["margins"]["suites"] = {}
    monkeypatch.chdir(tmp_path)
    for model, answerer in (("base", Answerer(n)), ("blind", Answerer(n, blind="5"))):
        shutil.copytree(tiny_vlm, tmp_path / "models" / model)  # the served model's folder: its name is the variant's
        with ChatServer(answerer) as server:
            settings["engine"] = dict(name="openai", base_url=server.base_url, model="served", prompt_format="text")
            write_params(tmp_path, settings)
            for suite in TASKS:
                result = CliRunner().invoke(app, ["eval", f"models/{model}", "--suite", suite, "--out",
                                                  f"results/{model}"])
                assert result.exit_code == 0, result.output
        assert len(server.requests) == len(TASKS) * n
    scores = {m: {s: json.loads((tmp_path / "results" / m / f"{s}.json").read_text())["score"] for s in TASKS}
              for m in ("base", "blind")}
    assert scores["base"] == dict.fromkeys(TASKS, 1.0)
    assert scores["blind"]["counting"] == pytest.approx(2 / 14)  # the chance floor of a constant guess
    assert scores["blind"]["small_text"] == 0.0  # a code or word cannot be guessed blind
    verdict = report.run(tmp_path / "results", tmp_path / "reports", Params.model_validate(settings),
                         models_dir=tmp_path / "models").verdict
    counting = verdict["difficulty"]["counting"]
    assert counting["axis"] == "count" and counting["bins"] == ["1", "2", "3", "5", "7", "10", "14"]
    assert counting["models"]["base"]["14"] == {"n": 2, "score": 1.0}
    assert counting["models"]["blind"]["5"] == {"n": 2, "score": 1.0} and counting["models"]["blind"]["14"]["score"] == 0
    html = (tmp_path / "reports" / "index.html").read_text()
    assert 'id="difficulty-counting"' in html and 'id="difficulty-small_text-6"' in html
    assert "accuracy by font_px" in html and verdict["variants"]["blind"]["suites"]["counting"]["counted"] in (True, False)
