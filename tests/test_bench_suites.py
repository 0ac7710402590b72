"""Issue 65: the bench takes its items from the suites the run configures (params.yaml `suites`), each through what
its YAML declares (metadata.suite.bench, or its hooks' bench_images), never from every suite evals/ ships; a run that
configures none that gives them takes the shipped ones."""

import json

from typer.testing import CliRunner

from conftest import TINY_PARAMS, write_params
from pipeline.cli.app import app
from pipeline.scoring.bench_load import image_sources
from pipeline.settings import suites
from pipeline.settings.params import Params

IMAGE_SUITES = ("vqa", "charts", "documents", "small_text", "counting")


def _configured(**named) -> tuple:
    return suites.configured(Params.model_validate({**TINY_PARAMS, "suites": named}).suites)


def test_the_image_workload_draws_only_from_the_configured_image_suites():
    chosen = _configured(counting={"task": "quant_counting"}, math={"task": "quant_gsm8k"}, vqa={"task": "quant_vqa"})
    assert [s.name for s in image_sources(chosen)] == ["counting", "vqa"]  # in params.yaml's order
    assert {s.name for s in image_sources(_configured(math={"task": "quant_gsm8k"}))} == set(IMAGE_SUITES)
    # the fixed workload's text: a configured suite's, else the shipped long-context book
    assert suites.bench_file("text", chosen).name == "alice29.txt"


def test_bench_of_a_vision_model_sends_the_images_of_the_configured_suites_only(tmp_path, monkeypatch):
    from tiny import save_tiny_glm4v

    model = save_tiny_glm4v(tmp_path / "glm4v")
    write_params(tmp_path, {**TINY_PARAMS, "bench": {"holdout": False}, "verdict": {"margins": {}},
                            "suites": {"charts": {"task": "quant_charts"}, "small_text": {"task": "quant_small_text"}}})
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["bench", str(model), "--concurrency", "1", "--input-len", "16", "--output-len",
                                      "2", "--images", "1", "--out", "bench.json"])
    assert result.exit_code == 0, result.output
    sent = json.loads((tmp_path / "bench.json").read_text())["workloads"]["1-image"]["image_sizes"]
    assert set(sent) == {"charts", "small_text"} and sum(v["images"] for v in sent.values()) == 64
