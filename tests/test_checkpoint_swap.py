"""The report checks each model's checkpoint against the one its results were scored on (issue 70.4): quant.json
(the quantize stage) and every <suite>.json (eval) record the weights' fingerprint; a folder swapped for another
variant's build, or weights replaced after quantize, is refused with a message, never reported."""

import json
import shutil

import pytest

from pipeline.checkpoints.fingerprint import weights_fingerprint
from test_bad_inputs import build_results, invoke, report_args


def test_quantize_and_eval_record_the_weights_they_built_and_scored(tiny_llama, tiny_variants, tiny_calib, tmp_path):
    from pipeline.stages import evaluate
    from pipeline.settings.params import SuiteParams

    awq = tiny_variants["awq-w4a16"]
    quant = json.loads((awq / "quant.json").read_text())
    assert quant["checkpoint"] == weights_fingerprint(awq) and quant["checkpoint"].startswith("weights:")
    evaluate.run(tiny_llama, SuiteParams(task="quant_ppl_book", limit=2), suite="ppl-book", variant="base",
                 out_dir=tmp_path / "r", engine="hf", dtype="float32")
    scored = json.loads((tmp_path / "r" / "ppl-book.json").read_text())["checkpoint"]
    assert scored == weights_fingerprint(tiny_llama) != quant["checkpoint"]
    from pipeline.stages import kl

    kl.run(tiny_llama, awq, tiny_calib / "holdout.jsonl", tmp_path / "kl.json", sequences=2, max_tokens=32)
    assert json.loads((tmp_path / "kl.json").read_text())["checkpoint"] == quant["checkpoint"]  # the variant's


@pytest.fixture
def project(tmp_path, tiny_variants, monkeypatch):
    """Report inputs whose awq-w4a16 results were scored on the tiny AWQ build now in models/awq-w4a16."""
    build_results(tmp_path)
    folder = tmp_path / "models" / "awq-w4a16"
    quant = json.loads((folder / "quant.json").read_text())
    shutil.rmtree(folder)
    shutil.copytree(tiny_variants["awq-w4a16"], folder)
    scored = weights_fingerprint(folder)
    (folder / "quant.json").write_text(json.dumps({**quant, "checkpoint": scored}))
    for suite in ("math", "ppl-book"):
        summary = tmp_path / "results" / "awq-w4a16" / f"{suite}.json"
        summary.write_text(json.dumps({"status": "ok", "checkpoint": scored}))
    monkeypatch.chdir(tmp_path)
    assert invoke(report_args(tmp_path)).exit_code == 0
    return tmp_path


def test_a_variant_folder_swapped_for_another_build_is_refused(project, tiny_variants):
    folder = project / "models" / "awq-w4a16"
    shutil.rmtree(folder)
    shutil.copytree(tiny_variants["fp8-w8a8"], folder)  # its own quant.json: it names these weights
    refused = invoke(report_args(project))
    assert refused.exit_code == 2, refused.output
    message = " ".join(refused.output.split())
    assert f"{folder}: its results were scored on another checkpoint than the one in the folder now" in message
    assert "results/awq-w4a16/math.json records" in message and "evaluate it again" in message
    assert "Traceback" not in refused.output


def test_weights_replaced_after_quantize_are_refused(project, tiny_variants):
    folder = project / "models" / "awq-w4a16"
    for shard in folder.glob("*.safetensors"):
        shard.unlink()
    for shard in tiny_variants["fp8-w8a8"].glob("*.safetensors"):
        shutil.copy(shard, folder / shard.name)  # the weights alone: quant.json and config.json stay the AWQ build's
    refused = invoke(report_args(project))
    assert refused.exit_code == 2, refused.output
    message = " ".join(refused.output.split())
    assert f"{folder}: its weights were changed after the quantize stage wrote them" in message
    assert "quant.json records" in message and "build it again" in message


def test_a_copy_without_weights_is_reported_as_before(project):
    for shard in (project / "models" / "awq-w4a16").glob("*.safetensors"):
        shard.unlink()  # what a bundle of report inputs keeps (benchmarks/report_bundle.py): no weights to check
    assert invoke(report_args(project)).exit_code == 0


def test_a_kl_json_measured_on_another_checkpoint_is_refused(project):
    path = project / "results" / "awq-w4a16" / "kl.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "checkpoint": "weights:0123456789abcdef"}))
    refused = invoke(report_args(project))
    assert refused.exit_code == 2, refused.output
    message = " ".join(refused.output.split())
    assert f"{path} records 0123456789ab" in message and "scored on another checkpoint" in message


def _swap_weights(model, other) -> None:
    """The weights replaced by another build's, as `cp` over a file does (in place, the same names)."""
    for path in other.glob("*.safetensors"):
        (model / path.name).write_bytes(path.read_bytes())


@pytest.mark.parametrize("stage", ["kl", "judge"])
def test_weights_swapped_while_kl_or_judge_runs_are_refused(tiny_llama, tiny_calib, tmp_path, monkeypatch, stage):
    """kl.json and judge.json record the weights the stage took as it started: weights swapped while it ran (after
    its start, before its results) stop it, never recorded as the weights it measured (issue 70.4)."""
    from chat_server import ChatServer
    from pipeline.errors import UserError
    from pipeline.settings.params import JudgeParams
    from pipeline.stages import judge, kl
    from tiny import save_tiny_llama

    variant = shutil.copytree(tiny_llama, tmp_path / "variant")
    other = save_tiny_llama(tmp_path / "other", seed=1)
    module, hook = (kl, "holdout_texts") if stage == "kl" else (judge, "generate_answers")
    before = getattr(module, hook)
    calls = []

    def swap_then(*args, **kwargs):
        if not calls:
            _swap_weights(variant, other)
        calls.append(1)
        return before(*args, **kwargs)
    monkeypatch.setattr(module, hook, swap_then)
    with pytest.raises(UserError) as refused:
        if stage == "kl":
            kl.run(tiny_llama, variant, tiny_calib / "holdout.jsonl", tmp_path / "out" / "kl.json", sequences=2,
                   max_tokens=32)
        else:
            with ChatServer(lambda body: "[[A]]") as server:
                params = JudgeParams(backend="openai", model="test-judge", retries=0, base_url=server.base_url,
                                     limit=2, max_new_tokens=6, judge_max_new_tokens=8, control=False)
                judge.run(variant, tiny_llama, tiny_calib / "holdout.jsonl", tmp_path / "out", params, bootstrap=200)
    assert f"the checkpoint {variant} changed while the {stage} stage ran" in str(refused.value)
    assert not (tmp_path / "out" / f"{stage}.json").exists()
