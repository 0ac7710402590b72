"""Issue 54: every decided variant comes with a model card a team can publish as is (pipeline/report/model_card.py),
checked by readers nobody here wrote: huggingface_hub's ModelCard parses each back with verdict.json's figures in its
model-index, and Python-Markdown (what the docs site renders with) renders its table."""

import copy
import json
import re
import shlex
from pathlib import Path

import pytest

from conftest import TINY_PARAMS, with_variants, write_params
from pipeline.checkpoints import origin as origins
from pipeline.checkpoints import serving
from pipeline.report.model_card import NOT_STATED, TIMING_ONLY, model_card, model_cards
from pipeline.settings.params import Params
from pipeline.stages import report
from test_bad_inputs import assert_refused, invoke, snapshot
from test_glm4v_vllm import ARCHS, _config
from test_report import write_results

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "reports" / "example"
TASKS = {"math": "quant_gsm8k", "code": "quant_humaneval", "ppl-chat": "quant_ppl_chat", "ppl-book": "quant_ppl_book",
         "ppl-math": "quant_ppl_gsm8k", "ppl-code": "quant_ppl_humaneval"}
ORIGIN = {"license": "apache-2.0", "license_name": None, "license_link": None,
          "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "name": "SmolLM2", "read_from": "x.gguf: GGUF metadata"}
SOURCE = {"source": ".cache/demo/SmolLM2-135M-Instruct.Q4_1.gguf", "kind": "gguf", "dtype": "float16", "origin": ORIGIN}


def example_verdict() -> dict:
    return json.loads((EXAMPLE / "verdict.json").read_text())


def loaded(text: str, tmp_path: Path, name: str = "README.md"):
    """The card as the Hub's own library reads it back from a file."""
    from huggingface_hub import ModelCard

    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return ModelCard.load(path)


def expected_figures(entry: dict) -> dict:
    """{(suite, metric): value} of every suite the verdict counted, read off verdict.json independently of the card."""
    found = {}
    for suite, d in (entry.get("suites") or {}).items():
        if d["counted"]:
            found[(suite, "accuracy")], found[(suite, "recovery")] = d["variant_score"], d["recovery"]
    for suite, d in (entry.get("perplexity") or {}).items():
        if d["counted"]:
            found[(suite, "perplexity")], found[(suite, "recovery")] = d["variant_ppl"], d["recovery"]
    if (entry.get("judge") or {}).get("counted"):
        found[("judge", "win_rate")] = entry["judge"]["summary"]["win_rate"]
    return found


def figures_of(card) -> dict:
    return {(r.task_name, r.metric_type): r.metric_value for r in card.data.eval_results or []}


def first_sentence(card) -> str:
    """The paragraph under the card's title."""
    body = card.text.strip().split("\n\n")
    assert body[0].startswith("# ")
    return body[1]


# ---------------------------------------------------------------- the Hub's reader, on the example's cards

def test_every_decided_variant_of_the_example_gets_a_card_the_hub_reads_back_with_the_verdicts_figures(tmp_path):
    verdict = example_verdict()
    cards = model_cards(verdict, source=SOURCE, tasks=TASKS)
    assert sorted(cards) == sorted(verdict["variants"])  # the example decided all four
    for name, text in cards.items():
        card, entry = loaded(text, tmp_path, f"{name}.md"), verdict["variants"][name]
        assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert card.data.base_model_relation == "quantized" and card.data.license == "apache-2.0"
        assert {"compressed-tensors", "quantized", entry["quant"]["method"]} <= set(card.data.tags)
        assert figures_of(card) == expected_figures(entry) and figures_of(card), name
        assert card.data.to_dict()["model-index"][0]["name"] == name
    assert {"fp8", "w8a8"} <= set(loaded(cards["fp8-w8a8"], tmp_path).data.tags)
    assert {"mixed", "rtn", "w4a16", "w8a16"} <= set(loaded(cards["rtn-w4a16-mixed"], tmp_path).data.tags)


def test_the_committed_example_cards_are_the_committed_verdicts():
    """reports/example/cards/ (make example-report copies the demo's): each parses back with its verdict's figures."""
    from huggingface_hub import ModelCard

    verdict = example_verdict()
    committed = sorted(p.parent.name for p in (EXAMPLE / "cards").glob("*/README.md"))
    assert committed == sorted(verdict["variants"])
    for name in committed:
        card = ModelCard.load(EXAMPLE / "cards" / name / "README.md")
        assert figures_of(card) == expected_figures(verdict["variants"][name]), name
        assert first_sentence(card).startswith({"GO, incomplete": "GO, incomplete:", "NO-GO": "NO-GO,",
                                                 "INCONCLUSIVE": "INCONCLUSIVE,"}[_label(verdict, name)])


def _label(verdict: dict, name: str) -> str:
    return next(d["label"] for d in verdict["decisions"] if d["variant"] == name)


# ---------------------------------------------------------------- honest cards only

def test_a_no_go_an_inconclusive_and_an_incomplete_go_say_so_in_their_first_sentence(tmp_path):
    verdict = example_verdict()
    cards = {name: loaded(text, tmp_path, f"{name}.md") for name, text in model_cards(verdict, source=SOURCE, tasks=TASKS).items()}
    assert first_sentence(cards["awq-w4a16"]).startswith("NO-GO, not a replacement for HuggingFaceTB/SmolLM2-135M-Instruct:")
    assert first_sentence(cards["rtn-w4a16"]).startswith("NO-GO,")
    assert first_sentence(cards["rtn-w4a16-mixed"]).startswith("INCONCLUSIVE, not yet shown to replace")
    fp8 = first_sentence(cards["fp8-w8a8"])
    assert fp8.startswith("GO, incomplete:") and "(math, code not run)" in fp8
    assert "recovers 94.5% to 97.4% of the base's perplexity score" in fp8  # the recovery, as the verdict has it per suite
    for name in ("awq-w4a16", "rtn-w4a16-mixed", "fp8-w8a8"):
        assert "**Before publishing**" in cards[name].text and "not as a replacement for the base" in cards[name].text
    # the same variant, decided on everything the base ran: a plain GO opens with what it is, and no warning
    complete = copy.deepcopy(verdict)
    complete["variants"]["fp8-w8a8"]["coverage"]["complete"] = True
    card = loaded(model_card("fp8-w8a8", complete, source=SOURCE, tasks=TASKS).content, tmp_path)
    assert first_sentence(card).startswith("fp8-w8a8 is HuggingFaceTB/SmolLM2-135M-Instruct quantized to FP8 W8A8")
    assert ", and it is GO: within the margin on all 4 counted suites." in first_sentence(card)
    assert "Before publishing" not in card.text


def test_a_run_on_made_up_weights_writes_a_timing_only_card_with_no_figures_for_the_hub(tmp_path):
    """The GPU example ran on random weights (verdict.json's `synthetic`): its cards are headed "Timing only" and put no
    accuracy figure in the model-index, whatever the paired tests said."""
    verdict = json.loads((REPO / "reports" / "example-gpu" / "verdict.json").read_text())
    assert verdict["synthetic"]["made_up"]
    cards = model_cards(verdict, tasks=TASKS)
    assert cards
    for name, text in cards.items():
        card = loaded(text, tmp_path, f"{name}.md")
        assert card.text.lstrip().startswith(f"# {TIMING_ONLY}: {name}")
        assert first_sentence(card).startswith(f"{TIMING_ONLY}, not for publishing:")
        assert not card.data.eval_results and "model-index" not in card.data.to_dict()
        assert "do not publish" in card.text
    real = copy.deepcopy(verdict)  # the same verdict on a real base: figures again
    del real["synthetic"]
    assert figures_of(loaded(model_card("fp8-w8a8", real, tasks=TASKS).content, tmp_path))


def test_a_licence_the_base_does_not_state_is_said_and_never_invented(tmp_path):
    unstated = {**SOURCE, "origin": {**ORIGIN, "license": None, "hub_id": None}}
    card = loaded(model_card("fp8-w8a8", example_verdict(), source=unstated, tasks=TASKS).content, tmp_path)
    assert card.data.license is None and "license" not in card.data.to_dict()
    assert f"License: {NOT_STATED}; check before publishing." in card.text
    assert card.data.base_model is None and "add `base_model: ORG/NAME` to the header" in card.text
    missing = loaded(model_card("fp8-w8a8", example_verdict(), source=None, tasks=TASKS).content, tmp_path)
    assert missing.data.license is None and f"License: {NOT_STATED}" in missing.text
    stated = loaded(model_card("fp8-w8a8", example_verdict(), source=SOURCE, tasks=TASKS).content, tmp_path)
    assert stated.data.license == "apache-2.0" and NOT_STATED not in stated.text


# ---------------------------------------------------------------- the serving command: only where a run showed it

def _with_serving(config: dict) -> dict:
    verdict = example_verdict()
    verdict["variants"]["fp8-w8a8"]["serving"] = serving.support_from_config(config)
    return verdict


def test_the_serving_command_is_given_as_served_only_where_a_recorded_run_showed_it(tmp_path):
    glm = _config(ARCHS["Glm"], "fp8-static", "per-head", moe=False)  # GLM-4-9B's FP8: vLLM 0.24 on the H200
    assert [r for r in serving.runs_for("vllm", glm) if r.served]
    text = model_card("fp8-w8a8", _with_serving(glm), source=SOURCE, tasks=TASKS).content
    line = next(line for line in text.splitlines() if line.startswith("- **vLLM**"))
    assert "shown on the GPU machine (vllm 0.24.0, 2026-11-30)" in line and "evidence: benchmarks/results/" in line
    assert line.endswith("served with: `vllm serve models/fp8-w8a8 --kv-cache-dtype fp8 --dtype bfloat16`")
    llama = {**glm, "architectures": ["LlamaForCausalLM"]}  # no run of a Llama was recorded
    text = model_card("fp8-w8a8", _with_serving(llama), source=SOURCE, tasks=TASKS).content
    line = next(line for line in text.splitlines() if line.startswith("- **vLLM**"))
    assert "served with" not in text and "not shown" in line
    assert "the command to try: `vllm serve models/fp8-w8a8 --kv-cache-dtype fp8 --dtype bfloat16`" in line
    # a verdict written before serving entries carried their command: the command to try comes from the words it has
    written_before = example_verdict()
    for decided in written_before["variants"].values():
        for entries in (decided.get("serving") or {}, (decided.get("quant") or {}).get("serving") or {}):
            for entry in entries.values():
                entry.pop("command", None)
    old = model_card("awq-w4a16", written_before, source=SOURCE, tasks=TASKS).content
    assert "the command to try: `vllm serve models/awq-w4a16` (or benchmarks/gpu_glm46v_vllm.py" in old


def test_a_glm41v_run_s_flags_are_the_engines_workaround_for_its_defect():
    """serving.py records the flags GLM-4.1V was served with; they must be what the vLLM engine passes for it."""
    from pipeline.engines import vllm_defects

    config = {**_config(ARCHS["Glm4v"], "awq", "none", moe=False), "model_type": "glm4v"}
    run = next(r for r in serving.runs_for("vllm", config) if r.served)
    assert shlex.split(run.flags) == vllm_defects.server_args(config, [], True) != []
    assert serving.support_from_config(config)["vllm"]["command"] == f"vllm serve DIR {run.flags}"


# ---------------------------------------------------------------- the Markdown renders

def test_the_card_renders_as_markdown_with_its_table_and_no_html_from_the_verdict(tmp_path):
    import markdown

    verdict = example_verdict()
    verdict["variants"]["awq-w4a16"]["why"] += " <script>alert(1)</script> | a pipe"
    card = loaded(model_card("awq-w4a16", verdict, source=SOURCE, tasks=TASKS).content, tmp_path)
    page = markdown.markdown(card.text, extensions=["tables"])
    assert "<script" not in page and "&lt;script&gt;" in page
    table = re.sub(r"<t([dh]) [^>]*>", r"<t\1>", page[page.index("<table>"):page.index("</table>")])  # alignment
    assert table.count("<tr>") == 1 + 4 + 1  # header, the four counted suites, the Average row
    assert "<td>ppl-code</td>" in table and "<td><strong>Average</strong></td>" in table
    assert "<td>+19.3% [+15.2%, +23.5%]</td>" in table and "<td>83.8%</td>" in table  # change, interval, recovery
    for heading in ("Evaluation", "Decision", "How it was made", "Calibration data", "Serving", "Speed and capacity",
                    "Limitations"):
        assert f"<h2>{heading}</h2>" in page


# ---------------------------------------------------------------- the report stage writes them

def test_the_report_writes_a_card_per_decided_variant_beside_page_and_verdict(tmp_path):
    """A GO decided on an accuracy suite: the Average row and the first sentence give its recovery; a NO-GO's card
    says so; a variant of params.yaml without results gets no card."""
    results = tmp_path / "results"
    write_results(results, "base", [1] * 1200 + [0] * 800)
    write_results(results, "copy", [1] * 1180 + [0] * 820)  # 20 right answers turned wrong: -1 point
    write_results(results, "broken", [0] * 2000)
    params = Params.model_validate(with_variants(TINY_PARAMS, "copy", "broken"))
    out = report.run(results, tmp_path / "reports", params, models_dir=tmp_path / "models")
    cards = tmp_path / "reports" / "cards"
    assert sorted(p.name for p in cards.iterdir()) == ["broken", "copy"] and out.cards
    assert (cards / "copy" / "README.md").resolve().is_relative_to((tmp_path / "reports" / ".report").resolve())
    verdict = json.loads((tmp_path / "reports" / "verdict.json").read_text())
    copy_card = loaded((cards / "copy" / "README.md").read_text(), tmp_path)
    entry = verdict["variants"]["copy"]
    assert entry["decision"] == "GO" and figures_of(copy_card) == expected_figures(entry)
    assert copy_card.data.eval_results[0].dataset_type == "openai/gsm8k"
    assert "recovers 98.3% of the base's accuracy on average over 1 suite (math), and it is GO" in first_sentence(copy_card)
    assert "| **Average** | accuracy (math) | 60.0% | 59.0% | | **98.3%** | |" in copy_card.text
    assert first_sentence(loaded((cards / "broken" / "README.md").read_text(), tmp_path)).startswith("NO-GO,")


# ---------------------------------------------------------------- the base's origin, read off its source

def test_the_origin_is_read_off_a_gguf_and_a_hub_folder_and_never_guessed(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.license", "mit")
    writer.add_string("general.name", "Tiny")
    writer.add_string("general.source.repo_url", "https://huggingface.co/OrgA/Tiny-1B")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = origins.read_origin(path, "gguf")
    assert (found["license"], found["hub_id"], found["name"]) == ("mit", "OrgA/Tiny-1B", "Tiny")
    snapshot_dir = tmp_path / "hub" / "models--THUDM--glm-4-9b-chat" / "snapshots" / "abc123"
    snapshot_dir.mkdir(parents=True)
    (snapshot_dir / "README.md").write_text("---\nlicense: other\nlicense_name: glm-4\nlicense_link: LICENSE\n---\n# GLM\n")
    found = origins.read_origin(snapshot_dir, "chatglm")
    assert found["hub_id"] == "THUDM/glm-4-9b-chat" and found["license"] == "other" and found["license_name"] == "glm-4"
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "README.md").write_text("no front matter here")
    assert origins.read_origin(bare, "hf") == dict.fromkeys(origins.FIELDS)  # nothing stated: nothing said
    assert origins.read_origin(bare, "hf", "HuggingFaceTB/SmolLM2-135M-Instruct")["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_resave_records_what_its_source_states_of_its_origin(tmp_path, tiny_llama):
    import shutil

    from pipeline.formats.source_json import read_source_json
    from pipeline.stages import resave

    source = tmp_path / "src"
    shutil.copytree(tiny_llama, source)
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    resave.run(source, tmp_path / "base", "float16")
    recorded = read_source_json(tmp_path / "base")
    assert recorded["kind"] == "hf" and recorded["origin"]["license"] == "apache-2.0"
    assert recorded["origin"]["hub_id"] is None and recorded["origin"]["read_from"].endswith("front matter license")


# ---------------------------------------------------------------- quantize card VARIANT_DIR

@pytest.fixture
def card_project(tmp_path, monkeypatch):
    """A project after a report: the example's verdict, each variant's quant.json, the base's source.json."""
    verdict = example_verdict()
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "verdict.json").write_text(json.dumps(verdict))
    for name, entry in verdict["variants"].items():
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "quant.json").write_text(json.dumps(entry["quant"]))
    (tmp_path / "models" / "base").mkdir()
    (tmp_path / "models" / "base" / "source.json").write_text(json.dumps(SOURCE))
    write_params(tmp_path, {**TINY_PARAMS, "suites": {s: {"task": t} for s, t in TASKS.items()}})
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_quantize_card_writes_the_card_the_report_writes(card_project, tmp_path):
    result = invoke(["card", "models/fp8-w8a8", "--out", "published"])
    assert result.exit_code == 0, result.output
    assert "card: wrote published/fp8-w8a8/README.md (GO, incomplete)" in result.output
    text = (card_project / "published" / "fp8-w8a8" / "README.md").read_text()
    params = Params.model_validate({**TINY_PARAMS, "suites": {s: {"task": t} for s, t in TASKS.items()}})
    assert text == report.card_files(example_verdict(), params, SOURCE, None)["cards/fp8-w8a8/README.md"]
    assert invoke(["card", "models/fp8-w8a8", "--out", "published"]).exit_code == 0  # its own output: replaced


@pytest.mark.parametrize("case", ["no verdict", "not json", "the base", "not a folder", "not decided", "built again",
                                  "out over an input"])
def test_quantize_card_refuses_bad_input_with_one_message_and_writes_nothing(card_project, case):
    args, expected = ["card", "models/fp8-w8a8", "--out", "published"], []
    verdict = card_project / "reports" / "verdict.json"
    if case == "no verdict":
        verdict.unlink()
        expected = ["reports/verdict.json: no verdict there", "quantize report"]
    elif case == "not json":
        verdict.write_text("{")
        expected = ["reports/verdict.json: not JSON", "rerun `quantize report`"]
    elif case == "the base":
        args[1], expected = "models/base", ["models/base/quant.json: missing", "pass one of: models/"]
    elif case == "not a folder":
        args[1], expected = "models/fp8", ["models/fp8: no such folder"]
    elif case == "not decided":
        (card_project / "models" / "gptq-w4a16").mkdir()
        (card_project / "models" / "gptq-w4a16" / "quant.json").write_text(
            (card_project / "models" / "fp8-w8a8" / "quant.json").read_text())
        args[1], expected = "models/gptq-w4a16", ["reports/verdict.json: it decides", "not gptq-w4a16", "dvc repro"]
    elif case == "built again":
        quant = card_project / "models" / "fp8-w8a8" / "quant.json"
        quant.write_text(json.dumps({**json.loads(quant.read_text()), "size_bytes": 1}))
        expected = ["models/fp8-w8a8/quant.json: not the build reports/verdict.json decided (size_bytes differ)",
                    "run `quantize report`"]
    else:
        args[3], expected = "models", ["--out models", "contains the variant models/fp8-w8a8"]
    before = snapshot(card_project)
    assert_refused(invoke(args), expected, case)
    assert snapshot(card_project) == before
