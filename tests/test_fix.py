"""A NO-GO comes with its fix (issue 45 item 3): the rank stage ranks every W4A16 variant's groups in its KL's pass
(`quantize kl --rank`), `quantize fix V` builds V-mixed from that ranking on V's own settings (pipeline/stages/fix.py),
dvc.yaml runs it (`quantize profile --fix V` adds it, comments kept, no stage of V's own changed), and the verdict
and the report set the fix beside V (pipeline/verdict/fix.py)."""

import json
import shutil
from html import unescape
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from conftest import TINY_PARAMS, copy_repo, write_params
from pipeline.cli.app import app
from pipeline.errors import UserError
from pipeline.settings.params import Params

EVERY_MODEL = {**TINY_PARAMS, "suites": {name: {**suite, "models": None} for name, suite in TINY_PARAMS["suites"].items()}}


def snapshot(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_llama, tiny_calib):
    """A project folder as `dvc repro` leaves it before the fix stage: the base, an RTN variant, the calib build."""
    from pipeline.stages.quantize import run as quantize_run

    root = tmp_path_factory.mktemp("fix-project")
    shutil.copytree(tiny_llama, root / "models" / "base")
    shutil.copytree(tiny_calib, root / "calib_data" / "build")
    quantize_run(root / "models" / "base", root / "models" / "rtn-w4a16", tiny_calib / "calib.jsonl", "rtn",
                 group_size=32)
    write_params(root, {**TINY_PARAMS, "fix": {"max_bits": 4.5}})
    return root


def test_the_fix_stage_builds_the_mixed_variant_from_its_ranking_on_its_own_settings(project, monkeypatch):
    from pipeline.formats.sensitivity import read_sensitivity

    monkeypatch.chdir(project)
    refused = CliRunner().invoke(app, ["fix", "rtn-w4a16"])  # not ranked yet: the rank stage's command named
    assert refused.exit_code == 2 and ("results/rtn-w4a16/sensitivity.json: no ranking of rtn-w4a16's groups to build "
                                       "its fix from; run `quantize kl models/rtn-w4a16 --rank` first") in refused.output
    assert not (project / "models" / "rtn-w4a16-mixed").exists()
    ranked = CliRunner().invoke(app, ["kl", "models/rtn-w4a16", "--rank"])  # the rank stage
    assert ranked.exit_code == 0, ranked.output
    before = (project / "results" / "rtn-w4a16" / "sensitivity.json").read_bytes()
    done = CliRunner().invoke(app, ["fix", "rtn-w4a16"])
    assert done.exit_code == 0, done.output
    summary = done.output.strip().splitlines()[-1]
    assert summary.startswith("fix: wrote models/rtn-w4a16-mixed from results/rtn-w4a16/sensitivity.json: ")
    assert "groups in 8 bits" in summary and "x the size of rtn-w4a16" in summary
    assert (project / "results" / "rtn-w4a16" / "sensitivity.json").read_bytes() == before  # read, not written
    ranking = read_sensitivity(project / "results" / "rtn-w4a16" / "sensitivity.json")
    assert ranking["variant"] == "models/rtn-w4a16" and ranking["sequences"] == 4  # params kl: the KL the verdict reads
    assert ranking["measured_in"] == "quantize kl --rank" and ranking["seconds"] <= ranking["pass_seconds"]
    info = json.loads((project / "models" / "rtn-w4a16-mixed" / "quant.json").read_text())
    assert info["method"] == "mixed" and info["base_method"] == "rtn" and info["max_bits"] == 4.5
    assert info["group_size"] == 32 and info["symmetric"] is False  # the variant's own, not the defaults
    assert info["groups_total"] == len(ranking["groups"]) and 0 < info["groups_in_8_bits"] < info["groups_total"]
    assert [g["name"] for g in info["groups"]] == [g["name"] for g in ranking["groups"]]
    assert info["sensitivity"] == "results/rtn-w4a16/sensitivity.json" and info["verify"]["reloads"] is True
    assert 4 < info["bits_per_weight"] <= 4.5
    quant = json.loads((project / "models" / "rtn-w4a16-mixed" / "config.json").read_text())["quantization_config"]
    bits = {g["weights"]["num_bits"]: g["targets"] for g in quant["config_groups"].values()}
    assert bits[4] == ["Linear"] and len(bits[8]) == info["groups_in_8_bits"]  # one checkpoint, a group per scheme


@pytest.fixture(scope="module", params=["Glm4v", "Glm46V"])
def vision_project(request, tmp_path_factory, tiny_calib):
    """A vision-language project before its fix stage: the base (a tiny Glm4v, or transformers' glm46v type as
    `quantize resave` writes it: GLM-4.6V-Flash's layout), its AWQ W4A16 variant, the calib build, the fix of
    awq-w4a16 in params.yaml."""
    from pipeline.stages import resave
    from pipeline.stages.quantize import run as quantize_run
    from tiny import save_tiny_glm4v, save_tiny_glm46v

    root = tmp_path_factory.mktemp(f"fix-{request.param}")
    if request.param == "Glm4v":
        save_tiny_glm4v(root / "models" / "base")
    else:
        resave.run(save_tiny_glm46v(root / "glm46v"), root / "models" / "base", "float16")
    shutil.copytree(tiny_calib, root / "calib_data" / "build")
    quantize_run(root / "models" / "base", root / "models" / "awq-w4a16", tiny_calib / "calib.jsonl", "awq",
                 group_size=32, batch_size=8, n_grid=4)  # TINY_PARAMS' awq-w4a16
    write_params(root, {**TINY_PARAMS, "fix": {"max_bits": 4.5, "variants": ["awq-w4a16"]}})
    return root


def test_the_fix_of_a_vision_model_ranks_and_keeps_text_groups_only_and_leaves_the_vision_tower_bit_identical(
        vision_project, monkeypatch):
    """Issue 55 item 6: `quantize kl --rank` then `quantize fix awq-w4a16` on a GLM-V: the ranking holds the text
    tower's groups only, the mixed checkpoint keeps every vision tensor bit for bit (verify says so in quant.json),
    and its W8A16 targets name the layers as vLLM names them (the prefix mapper), without which vLLM would build
    every group kept in 8 bits with the 4-bit scheme: the fix stage refused to build it before."""
    from conftest import read_tensors
    from pipeline.checkpoints import fused, serving_names
    from pipeline.formats.sensitivity import read_sensitivity

    monkeypatch.chdir(vision_project)
    assert json.loads(Path("models/base/config.json").read_text())["architectures"] == ["Glm4vForConditionalGeneration"]
    ranked = CliRunner().invoke(app, ["kl", "models/awq-w4a16", "--rank"])
    assert ranked.exit_code == 0, ranked.output
    done = CliRunner().invoke(app, ["fix", "awq-w4a16"])
    assert done.exit_code == 0, done.output
    ranking = read_sensitivity(Path("results/awq-w4a16/sensitivity.json"))
    modules = [m for g in ranking["groups"] for m in g["modules"]]
    assert len(ranking["groups"]) == 8 and all(m.startswith("model.language_model.layers.") for m in modules)
    info = json.loads(Path("models/awq-w4a16-mixed/quant.json").read_text())
    kept = [g["name"] for g in info["groups"] if g["scheme"] == "W8A16"]
    assert kept and all(name.startswith("model.language_model.layers.") for name in kept)
    base, mixed = read_tensors(Path("models/base")), read_tensors(Path("models/awq-w4a16-mixed"))
    vision = sorted(k for k in base if k.startswith("model.visual."))
    assert vision and all(torch.equal(base[k], mixed[k]) for k in vision)
    assert {k: info["verify"]["vision"][k] for k in ("vision_tensors", "mismatched")} == \
        {"vision_tensors": len(vision), "mismatched": []}
    assert info["verify"]["serving_names"]["vllm_would_quantize"] == []
    config = json.loads(Path("models/awq-w4a16-mixed/config.json").read_text())
    linears = serving_names.quantized_linears(Path("models/awq-w4a16-mixed"))
    assert not [name for name in linears if "visual" in name]
    assert serving_names.vllm_scheme_conflicts(config, linears) == []
    eight = next(g for g in config["quantization_config"]["config_groups"].values() if g["targets"] != ["Linear"])
    assert all("language_model\\.model\\.layers" in t for t in eight["targets"])  # vLLM's names beside the HF ones
    groups = {g.name: g for g in fused.groups(modules)}
    eight["targets"] = [fused.target_regex(groups[name]) for name in kept]  # the HF names alone, as before
    assert len(serving_names.vllm_scheme_conflicts(config, linears)) >= len(kept)


def test_a_variant_that_is_not_w4a16_is_refused_with_exit_2_and_nothing_written(project, monkeypatch):
    monkeypatch.chdir(project)
    before = snapshot(project)
    for name, expected in (("fp8-w8a8", "variants.fp8-w8a8 is a fp8 variant; a fix keeps groups of a W4A16 variant "
                                        "in 8 bits, so it takes method awq, gptq, rtn: awq-w4a16, rtn-w4a16"),
                           ("awq-w4a17", "variants.awq-w4a17: no such variant; a fix takes a W4A16 variant")):
        refused = CliRunner().invoke(app, ["fix", name])
        assert refused.exit_code == 2 and expected in refused.output and "Traceback" not in refused.output, refused.output
    refused = CliRunner().invoke(app, ["fix", "awq-w4a16"])  # a W4A16 variant not built yet
    assert refused.exit_code == 2 and "models/awq-w4a16: not built; run `quantize variant awq-w4a16`" in refused.output
    assert snapshot(project) == before


def test_the_mixed_recipe_takes_the_base_methods_own_settings(tmp_path, tiny_llama):
    """AWQ's n_grid and search come from the variant being fixed, not from AWQ's defaults; settings that disagree
    with the mixed section are refused; a `method: mixed` variant still builds the base's section itself."""
    from pipeline.checkpoints import fused
    from pipeline.checkpoints.loading import meta_model
    from pipeline.formats.sensitivity import write_sensitivity
    from pipeline.methods import awq, mixed
    from pipeline.stages.quantize import read_target

    linears = [name for name, module in meta_model(tiny_llama).named_modules()
               if type(module).__name__ == "Linear" and ".layers." in name]
    groups = [{"name": g.name, "layer": g.layer, "kind": g.kind, "modules": g.modules, "weights": 1000,
               "kl_restored": 0.1, "kl_removed": 0.5 - 0.01 * i, "share_removed": 0.5 - 0.01 * i}
              for i, g in enumerate(fused.groups(linears))]
    ranking = write_sensitivity(tmp_path / "sensitivity.json", {
        "base": "b", "variant": "v", "holdout": "h", "sequences": 1, "tokens": 2, "kl_mean": 1.0, "groups": groups,
        "device": "cpu", "dtype": "float32", "seconds": 1.0})
    variant = awq.Params(method="awq", group_size=32, batch_size=8, n_grid=4, search="forward")
    section = mixed.for_variant(variant, 4.5, ranking)
    target = read_target(tiny_llama)
    details = mixed.recipe(section, target, base_settings=variant).details
    assert (details["n_grid"], details["search"], details["group_size"], details["base_method"]) == (4, "forward", 32, "awq")
    assert details["groups_in_8_bits"] == 1 and details["groups_total"] == len(groups) == 8
    assert mixed.recipe(section, target).details["n_grid"] == 20  # a params.yaml `method: mixed` variant: AWQ's default
    with pytest.raises(UserError, match="differ from the mixed section's on group_size"):
        mixed.recipe(section.model_copy(update={"group_size": 16}), target, base_settings=variant)


def test_params_checks_the_fix_stage_against_params_yaml(tmp_path):
    """Each variant the fix stage lists is a W4A16 variant of params.yaml that the rank stage ranks and params.yaml
    fix.variants names, and its fix is in kl's and evaluate's lists; a fix runs the suites its variant runs."""
    from conftest import REPO
    from pipeline.settings import fixes, params

    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    p = params.load(write_params(tmp_path, {**TINY_PARAMS, "fix": {"max_bits": 4.25, "variants": ["rtn-w4a16"]}}))
    assert p.fix.max_bits == 4.25 and fixes.models(p)[1:] == [*TINY_PARAMS["variants"], "rtn-w4a16-mixed"]
    with pytest.raises(UserError, match=r"the fix stage lists \[rtn-w4a16\] and params.yaml fix.variants \[\]: they "
                                        r"name the same variants"):
        params.load(write_params(tmp_path, {**TINY_PARAMS, "fix": {"max_bits": 4.25}}))
    write_params(tmp_path, {**TINY_PARAMS, "fix": {"max_bits": 4.25, "variants": ["rtn-w4a16"]}})
    assert not fixes.runs_on(p.suites["math"].models, "rtn-w4a16-mixed")  # math runs on base and AWQ only
    assert fixes.runs_on(p.suites["math"].models, "awq-w4a16-mixed")
    text = (REPO / "dvc.yaml").read_text()
    for edited, message in (
            (text.replace("foreach: [rtn-w4a16]", "foreach: [fp8-w8a8]").replace(
                "fp8-w8a8, rtn-w4a16-mixed]\n    do:\n      cmd: quantize kl", "fp8-w8a8]\n    do:\n      cmd: quantize kl"),
             r"stages.fix.foreach lists 'fp8-w8a8', a fp8 variant; a fix takes a W4A16 variant \(method awq, gptq, rtn\)"),
            (text.replace("fp8-w8a8, rtn-w4a16-mixed]\n    do:\n      cmd: quantize kl",
                          "fp8-w8a8]\n    do:\n      cmd: quantize kl"),
             "stages.kl.foreach does not list rtn-w4a16-mixed, which the fix stage builds"),
            (text.replace("foreach: [awq-w4a16, rtn-w4a16]\n    do:\n      cmd: quantize kl models/${item} --rank",
                          "foreach: [awq-w4a16]\n    do:\n      cmd: quantize kl models/${item} --rank"),
             r"stages.fix.foreach lists rtn-w4a16, whose groups no stage ranks \(the fix reads "
             r"results/rtn-w4a16/sensitivity.json\): list rtn-w4a16 in the rank stage")):
        assert edited != text
        (tmp_path / "dvc.yaml").write_text(edited)
        with pytest.raises(UserError, match=message):
            params.load(tmp_path / "params.yaml")
    with pytest.raises(UserError, match="fix.max_bits"):
        params.load(write_params(tmp_path, {**TINY_PARAMS, "fix": {"max_bits": 9, "variants": ["rtn-w4a16"]}}))


def test_profile_fix_edits_dvc_yaml_in_place_keeping_comments_and_is_idempotent(tmp_path, monkeypatch):
    from pipeline import profiles
    from pipeline.settings import params

    repo = copy_repo(tmp_path / "repo")
    monkeypatch.chdir(repo)
    before, params_before = (repo / "dvc.yaml").read_text(), (repo / "params.yaml").read_text()
    runner = CliRunner()
    done = runner.invoke(app, ["profile", "--fix", "awq-w4a16"])
    assert done.exit_code == 0, done.output
    assert "stages.fix.foreach: + awq-w4a16; stages.kl.foreach: + awq-w4a16-mixed" in done.output
    assert "stages.rank" not in done.output  # the rank stage ranks awq-w4a16 already: no stage of its own changes
    assert ("stages.report deps: + models/awq-w4a16-mixed/quant.json, models/awq-w4a16-mixed/config.json, "
            "models/awq-w4a16-mixed" in done.output)
    after = (repo / "dvc.yaml").read_text()
    comments = lambda text: [line.strip() for line in text.splitlines() if line.strip().startswith("#")]  # noqa: E731
    assert comments(after) == comments(before) and len(after.splitlines()) == len(before.splitlines()) + 3
    stages = yaml.safe_load(after)["stages"]
    assert stages["fix"]["foreach"] == ["rtn-w4a16", "awq-w4a16"]
    assert stages["kl"]["foreach"] == ["fp8-w8a8", "rtn-w4a16-mixed", "awq-w4a16-mixed"]
    assert stages["rank"] == yaml.safe_load(before)["stages"]["rank"]  # awq-w4a16's KL and ranking, as they were
    assert stages["evaluate"]["foreach"][-1] == "awq-w4a16-mixed"
    assert stages["judge"]["foreach"] == ["awq-w4a16", "fp8-w8a8"]  # the demo's judge covers two variants only
    assert {"models/awq-w4a16-mixed/quant.json", "models/awq-w4a16-mixed/config.json",
            "models/awq-w4a16-mixed"} <= set(stages["report"]["deps"])  # its weights too: the report checks them
    params.load(repo / "params.yaml")  # the lists agree with params.yaml
    assert profiles.current(repo) is None  # local edits now: `quantize profile` says so
    again = runner.invoke(app, ["profile", "--fix", "awq-w4a16"])
    assert again.exit_code == 0 and "nothing changed" in again.output and (repo / "dvc.yaml").read_text() == after
    fixed_params = (repo / "params.yaml").read_text()
    for name, expected in (("fp8-w8a8", "is a fp8 variant"), ("nope", "variants.nope: no such variant")):
        refused = runner.invoke(app, ["profile", "--fix", name])
        assert refused.exit_code == 2 and expected in refused.output, refused.output
    assert (repo / "dvc.yaml").read_text() == after and not list(repo.glob(".dvc.yaml.*"))
    assert (repo / "params.yaml").read_text() == fixed_params and not list(repo.glob(".params.yaml.*"))
    assert "params.yaml fix.variants: + awq-w4a16" in done.output
    assert yaml.safe_load((repo / "params.yaml").read_text())["fix"]["variants"] == ["rtn-w4a16", "awq-w4a16"]
    assert [l for l in (repo / "params.yaml").read_text().splitlines() if l not in params_before.splitlines()] == [
        "  variants: [rtn-w4a16, awq-w4a16]   # the W4A16 variants whose fix the run builds and decides: dvc.yaml's fix "
        "stage lists"]  # one line changed, its comment kept
    # --unfix: the inverse edit, the ranking left as it was; then the files are the profile's again
    undone = runner.invoke(app, ["profile", "--unfix", "awq-w4a16"])
    assert undone.exit_code == 0 and "stages.kl.foreach: - awq-w4a16-mixed" in undone.output, undone.output
    assert (repo / "dvc.yaml").read_text() == before and (repo / "params.yaml").read_text() == params_before
    assert profiles.current(repo) == "cpu-demo"
    assert "nothing changed" in runner.invoke(app, ["profile", "--unfix", "awq-w4a16"]).output
    # a dvc.yaml whose rank stage does not list the variant yet: it moves there from the kl stage (its fix reads it)
    (repo / "params.yaml").write_text(params_before)
    (repo / "dvc.yaml").write_text(before.replace("foreach: [awq-w4a16, rtn-w4a16]", "foreach: [rtn-w4a16]").replace(
        "foreach: [fp8-w8a8, rtn-w4a16-mixed]", "foreach: [awq-w4a16, fp8-w8a8, rtn-w4a16-mixed]"))
    moved = runner.invoke(app, ["profile", "--fix", "awq-w4a16"])
    assert moved.exit_code == 0, moved.output
    assert ("stages.rank.foreach: + awq-w4a16; stages.fix.foreach: + awq-w4a16; stages.kl.foreach: - awq-w4a16 (the "
            "rank stage measures its KL, with its ranking); stages.kl.foreach: + awq-w4a16-mixed") in moved.output
    assert yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]["rank"]["foreach"] == ["rtn-w4a16", "awq-w4a16"]


def write_fix_evidence(tmp_path, variant_scores, fixed_scores, fixed=True):
    """results/ and models/ of base, rtn-w4a16 and (fixed) its fix rtn-w4a16-mixed: math lines, quant.json of both
    (1.10x the size, 2 of 14 groups in 8 bits), the ranking the fix was built from."""
    from pipeline.formats.sensitivity import write_sensitivity
    from test_report import write_results

    results, models = tmp_path / "results", tmp_path / "models"
    write_results(results, "base", [1] * 120 + [0] * 80)
    write_results(results, "rtn-w4a16", variant_scores)
    groups = [{"name": f"model.layers.{i // 2}.{'mlp.down_proj' if i % 2 else 'self_attn.qkv_proj'}", "layer": i // 2,
               "kind": "down_proj" if i % 2 else "qkv_proj", "modules": [f"m{i}"], "weights": 1000,
               "kl_restored": 0.1 + 0.01 * i, "kl_removed": 0.5 - 0.03 * i, "share_removed": (0.5 - 0.03 * i) / 0.6}
              for i in range(14)]
    write_sensitivity(results / "rtn-w4a16" / "sensitivity.json",
                      {"base": "models/base", "variant": "models/rtn-w4a16", "holdout": "h", "sequences": 4,
                       "tokens": 256, "kl_mean": 0.6, "groups": groups, "device": "cpu", "dtype": "float32",
                       "seconds": 3.0})
    quant = {"scheme": "W4A16 asymmetric, group 32, round-to-nearest", "size_bytes": 1000, "quantized_modules": 14,
             "calibration": {"blocks": 8, "seq_len": 64, "sha256": "ab"}, "seconds": {"total": 5.0}, "device": "cpu",
             "method": "rtn", "ignored": {"lm_head": "kept"}, "peak_rss_bytes": 1,
             "verify": {"reloads": True, "sample": "x", "vision": {"vision_tensors": 0, "mismatched": []}}}
    for name, info in (("rtn-w4a16", quant), ("rtn-w4a16-mixed", {
            **quant, "method": "mixed", "base_method": "rtn", "size_bytes": 1100, "max_bits": 4.5,
            "bits_per_weight": 4.4, "groups_in_8_bits": 2, "groups_total": 14,
            "groups": [{"name": g["name"], "layer": g["layer"], "weights": 1000,
                        "scheme": "W8A16" if i < 2 else "W4A16", "why": "rank"} for i, g in enumerate(groups)]})):
        (models / name).mkdir(parents=True, exist_ok=True)
        (models / name / "quant.json").write_text(json.dumps(info))
    if fixed:
        write_results(results, "rtn-w4a16-mixed", fixed_scores)
    return results, models


@pytest.mark.parametrize("fixed_scores, line", [
    ([1] * 120 + [0] * 80, "NO-GO; keeping 2 of 14 groups in 8 bits (4.40 bits per weight, 1.10x the size) gives GO"),
    ([0] * 200, "NO-GO; keeping 2 of 14 groups in 8 bits (4.40 bits per weight, 1.10x the size) still NO-GO on math")])
def test_the_verdict_sets_the_fix_beside_the_no_go_and_the_report_shows_it(tmp_path, monkeypatch, fixed_scores, line):
    from pipeline.stages import report

    results, models = write_fix_evidence(tmp_path, [0] * 200, fixed_scores)
    out = report.run(results, tmp_path / "reports", Params.model_validate(EVERY_MODEL), models_dir=models)
    verdict = json.loads(out.verdict_json.read_text())
    fix = verdict["variants"]["rtn-w4a16"]["fix"]
    assert verdict["variants"]["rtn-w4a16"]["decision"] == "NO-GO" and fix["line"] == line
    assert verdict["variants"]["rtn-w4a16-mixed"]["fix_of"] == "rtn-w4a16"  # decided like any variant
    assert fix["variant"] == "rtn-w4a16-mixed" and fix["size_ratio"] == pytest.approx(1.1)
    assert fix["still_nogo_on"] == ([] if fix["decision"] == "GO" else ["math"])
    assert [g["name"] for g in fix["kept"]] == ["model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"]
    assert fix["kept"][0]["share_removed"] == pytest.approx(0.5 / 0.6)
    assert len(fix["ranking"]) == 12 and [g["kept"] for g in fix["ranking"]][:3] == [True, True, False]
    html = unescape(out.html.read_text())
    assert html.count(line) >= 3  # the phone's brief list, the first screen's card, the variant's section
    assert 'id="fix-screen-rtn-w4a16"' in html and 'id="fix-detail-rtn-w4a16"' in html
    assert 'id="fix-chart-rtn-w4a16"' in html and 'id="fix-chart-detail-rtn-w4a16"' in html
    assert html.count('class="kept"') == 2 * 3  # two kept bars and the legend's swatch, in each chart
    assert ">0.attn.qkv_proj</text>" in html and "Kept in 8 bits: " in html
    write_params(tmp_path, EVERY_MODEL)
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(app, ["show-verdict"])
    assert shown.exit_code == 0 and f"  fix rtn-w4a16-mixed: {line}; kept in 8 bits: model.layers.0" in shown.output


def test_a_go_variants_fix_is_not_needed_and_a_no_go_without_one_is_offered_it(tmp_path, monkeypatch):
    from pipeline.stages import report

    results, models = write_fix_evidence(tmp_path, [1] * 120 + [0] * 80, [1] * 120 + [0] * 80)
    params = Params.model_validate(EVERY_MODEL)
    verdict = report.run(results, tmp_path / "reports", params, models_dir=models).verdict
    assert verdict["variants"]["rtn-w4a16"]["fix"]["line"] == (
        "GO as it is: the fix is not needed (rtn-w4a16-mixed: keeping 2 of 14 groups in 8 bits (4.40 bits per weight, "
        "1.10x the size), GO)")
    shutil.rmtree(tmp_path / "results")
    results, models = write_fix_evidence(tmp_path, [0] * 200, None, fixed=False)
    out = report.run(results, tmp_path / "reports", params, models_dir=models)
    offer = out.verdict["variants"]["rtn-w4a16"]["fix"]
    assert offer["state"] == "not built" and offer["commands"] == ["quantize profile --fix rtn-w4a16", "dvc repro"]
    assert "quantize profile --fix rtn-w4a16" in unescape(out.html.read_text())
    write_params(tmp_path, EVERY_MODEL)
    monkeypatch.chdir(tmp_path)
    said = ("rtn-w4a16 is NO-GO and dvc.yaml has no fix stage for it: `quantize profile --fix rtn-w4a16` adds one")
    assert said in CliRunner().invoke(app, ["show-verdict"]).output
    assert said in CliRunner().invoke(app, ["profile"]).output


@pytest.mark.parametrize("fixed_scores, passes", [([1] * 120 + [0] * 80, True), ([0] * 200, False)])
def test_the_gate_takes_a_no_go_variant_with_its_fix(tmp_path, monkeypatch, fixed_scores, passes):
    """`quantize report --fail-on no-go` (CI's gate): a NO-GO W4A16 variant whose fix is GO passes, and the gate says
    to ship the fix; when the fix is NO-GO too, the variant fails with both reasons."""
    from pipeline.verdict.decision import failing, passed_by_fix

    write_fix_evidence(tmp_path, [0] * 200, fixed_scores)
    write_params(tmp_path, EVERY_MODEL)
    monkeypatch.chdir(tmp_path)
    gated = CliRunner().invoke(app, ["report", "--fail-on", "no-go"])
    verdict = json.loads((tmp_path / "reports" / "verdict.json").read_text())
    assert verdict["variants"]["rtn-w4a16"]["decision"] == "NO-GO"
    if passes:
        assert gated.exit_code == 0, gated.output
        assert ("gate: rtn-w4a16 is NO-GO; its fix rtn-w4a16-mixed is GO and passes --fail-on no-go in its place: "
                "ship rtn-w4a16-mixed") in gated.output
        assert failing(verdict, "no-go") == {} and passed_by_fix(verdict, "no-go") == {"rtn-w4a16": "rtn-w4a16-mixed"}
        assert "rtn-w4a16" not in failing(verdict, "incomplete")  # the fix's GO rests on every suite the base ran
    else:
        assert gated.exit_code == 1
        assert failing(verdict, "no-go") == {"rtn-w4a16": "NO-GO; its fix rtn-w4a16-mixed: NO-GO"}
        assert "rtn-w4a16: NO-GO; its fix rtn-w4a16-mixed: NO-GO" in gated.output
        assert passed_by_fix(verdict, "no-go") == {}


def test_the_gate_says_to_ship_a_fix_in_its_place_only_when_the_fix_is_go(tmp_path, monkeypatch):
    """Issue 69 item 5: an INCONCLUSIVE fix passes --fail-on no-go (it is not NO-GO), and the gate says so, never
    "ship" it: only a fix that is GO is shipped in its variant's place."""
    write_fix_evidence(tmp_path, [0] * 200, [1] * 112 + [0] * 88)
    write_params(tmp_path, EVERY_MODEL)
    monkeypatch.chdir(tmp_path)
    gated = CliRunner().invoke(app, ["report", "--fail-on", "no-go"])
    verdict = json.loads((tmp_path / "reports" / "verdict.json").read_text())
    assert verdict["variants"]["rtn-w4a16-mixed"]["decision"] == "INCONCLUSIVE"
    assert gated.exit_code == 0, gated.output
    assert ("gate: rtn-w4a16 is NO-GO; its fix rtn-w4a16-mixed passes --fail-on no-go but is INCONCLUSIVE, not GO: "
            "ship neither yet") in gated.output
    assert "ship rtn-w4a16-mixed" not in gated.output and "in its place" not in gated.output
    assert verdict["headline"].startswith("Ship none:")
