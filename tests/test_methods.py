"""The method registry (pipeline/methods/): each quantization method is one module, and the CLI, params.yaml's
validation, the plan and the report take every method from it; no other module names a method."""

import typing

import pytest
from typer.testing import CliRunner

from conftest import TINY_PARAMS, write_params
from pipeline import methods
from pipeline.settings import params
from pipeline.cli.app import app
from pipeline.errors import UserError
from pipeline.methods import int4
from test_engine_registry import name_uses_outside

DECLARED = {"NAME": str, "SUMMARY": str, "DEFAULT_VARIANT": str, "NEEDS_CALIBRATION": bool, "CALIBRATION_STATE": str,
            "SERVING_FORMAT": str, "COMPARED_WITH": dict, "CARD_TAGS": tuple, "CARD_WEIGHTS": str}
# "awq" is also AutoAWQ's quant_method in a config.json (a checkpoint format, not one of our methods)
ALLOWED = {"checkpoints/export.py": {"awq"}, "checkpoints/serving.py": {"awq"}}


@pytest.mark.parametrize("method", methods.METHODS, ids=lambda m: m.NAME)
def test_each_method_declares_what_the_stage_the_cli_and_the_plan_read(method):
    for name, kind in DECLARED.items():
        assert isinstance(getattr(method, name), kind), f"{method.__name__}.{name}"
    assert typing.get_args(method.Params.model_fields["method"].annotation) == (method.NAME,)
    assert method.CALIBRATION_STATE in ("none", "activation-cache", "hessians")
    assert set(method.COMPARED_WITH) <= {m.NAME for m in methods.METHODS} - {method.NAME}
    assert callable(method.recipe) and "batch_size" in method.Params.model_fields
    assert callable(method.card_words) and method.CARD_WEIGHTS
    for name, field in method.Params.model_fields.items():  # help stated once, on the field: the CLI shows it
        assert name == "method" or field.description, f"{method.NAME}.{name} has no description"


def test_no_module_outside_the_registry_compares_method_names():
    """A new method is one module: a module that compares a name ("if method == 'awq'") would miss it."""
    assert name_uses_outside("methods/", {m.NAME for m in methods.METHODS}, ALLOWED) == []


def help_of(command: str) -> str:
    """`quantize COMMAND --help` as one line of words (rich's boxes and wrapping taken out)."""
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.replace("│", " ").split())


@pytest.mark.parametrize("method", methods.METHODS, ids=lambda m: m.NAME)
def test_every_method_has_its_subcommand_with_one_flag_per_setting(method):
    help_text = help_of(method.NAME)
    for name, field in method.Params.model_fields.items():
        if name == "method":
            continue
        flag = (field.json_schema_extra or {}).get("flag", f"--{name.replace('_', '-')}").split("/")[0]
        assert flag in help_text, f"{method.NAME}: {flag}"
        assert " ".join(field.description.split()) in help_text
    assert method.SUMMARY.split(";")[0] in help_text


def test_every_method_validates_in_params_yaml_with_its_defaults():
    loaded = params.Params.model_validate({"variants": {f"{m.NAME}-x": {"method": m.NAME} for m in methods.METHODS}})
    for m in methods.METHODS:
        assert type(loaded.variants[f"{m.NAME}-x"]) is m.Params


def test_the_group_size_rule_is_stated_once(tmp_path):
    """params.yaml, the CLI flag and the plan allow the same sizes and say so in the same words."""
    grouped = [m for m in methods.METHODS if "group_size" in m.Params.model_fields]
    assert grouped and all(m.Params.model_fields["group_size"].description == int4.GroupSize.__metadata__[1].description
                           for m in grouped)
    for m in grouped:
        bad = {**TINY_PARAMS, "variants": {"v": {"method": m.NAME, "group_size": 256}}}
        with pytest.raises(UserError, match=f"variants.v.group_size: 256 is not one of {int4.ALLOWED}"):
            params.load(write_params(tmp_path, bad))
        result = CliRunner().invoke(app, [m.NAME, "--group-size", "256", "--params", str(write_params(tmp_path))])
        assert result.exit_code == 2 and f"--group-size 256: 256 is not one of {int4.ALLOWED}" in result.output
        assert int4.ALLOWED in help_of(m.NAME)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 13696,
              "num_attention_heads": 32, "head_dim": 128}
    assert int4.choose_group_size(config, "auto", "m") == int4.GROUP_SIZES[0] == 128


def tiny_ranking(path):
    """A sensitivity.json for the tiny Llama: its down_proj groups, layer 1's first."""
    import json

    groups = [{"name": f"model.layers.{i}.mlp.down_proj", "layer": i, "kind": "down_proj",
               "modules": [f"model.layers.{i}.mlp.down_proj"], "weights": 8192, "kl_restored": 0.1 * i,
               "kl_removed": 0.1 * (1 + i), "share_removed": 0.5 * (1 + i)} for i in (1, 0)]
    path.write_text(json.dumps({"base": "b", "variant": "v", "holdout": "h", "sequences": 1, "tokens": 2,
                                "kl_mean": 0.2, "groups": groups, "device": "cpu", "dtype": "float32", "seconds": 1}))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("method", methods.METHODS, ids=lambda m: m.NAME)
def test_needs_calibration_says_what_the_recipe_does(method, tiny_llama, tmp_path):
    """NEEDS_CALIBRATION (the CLI's help, the stage's words) agrees with llm-compressor's own modifiers."""
    from pipeline.quantize.calibrate import needs_data
    from pipeline.stages.quantize import read_target

    extra = {}
    if "sensitivity" in method.Params.model_fields:  # `mixed`: a ranking of the model's groups to read
        extra["sensitivity"] = tiny_ranking(tmp_path / "sensitivity.json")
    recipe = method.recipe(method.Params(method=method.NAME, **extra), read_target(tiny_llama))
    assert needs_data(recipe.modifiers) == method.NEEDS_CALIBRATION
    assert recipe.scheme and isinstance(recipe.details, dict)


def test_the_report_compares_what_the_methods_declare():
    assert ("awq", "rtn") in {(m, other) for m, other, _ in methods.comparisons()}
