"""The engine registry (pipeline/engines/__init__.py, ENGINES) is the one home of engine names and of what
each engine can do and reads (issue 26.2): params, bench, evaluate, judge and the CLI ask it; no module
outside pipeline/engines/ compares a value with an engine's name."""

import ast
import sys
from pathlib import Path

import pytest

from pipeline import engines
from pipeline.errors import UserError
from pipeline.settings.params import EngineParams, Params

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
}

DEFAULTS = {
    "hf": {"batch_size": 32, "max_batch_tokens": 65536, "dtype": "float32", "threads": 0},
    "vllm": {"batch_size": 32, "tensor_parallel_size": 1, "max_model_len": None, "gpu_memory_utilization": 0.9,
             "kv_cache_dtype": "checkpoint", "enable_prefix_caching": None, "max_num_batched_tokens": None,
             "max_num_seqs": None, "server_command": ["vllm", "serve"], "server_env": {}, "server_args": [],
             "start_timeout": 900.0, "share_server": True, "server_idle_timeout": None, "max_servers": 1,
             "kv_cache_memory": "auto", "non_kv_memory_gib": 4.0, "device_memory_gib": None,
             "timeout": 600.0, "retries": 1, "max_response_bytes": 16777216, "enable_expert_parallel": False,
             "defect_workarounds": True, "dtype": None},
    "lmdeploy": {"batch_size": 32, "max_batch_tokens": 65536, "dtype": "float32", "threads": 0,
                 "tensor_parallel_size": 1},
    "openai": {"base_url": None, "model": "served", "api_key_env": None, "concurrency": 8, "timeout": 120.0,
               "retries": 3, "batch_size": 32, "params_section": "engine", "prompt_format": "tokens",
               "max_response_bytes": 16777216},
}

EVERY_SETTING = dict(
    batch_size=7, max_batch_tokens=999, dtype="bfloat16", threads=3, tensor_parallel_size=2,
    enable_expert_parallel=True, max_model_len=4096, gpu_memory_utilization=0.5, kv_cache_dtype="fp8",
    enable_prefix_caching=False, max_num_batched_tokens=2048, max_num_seqs=16,
    server_command=["python3", "-m", "vllm"], server_env={"A": "1"}, server_args=["--x"], start_timeout=60,
    share_server=False, server_idle_timeout=10, max_servers=2, kv_cache_memory="planned", non_kv_memory_gib=2.5,
    device_memory_gib=80, defect_workarounds=False, base_url="http://h:1/v1", model="m",
    api_key_env="KEY", prompt_format="chat", concurrency=3, timeout=700, retries=5, max_response_bytes=2048)
CHANGED = {
    "hf": {"batch_size": 7, "max_batch_tokens": 999, "dtype": "bfloat16", "threads": 3},
    "vllm": {"batch_size": 7, "tensor_parallel_size": 2, "max_model_len": 4096, "gpu_memory_utilization": 0.5,
             "kv_cache_dtype": "fp8", "enable_prefix_caching": False, "max_num_batched_tokens": 2048,
             "max_num_seqs": 16, "server_command": ["python3", "-m", "vllm"], "server_env": {"A": "1"},
             "server_args": ["--x"], "start_timeout": 60.0, "share_server": False, "server_idle_timeout": 10.0,
             "max_servers": 2, "kv_cache_memory": "planned", "non_kv_memory_gib": 2.5, "device_memory_gib": 80.0,
             "timeout": 700.0, "retries": 1, "max_response_bytes": 2048,
             "enable_expert_parallel": True, "defect_workarounds": False, "dtype": "bfloat16"},
    "lmdeploy": {"batch_size": 7, "max_batch_tokens": 999, "dtype": "bfloat16", "threads": 3,
                 "tensor_parallel_size": 2},
    "openai": {"base_url": "http://h:1/v1", "model": "m", "api_key_env": "KEY", "concurrency": 3, "timeout": 700.0,
               "retries": 5, "batch_size": 12, "params_section": "engine", "prompt_format": "chat",
               "max_response_bytes": 2048},
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_each_engine_takes_the_same_settings_from_the_engine_section(name):
    """What make_engine gets per engine, pinned (keys in order): the registry's options functions
    (pipeline/engines/options.py) hand over exactly what params.py's per-name branches did."""
    for section, expected in ((EngineParams(model="served"), DEFAULTS[name]),
                              (EngineParams(**EVERY_SETTING), CHANGED[name])):
        got = section.options(name)
        assert list(got.items()) == list(expected.items())
        assert engines.engine_options(name, section) == got


def test_the_openai_engine_needs_the_served_model_name():
    with pytest.raises(UserError, match="engine.model: with the openai engine, set the served model's name"):
        EngineParams().options("openai")


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
        params = Params.model_validate({"engine": {"name": name}, "bench": {"engine": name},
                                        "judge": {"backend": name}, "verdict": {"speed_engine": name}})
        assert (params.engine.name, params.bench.engine, params.judge.backend, params.verdict.speed_engine) == (
            name, name, name, name)
    monkeypatch.setattr(engines, "ENGINES", {"fake": engines.EngineSpec("fake", "m:C", "a test's", "in-process")})
    assert Params.model_validate({"engine": {"name": "fake"}}).engine.name == "fake"  # read when validating
    with pytest.raises(ValueError, match="Input should be 'fake'"):
        Params.model_validate({"engine": {"name": "hf"}})


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
    Ask the registry (capability, engine_spec, engine_options, require, engine_names) instead."""
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
