"""The engine registry (pipeline/engines/__init__.py, ENGINES) is the one home of engine names and of what
each engine can do and reads (issue 26.2): params, bench, evaluate, judge and the CLI ask it; no module
outside pipeline/engines/ compares a value with an engine's name."""

import ast
import sys
from pathlib import Path

import pytest

from pipeline import engines
from pipeline.errors import UserError
from pipeline.settings.params import Params

PACKAGE = Path(__file__).resolve().parent.parent / "pipeline"
NAMES = {"hf", "vllm", "lmdeploy", "openai"}
# module (relative to pipeline/) -> engine-name strings it may compare or key on, and why. (Not needed:
# checkpoints/resave.py's "hf", a source format it only returns, and the export targets of
# checkpoints/export.py, its own table ENGINES compared by variable, never by a literal.)
ALLOWED: dict[str, set[str]] = {
    # `quantize export --engine lmdeploy` is an export target (its own table, not the engine registry):
    # refusing an FP8 checkpoint it reads lmdeploy's row of the serving-support table for the reason
    "checkpoints/export.py": {"lmdeploy"},
    # the serving-support table (moved out of engines/ to sit below the engines that read it): what each engine
    # was seen to do with a checkpoint on the GPU machine, a table of recorded evidence per engine name
    "checkpoints/serving.py": {"hf", "vllm", "lmdeploy"},
    # a model card's usage snippets are vLLM's own Python API and `vllm serve` (what a Hub user runs a published
    # compressed-tensors checkpoint with): code for that one engine, written from its row of the serving table
    "report/card_usage.py": {"vllm"},
}

# each engine's defaults, written once: in its section (engines/sections.py; the fields every engine shares: engines/settings.py)
DEFAULTS = {
    "hf": {"name": "hf", "batch_size": 32, "max_batch_tokens": 65536, "dtype": "float32", "threads": 0},
    "vllm": {"name": "vllm", "batch_size": 32, "timeout": 600.0, "retries": 1, "max_response_bytes": 16777216,
             "dtype": None, "tensor_parallel_size": 1, "enable_expert_parallel": False, "max_model_len": None,
             "gpu_memory_utilization": 0.9, "kv_cache_dtype": "checkpoint", "enable_prefix_caching": None,
             "max_num_batched_tokens": None, "max_num_seqs": None, "server_command": ["vllm", "serve"],
             "server_env": {}, "server_args": [], "defect_workarounds": True, "start_timeout": 900.0,
             "share_server": True, "server_idle_timeout": None, "max_servers": 1, "kv_cache_memory": "auto",
             "non_kv_memory_gib": 4.0, "vision_memory_gib": 5.0,
             "device_memory_gib": None, "plan_request_tokens": 768, "warm_servers": False, "build_memory_fraction": 0.5,
             "score_ahead": False},
    "lmdeploy": {"name": "lmdeploy", "batch_size": 32, "dtype": "float32", "tensor_parallel_size": 1},
    "openai": {"name": "openai", "batch_size": 32, "timeout": 120.0, "retries": 3, "max_response_bytes": 16777216,
               "base_url": None, "model": None, "api_key_env": None, "prompt_format": "tokens", "concurrency": 8},
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_each_engine_takes_its_defaults_from_its_own_section(name):
    """`engine: {name: X}` is engine X's section with X's defaults (keys in order), and its class is made with it."""
    section = Params.model_validate({"engine": {"name": name}}).engine
    assert type(section) is engines.ENGINES[name].settings
    assert list(section.model_dump().items()) == list(DEFAULTS[name].items())
    assert Params().engine.model_dump() == DEFAULTS["hf"]  # no engine section: the default engine's


def test_an_engine_class_takes_one_settings_object_not_its_fields():
    """The classes take (model_dir, settings, what the stage supplies): no keyword argument repeats a setting (and
    its default) of the section."""
    import importlib
    import inspect

    for spec in engines.ENGINES.values():
        for target in filter(None, (spec.target, spec.vision_target)):
            module, name = target.split(":")
            parameters = inspect.signature(getattr(importlib.import_module(module), name).__init__).parameters
            assert list(parameters)[1:3] == ["model_dir", "settings"], target
            assert not set(parameters) & (set(spec.settings.model_fields) - {"name"}), target


def test_make_engine_hands_the_engines_class_its_settings(monkeypatch):
    made = []

    class Fake:
        def __init__(self, model_dir, settings, **stage):
            made.append((model_dir, settings, stage))

    import pipeline.engines.hf as hf

    monkeypatch.setattr(hf, "HFEngine", Fake)
    vllm_section = engines.ENGINES["vllm"].settings(batch_size=5, timeout=1800, kv_cache_dtype="fp8")
    engines.make_engine("hf", None, vllm_section, progress=print)
    [(model_dir, settings, stage)] = made
    assert type(settings) is hf.Settings and settings.batch_size == 5 and stage == {"progress": print}
    engines.make_engine("hf", None)
    assert made[-1][1] == hf.Settings()


def test_the_vllm_timeout_and_retries_are_its_own_defaults_not_a_patch_of_the_shared_ones():
    vllm = engines.ENGINES["vllm"].settings
    assert (vllm().timeout, vllm().retries) == (600.0, 1)
    assert (vllm(timeout=120, retries=3).timeout, vllm(timeout=120, retries=3).retries) == (120.0, 3)  # as written
    hf_section = Params.model_validate({"engine": {"name": "hf", "batch_size": 8}}).engine
    assert engines.settings_for(hf_section, "vllm").timeout == 600.0  # not set in hf's section: vLLM's own
    assert engines.settings_for(hf_section, "vllm").batch_size == 8


def test_another_engine_takes_what_it_shares_of_the_section_and_ignores_the_rest():
    """`--engine hf` (bench.engine, judge.backend) on a params.yaml written for vllm: the settings both take and
    the section gives are carried over, vllm's own ignored, with no error; a value the other engine does not take
    is left at its default."""
    vllm_section = Params.model_validate({"engine": {
        "name": "vllm", "batch_size": 256, "dtype": "bfloat16", "tensor_parallel_size": 2, "timeout": 1800,
        "kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.22}}).engine
    hf = engines.settings_for(vllm_section, "hf")
    assert hf.model_dump() == {**DEFAULTS["hf"], "batch_size": 256, "dtype": "bfloat16"}
    lmdeploy = engines.settings_for(vllm_section, "lmdeploy")
    assert (lmdeploy.batch_size, lmdeploy.dtype, lmdeploy.tensor_parallel_size) == (256, "bfloat16", 2)
    assert engines.settings_for(vllm_section, "vllm") is vllm_section
    null_dtype = Params.model_validate({"engine": {"name": "vllm", "dtype": None}}).engine
    assert engines.settings_for(null_dtype, "hf").dtype == "float32"  # hf takes no null dtype: its default
    with pytest.raises(UserError, match="engine.model: with the openai engine, set the served model's name"):
        engines.settings_for(vllm_section, "openai")  # before any work
    with pytest.raises(UserError, match="engine 'tgi': use hf, vllm, lmdeploy or openai"):
        engines.settings_for(vllm_section, "tgi")


def test_the_openai_engine_needs_the_served_model_name():
    openai = Params.model_validate({"engine": {"name": "openai", "base_url": "http://h:1/v1"}}).engine
    with pytest.raises(UserError, match="engine.model: with the openai engine, set the served model's name"):
        engines.settings_for(openai, "openai")


@pytest.mark.parametrize("engine, expected", [
    ({"name": "vllm", "base_url": "http://h:1/v1"}, "engine.base_url: the openai engine's setting; engine.name is vllm"),
    ({"name": "hf", "kv_cache_dtype": "fp8"}, "engine.kv_cache_dtype: the vllm engine's setting; engine.name is hf"),
    ({"batch_size": 4, "timeout": 30}, "engine.timeout: the vllm and the openai engines' setting; engine.name is hf"),
    ({"name": "openai", "model": "m", "bogus": 1}, "engine.bogus: unknown key; remove it or check its spelling "
                                                   "(the openai engine takes: name, batch_size, timeout"),
    ({"name": "tgi"}, "engine.name: 'tgi' is not allowed; input should be 'hf', 'vllm', 'lmdeploy' or 'openai'"),
    ({"name": "vllm", "timeout": 0}, "engine.timeout: Input should be greater than 0"),
])
def test_a_key_the_chosen_engine_does_not_take_names_the_engine_that_does(tmp_path, engine, expected):
    from conftest import TINY_PARAMS, write_params
    from pipeline.settings import params

    path = write_params(tmp_path, {**TINY_PARAMS, "engine": engine})
    with pytest.raises(UserError) as err:
        params.load(path)
    assert expected in str(err.value)
    assert f"{path}:" in str(err.value).split(": engine.")[0]  # at its line


def test_the_repo_and_profile_params_validate_as_their_engines_sections():
    from pipeline.settings import params

    root = PACKAGE.parent
    assert type(params.load(root / "params.yaml").engine) is engines.ENGINES["hf"].settings
    for profile in sorted((PACKAGE / "profiles").glob("*/params.yaml")):
        section = params.Params.model_validate(__import__("yaml").safe_load(profile.read_text())).engine
        assert type(section) is engines.ENGINES[section.name].settings


def test_the_registry_names_every_engine_and_what_it_can_do():
    assert set(engines.ENGINES) == NAMES
    assert engines.engine_names() == "hf, vllm, lmdeploy or openai"
    assert engines.engine_names(quote=True) == "'hf', 'vllm', 'lmdeploy' or 'openai'"
    assert engines.engine_names(where=lambda s: s.likelihoods) == "hf or vllm"
    assert engines.engine_names(where=lambda s: s.timing == "http") == "vllm or openai"
    assert {n: s.package for n, s in engines.ENGINES.items()} == {
        "hf": "transformers", "vllm": "vllm", "lmdeploy": "lmdeploy", "openai": None}
    assert [n for n in engines.ENGINES if engines.capability(n, "local_weights")] == ["hf", "vllm", "lmdeploy"]
    assert [n for n in engines.ENGINES if engines.capability(n, "starts_server")] == ["vllm"]


def test_bench_records_the_same_package_versions():
    from pipeline.stages.bench import versions

    assert list(versions()) == ["torch", "transformers", "lmdeploy", "vllm"]


def test_params_take_every_registered_name_and_only_those(monkeypatch):
    for name in NAMES:
        extra = {"model": "m"} if name == "openai" else {}
        params = Params.model_validate({"engine": {"name": name, **extra}, "bench": {"engine": name},
                                        "judge": {"backend": name}, "verdict": {"speed_engine": name}})
        assert (params.engine.name, params.bench.engine, params.judge.backend, params.verdict.speed_engine) == (
            name, name, name, name)
    fake = engines.EngineSpec("fake", engines.EngineSettings, "m:C", "a test's", "in-process")
    monkeypatch.setattr(engines, "ENGINES", {"hf": engines.ENGINES["hf"], "fake": fake})
    assert Params.model_validate({"bench": {"engine": "fake"}}).bench.engine == "fake"  # read when validating
    with pytest.raises(ValueError, match="Input should be 'hf' or 'fake'"):
        Params.model_validate({"judge": {"backend": "vllm"}})


def test_require_fails_early_naming_the_extra_only_where_an_engine_checks(monkeypatch):
    monkeypatch.setitem(sys.modules, "lmdeploy", None)  # as on a machine without the lmdeploy extra
    with pytest.raises(UserError, match=r"needs the lmdeploy extra .*pip install -e '\.\[lmdeploy\]'"):
        engines.require("lmdeploy")
    for name in ("hf", "vllm", "openai", "not-registered"):
        engines.require(name)  # nothing to check here (vllm: its server command, when it starts)


# ------------------------------------------------------------------ no engine-name comparisons outside

def engine_name_uses(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) for each comparison with an engine name (==, !=, is, a `case`, or `in` a literal
    tuple/list/set holding one) and each dict key or subscript that is one."""
    found = []

    def named(node) -> str | None:
        return node.value if isinstance(node, ast.Constant) and node.value in names else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands, operands[1:]):
                sides = [left, right]
                if isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
                    sides += list(right.elts)
                found += [(node.lineno, n) for n in map(named, sides) if n]
        elif isinstance(node, ast.Dict):
            found += [(node.lineno, n) for n in map(named, node.keys) if n]
        elif isinstance(node, ast.Subscript):
            found += [(node.lineno, n) for n in [named(node.slice)] if n]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, n) for n in [named(node.value)] if n]
    return found


def name_uses_outside(registry: str, names: set[str], allowed: dict[str, set[str]]) -> list[str]:
    """pipeline/FILE:LINE: 'name' for each comparison with one of `names` outside the registry's folder (and not
    allowed for that file)."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(registry):
            continue
        for line, name in engine_name_uses(ast.parse(path.read_text(encoding="utf-8")), names):
            if name not in allowed.get(relative, set()):
                wrong.append(f"pipeline/{relative}:{line}: {name!r}")
    return wrong


def test_no_module_outside_the_registry_compares_engine_names():
    """A new engine is one EngineSpec: a module that compares a name ("if engine == 'vllm'") would miss it.
    Ask the registry (capability, engine_spec, settings_for, require, engine_names) instead."""
    assert name_uses_outside("engines/", NAMES, ALLOWED) == []


@pytest.mark.parametrize("source, expected", [
    ("if engine == 'vllm': pass", [(1, "vllm")]),
    ("x = 'lmdeploy' != name", [(1, "lmdeploy")]),
    ("ok = name in ('hf', 'openai')", [(1, "hf"), (1, "openai")]),
    ("v = {'hf': 'transformers'}.get(name)", [(1, "hf")]),
    ("v = table['vllm']", [(1, "vllm")]),
    ("match name:\n    case 'openai': pass", [(2, "openai")]),
    ("fmt = 'hf'\nreturn_value = fmt", []),  # a value, not a comparison (checkpoints/resave.py's source format)
    ("ok = name in TARGETS", []),
    ("help = 'hf or vllm'", []),
])
def test_the_guard_finds_comparisons_with_engine_names(source, expected):
    assert engine_name_uses(ast.parse(source), NAMES) == expected


def test_a_suites_code_digest_holds_its_own_engines_modules_not_every_registered_one():
    """The registry imports every engine module (their sections validate params.yaml), but an hf suite's results
    do not depend on vllm.py: the code digest (pipeline/imports.py) takes the registry's own file, not its imports."""
    from pipeline.imports import closure

    hf = closure("pipeline.engines.hf")
    assert "pipeline.engines" in hf and "pipeline.engines.settings" in hf and "pipeline.engines.vllm" not in hf
    assert "pipeline.engines.openai" in closure("pipeline.engines.vllm")  # what vllm.py imports itself
