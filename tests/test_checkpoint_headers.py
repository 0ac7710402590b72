"""Bad checkpoint directories (issues 16.1 and 20.2): every command that reads a checkpoint exits 2
with one message that names the file and the fix, before any model is loaded or engine started, and
leaves nothing behind; weights that do not cover their config are refused with the tensor names."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_PARAMS, write_params
from pipeline.checkpoints import config_json, headers
from pipeline.console import LOG_DIR
from pipeline.errors import UserError
from tiny import save_tiny_glm, save_tiny_llama


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory) -> Path:
    return save_tiny_glm(tmp_path_factory.mktemp("glm") / "glm")


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _rewrite_tensors(model_dir: Path, change) -> Path:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


def _edit_config(model_dir: Path, **changes) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def _cut(path: Path, keep) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep(len(data))])


def _drop(predicate):
    def change(tensors):
        for name in [n for n in tensors if predicate(n)]:
            del tensors[name]
    return change


def _sharded(dest: Path, good: Path, drop_shard: bool) -> Path:
    _copy(good, dest)
    tensors = load_file(dest / "model.safetensors")
    (dest / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, dest / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if drop_shard:
        (dest / "model-00002-of-00002.safetensors").unlink()
    return dest


# name -> (make(dest, good glm, variants), what the message must say)
CORRUPT = {
    "missing dir": (lambda d, g, v: d, "no such"),
    "config.json only": (lambda d, g, v: (d.mkdir(), shutil.copy(g / "config.json", d), d)[-1], "no weights beside config.json"),
    "no weights": (lambda d, g, v: (_copy(g, d), (d / "model.safetensors").unlink(), d)[-1], "no weights beside config.json"),
    "truncated safetensors": (lambda d, g, v: (_copy(g, d), _cut(d / "model.safetensors", lambda n: n // 2), d)[-1],
                              "truncated or corrupt"),
    "safetensors cut inside its header": (lambda d, g, v: (_copy(g, d), _cut(d / "model.safetensors", lambda n: 60), d)[-1],
                                          "truncated or corrupt"),
    "empty safetensors": (lambda d, g, v: (_copy(g, d), _cut(d / "model.safetensors", lambda n: 0), d)[-1],
                          "truncated or corrupt"),
    "garbage safetensors": (lambda d, g, v: (_copy(g, d), (d / "model.safetensors").write_bytes(bytes(range(256)) * 64), d)[-1],
                            "truncated or corrupt"),
    "garbage pytorch_model.bin": (lambda d, g, v: (_copy(g, d), (d / "model.safetensors").unlink(),
                                                   (d / "pytorch_model.bin").write_bytes(b"\x00junk" * 999), d)[-1],
                                  "truncated or corrupt"),
    "unparsable config.json": (lambda d, g, v: (_copy(g, d), (d / "config.json").write_text('{"model_type": "glm",\n'), d)[-1],
                               "not valid JSON"),
    "config.json holds a list": (lambda d, g, v: (_copy(g, d), (d / "config.json").write_text("[1, 2]"), d)[-1],
                                 "not an object"),
    "unknown architecture": (lambda d, g, v: _edit_config(_copy(g, d), model_type="frobnicator",
                                                          architectures=["FrobnicatorForCausalLM"]),
                             "model_type 'frobnicator'"),
    "no model_type": (lambda d, g, v: (_copy(g, d), (d / "config.json").write_text('{"architectures": ["GlmForCausalLM"], "hidden_size": 64}'), d)[-1],
                      "no model_type"),
    "unbuildable config": (lambda d, g, v: _edit_config(_copy(g, d), vocab_size=-5),
                           "cannot build"),
    "config value of the wrong type": (lambda d, g, v: _edit_config(_copy(g, d), hidden_size="big"), "not a valid glm config"),
    "shard listed in the index is missing": (lambda d, g, v: _sharded(d, g, drop_shard=True), "missing from"),
    "a decoder layer removed": (lambda d, g, v: _rewrite_tensors(_copy(g, d), _drop(lambda n: ".layers.1." in n)),
                                "missing (model.layers.1."),
    "another architecture's config": (lambda d, g, v: (_copy(g, d), shutil.copy(v["llama"] / "config.json", d), d)[-1],
                                      "unexpected (model.layers.0.mlp.gate_up_proj.weight"),
    "config with other widths": (lambda d, g, v: _edit_config(_copy(g, d), intermediate_size=96), "of another shape"),
    "one tensor too many": (lambda d, g, v: _rewrite_tensors(
        _copy(g, d), lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2, 2)})),
        "unexpected (model.layers.0.mlp.extra.weight)"),
    "AWQ variant without a weight scale": (lambda d, g, v: _rewrite_tensors(
        _copy(v["awq-w4a16"], d), _drop(lambda n: n == "model.layers.1.mlp.down_proj.weight_scale")),
        "model.layers.1.mlp.down_proj.weight_scale"),
    "AWQ variant with unpacked zero points": (lambda d, g, v: _rewrite_tensors(
        _copy(v["awq-w4a16"], d), lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_zero_point":
                                                      torch.zeros(64, 2, dtype=torch.int32)})),
        "model.layers.0.self_attn.q_proj.weight_zero_point [64, 2] where the config implies [8, 2]"),
    "FP8 variant without its KV-cache scale": (lambda d, g, v: _rewrite_tensors(
        _copy(v["fp8-w8a8"], d), _drop(lambda n: n == "model.layers.0.self_attn.k_scale")),
        "missing (model.layers.0.self_attn.k_scale)"),
    "AWQ config over FP8 weights": (lambda d, g, v: (_copy(v["fp8-w8a8"], d), shutil.copy(v["awq-w4a16"] / "config.json", d), d)[-1],
                                    "weight_packed"),
}

# The fix every message ends with starts with one of these.
FIXES = ("restore ", "copy ", "rebuild ", "convert ", "upgrade ", "use the config.json", "pass ", "serve it with")
# What the export says instead, where it refuses the input for what it is before reading its weights.
EXPORT_SAYS = {"FP8 variant without its KV-cache scale": "vllm serve"}


def _commands(bad: Path, good: Path, holdout: Path, calib: Path, out: Path) -> dict[str, list[str]]:
    return {
        "awq": ["awq", "--model", str(bad), "--calib", str(calib), "--out", str(out)],
        "fp8": ["fp8", "--model", str(bad), "--calib", str(calib), "--out", str(out)],
        "eval": ["eval", str(bad), "--suite", "math", "--out", str(out)],
        "kl": ["kl", str(bad), "--base", str(good), "--holdout", str(holdout), "--out", str(out / "kl.json")],
        "kl --base": ["kl", str(good), "--base", str(bad), "--holdout", str(holdout), "--out", str(out / "kl.json")],
        "judge": ["judge", str(bad), "--base", str(good), "--prompts", str(holdout), "--out", str(out)],
        "judge --base": ["judge", str(good), "--base", str(bad), "--prompts", str(holdout), "--out", str(out)],
        "bench": ["bench", str(bad), "--holdout", str(holdout), "--out", str(out / "bench.json")],
        "export": ["export", str(bad), "--out", str(out)],
        "resave": ["resave", str(bad), "--out", str(out)],
    }


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    """What the project holds, less the libraries' warning logs (.cache/logs/<command>.log): a refused command may
    leave the warnings that led to its refusal there (transformers warns about a broken config's token ids once per
    process, so whether it does depends on what ran before in the worker), and a log is no half-written output."""
    logs = root / LOG_DIR
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if logs not in p.parents and p != logs and p not in logs.parents}


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_glm, tiny_llama, tiny_variants, tiny_calib):
    """A project dir with params.yaml, a good base, calibration and every corrupt checkpoint."""
    root = tmp_path_factory.mktemp("corpus")
    write_params(root, TINY_PARAMS)
    good = _copy(tiny_glm, root / "good")
    shutil.copytree(tiny_calib, root / "calib")
    sources = {**tiny_variants, "llama": tiny_llama}
    (root / "bad").mkdir()
    bad = {}
    for i, (kind, (make, _)) in enumerate(CORRUPT.items()):
        bad[kind] = make(root / "bad" / f"c{i:02d}", good, sources)
    return root, good, bad


class _Loaded(Exception):
    """Raised if a command gets as far as loading a model or starting an engine."""


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_every_checkpoint_command_refuses_the_corpus_clean(project, kind, monkeypatch):
    import transformers
    from typer.testing import CliRunner

    import pipeline.engines
    from pipeline.cli.app import app

    root, good, bad = project
    monkeypatch.chdir(root)

    def forbidden(*args, **kwargs):
        raise _Loaded("a model was loaded before the checkpoint was refused")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(forbidden))
    monkeypatch.setattr(pipeline.engines, "make_engine", forbidden)
    expected = CORRUPT[kind][1]
    failures = []
    for command, args in _commands(bad[kind], good, root / "calib" / "holdout.jsonl", root / "calib" / "calib.jsonl",
                                   root / "out").items():
        before = _listing(root)
        result = CliRunner().invoke(app, args)
        says = EXPORT_SAYS.get(kind, expected) if command == "export" else expected
        problems = []
        if result.exit_code != 2 or not isinstance(result.exception, SystemExit):
            problems.append(f"exit {result.exit_code} ({result.exception!r})")
        if result.output.count("error: ") != 1 or "Traceback" in result.output:
            problems.append("not one error message")
        if says not in result.output or str(bad[kind]) not in result.output:
            problems.append(f"message lacks {says!r} or the path")
        if not any(fix in result.output.lower() for fix in FIXES):
            problems.append("message names no fix")
        if _listing(root) != before:
            problems.append("the project changed")
        if problems:
            failures.append(f"{command}: {'; '.join(problems)}\n    {result.output.strip()}")
    assert not failures, f"{kind}:\n" + "\n".join(failures)


# ---------------------------------------------------------------- coverage, directly


def test_whole_checkpoints_of_every_kind_pass(tiny_glm, tiny_llama, tiny_variants, tmp_path):
    """Real layouts: Llama, Glm, tied embeddings, compressed-tensors AWQ (packed int4, packed zero points)
    and FP8 (weight, weight_scale, input_scale, k_scale / v_scale), sharded with an index."""
    tied = save_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(tied / "model.safetensors")
    sharded = _sharded(tmp_path / "sharded", tiny_glm, drop_shard=False)
    for model_dir in (tiny_glm, tiny_llama, tied, sharded, *tiny_variants.values()):
        found = headers.check(model_dir)
        assert found.tensors == len({k for f in found.weight_files for k in load_file(f)})
    names = set(load_file(tiny_variants["awq-w4a16"] / "model.safetensors"))
    assert {"model.layers.0.self_attn.q_proj.weight_packed", "model.layers.0.self_attn.q_proj.weight_zero_point",
            "model.layers.0.self_attn.q_proj.weight_shape"} <= names
    assert "model.layers.0.self_attn.k_scale" in load_file(tiny_variants["fp8-w8a8"] / "model.safetensors")


def test_a_removed_layer_is_named_with_the_count(tiny_glm, tmp_path):
    bad = _rewrite_tensors(_copy(tiny_glm, tmp_path / "bad"), _drop(lambda n: ".layers.1." in n))
    missing = headers.coverage(bad, config_json.load(bad),
                               headers.read_headers([bad / "model.safetensors"]))["missing"]
    layer = {n for n in load_file(tiny_glm / "model.safetensors") if ".layers.1." in n}
    assert set(missing) == layer and len(layer) == 11  # q, k, v (weight and bias), o, gate_up, down, 2 norms
    with pytest.raises(UserError) as err:
        headers.check(bad)
    assert f"tensors {len(layer)} missing (model.layers.1." in str(err.value) and "and 6 more" in str(err.value)


def test_the_check_reads_headers_only(tiny_glm, tmp_path, monkeypatch):
    """Zeroing every data byte after the header changes nothing: the data is never read."""
    import struct

    model_dir = _copy(tiny_glm, tmp_path / "m")
    path = model_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[start:] = bytes(len(data) - start)
    path.write_bytes(bytes(data))
    assert headers.check(model_dir).tensors == len(load_file(tiny_glm / "model.safetensors"))


def test_chatglm_layout_is_sent_to_resave(tmp_path):
    model_dir = tmp_path / "chatglm"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "chatglm", "architectures": ["ChatGLMModel"]}))
    with pytest.raises(UserError, match=r"convert it first: quantize resave .*chatglm --out DIR"):
        headers.check(model_dir)

