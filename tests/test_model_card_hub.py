"""Issue 68: a model card a Hub reader trusts, checked the way a reader of the Hub checks it: every card of both
committed examples (reports/example/cards, reports/example-gpu/cards) and the same cards for a Hub repository parse
with huggingface_hub's ModelCard.load and keep every metadata field within the Hub's rules (tests/hub_rules.py); the
usage block runs as written against a local checkpoint; and each error the issue lists fails a test here or in
tests/test_model_card.py (named beside each)."""

import ast
import json
import re
from pathlib import Path

import pytest

import pipeline.verdict.facts as facts
from hub_rules import problems
from pipeline.report.model_card import model_card, model_cards
from pipeline.verdict.headline import headline
from test_model_card import CALIB, SOURCE, TASKS, body, code_blocks, example_cards, example_verdict, gpu_verdict, paragraphs, section

REPO = Path(__file__).resolve().parent.parent
COMMITTED = {"example": REPO / "reports" / "example" / "cards", "example-gpu": REPO / "reports" / "example-gpu" / "cards"}


def load(path: Path):
    from huggingface_hub import ModelCard

    return ModelCard.load(path)


def committed_cards() -> dict[str, Path]:
    return {f"{which}/{p.parent.name}": p for which, folder in COMMITTED.items() for p in sorted(folder.glob("*/README.md"))}


def test_every_committed_card_of_both_examples_passes_the_hubs_rules():
    cards = committed_cards()
    assert len(cards) == 7  # four CPU variants, three GPU ones
    for name, path in cards.items():
        assert problems(load(path), hub=False) == [], name


def test_every_card_for_a_hub_repository_passes_the_hubs_rules_with_its_id_as_its_name(tmp_path):
    verdicts = {"example": example_verdict(), "example-gpu": gpu_verdict()}
    for which, verdict in verdicts.items():
        for name in verdict["variants"]:
            repo = f"my-org/SmolLM2-135M-{name}"
            text = model_card(name, verdict, source=SOURCE, tasks=TASKS, repo_id=repo).content
            (tmp_path / "README.md").write_text(text)
            card = load(tmp_path / "README.md")
            assert problems(card, hub=True) == [], f"{which}/{name}"
            assert body(text).lstrip().startswith(f"# {'Timing only: ' if verdict.get('synthetic') else ''}{repo}\n")
            if not verdict.get("synthetic"):
                assert card.data.to_dict()["model-index"][0]["name"] == repo


@pytest.mark.parametrize("key, value", [("license", "Apache 2.0"), ("base_model_relation", "quantised"),
                                        ("base_model", "not a repo id!"), ("model_name", "my model"),
                                        ("library_name", "vllm")])
def test_the_hub_rules_refuse_what_the_hub_refuses(tmp_path, key, value):
    """The check itself fails on each kind of bad field (a check that passes everything checks nothing)."""
    from huggingface_hub import ModelCard

    text = model_card("fp8-w8a8", example_verdict(), source=SOURCE, tasks=TASKS, repo_id="my-org/fp8").content
    card = ModelCard(text)
    setattr(card.data, key, value)
    (tmp_path / "README.md").write_text(str(card))
    assert problems(load(tmp_path / "README.md"), hub=True), (key, value)


def test_the_usage_block_runs_as_written_against_the_local_checkpoint(tiny_variants, capsys):
    """A local record's transformers snippet loads models/<variant>: run as written there (the tiny checkpoint of that
    format in the folder's place), on the CPU."""
    verdict = example_verdict()
    for name in ("awq-w4a16", "fp8-w8a8"):
        text = example_cards(verdict)[name]
        snippet = next(b for b in code_blocks(text, "python") if "transformers" in b)
        assert f'model_id = "models/{name}"' in snippet
        snippet = snippet.replace(f'"models/{name}"', repr(str(tiny_variants[name]))).replace("max_new_tokens=256",
                                                                                             "max_new_tokens=4")
        exec(compile(snippet, f"<{name} card>", "exec"), {})
        assert capsys.readouterr().out.strip(), name


# ---------------------------------------------------------------- issue 68's list, each a failing check on the old card

def test_nothing_on_a_card_speaks_to_the_publisher_and_the_local_record_says_what_it_is():
    """Item 1 (also tests/test_model_card.py: INTERNAL and the repository-id test)."""
    for name, path in committed_cards().items():
        text = path.read_text()
        for said in ("your-org", "quantize card", "--repo-id", "Do not publish", "replace it"):
            assert said not in text, f"{name}: {said}"
        assert "(local record)" in body(text).splitlines()[1], name


def test_perplexity_is_its_rise_under_its_own_metric_type_never_a_recovery():
    """Item 4: the old card put 'recovers 86.1 %' under metric type recovery for a perplexity that rose 16 %."""
    for name, path in committed_cards().items():
        card = load(path)
        for result in card.data.eval_results or []:
            if result.metric_type == "recovery":
                assert "ppl" not in result.task_name and "perplexity" not in result.metric_name, name
        text = path.read_text()
        assert "perplexity score" not in text and "perplexity over this model's" not in text, name
        assert not re.search(r"recovers [\d.]+% to [\d.]+% of the base's perplexity", text), name
    awq = load(COMMITTED["example"] / "awq-w4a16" / "README.md")
    change = {r.task_name: r for r in awq.data.eval_results if r.metric_type == "perplexity_change"}
    assert round(change["ppl-book"].metric_value, 3) == 0.162 and "margin +10.0%" in change["ppl-book"].metric_name


def test_no_next_step_on_a_card_exceeds_its_suite():
    """Items 4 and 69.6: "about 2093 paired documents would likely settle it" on a suite of 164."""
    for name, path in committed_cards().items():
        assert "2093" not in path.read_text(), name
    verdict = example_verdict()
    entry = verdict["variants"]["rtn-w4a16-mixed"]
    code = entry["perplexity"]["ppl-code"]
    code["available"], code["documents_to_settle"] = 164, 2093
    entry["next_steps"] = [{**s, "needed": None, "available": 164, "commands": []} if s["suite"] == "ppl-code" else s
                           for s in entry["next_steps"]]
    code["sentence"] = code["sentence"].replace("(about 2093 paired documents would likely settle it)",
                                                "(it cannot be settled on this suite (164 documents))")
    text = model_card("rtn-w4a16-mixed", verdict, source=SOURCE, tasks=TASKS).content
    assert "2093" not in text
    assert "- ppl-code: 8 documents did not settle it, and it cannot be settled on this suite (164 documents)" in text


def test_the_headline_and_each_card_agree_on_what_to_ship():
    """Item 5 and 69.5: the headline said "Ship fp8-w8a8" beside a card saying not to publish it."""
    for verdict in (example_verdict(), gpu_verdict()):
        text = headline(verdict)
        cards = model_cards(verdict, source=SOURCE, tasks=TASKS)
        for name, card in cards.items():
            ships = facts.ships(verdict["variants"][name]) and not verdict.get("synthetic")
            assert text.startswith(f"Ship {name}") == ships or text.startswith("Ship any of") and (name in text) == ships
            caveat = paragraphs(card)[2]
            assert caveat.startswith("**") != (ships and "not yet served" not in caveat), name


def test_scoring_and_serving_are_both_said_and_a_go_without_a_vllm_run_says_so():
    """Item 5: scored on the CPU in float32 with simulated FP8, served with --dtype bfloat16, never run on vLLM."""
    fp8 = (COMMITTED["example"] / "fp8-w8a8" / "README.md").read_text()
    assert "Not yet served with vLLM" in fp8 and "--dtype bfloat16" in fp8
    assert ("- its figures were scored with transformers in float32 on x86_64, 2 CPUs (FP8 weights decompressed at load "
            "to the values they hold; activations and KV cache fake-quantized to FP8 with their scales in every "
            "forward); served with vLLM it runs on vLLM's own kernels in bfloat16, which was not scored") in fp8


def test_the_card_has_what_published_quantized_cards_have_and_no_boilerplate_that_does_not_apply():
    """Items 2, 6 and the boilerplate: the chain from the GGUF file, requirements, intended and out-of-scope use, who
    quantized it, date and version; no vision tower or MoE router on a dense text model, no "small" head, the
    checkpoint's layer names rather than vLLM's fused ones."""
    for name, path in committed_cards().items():
        text = path.read_text()
        for said in ("- **Model**: ", "- **Inputs and outputs**: ", "- **Intended use**: ", "- **Out-of-scope use**: ",
                     "- **Date and version**: ", "### Requirements", "- GPU: "):
            assert said in text, f"{name}: {said}"
        for said in ("re:.*visual.*", "MoE router", "output head: small", "qkv_proj", "gate_up_proj"):
            assert said not in text, f"{name}: {said}"
    cpu = (COMMITTED["example"] / "awq-w4a16" / "README.md").read_text()
    assert "vqa" not in section(cpu, "Limitations")  # a text model's limitations name no image suite
    assert "then quantized again: a re-quantization of weights the GGUF file already held quantized" in cpu
    hub = model_card("awq-w4a16", example_verdict(), source=SOURCE, tasks=TASKS, repo_id="my-org/awq").content
    assert "- **Quantized by**: my-org" in hub


def test_the_reproduction_needs_only_public_tools_and_names_private_data_as_private():
    """Item 3: public suites with `lm_eval --model vllm` on the repository id; the held-out conversations named as
    private and in no command; the calibration set said private, with its checksum."""
    text = model_card("fp8-w8a8", example_verdict(), source=SOURCE, calib=CALIB, tasks=TASKS, repo_id="my-org/fp8").content
    lm_eval = [line for block in code_blocks(text, "bash") for line in block.splitlines() if line.startswith("lm_eval")]
    assert lm_eval and lm_eval[0].startswith("lm_eval --model vllm --model_args pretrained=my-org/fp8 ")
    assert all("quant_ppl_chat" not in line for line in lm_eval)
    assert "ppl-chat scores held-out conversations of the publisher's own logs, which are private" in text
    assert "The set is private, not published with the model (its blocks, sha256 4fd37417" in text


def test_the_pipelines_revision_comes_with_its_address_or_says_it_has_none():
    """Item 3: a git revision with no address cannot be fetched; the card says where the revision lives (the
    package's Project-URL, recorded by the report) or that a reader cannot fetch it."""
    import copy

    verdict = example_verdict()
    revision = verdict["environment"]["git_revision"]
    text = model_card("fp8-w8a8", verdict, source=SOURCE, calib=CALIB, tasks=TASKS, repo_id="my-org/fp8").content
    unfetchable = f"glm-quant-pipeline git revision {revision}, whose repository has no public address"
    assert text.count(unfetchable) == 3  # the creation, the reproduction and the date-and-version line
    assert "git revision" not in text.replace(unfetchable, "")
    published = copy.deepcopy(verdict)
    published["environment"]["pipeline_repository"] = "https://example.org/team/glm-quant-pipeline"
    text = model_card("fp8-w8a8", published, source=SOURCE, calib=CALIB, tasks=TASKS, repo_id="my-org/fp8").content
    assert text.count(f"glm-quant-pipeline https://example.org/team/glm-quant-pipeline, git revision {revision}") == 3
    assert "no public address" not in text


def test_the_cards_code_names_no_engine_by_string():
    """Item 7: what an engine is called and how it is served comes from the engine registry (EngineSpec.hub_serving,
    shown_as, package), never a literal in the card's code."""
    from pipeline.engines import ENGINES

    names = set(ENGINES)
    for path in sorted((REPO / "pipeline" / "report").glob("card_*.py")) + [REPO / "pipeline/report/model_card.py"]:
        literals = {node.value for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        assert not literals & names, f"{path.name}: {literals & names}"
    assert json.dumps(sorted(n for n, s in ENGINES.items() if s.hub_serving)) == '["vllm"]'


def test_the_recipe_runs_with_llm_compressor_alone(tiny_llama, tiny_variants, tmp_path, monkeypatch):
    """Item 3: the creation section's llm-compressor snippet, run as written (the base, the checkpoint's own
    recipe.yaml and a calibration file of one's own in their places), writes a checkpoint of the same scheme."""
    text = example_cards()["fp8-w8a8"]
    snippet = next(b for b in code_blocks(text, "python") if "oneshot(" in b)
    recipe = tiny_variants["fp8-w8a8"] / "recipe.yaml"
    assert recipe.is_file()  # llm-compressor wrote it beside the weights: it ships with the checkpoint
    (tmp_path / "calibration.jsonl").write_text("".join(json.dumps({"text": f"Order {i} is late, please help."}) + "\n"
                                                        for i in range(16)))
    monkeypatch.chdir(tmp_path)
    snippet = (snippet.replace('"models/base"', repr(str(tiny_llama))).replace('"recipe.yaml"', repr(str(recipe)))
               .replace("max_seq_length=256", "max_seq_length=32"))
    exec(compile(snippet, "<fp8 card: creation>", "exec"), {})
    config = json.loads((tmp_path / "quantized" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] == "float"


def test_a_go_card_says_first_whether_vllm_serves_it():
    """Item 5: a plain GO card carried no caveat at all; now a GO that vLLM refused, or that no vLLM run covers, says
    so first, and only a GO a recorded vLLM run served opens with what it is."""
    from test_glm4v_vllm import ARCHS, _config
    from test_model_card import _with_serving

    glm46v = _with_serving(_config(ARCHS["Glm46V"], "fp8-static", "per-head", moe=False))
    glm46v["variants"]["fp8-w8a8"]["coverage"]["complete"] = True
    text = model_card("fp8-w8a8", glm46v, source=SOURCE, tasks=TASKS, repo_id="o/m").content
    assert paragraphs(text)[1].startswith("**GO against HuggingFaceTB/SmolLM2-135M-Instruct on every suite the base "
                                          "ran, not served with vLLM, which refused a checkpoint like it")
    assert "; not served with vLLM, which refused it\n" in text
