"""Issues 54 and 61: every decided variant comes with a model card a team can publish as it is
(pipeline/report/model_card.py and its parts), checked by readers nobody here wrote: huggingface_hub's ModelCard parses
each back with verdict.json's figures in its model-index, Python-Markdown (what the docs site renders with) renders
it, Python parses its snippets and transformers runs its transformers snippet, and `quantize` reads its recipe.

Issue 61's list, one test each (each fails on the card issue 54 wrote): a perplexity recovery named by what it
divides; the base named as what it was (a GGUF dequantized), never "the unquantized model"; no lmdeploy prose in a
code span; no ChatGLM reason on a Llama; the fix's own decision; sizes in MiB named MiB and each format's own
precision; a timing-only card without a decision, a recovery or a doubled "base: base:"; no internal material;
overview, usage by repository id, recipe, engine and precision, datasets with config and split, math and code in the
evaluation. Then: a card not decided GO says first, in one sentence, why not to publish it."""

import ast
import copy
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from conftest import TINY_PARAMS, with_variants, write_params
from pipeline.checkpoints import origin as origins
from pipeline.checkpoints import serving
from pipeline.report.model_card import NOT_STATED, TIMING_ONLY, model_card, model_cards, run_settings
from pipeline.settings.params import Params
from pipeline.stages import report
from test_bad_inputs import assert_refused, invoke, snapshot
from test_glm4v_vllm import ARCHS, _config
from test_report import write_results

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "reports" / "example"
INPUTS = EXAMPLE / "card_inputs"
TASKS = {"math": "quant_gsm8k", "code": "quant_humaneval", "ppl-chat": "quant_ppl_chat", "ppl-book": "quant_ppl_book",
         "ppl-math": "quant_ppl_gsm8k", "ppl-code": "quant_ppl_humaneval"}
ORIGIN = {"license": "apache-2.0", "license_name": None, "license_link": None,
          "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "name": "SmolLM2", "read_from": "x.gguf: GGUF metadata"}
SOURCE = {"source": ".cache/demo/SmolLM2-135M-Instruct.Q4_1.gguf", "kind": "gguf", "dtype": "float16", "origin": ORIGIN}
CALIB = json.loads((INPUTS / "stats.json").read_text())
HEADINGS = ("Model overview", "Deployment", "Evaluation", "Creation", "Reproduction", "Limitations")


def example_verdict() -> dict:
    return json.loads((EXAMPLE / "verdict.json").read_text())


def example_params() -> Params:
    from pipeline.settings.params import load

    return load(INPUTS / "params.yaml")


def example_cards(verdict: dict | None = None, **facts) -> dict[str, str]:
    """The example's cards as the report stage writes them (its source, calibration summary and run settings)."""
    verdict = verdict or example_verdict()
    facts = {"source": SOURCE, "calib": CALIB, "tasks": TASKS, "run": run_settings(verdict, example_params()), **facts}
    return model_cards(verdict, **facts)


def gpu_verdict() -> dict:
    return json.loads((REPO / "reports" / "example-gpu" / "verdict.json").read_text())


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
    for suite, d in (entry.get("perplexity") or {}).items():  # its rise, never a recovery (issue 68 item 4)
        if d["counted"]:
            found[(suite, "perplexity")], found[(suite, "perplexity_change")] = d["variant_ppl"], d["change"]
    if (entry.get("judge") or {}).get("counted"):
        found[("judge", "win_rate")] = entry["judge"]["summary"]["win_rate"]
    return found


def figures_of(card) -> dict:
    return {(r.task_name, r.metric_type): r.metric_value for r in card.data.eval_results or []}


def body(text: str) -> str:
    """The card below its YAML header."""
    return text.split("\n---\n", 1)[1] if text.startswith("---\n") else text


def paragraphs(text: str) -> list[str]:
    return [p for p in body(text).strip().split("\n\n") if p.strip()]


def prose(text: str) -> str:
    """The card's body without its code blocks: what a reader reads as sentences."""
    return re.sub(r"```.*?```", "", body(text), flags=re.S)


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def section(text: str, heading: str) -> str:
    """The text under `## heading`, up to the next `## `."""
    after = body(text).split(f"\n## {heading}\n", 1)[1]
    return after.split("\n## ", 1)[0]


# ---------------------------------------------------------------- the Hub's reader, on the example's cards

def test_every_decided_variant_of_the_example_gets_a_card_the_hub_reads_back_with_the_verdicts_figures(tmp_path):
    from huggingface_hub.repocard_data import model_index_to_eval_results

    verdict = example_verdict()
    cards = example_cards(verdict)
    assert sorted(cards) == sorted(verdict["variants"])  # the example decided all four
    for name, text in cards.items():
        card, entry = loaded(text, tmp_path, f"{name}.md"), verdict["variants"][name]
        assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert card.data.base_model_relation == "quantized" and card.data.license == "apache-2.0"
        assert {"compressed-tensors", "quantized", entry["quant"]["method"]} <= set(card.data.tags)
        assert figures_of(card) == expected_figures(entry) and figures_of(card), name
        index = card.data.to_dict()["model-index"]
        assert index[0]["name"] == name
        assert {(r.task_name, r.metric_type): r.metric_value for r in model_index_to_eval_results(index)[1]} == \
            expected_figures(entry)  # the round trip through the Hub's own parser
    assert {"fp8", "w8a8"} <= set(loaded(cards["fp8-w8a8"], tmp_path).data.tags)
    assert {"mixed", "rtn", "w4a16", "w8a16"} <= set(loaded(cards["rtn-w4a16-mixed"], tmp_path).data.tags)


def test_the_committed_example_cards_are_what_the_committed_verdict_and_card_inputs_write():
    """reports/example/cards/ is re-rendered by `make example-cards` (benchmarks/example_cards.py) from the verdict and
    what the demo's report stage handed the cards (reports/example/card_inputs/): never stale."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import example_cards as script

    rendered = script.rendered(EXAMPLE)
    committed = {str(p.relative_to(EXAMPLE)): p.read_text() for p in (EXAMPLE / "cards").glob("*/README.md")}
    assert sorted(committed) == sorted(rendered) == sorted(f"cards/{v}/README.md" for v in example_verdict()["variants"])
    for name, text in rendered.items():
        assert committed[name] == text, f"{name}: run `make example-cards`"
    assert example_params().digest() == example_verdict()["params_sha256"]  # the inputs are the run's


# ---------------------------------------------------------------- issue 61: each error of the issue-54 card

def test_a_perplexity_recovery_is_named_by_what_it_divides(tmp_path):
    """The verdict's perplexity recovery is base / variant: its model-index entry says so, an accuracy one says the
    other way round, and both equal the quotient computed here."""
    verdict = example_verdict()
    for name, text in example_cards(verdict).items():
        entry = verdict["variants"][name]
        for result in loaded(text, tmp_path).data.eval_results:
            if result.metric_type != "recovery":
                continue
            suite = result.task_name
            if suite in (entry.get("perplexity") or {}):
                d = entry["perplexity"][suite]
                assert result.metric_name == f"{suite} recovery (the base's perplexity / this model's)"
                assert result.metric_value == pytest.approx(d["base_ppl"] / d["variant_ppl"])
            else:
                d = entry["suites"][suite]
                assert result.metric_name == f"{suite} recovery (this model's accuracy / the base's)"
                assert result.metric_value == pytest.approx(d["variant_score"] / d["base_score"])
        assert "variant / base" not in text


def test_the_card_names_the_base_it_was_compared_with_a_gguf_dequantized_never_the_unquantized_model():
    for name, text in example_cards().items():
        assert "unquantized model" not in text, name
        opening = next(p for p in paragraphs(text) if p.startswith(f"{name} is "))
        assert ("Against HuggingFaceTB/SmolLM2-135M-Instruct as converted from the GGUF file "
                "SmolLM2-135M-Instruct.Q4_1.gguf (its quantized weights dequantized to float16), not the original "
                "unquantized release, it") in opening
        # issue 68 item 2: the whole chain its weights were made from, the re-quantization said
        assert ("with llm-compressor, made from the GGUF file SmolLM2-135M-Instruct.Q4_1.gguf of "
                "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1, by its file name; its checksum not recorded), dequantized "
                "to float16, then quantized again: a re-quantization of weights the GGUF file already held "
                "quantized.") in opening
    hf = {"source": "/x/snapshots/abc", "kind": "hf", "dtype": "bfloat16", "origin": ORIGIN}
    text = model_card("fp8-w8a8", example_verdict(), source=hf, tasks=TASKS).content
    assert "Against HuggingFaceTB/SmolLM2-135M-Instruct in bfloat16, its perplexity rises" in text and "GGUF" not in text
    recorded = {**SOURCE, "file_type": "Q4_1", "sha256": "ab" * 32}
    text = model_card("fp8-w8a8", example_verdict(), source=recorded, tasks=TASKS).content
    assert f"(Q4_1, by its GGUF metadata; sha256 {'ab' * 32})" in text


def test_no_lmdeploy_prose_in_a_code_span_and_every_code_block_is_code_that_runs_as_written():
    """lmdeploy needs this project's `quantize export` first: no Hub user's command. Each Python block parses; each
    shell line is a command of a tool a reader has (vllm, hf, lm_eval, quantize), with no word left to fill in."""
    for name, text in example_cards().items():
        assert "lmdeploy" not in text and "EXPORT" not in text and " DIR" not in text, name
        for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose(text)):
            assert ", then " not in span, f"{name}: prose in a code span: {span}"
        for block in code_blocks(text, "python"):
            ast.parse(block)
        for block in code_blocks(text, "bash"):
            for line in block.strip().splitlines():
                assert shlex.split(line)[0] in ("vllm", "hf", "lm_eval", "quantize"), f"{name}: {line}"


def test_the_fp8_card_of_a_llama_gives_no_chatglm_reason_and_the_serving_record_gives_it_only_to_glm():
    fp8 = example_cards()["fp8-w8a8"]
    assert example_verdict()["variants"]["fp8-w8a8"]["quant"]["architecture"] == "LlamaForCausalLM"
    assert "ChatGLM" not in fp8 and "query_key_value" not in fp8
    glm = _config(ARCHS["Glm"], "fp8-static", "per-tensor", moe=False)
    llama = {**glm, "architectures": ["LlamaForCausalLM"]}
    assert "ChatGLM loader splits every query_key_value" in serving.support_from_config(glm)["lmdeploy"]["how"]
    refused = serving.support_from_config(llama)["lmdeploy"]
    assert refused["status"] == "cannot" and "ChatGLM" not in refused["how"]
    assert refused["how"].startswith("lmdeploy 0.18 cannot serve FP8 W8A8: it reads compressed-tensors")


def test_the_fix_line_gives_the_fix_its_own_decision():
    """"Its fix (rtn-w4a16-mixed): NO-GO; ... leaves it INCONCLUSIVE" read as if the fix were NO-GO."""
    text = example_cards()["rtn-w4a16"]
    line = next(line for line in text.splitlines() if line.startswith("Its fix"))
    assert line == ("Its fix, rtn-w4a16-mixed, keeps 17 of 120 groups in 8 bits (4.50 bits per weight, 1.1× this "
                    "model's size) and is INCONCLUSIVE: the evidence settles neither way on ppl-book, ppl-code and "
                    "ppl-math.")
    fixed = example_cards()["rtn-w4a16-mixed"]
    assert "It is the fix of rtn-w4a16, a NO-GO W4A16 variant" in fixed


def test_sizes_are_in_binary_units_named_so_and_each_card_says_its_own_formats_precision():
    cards, verdict = example_cards(), example_verdict()
    for name, text in cards.items():
        quant = verdict["variants"][name]["quant"]
        assert f"{quant['size_bytes'] / 2**20:.1f} MiB" in text and f"{quant['base_size_bytes'] / 2**20:.1f} MiB" in text
        assert not re.search(r"\d \b[KMG]B\b", text), name  # MiB counted, MB written: gone
        assert "W4A16 dequantized and FP8 fake-quantized" not in text
    assert "159.1 MiB" in cards["fp8-w8a8"]  # 166,785,653 bytes
    fp8, awq = section(cards["fp8-w8a8"], "Evaluation"), section(cards["awq-w4a16"], "Evaluation")
    assert "this model's FP8 weights decompressed at load" in fp8 and "int4" not in fp8
    assert "this model's int4 weights decompressed at load" in awq and "FP8" not in awq
    mixed = section(cards["rtn-w4a16-mixed"], "Evaluation")
    assert "this model's int4 and int8 weights decompressed at load" in mixed
    assert "decompressing its FP8 weights at load" in cards["fp8-w8a8"]
    assert "decompressing its int4 weights at load" in cards["awq-w4a16"]
    glm = _config(ARCHS["Glm"], "fp8-static", "per-head", moe=False)
    assert "FP8 weights decompressed" in serving.support_from_config(glm)["hf"]["how"]
    int4 = _config(ARCHS["Glm"], "awq", "none", moe=False)
    assert "int4 weights" in serving.support_from_config(int4)["hf"]["how"]
    assert "FP8" not in serving.support_from_config(int4)["hf"]["how"]


def test_a_timing_only_card_says_no_decision_no_recovery_and_each_reason_once(tmp_path):
    """The GPU example ran on random weights: its cards put no figure in the model-index and say no GO, no recovery
    (the issue-54 card said "GO, incomplete" and "recovery 100.7%"), and no "base: base:"."""
    verdict = gpu_verdict()
    assert verdict["synthetic"]["made_up"]
    cards = model_cards(verdict, tasks=TASKS)
    assert cards
    for name, text in cards.items():
        card = loaded(text, tmp_path, f"{name}.md")
        assert card.text.lstrip().startswith(f"# {TIMING_ONLY}: {name}")
        assert paragraphs(text)[2] == ("**Not evaluated: the base's weights were made up by the run, so none of its "
                                       "accuracy figures means anything; this card records what was built and how "
                                       "fast it runs.**")
        assert not card.data.eval_results and "model-index" not in card.data.to_dict()
        assert not re.search(r"\bGO\b", text) and "recover" not in text.lower() and "100.7" not in text, name
        assert "base: base:" not in text and f"{name}: {name}:" not in text
        assert "Speed" in text and "tok/s at batch 1" in section(text, "Deployment")  # what it is for: timing
    real = copy.deepcopy(verdict)  # the same verdict on a real base: figures again
    del real["synthetic"]
    assert figures_of(loaded(model_card("fp8-w8a8", real, tasks=TASKS).content, tmp_path))


def test_a_suite_not_applicable_to_both_models_says_its_reason_once():
    from pipeline.verdict.coverage import not_applicable_why

    same = {"base": "base: text-only model (no vision_config in config.json); the suite needs images",
            "fp8-w8a8": "fp8-w8a8: text-only model (no vision_config in config.json); the suite needs images"}
    assert not_applicable_why(same) == "text-only model (no vision_config in config.json); the suite needs images"
    assert not_applicable_why({"base": None, "v": "v: no images"}) == "no images"
    assert not_applicable_why({"base": "base: a", "v": "v: b"}) == "base: a; v: b"


# what a reader outside this project cannot use: the pipeline operator's keys, this machine's paths, the calibration
# log's redaction counts, the report's shorthand
INTERNAL = [r"Before publishing", r"\.cache/", r"\bresults/", r"calib_data/", r"benchmarks/", r"\bemail \d", r"phone \d",
            r"ppl-chat open", r"search gram", r"\b(suites|judge|fix|calib|verdict|engine|kl)\.[a-z_]+\b",
            r"in params\.yaml", r"params\.yaml (digest|has)", r"dvc\b", r"`quantize (bench|report|eval)` first", r"the gpu-h200 profile",
            r"\bmodel\.(source|base_dir|dtype)\b",
            # issue 68: the tool's own words and instructions to the publisher, on a page for the Hub's readers
            r"GO, incomplete", r"shown, not counted", r"your-org", r"quantize card", r"--repo-id", r"Do not publish",
            r"publisher's GPU machine", r"output head: small", r"MoE router", r"vision tower: kept",
            r"\.(qkv_proj|gate_up_proj)\b"]


def test_no_internal_material_goes_on_a_card():
    texts = {**example_cards(), **{f"gpu {n}": t for n, t in model_cards(gpu_verdict(), tasks=TASKS).items()}}
    for name, text in texts.items():
        for pattern in INTERNAL:
            found = re.search(pattern, prose(text))
            assert not found, f"{name}: {found.group(0)!r} ({pattern})"
        assert ".cache/" not in text and "results/" not in text  # nor in a code block
    # the calibration set in words: which kinds of personal data were redacted, never how many of each
    assert ("- calibration: 16 blocks of 256 tokens from 468 conversations of the publisher's own logs, card "
            "numbers, e-mail addresses and phone numbers redacted; 32 more conversations held out") in texts["awq-w4a16"]
    assert "- calibration: none: the rtn method rounds each weight on its own" in texts["rtn-w4a16-mixed"]


def test_the_card_has_the_sections_the_published_cards_have():
    for name, text in example_cards().items():
        headings = re.findall(r"^## (.+)$", body(text), flags=re.M)
        assert headings == list(HEADINGS), name
        overview = section(text, "Model overview")
        for item in ("Base model", "Architecture", "What changed", "Checkpoint", "Compared with", "Intended use",
                     "License", "Decision"):
            assert f"- **{item}**: " in overview, f"{name}: {item}"
        assert "LlamaForCausalLM" in overview and "210 linear layers quantized" in overview
    assert ("- **What changed**: FP8 weights with one scale per output channel, FP8 activations with one calibrated "
            "scale per tensor, an FP8 KV cache with one calibrated scale per attention head") in example_cards()["fp8-w8a8"]


def test_each_method_says_what_it_changed_from_its_own_record():
    """What changed is the method's own words (its card_words), from what its quant.json recorded."""
    from pipeline.methods import awq, fp8, gptq, mixed, rtn

    symmetric = {"group_size": 128, "symmetric": True}
    assert awq.card_words(symmetric) == ("4-bit integer weights with one scale per group of 128 weights, activations in "
                                         "16 bits, after AWQ smoothing (per-channel scales searched on calibration "
                                         "data, folded into the layers before)")
    assert rtn.card_words({**symmetric, "symmetric": False}).startswith("4-bit integer weights with one scale and zero "
                                                                          "point per group of 128 weights")
    assert gptq.card_words(symmetric).endswith("by GPTQ (each rounding error fed back through its layer's Hessian)")
    assert fp8.card_words({"activations": "dynamic", "kv_cache": "none"}) == (
        "FP8 weights with one scale per output channel, FP8 activations scaled per token at run time, the KV cache "
        "unquantized")
    fixed = mixed.card_words({**symmetric, "base_method": "awq", "groups_in_8_bits": 3, "groups_total": 40,
                              "bits_per_weight": 4.3})
    assert "after AWQ smoothing" in fixed and fixed.endswith("; 3 of 40 groups of layers kept in 8-bit integers "
                                                             "(W8A16), 4.30 bits per weight on average")


def test_the_usage_snippets_name_the_repository_and_say_what_it_needs(tmp_path):
    verdict = example_verdict()
    text = model_card("fp8-w8a8", verdict, source=SOURCE, tasks=TASKS, repo_id="my-org/SmolLM2-135M-FP8").content
    deployment = section(text, "Deployment")
    assert 'llm = LLM(model="my-org/SmolLM2-135M-FP8", kv_cache_dtype="fp8", dtype="bfloat16")' in deployment
    assert "vllm serve my-org/SmolLM2-135M-FP8 --kv-cache-dtype fp8 --dtype bfloat16" in deployment
    assert 'model_id = "my-org/SmolLM2-135M-FP8"' in deployment and "your-org" not in text
    assert "hf download my-org/SmolLM2-135M-FP8 --local-dir models/fp8-w8a8" in section(text, "Reproduction")
    # issue 68 item 1: the repository id is the title, the first sentence and the model-index name
    assert text.split("\n---\n", 1)[1].lstrip().startswith("# my-org/SmolLM2-135M-FP8\n")
    assert any(p.startswith("my-org/SmolLM2-135M-FP8 is HuggingFaceTB/SmolLM2-135M-Instruct quantized to FP8")
               for p in paragraphs(text))
    assert loaded(text, tmp_path).data.to_dict()["model-index"][0]["name"] == "my-org/SmolLM2-135M-FP8"
    assert "local record" not in text
    assert "- weights: 159.1 MiB, 61.2% of the base's 260.0 MiB" in deployment  # the GPU memory its weights take
    assert "`--gpu-memory-utilization`" in deployment
    # without a repository id: a local record that says so, its snippets loading the checkpoint's folder
    local = example_cards()["awq-w4a16"]
    assert body(local).lstrip().startswith("# awq-w4a16 (local record)\n\n*A local record of awq-w4a16, not a Hub card")
    assert 'LLM(model="models/awq-w4a16")' in local and 'model_id = "models/awq-w4a16"' in local
    assert "hf download" not in local


def test_the_datasets_carry_their_hub_id_config_split_and_the_items_scored(tmp_path):
    hub = {"openai/gsm8k": ("main", "test"), "openai/openai_humaneval": ("openai_humaneval", "test")}
    cards = example_cards()
    for name, text in cards.items():
        for result in loaded(text, tmp_path).data.eval_results:
            assert re.search(r"\(\d+ (items|documents|pairs) scored\)$", result.dataset_name), (name, result)
            if result.dataset_type in hub:
                assert (result.dataset_config, result.dataset_split) == hub[result.dataset_type], (name, result)
    ppl_math = next(r for r in loaded(cards["fp8-w8a8"], tmp_path).data.eval_results if r.task_name == "ppl-math")
    assert (ppl_math.dataset_type, ppl_math.dataset_config, ppl_math.dataset_split) == ("openai/gsm8k", "main", "test")
    assert ppl_math.dataset_name == "GSM8K test questions with their reference solutions (10 documents scored)"


def test_the_evaluation_says_which_engine_and_precision_scored_it_and_shows_math_and_code_beside_perplexity():
    cards = example_cards()
    awq = section(cards["awq-w4a16"], "Evaluation").strip()
    assert awq.startswith("Scored with transformers, in process, in float32: the base's float16 weights as stored, "
                          "this model's int4 weights")
    assert ("| math | GSM8K test questions (accuracy) | 20 items | 5.0% | 0.0% | -5.00 pts [-30.10, +19.45] | -3.00 pts "
            "| 0.0% | not counted: the base model scores 5.0%, at the floor |") in awq
    assert "| code | HumanEval problems (accuracy) | 10 items | 0.0% | 0.0% |" in awq
    rows = [line.split(" | ")[0] for line in awq.splitlines() if line.startswith("| ")][1:]
    assert rows[:2] == ["| math", "| code"] and "| ppl-book" in rows  # accuracy first, then perplexity
    fp8 = section(cards["fp8-w8a8"], "Evaluation")
    assert "| math | GSM8K test questions | – | 5.0% | – | | | | not run on this model |" in fp8
    # issue 68 item 4: perplexity as its rise with its interval and margin, never a recovery
    assert ("| ppl-chat | held-out conversations of the publisher's own logs (perplexity, lower is better) | 12 documents "
            "(6,233 tokens) | 18.166 | 18.758 | +3.3% [+2.4%, +4.2%] | +10.0% | – | GO |") in fp8
    assert "recovers" not in fp8 and "perplexity score" not in cards["fp8-w8a8"]
    # a params.yaml other than the one the verdict was decided under says nothing of the dtype
    other = model_card("awq-w4a16", example_verdict(), source=SOURCE, tasks=TASKS, run=None).content
    assert "in the engine's dtype (not recorded with this verdict)" in other


# ---------------------------------------------------------------- issue 61 item 3: why not, first

def test_a_variant_not_decided_go_says_first_in_one_sentence_why_it_should_not_be_published(tmp_path):
    cards = example_cards()
    first = {name: paragraphs(text)[2] for name, text in cards.items()}  # after the title and the local record's note
    assert first["awq-w4a16"] == ("**Not a replacement for HuggingFaceTB/SmolLM2-135M-Instruct: it is NO-GO, its "
                                  "perplexity rises by more than the margin on ppl-book, ppl-code and ppl-math.**")
    assert first["rtn-w4a16-mixed"] == ("**Not shown to replace HuggingFaceTB/SmolLM2-135M-Instruct: it is INCONCLUSIVE, "
                                        "the evidence settles neither way on ppl-book, ppl-code and ppl-math.**")
    assert first["fp8-w8a8"] == ("**Not yet shown to replace HuggingFaceTB/SmolLM2-135M-Instruct: it is GO on ppl-chat, "
                                 "ppl-book, ppl-math and ppl-code only; math and code were not run on it.**")
    for name, sentence in first.items():
        assert len(re.findall(r"[.!?](?=\*\*$|\s)", sentence)) == 1, f"{name}: one sentence: {sentence}"
    # the same variant, decided on everything the base ran: a plain GO opens with what it is, and no warning
    complete = copy.deepcopy(example_verdict())
    complete["variants"]["fp8-w8a8"]["coverage"]["complete"] = True
    text = model_card("fp8-w8a8", complete, source=SOURCE, tasks=TASKS).content
    # issue 68 item 5: a GO without a recorded vLLM run says so first; what scored it and what serves it, both said
    assert paragraphs(text)[2] == ("**GO against HuggingFaceTB/SmolLM2-135M-Instruct on every suite the base ran, not "
                                   "yet served with vLLM: no vLLM run of a checkpoint like it was recorded "
                                   "(Deployment).**")
    assert paragraphs(text)[3].startswith("fp8-w8a8 is HuggingFaceTB/SmolLM2-135M-Instruct quantized to FP8 W8A8")
    assert paragraphs(text)[3].endswith(", and it is GO: within the margin on all 4 counted suites.")
    assert "- **Intended use**: the base model's, as [its card]" in text and "; not yet served with vLLM\n" in text
    assert ("- its figures were scored with transformers on x86_64, 2 CPUs (FP8 weights decompressed at "
            "load to the values they hold; activations and KV cache fake-quantized to FP8 with their scales in every "
            "forward); served with vLLM it runs on vLLM's own kernels in bfloat16, which was not scored") in text
    complete["variants"]["fp8-w8a8"]["serving"]["vllm"].update(
        serves=True, status="shown", version="0.24.0", date="2026-12-02", command="vllm serve DIR --kv-cache-dtype fp8")
    text = model_card("fp8-w8a8", complete, source=SOURCE, tasks=TASKS).content
    assert paragraphs(text)[2].startswith("fp8-w8a8 is ")  # a GO served: no caveat
    assert ", in less GPU memory, served with vLLM\n" in text and "- vLLM: 0.24.0 or newer" in text


def test_a_licence_the_base_does_not_state_is_said_and_never_invented(tmp_path):
    unstated = {**SOURCE, "origin": {**ORIGIN, "license": None, "hub_id": None}}
    card = loaded(model_card("fp8-w8a8", example_verdict(), source=unstated, tasks=TASKS).content, tmp_path)
    assert card.data.license is None and "license" not in card.data.to_dict()
    assert f"- **License**: {NOT_STATED}; the base model's own terms apply" in card.text
    assert card.data.base_model is None
    missing = loaded(model_card("fp8-w8a8", example_verdict(), source=None, tasks=TASKS).content, tmp_path)
    assert missing.data.license is None and NOT_STATED in missing.text
    assert "- **Base model**: not recorded" in missing.text
    stated = loaded(model_card("fp8-w8a8", example_verdict(), source=SOURCE, tasks=TASKS).content, tmp_path)
    assert stated.data.license == "apache-2.0" and NOT_STATED not in stated.text


# ---------------------------------------------------------------- peers: quantize reads the recipe, transformers runs it

def _yaml_blocks(text: str) -> list[dict]:
    import yaml

    return [yaml.safe_load(block) for block in code_blocks(text, "yaml")]


def test_the_recipe_is_a_params_yaml_quantize_reads_and_its_commands_are_quantize_commands(tmp_path, monkeypatch):
    """The creation and reproduction sections' params.yaml, merged as the card says, validates as params.yaml does,
    with each variant's settings the verdict's quant.json recorded; every `quantize` command the card gives exists."""
    from typer.main import get_command

    from pipeline.cli.app import app

    commands = set(get_command(app).commands)
    monkeypatch.chdir(tmp_path)
    verdict = example_verdict()
    for name, text in example_cards(verdict).items():
        creation, repro = _yaml_blocks(text)
        params = Params.model_validate({**creation, **repro})
        quant = verdict["variants"][name]["quant"]
        assert params.calib.num_blocks == quant["calibration"]["blocks"] and params.calib.seq_len == 256
        assert params.model.dtype == "float16" and str(params.model.source) == "SmolLM2-135M-Instruct.Q4_1.gguf"
        settings = params.variants[name]
        assert settings.method == quant["method"]
        for key in ("group_size", "symmetric", "n_grid", "activations", "max_bits"):
            if key in quant:
                assert getattr(settings, key) == quant[key], (name, key)
        for suite, d in {**verdict["variants"][name]["suites"], **verdict["variants"][name]["perplexity"]}.items():
            if suite == "ppl-chat":  # the publisher's own held-out conversations: private, named, in no command
                assert suite not in params.suites and "ppl-chat scores held-out conversations of the publisher's own " \
                    "logs, which are private" in section(text, "Reproduction")
                continue
            assert params.suites[suite].limit == d["n"] and params.verdict.margins.suites[suite] == d["margin"]
        for block in code_blocks(text, "bash"):
            for line in block.strip().splitlines():
                words = shlex.split(line)
                if words[0] == "quantize":
                    assert words[1] in commands, f"{name}: {line}"
    assert Params.model_validate(_yaml_blocks(example_cards(verdict)["fp8-w8a8"])[0]).variants["fp8-w8a8"].kv == "per-head"
    # a fix: its W4A16 variant, ranked by `quantize kl --rank` into the file the fix's settings name
    fixed = example_cards(verdict)["rtn-w4a16-mixed"]
    params = Params.model_validate(_yaml_blocks(fixed)[0])
    assert list(params.variants) == ["rtn-w4a16", "rtn-w4a16-mixed"]
    assert str(params.variants["rtn-w4a16-mixed"].sensitivity) == "ranking/sensitivity.json"
    assert ("quantize variant rtn-w4a16\nquantize kl models/rtn-w4a16 --rank --out ranking/kl.json\n"
            "quantize variant rtn-w4a16-mixed\n") in fixed


def test_the_transformers_snippet_runs_on_a_checkpoint_of_that_format(tiny_variants, capsys):
    """The card's transformers code, run as written on a tiny checkpoint of each format (its repository id replaced
    by the folder, fewer new tokens): it loads, decompresses and answers."""
    verdict = example_verdict()
    for name in ("awq-w4a16", "fp8-w8a8"):
        text = model_card(name, verdict, source=SOURCE, tasks=TASKS, repo_id=f"my-org/{name}").content
        snippet = next(b for b in code_blocks(text, "python") if "transformers" in b)
        snippet = snippet.replace(f'"my-org/{name}"', repr(str(tiny_variants[name]))).replace("max_new_tokens=256",
                                                                                           "max_new_tokens=4")
        exec(compile(snippet, f"<{name} card>", "exec"), {})
        assert capsys.readouterr().out.strip(), name


def test_vllm_flags_become_the_keyword_arguments_of_vllms_python_api():
    from pipeline.report.card_usage import python_arguments

    assert python_arguments(["--kv-cache-dtype", "fp8", "--dtype", "bfloat16"]) == ['kv_cache_dtype="fp8"',
                                                                                    'dtype="bfloat16"']
    flags = shlex.split(serving._GLM4V_FLAGS)
    assert python_arguments(flags) == ["compilation_config={'custom_ops': ['-rotary_embedding']}"]
    assert python_arguments(["--enforce-eager"]) == ["enforce_eager=True"]


# ---------------------------------------------------------------- the serving command: only where a run showed it

def _with_serving(config: dict) -> dict:
    verdict = example_verdict()
    verdict["variants"]["fp8-w8a8"]["serving"] = serving.support_from_config(config)
    return verdict


def test_vllm_is_said_tested_only_where_a_recorded_run_showed_it():
    glm = _config(ARCHS["Glm"], "fp8-static", "per-head", moe=False)  # GLM-4-9B's FP8: vLLM 0.24 on the H200
    assert [r for r in serving.runs_for("vllm", glm) if r.served]
    text = model_card("fp8-w8a8", _with_serving(glm), source=SOURCE, tasks=TASKS, repo_id="o/m").content
    assert "**vLLM**. vLLM 0.24.0 served a LlamaForCausalLM checkpoint in this format (2026-11-30)." in text
    assert "vllm serve o/m --kv-cache-dtype fp8 --dtype bfloat16" in text and "untested" not in text
    llama = {**glm, "architectures": ["LlamaForCausalLM"]}  # no run of a Llama was recorded
    text = model_card("fp8-w8a8", _with_serving(llama), source=SOURCE, tasks=TASKS, repo_id="o/m").content
    assert "**vLLM**. Not yet served with vLLM: no vLLM run of a LlamaForCausalLM checkpoint in this format" in text
    assert "vllm serve o/m --kv-cache-dtype fp8 --dtype bfloat16" in text
    assert ("- not yet served with vLLM: no vLLM run of a checkpoint of this architecture and format was recorded"
            in section(text, "Limitations"))
    # a verdict written before serving entries carried their command: the flags its scheme needs
    written_before = example_verdict()
    for decided in written_before["variants"].values():
        for entries in (decided.get("serving") or {}, (decided.get("quant") or {}).get("serving") or {}):
            for entry in entries.values():
                entry.pop("command", None)
                entry["how"] = entry.get("how", "").split("; try: ")[0]
    # an engine that cannot load it: said, and no snippet for it
    glm46v = _config(ARCHS["Glm46V"], "fp8-static", "per-head", moe=False)
    text = model_card("fp8-w8a8", _with_serving(glm46v), source=SOURCE, tasks=TASKS, repo_id="o/m").content
    assert "**vLLM**: vLLM 0.24 has no model of its own for Glm46VForConditionalGeneration" in text
    assert "so it is not served with vLLM; transformers loads it (below)." in text
    assert "vllm serve" not in text and "from vllm" not in text and 'model_id = "o/m"' in text
    assert "deployment commands are untested" not in text
    old = model_card("fp8-w8a8", written_before, source=SOURCE, tasks=TASKS, repo_id="o/m").content
    assert "vllm serve o/m --kv-cache-dtype fp8 --dtype bfloat16" in old
    assert "vllm serve o/m\n" in model_card("awq-w4a16", written_before, source=SOURCE, tasks=TASKS, repo_id="o/m").content


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
    verdict["variants"]["awq-w4a16"]["perplexity"]["ppl-book"]["sentence"] += " <script>alert(1)</script> | a pipe"
    card = loaded(model_card("awq-w4a16", verdict, source=SOURCE, tasks=TASKS).content, tmp_path)
    page = markdown.markdown(card.text, extensions=["tables", "fenced_code"])
    assert "<script" not in page and "&lt;script&gt;" in page
    table = re.sub(r"<t([dh]) [^>]*>", r"<t\1>", page[page.index("<table>"):page.index("</table>")])  # alignment
    assert table.count("<tr>") == 1 + 2 + 4 + 1 + 1  # header, math and code, four perplexity suites, judge, Average
    assert "<td>ppl-code</td>" in table and "<td><strong>Average</strong></td>" in table
    assert "<td>+19.3% [+15.2%, +23.5%]</td><td>+10.0%</td>".replace("</td><td>", "</td>\n<td>") in table  # change, interval, margin
    assert "<td>83.8%</td>" not in table  # a perplexity has no recovery
    for heading in HEADINGS:
        assert f"<h2>{heading}</h2>" in page
    assert page.count("<pre><code") == 9  # vLLM in Python and served, transformers; recipe (3); lm_eval, params, quantize
    # its params.yaml and its commands


# ---------------------------------------------------------------- the report stage writes them

def test_the_report_writes_a_card_per_decided_variant_beside_page_and_verdict(tmp_path):
    """A GO decided on an accuracy suite: the Average row and the opening give its recovery; a NO-GO's card says
    so first; a variant of params.yaml without results gets no card."""
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
    text = (cards / "copy" / "README.md").read_text()
    copy_card = loaded(text, tmp_path)
    entry = verdict["variants"]["copy"]
    assert entry["decision"] == "GO" and figures_of(copy_card) == expected_figures(entry)
    result = copy_card.data.eval_results[0]
    assert (result.dataset_type, result.dataset_config, result.dataset_split) == ("openai/gsm8k", "main", "test")
    opening = next(p for p in paragraphs(text) if p.startswith("copy is "))
    assert "it recovers 98.3% of the base's accuracy on average over 1 suite (math), and it is GO" in opening
    assert "| **Average** | accuracy over math | | 60.0% | 59.0% | | | **98.3%** | |" in text
    assert "Scored with transformers, in process, in float32" in text  # the report's own params.yaml: its dtype
    assert paragraphs((cards / "broken" / "README.md").read_text())[2].startswith("**Not a replacement for ")


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
    import hashlib  # issue 68 item 2: the file's quantization type (none stated here) and checksum, for the card

    assert origins.gguf_file(path) == {"file_type": None, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    typed = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(typed), "llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert origins.gguf_file(typed)["file_type"] == "Q4_1"
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
    assert ("before publishing: GO, incomplete: not one to ship; the card opens by saying why it does not replace the "
            "base") in result.output
    assert ("before publishing: no --repo-id: written as a local record (snippets load models/fp8-w8a8), not a Hub "
            "card") in result.output
    text = (card_project / "published" / "fp8-w8a8" / "README.md").read_text()
    params = Params.model_validate({**TINY_PARAMS, "suites": {s: {"task": t} for s, t in TASKS.items()}})
    assert text == report.card_files(example_verdict(), params, SOURCE, None)["cards/fp8-w8a8/README.md"]
    assert "before publishing" not in text.lower()  # the publisher's checks are printed, not written on the card
    assert invoke(["card", "models/fp8-w8a8", "--out", "published"]).exit_code == 0  # its own output: replaced


def test_quantize_card_with_a_repo_id_writes_the_snippets_with_it(card_project):
    result = invoke(["card", "models/awq-w4a16", "--out", "published", "--repo-id", "my-org/SmolLM2-135M-AWQ"])
    assert result.exit_code == 0, result.output
    assert "no --repo-id" not in result.output
    text = (card_project / "published" / "awq-w4a16" / "README.md").read_text()
    assert 'LLM(model="my-org/SmolLM2-135M-AWQ")' in text and "vllm serve my-org/SmolLM2-135M-AWQ\n" in text
    assert "your-org" not in text and "- name: my-org/SmolLM2-135M-AWQ\n" in text  # the model-index's name


@pytest.mark.parametrize("case", ["no verdict", "not json", "the base", "not a folder", "not decided", "built again",
                                  "out over an input", "not a repo id"])
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
    elif case == "not a repo id":
        args += ["--repo-id", "my org/model"]
        expected = ["--repo-id my org/model: not a Hub repository id", "pass ORG/NAME", "--repo-id my-org/awq-w4a16"]
    else:
        args[3], expected = "models", ["--out models", "contains the variant models/fp8-w8a8"]
    before = snapshot(card_project)
    assert_refused(invoke(args), expected, case)
    assert snapshot(card_project) == before


def test_every_shipped_suite_has_its_data_named_for_the_hub():
    """Each shipped suite's YAML names what it scores for the cards (metadata.suite.card), and the card reads it."""
    from pipeline.report.card_header import data_of, task_type
    from pipeline.settings import suites

    for task, suite in suites.shipped().items():
        assert suite.card.describes != task, f"{suite.yaml}: metadata.suite.card.describes missing"
        assert data_of(suite.name, {suite.name: task})[:2] == (suite.card.dataset, suite.card.describes)
    assert data_of("math", {"math": "quant_gsm8k"}) == ("openai/gsm8k", "GSM8K test questions", "main", "test")
    assert task_type("vqa", {"vqa": "quant_vqa"}) == "visual-question-answering"
    assert data_of("mine", {"mine": "no_such_task"}) == ("no_such_task", "no_such_task", None, None)
