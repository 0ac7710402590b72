"""Known vLLM defects (pipeline/engines/vllm_defects.py): which checkpoints get which `vllm serve` settings,
what a suite's summary records, and what the verdict and the report make of it.

The defect itself was measured on the H200 (benchmarks/gpu_glm4v_layers.py: vLLM 0.24's CUDA M-RoPE kernel
rotates GLM-4.1V's GPT-J pairs NeoX-style; benchmarks/results/gpu_glm4v_vqa_agreement.json: 54 of 100 VQA
answers equal to the hf engine's as vLLM ships, 100 of 100 with the setting below). Here: the engine passes
the setting to exactly the checkpoints it concerns, a user's own compilation config is not overridden
silently, and a suite scored with the defect on one side and not on the other is not counted.
"""

import json

import pytest

from conftest import TINY_PARAMS, with_variants
from pipeline.stages import report
from pipeline.engines import vllm_defects
from pipeline.errors import UserError
from pipeline.settings.params import Params
from test_report import write_results

GLM41V = {"model_type": "glm4v", "architectures": ["Glm4vForConditionalGeneration"]}
GLM46V = {"model_type": "glm4v_moe", "architectures": ["Glm4vMoeForConditionalGeneration"]}
GLM4 = {"model_type": "glm4", "architectures": ["Glm4ForCausalLM"]}


def test_only_glm41v_layout_gets_the_rotary_setting_and_only_while_workarounds_are_on():
    args = vllm_defects.server_args(GLM41V, [], enabled=True)
    assert args[0] == "--compilation-config" and json.loads(args[1]) == {"custom_ops": ["-rotary_embedding"]}
    assert vllm_defects.server_args(GLM41V, [], enabled=False) == []
    # GLM-4.5V / 4.6V rotate NeoX pairs in both engines (the kernel is right for them); text-only GLM-4 never
    # reaches the kernel (1-D positions)
    assert vllm_defects.server_args(GLM46V, [], enabled=True) == []
    assert vllm_defects.server_args(GLM4, [], enabled=True) == []
    [described] = vllm_defects.described(GLM41V, enabled=False)
    assert described["key"] == "vllm-mrope-gptj" and described["avoided"] is False
    assert "vllm-project/vllm#42016" in described["upstream"]
    assert vllm_defects.described(GLM46V, enabled=True) == []


@pytest.mark.parametrize("user_args", [["--compilation-config", '{"level": 0}'], ['--compilation-config={"level": 0}'],
                                       ["-cc.custom_ops+=+rms_norm"]])
def test_a_users_own_compilation_config_is_refused_with_the_fix_not_overridden(user_args):
    with pytest.raises(UserError) as error:
        vllm_defects.server_args(GLM41V, user_args, enabled=True)
    message = str(error.value)
    assert "engine.server_args" in message and "-rotary_embedding" in message
    assert "engine.defect_workarounds: false" in message
    assert vllm_defects.server_args(GLM41V, user_args, enabled=False) == []  # vLLM as it ships: theirs alone
    assert vllm_defects.server_args(GLM46V, user_args, enabled=True) == []  # nothing to add: nothing to refuse


def _suite(root, model, suite, scores, engine, defects=None):
    write_results(root.parent / "scratch", model, scores)  # math.jsonl's lines, moved to <suite>.jsonl
    (root / model).mkdir(parents=True, exist_ok=True)
    (root.parent / "scratch" / model / "math.jsonl").rename(root / model / f"{suite}.jsonl")
    summary = {"suite": suite, "engine": engine, "n": len(scores)}
    if defects is not None:
        summary["engine_defects"] = defects
    (root / model / f"{suite}.json").write_text(json.dumps(summary))


def _defect(avoided: bool) -> list[dict]:
    return vllm_defects.described(GLM41V, enabled=avoided)


def _params(*variants) -> Params:
    settings = with_variants(TINY_PARAMS, *variants)
    settings["suites"] = {"math": {"task": "quant_gsm8k"}, "vqa": {"task": "quant_vqa"}}
    return Params.model_validate(settings)


def test_a_suite_scored_differently_for_base_and_variant_is_shown_not_counted(tmp_path):
    """Base and variant on different engines, or one with the defect avoided and one without: the change would
    carry the engines' difference, so the suite is not counted and says why; alike on both sides it counts."""
    results = tmp_path / "results"
    same = [1] * 150 + [0] * 50
    _suite(results, "base", "math", same, "vllm")
    _suite(results, "base", "vqa", same, "vllm", _defect(avoided=True))
    _suite(results, "alike", "math", same, "vllm")
    _suite(results, "alike", "vqa", same, "vllm", _defect(avoided=True))
    _suite(results, "hf-side", "math", same, "hf")
    _suite(results, "hf-side", "vqa", same, "vllm", _defect(avoided=False))
    out = report.run(results, tmp_path / "reports", _params("alike", "hf-side"), models_dir=tmp_path / "models")
    verdict = out.verdict
    alike, mixed = verdict["variants"]["alike"], verdict["variants"]["hf-side"]
    assert alike["suites"]["math"]["counted"] and alike["suites"]["vqa"]["counted"]
    assert alike["suites"]["math"]["decision"] == "GO"
    assert not mixed["suites"]["math"]["counted"] and not mixed["suites"]["vqa"]["counted"]
    assert mixed["suites"]["math"]["reasons"][0].startswith("NOT PAIRED: the base was scored on vllm, hf-side on hf")
    assert "vllm-mrope-gptj avoided" in mixed["suites"]["vqa"]["reasons"][0]
    assert "vllm-mrope-gptj not avoided" in mixed["suites"]["vqa"]["reasons"][0]
    assert mixed["decision"] == "INCONCLUSIVE"
    assert mixed["coverage"]["suites"]["vqa"]["state"] == "not counted"
    assert mixed["coverage"]["suites"]["vqa"]["why"].startswith("NOT PAIRED")
    [vqa] = [note for note in verdict["engines"] if note["suite"] == "vqa"]
    assert vqa["engines"] == ["vllm"] and not vqa["comparable_with_hf"] and not vqa["paired"]
    assert vqa["defects"][0]["models"] == {"alike": True, "base": True, "hf-side": False}
    html = out.html.read_text()
    assert 'id="engines"' in html and "NOT PAIRED" in html
    assert "are not comparable with the hf engine" in html and "Not avoided for hf-side" in html


def test_the_report_says_vqa_on_vllm_is_paired_and_comparable_when_every_model_avoided_the_defect(tmp_path):
    results = tmp_path / "results"
    _suite(results, "base", "vqa", [1] * 150 + [0] * 50, "vllm", _defect(avoided=True))
    _suite(results, "v", "vqa", [1] * 150 + [0] * 50, "vllm", _defect(avoided=True))
    _suite(results, "base", "math", [1] * 150 + [0] * 50, "vllm")
    _suite(results, "v", "math", [1] * 150 + [0] * 50, "vllm")
    (results / "w").mkdir()  # a variant that did not run vqa: not counted among the models that scored it
    (results / "w" / "vqa.json").write_text(json.dumps({"suite": "vqa", "engine": "hf", "status": "not run", "n": 0}))
    _suite(results, "w", "math", [1] * 150 + [0] * 50, "vllm")
    out = report.run(results, tmp_path / "reports", _params("v", "w"), models_dir=tmp_path / "models")
    [vqa] = [note for note in out.verdict["engines"] if note["suite"] == "vqa"]
    assert vqa["models"] == ["base", "v"] and vqa["engines"] == ["vllm"]
    assert vqa["comparable_with_hf"] and vqa["paired"] and vqa["defects"][0]["avoided"]
    html = " ".join(out.html.read_text().split())
    assert "<b>math</b>: scored on vllm (every model): the base and each variant alike" in html
    assert "<b>vqa</b>: scored on vllm (base, v): the base and each variant alike, so each verdict compares the " \
           "two on the same engine (paired)" in html
    assert "Avoided for every model" in html and "comparable with the hf engine's" in html
    assert "not comparable" not in html
