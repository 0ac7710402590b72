import shutil
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TINY_PARAMS, write_params
from pipeline.settings import params
from pipeline.errors import UserError


def test_repo_params_load_and_match_dvc_yaml(monkeypatch):
    monkeypatch.chdir(REPO)
    p = params.load("params.yaml")
    assert set(p.variants) == {"awq-w4a16", "fp8-w8a8", "rtn-w4a16"}
    assert p.variants["awq-w4a16"].group_size == 64  # SmolLM2's 576 is not a multiple of 128
    assert p.verdict.margin_for("math") == p.verdict.margins.suites["math"]


def test_unknown_key_names_its_path(tmp_path):
    bad = {**TINY_PARAMS, "calib": {**TINY_PARAMS["calib"], "seqlen": 64}}
    with pytest.raises(UserError) as err:
        params.load(write_params(tmp_path, bad))
    assert "calib.seqlen: unknown key" in str(err.value)


def test_bad_value_lists_allowed_values(tmp_path):
    bad = {**TINY_PARAMS, "variants": {"fp8-w8a8": {"method": "fp8", "kv": "per-channel"}}}
    with pytest.raises(UserError) as err:
        params.load(write_params(tmp_path, bad))
    message = str(err.value)
    assert "variants.fp8-w8a8.kv" in message and "'per-head'" in message and "'per-channel'" in message


def test_unknown_method_is_refused(tmp_path):
    bad = {**TINY_PARAMS, "variants": {"hqq": {"method": "hqq"}}}
    with pytest.raises(UserError) as err:
        params.load(write_params(tmp_path, bad))
    assert "variants.hqq" in str(err.value) and "'awq'" in str(err.value)


def test_group_size_checked_against_the_base_model(tmp_path, tiny_llama):
    shutil.copytree(tiny_llama, tmp_path / "models" / "base")
    bad = {**TINY_PARAMS, "variants": {"awq-w4a16": {"method": "awq", "group_size": 128}}}
    with pytest.raises(UserError) as err:
        path = write_params(tmp_path, {**bad, "model": {"base_dir": str(tmp_path / "models" / "base")}})
        params.load(path)
    line = path.read_text().splitlines().index("    group_size: 128") + 1  # the error names its line (issue 26)
    assert f"params.yaml:{line}: variants.awq-w4a16.group_size: 128 does not divide 64 (hidden size of" in str(err.value)
    assert "use 64" in str(err.value)


def test_group_size_not_a_power_of_two(tmp_path):
    bad = {**TINY_PARAMS, "variants": {"awq-w4a16": {"method": "awq", "group_size": 100}}}
    with pytest.raises(UserError) as err:
        params.load(write_params(tmp_path, bad))
    assert "variants.awq-w4a16.group_size: 100 is not one of auto, 16, 32, 64, 128" in str(err.value)


def test_the_evaluate_stage_must_list_every_model(tmp_path):
    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    extra = {**TINY_PARAMS, "variants": {**TINY_PARAMS["variants"], "awq-g32": {"method": "awq"}}}
    with pytest.raises(UserError) as err:
        params.load(write_params(tmp_path, extra))
    assert "stages.evaluate.foreach" in str(err.value) and "awq-g32" in str(err.value)


def test_cli_exits_2_with_the_message(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    path = write_params(tmp_path, {**TINY_PARAMS, "engine": {"name": "tgi"}})
    result = CliRunner().invoke(app, ["resave", "--params", str(path)])
    assert result.exit_code == 2
    assert "engine.name" in result.output and "'tgi' is not allowed" in result.output
    assert "Traceback" not in result.output
    assert yaml.safe_load(path.read_text())["engine"]["name"] == "tgi"


def test_suite_models_must_exist_and_include_base(tmp_path):
    settings = {**TINY_PARAMS, "suites": {"math": {"task": "quant_gsm8k", "models": ["base", "awq-w4a17"]}}}
    with pytest.raises(UserError, match=r"suites.math.models: \['awq-w4a17'\] not among base, the variants"):
        params.load(write_params(tmp_path, settings))
    settings = {**TINY_PARAMS, "suites": {"math": {"task": "quant_gsm8k", "models": ["awq-w4a16"]}}}
    with pytest.raises(UserError, match="suites.math.models: must include base"):
        params.load(write_params(tmp_path, settings))


def test_the_evaluate_stage_must_list_each_suites_results(tmp_path):
    """One evaluate stage per model runs every suite (those a model does not run are recorded as not run):
    its outs name each suite's results, and no suite params.yaml does not define."""
    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    params.load(write_params(tmp_path))  # the tiny profile matches the repo's dvc.yaml
    fewer = {**TINY_PARAMS, "suites": {**TINY_PARAMS["suites"], "ppl-book": {"task": "quant_ppl_book",
                                                                             "models": ["base", "awq-w4a16"]}}}
    params.load(write_params(tmp_path, fewer))  # which models run a suite is params.yaml's alone
    more = {**TINY_PARAMS, "suites": {**TINY_PARAMS["suites"], "ppl-wiki": {"task": "quant_ppl_book"}}}
    with pytest.raises(UserError, match=r"stages.evaluate.do.outs: no results/\$\{item\}/<suite>.jsonl and .json "
                                        "for ppl-wiki"):
        params.load(write_params(tmp_path, more))
    dropped = {**TINY_PARAMS, "suites": {k: v for k, v in TINY_PARAMS["suites"].items() if k != "ppl-code"}}
    with pytest.raises(UserError, match="stages.evaluate.do.outs lists results of ppl-code, which params.yaml does "
                                        "not define"):
        params.load(write_params(tmp_path, dropped))
    gone = {**TINY_PARAMS, "variants": {k: v for k, v in TINY_PARAMS["variants"].items() if k != "fp8-w8a8"},
            "suites": {k: {**v, "models": None} for k, v in TINY_PARAMS["suites"].items()}}
    with pytest.raises(UserError, match=r"stages.kl.foreach lists \['fp8-w8a8'\]"):  # kl lists every model too
        params.load(write_params(tmp_path, gone))


@pytest.mark.parametrize("margin", [0, -0.05, 1.5])
def test_perplexity_margin_is_bounded(tmp_path, margin):
    with pytest.raises(UserError, match="verdict.margins.perplexity"):
        params.load(write_params(tmp_path, {**TINY_PARAMS, "verdict": {"margins": {"perplexity": margin}}}))
    if margin != 0:  # a suite's own margin may be 0 (no loss accepted), in either unit
        with pytest.raises(UserError, match="verdict.margins.suites.math"):
            params.load(write_params(tmp_path, {**TINY_PARAMS, "verdict": {"margins": {"suites": {"math": margin}}}}))


def test_every_margin_lives_in_one_block_and_kl_in_its_own_section(tmp_path):
    """verdict.margins holds the defaults per kind of suite, the judge's and each suite's own; the earlier keys
    (verdict.default_margin, perplexity_margin(s), kl_*, judge.margin) are refused with where they went."""
    p = params.load(write_params(tmp_path, {**TINY_PARAMS, "kl": {"sequences": 6, "max_tokens": 128},
                                            "verdict": {"margins": {"accuracy": 0.04, "perplexity": 0.07, "judge": 0.1,
                                                                    "suites": {"math": 0.01}}}}))
    assert (p.verdict.margin_for("math"), p.verdict.margin_for("other"), p.verdict.perplexity_margin_for("ppl")) == \
        (0.01, 0.04, 0.07)
    assert p.verdict.margins.judge == 0.1 and (p.kl.sequences, p.kl.max_tokens) == (6, 128)
    for old, new in [({"verdict": {"default_margin": 0.02}}, "verdict.margins.accuracy"),
                     ({"verdict": {"perplexity_margin": 0.1}}, "verdict.margins.perplexity"),
                     ({"verdict": {"perplexity_margins": {}}}, "verdict.margins.suites"),
                     ({"verdict": {"kl_sequences": 8}}, "kl.sequences"),
                     ({"verdict": {"kl_max_tokens": 256}}, "kl.max_tokens"),
                     ({"judge": {"margin": 0.05}}, "verdict.margins.judge")]:
        with pytest.raises(UserError, match=f"this setting moved: write it as {new}"):
            params.load(write_params(tmp_path, {**TINY_PARAMS, **old}))


def test_a_stage_takes_overrides_routed_to_the_first_section_with_that_field_and_validated_again():
    from pipeline.engines.openai import Settings as OpenAISettings
    from pipeline.settings.params import JudgeParams, VerdictParams, sections_with_overrides

    served = OpenAISettings(model="m")
    judge, engine, verdict = sections_with_overrides(JudgeParams(), served, VerdictParams(),
                                                     concurrency=2, batch_size=3, bootstrap=200)
    assert judge.concurrency == 2 and engine.concurrency == served.concurrency  # the judge's own first
    assert engine.batch_size == 3 and verdict.bootstrap == 200
    with pytest.raises(UserError, match=r"--bootstrap 5: .*greater than or equal to 100"):
        sections_with_overrides(JudgeParams(), VerdictParams(), bootstrap=5)
    with pytest.raises(TypeError, match="no setting batchsize"):
        sections_with_overrides(JudgeParams(), served, batchsize=3)
    with pytest.raises(UserError, match="--task: required key missing"):  # a suite has no default task
        params.with_overrides(params.SuiteParams, limit=3)


def test_a_bad_flag_value_exits_2_naming_the_flag(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    path = write_params(tmp_path)
    model = str(tmp_path / "no-model")  # never reached: the flag is refused first
    for args, flag in ((["eval", model, "--suite", "math", "--limit", "0"], "--limit 0: "),
                       (["judge", model, "--mode", "both"], "--mode both: "),
                       (["bench", model, "--engine", "hf", "--input-len", "0"], "--input-len 0: "),
                       (["awq", "--group-size", "100"], "--group-size 100: ")):
        result = CliRunner().invoke(app, [*args, "--params", str(path)])
        assert result.exit_code == 2 and flag in result.output and "Traceback" not in result.output, result.output


# ---------------------------------------------------------------- names that must become folders (issue 46 item 4)

def test_a_name_the_file_system_cannot_hold_with_the_writers_temp_names_is_refused_with_the_limit(tmp_path, monkeypatch):
    from pipeline.outputs import TEMP_NAME_EXTRA, longest_name, name_max

    monkeypatch.chdir(tmp_path)
    limit = longest_name("models")
    assert limit == name_max("models") - TEMP_NAME_EXTRA
    for length in (300, 250, limit + 1):  # 300 died in os.stat, 250 after quantizing (models/.NAME.tmp-...)
        settings = {**TINY_PARAMS, "variants": {"a" * length: {"method": "rtn"}}}
        with pytest.raises(UserError) as err:
            params.load(write_params(tmp_path, settings))
        assert "variants: name 'aaaa" in str(err.value) and f"is {length} bytes long, over the {limit} a name in " \
            f"models/ may have here (the file system takes {name_max('models')} bytes" in str(err.value)
    suite = {"task": "quant_gsm8k"}
    with pytest.raises(UserError, match=rf"suites: name 's+'\.\.\. is {limit - 5} bytes long, over the {limit - 6}"):
        params.load(write_params(tmp_path, {**TINY_PARAMS, "suites": {"s" * (limit - 5): suite}}))
    with pytest.raises(UserError, match=rf"model.base_dir: its part 'b+'\.\.\. is {limit + 1} bytes long"):
        params.load(write_params(tmp_path, {**TINY_PARAMS, "model": {"base_dir": "models/" + "b" * (limit + 1)}}))
    with pytest.raises(UserError, match=r"calib.out: its part 'é+'\.\.\. is 300 bytes long, over the"):  # bytes, not characters
        params.load(write_params(tmp_path, {**TINY_PARAMS, "calib": {"out": "calib_data/" + "é" * 150}}))


def test_the_longest_name_accepted_is_written_atomically_by_a_process_with_the_largest_pid(tmp_path, monkeypatch):
    from pipeline import outputs

    monkeypatch.chdir(tmp_path)
    longest = "v" * outputs.longest_name("models")
    p = params.load(write_params(tmp_path, {**TINY_PARAMS, "variants": {**TINY_PARAMS["variants"],
                                                                         longest: {"method": "rtn"}}}))
    assert longest in p.variants
    monkeypatch.setattr(outputs.os, "getpid", lambda: 10 ** outputs.PID_DIGITS - 1)  # every pid's digits
    for _ in range(2):  # the second replaces the first: the .old-PID name too
        with outputs.atomic_dir(Path("models") / longest, "quantize") as tmp:
            assert len(tmp.name) == outputs.name_max("models")  # the temp dir's name at the file system's limit
            (tmp / "config.json").write_text("{}")
    outputs.write_atomic(Path("results") / longest / "kl.json", "{}")
    assert (Path("models") / longest / "config.json").is_file()


def test_quantize_refuses_a_name_too_long_before_any_work(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    monkeypatch.chdir(tmp_path)
    name = "w" * 250
    write_params(tmp_path, {**TINY_PARAMS, "variants": {**TINY_PARAMS["variants"], name: {"method": "rtn"}}})
    result = CliRunner().invoke(app, ["variant", name])
    assert result.exit_code == 2 and "is 250 bytes long, over the" in result.output, result.output
    write_params(tmp_path)
    result = CliRunner().invoke(app, ["rtn", "--out", f"models/{name}"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--out 'models/ww" in result.output and f": its part '{'w' * 37}'... is 250 bytes long" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]  # nothing made, not even models/
