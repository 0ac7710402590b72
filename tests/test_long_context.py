import itertools
import json
from pathlib import Path

import pytest

from conftest import REPO, read_jsonl
from pipeline.settings import suites
from pipeline.stages import evaluate

long_context = suites.shipped()["quant_long_context"].hooks  # the suite's own module (evals/long_context/hooks.py)
suite = long_context.suite()


def _task_docs(metadata: dict | None = None) -> list[dict]:
    """The docs lm-eval itself builds from quant_long_context.yaml, with the pipeline's metadata."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(REPO / "evals"), include_defaults=False, metadata=metadata)
    return list(manager.load(["quant_long_context"])["tasks"]["quant_long_context"].test_docs())


def test_generation_is_deterministic_and_items_do_not_depend_on_the_ladder():
    assert suite.generate() == suite.generate()
    alone = suite.make_item("multikey", 2048, 75, 1)
    in_ladder = next(i for i in suite.generate() if i["id"] == "multikey-2048-d75-01")
    assert alone == in_ladder
    assert suite.make_item("niah", 2048, 75, 1)["value"] != suite.make_item("niah", 2048, 75, 2)["value"]


def test_the_yaml_ladder_is_every_length_depth_kind_and_repeat():
    docs = _task_docs()
    expected = {suite.item_id(k, n, d, r) for k, n, d, r in
                itertools.product(["niah", "multikey"], [1024, 2048, 4096, 8192], [0, 25, 50, 75, 100], range(4))}
    assert [d["id"] for d in docs] == sorted(expected, key=[d["id"] for d in docs].index)
    assert {d["id"] for d in docs} == expected and len(docs) == 160
    assert "niah-1024-d25-03" in expected


@pytest.mark.parametrize("length", [1024, 8192])
def test_nominal_length_is_the_whole_prompt_in_tokens_of_the_given_ratio(length):
    for cpt in (4.0, 2.5):
        prompt = suite.doc_to_text(suite.make_item("niah", length, 50, 0, chars_per_token=cpt))
        assert abs(len(prompt) / cpt - length) / length < 0.01


def test_the_needle_sits_at_the_stated_depth():
    for item in suite.generate(lengths=[1024, 4096]):
        context, offset = item["context"], item["needle_offset"]
        assert context[offset:].startswith(item["needle"]) and item["value"] in item["needle"]
        if item["depth"] == 0:
            assert offset == 0
        elif item["depth"] == 100:
            assert context.endswith(item["needle"])
        else:
            assert abs(offset / len(context) - item["depth"] / 100) < 0.05, item["id"]


def test_multikey_asks_for_one_key_among_several():
    item = suite.make_item("multikey", 2048, 50, 0)
    assert len(set(item["keys"])) == suite.N_KEYS >= 3 and item["key"] == item["keys"][0]
    for key in item["keys"]:
        assert item["context"].count(f"The special magic number for {key} is ") == 1
    prompt = suite.doc_to_text(item)
    assert prompt.endswith(suite.QUESTION.format(key=item["key"])) and suite.doc_to_target(item) == item["value"]
    single = suite.make_item("niah", 2048, 50, 0)
    assert single["context"].count("The special magic number for") == 1


def test_scoring_finds_the_number_not_a_longer_one():
    doc = {"value": "4817203"}
    assert suite.process_results(doc, ["4817203"]) == {"acc": 1.0, "exact_match": 1.0}
    assert suite.process_results(doc, ["The number is 4817203."]) == {"acc": 1.0, "exact_match": 0.0}
    assert suite.process_results(doc, ["48172031"])["acc"] == 0.0
    assert suite.process_results(doc, ["4817204"])["acc"] == 0.0


def test_lengths_beyond_a_small_context_are_skipped_and_reported(tiny_llama):
    metadata = long_context.task_metadata(tiny_llama)
    assert metadata["max_context"] == 512 and 1.0 < metadata["chars_per_token"] < 6.0
    skipped = long_context.skipped_lengths(suite.LENGTHS, 512)
    assert [s["length"] for s in skipped] == [1024, 2048, 4096, 8192]
    assert "beyond the model's context" in skipped[0]["reason"]
    with pytest.raises(ValueError, match="no length of the ladder"):
        _task_docs(metadata)
    docs = suite.load_long_context(lengths=[256, 1024], max_context=512)["test"].to_list()
    assert {d["nominal_tokens"] for d in docs} == {256}
    kept, dropped = long_context.skip_beyond_context(suite.generate(lengths=[256, 1024]), 512)
    assert {d["nominal_tokens"] for d in kept} == {256} and {d["nominal_tokens"] for d in dropped} == {1024}


def test_metadata_caps_the_ladder_through_lm_eval():
    docs = _task_docs({"max_context": 4096, "chars_per_token": 3.0})
    assert sorted({d["nominal_tokens"] for d in docs}) == [1024, 2048]  # 4096 + answer room does not fit
    summary = long_context.summarize([], {"max_context": 4096})
    assert summary["lengths_run"] == [1024, 2048]
    assert [s["length"] for s in summary["lengths_skipped"]] == [4096, 8192]


def test_metadata_overrides_the_yaml_ladder():
    docs = _task_docs({"lengths": [1024, 2048], "repeats": 1, "kinds": ["multikey"]})
    assert [d["id"] for d in docs] == [f"multikey-{n}-d{d}-00" for n in (1024, 2048) for d in (0, 25, 50, 75, 100)]


def test_summary_is_per_length_and_depth():
    lines = [{"id": "niah-1024-d0-00", "score": 1.0}, {"id": "multikey-1024-d0-00", "score": 0.0},
             {"id": "niah-2048-d50-01", "score": 1.0}]
    assert long_context.by_length_and_depth(lines) == {
        "1024": {"d0": {"n": 2, "score": 0.5}}, "2048": {"d50": {"n": 1, "score": 1.0}}}
    assert long_context.by_kind(lines) == {"niah": {"n": 2, "score": 1.0}, "multikey": {"n": 1, "score": 0.0}}
    with pytest.raises(ValueError, match="not kind-length"):
        long_context.by_length_and_depth([{"id": "gsm8k-test-0001", "score": 1.0}])


@pytest.fixture(scope="module")
def tiny_llama_4k(tmp_path_factory):
    from tiny import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny4k") / "llama", max_position_embeddings=4096)


def test_shortest_length_runs_through_the_pipeline(tmp_path, tiny_llama_4k):
    result = evaluate.run(tiny_llama_4k, suite="long_context", task="quant_long_context", variant="base",
                          out_dir=tmp_path, limit=4, max_new_tokens=8, batch_size=4)
    lines = read_jsonl(tmp_path / "long_context.jsonl")
    assert [l["id"] for l in lines] == [f"niah-1024-d0-0{r}" for r in range(4)]
    assert all(l["prompt"].startswith("<|im_start|>user\nBelow is a long text.") for l in lines)
    assert all(l["score"] in (0.0, 1.0) and 0 < l["n_tokens"] <= 8 for l in lines)
    assert result.figures["metric"] == "acc"
    assert long_context.by_length_and_depth(lines)["1024"]["d0"]["n"] == 4


def test_with_the_measured_ratio_prompts_are_their_nominal_length_in_model_tokens(tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ratio = long_context.chars_per_token(tiny_llama)
    for item in suite.generate(lengths=[1024, 2048], depths=[0, 50], repeats=2, chars_per_token=ratio):
        n = len(tokenizer(suite.doc_to_text(item), add_special_tokens=False)["input_ids"])
        assert 0.95 * item["nominal_tokens"] <= n <= suite.SLACK * item["nominal_tokens"], (item["id"], n)


def test_a_model_with_4k_positions_gets_the_1k_and_2k_rungs(tiny_llama_4k):
    metadata = long_context.task_metadata(tiny_llama_4k)
    assert metadata["max_context"] == 4096
    assert sorted({d["nominal_tokens"] for d in _task_docs(metadata)}) == [1024, 2048]
    assert long_context.not_applicable(metadata) is None
    assert "below the shortest length" in long_context.not_applicable({"max_context": 512})
    assert long_context.not_applicable({"max_context": 512, "lengths": [256, 1024]}) is None


@pytest.mark.parametrize("server_flags, max_model_len, skipped, skipped_because", [
    (["--kv-cache-tokens", "400"], 450, [384],
     "beyond the engine's KV cache at gpu_memory_utilization 0.5: needs ~467 tokens, has 400"),
    ([], 300, [256, 384], "beyond the engine's max_model_len: needs ~333 tokens, has 300"),
])
def test_through_vllm_the_ladder_goes_as_far_as_the_served_engine_holds(tmp_path, tiny_llama, monkeypatch,
                                                                        server_flags, max_model_len, skipped,
                                                                        skipped_because):
    """Lengths past the engine's max_model_len or its KV cache (the server's own start-up figures) are
    skipped with that reason, recorded in the suite's summary; the rest run through the server."""
    import sys

    from typer.testing import CliRunner

    from conftest import TINY_PARAMS, write_params
    from pipeline.cli.app import app

    settings = json.loads(json.dumps(TINY_PARAMS))
    settings["suites"]["long_context"] = {"task": "quant_long_context", "max_new_tokens": 4, "options": {
        "lengths": [128, 256, 384], "depths": [50], "kinds": ["niah"], "repeats": 1}}
    settings["engine"].update(name="vllm", server_command=[sys.executable, str(Path(__file__).with_name(
        "openai_server.py"))], server_args=server_flags, max_model_len=max_model_len, gpu_memory_utilization=0.5,
        start_timeout=120)
    write_params(tmp_path, settings)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "long_context", "--out", "r"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "r" / "long_context.json").read_text())
    lc = summary["table"]
    assert lc["max_context"] < 512  # the engine binds before the model's window does
    assert lc["lengths_run"] == [n for n in (128, 256, 384) if n not in skipped]
    assert [s["length"] for s in lc["lengths_skipped"]] == skipped
    assert lc["lengths_skipped"][0]["reason"] == skipped_because
    assert summary["n"] == 3 - len(skipped) and summary["engine"] == "vllm"
