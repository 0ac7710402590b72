"""config.json has one reader (pipeline/checkpoints/config_json.py): its messages, its facts for text
and vision-language layouts, and no other module parsing the file or digging out `text_config` itself."""

import ast
import json
from pathlib import Path

import pytest

from pipeline.checkpoints import config_json
from pipeline.errors import UserError

PACKAGE = Path(__file__).resolve().parent.parent / "pipeline"

TEXT = {"architectures": ["GlmForCausalLM"], "model_type": "glm", "hidden_size": 4096, "intermediate_size": 13696,
        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 40,
        "vocab_size": 151552, "max_position_embeddings": 131072, "dtype": "bfloat16", "tie_word_embeddings": False}
# GLM-4.6V's layout: the language model's settings under text_config, the top level the wrapper's
VISION_MOE = {"architectures": ["Glm4vMoeForConditionalGeneration"], "model_type": "glm4v_moe",
              "image_token_id": 151363, "vision_config": {"hidden_size": 1536, "depth": 24},
              "text_config": {"model_type": "glm4v_moe_text", "hidden_size": 4096, "intermediate_size": 10944,
                              "moe_intermediate_size": 1408, "n_routed_experts": 128, "first_k_dense_replace": 1,
                              "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
                              "num_hidden_layers": 46, "vocab_size": 151552, "max_position_embeddings": 65536,
                              "dtype": "bfloat16"}}
# ChatGLM remote code's own names for the same facts
CHATGLM = {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "hidden_size": 4096, "num_layers": 40,
           "num_attention_heads": 32, "multi_query_group_num": 2, "kv_channels": 128, "seq_length": 131072,
           "padded_vocab_size": 151552, "torch_dtype": "bfloat16"}


def write(tmp_path: Path, text: bytes | str) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    return model


def test_reads_an_object(tmp_path):
    assert config_json.read(write(tmp_path, json.dumps(TEXT))) == TEXT


@pytest.mark.parametrize("content, expected", [
    (b"\xff\xfe{}", "config.json: not UTF-8 text"),
    ('{"hidden_size": 4096,\n "vocab_size": }', "config.json:2:16: not valid JSON"),
    ("[1, 2]", "config.json: holds a JSON list, not an object of settings"),
])
def test_a_broken_file_is_named_with_where_and_the_fix(tmp_path, content, expected):
    with pytest.raises(UserError) as err:
        config_json.read(write(tmp_path, content))
    assert expected in str(err.value) and "restore the config.json that came with the weights" in str(err.value)


def test_a_missing_directory_or_file_says_what_to_pass(tmp_path):
    with pytest.raises(UserError, match="no such directory; pass a checkpoint directory"):
        config_json.read(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        config_json.read(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json; a checkpoint directory holds config.json"):
        config_json.read(tmp_path / "empty")
    assert not config_json.present(tmp_path / "empty") and not config_json.present(tmp_path / "nowhere")


def test_load_refuses_remote_code_and_unknown_types(tmp_path):
    with pytest.raises(UserError, match="ChatGLM remote-code checkpoint.*quantize resave"):
        config_json.load(write(tmp_path, json.dumps(CHATGLM)))
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(UserError, match="transformers does not know model_type 'nonesuch'"):
        config_json.load(write(other, json.dumps({"model_type": "nonesuch", "architectures": ["X"]})))


def test_facts_of_a_vision_moe_come_from_its_text_config():
    assert config_json.architecture(VISION_MOE) == "Glm4vMoeForConditionalGeneration"
    assert config_json.text_section(VISION_MOE) is VISION_MOE["text_config"]
    assert config_json.text_section_named(VISION_MOE) == (VISION_MOE["text_config"], "text_config.")
    assert config_json.routed_experts(VISION_MOE) == 128 and config_json.dense_layers_first(VISION_MOE) == 1
    assert config_json.linear_input_widths(VISION_MOE) == {
        "hidden size": 4096, "intermediate size": 10944, "MoE intermediate size": 1408,
        "attention width (heads x head_dim)": 96 * 128}
    assert config_json.kv_cache_shape(VISION_MOE) == (46, 8, 128)
    assert config_json.vocab_size(VISION_MOE) == 151552 and config_json.max_positions(VISION_MOE) == 65536
    assert config_json.dtype(VISION_MOE) == "bfloat16" and config_json.has_vision(VISION_MOE)
    assert config_json.quantization(VISION_MOE) == {} and not config_json.is_compressed_tensors(VISION_MOE)


def test_facts_of_a_text_model_and_of_chatglm_remote_code():
    assert config_json.text_section(TEXT) is TEXT and config_json.routed_experts(TEXT) == 0
    assert config_json.linear_input_widths(TEXT) == {"hidden size": 4096, "intermediate size": 13696}
    assert config_json.kv_cache_shape(TEXT) == (40, 2, 128) and not config_json.has_vision(TEXT)
    assert config_json.kv_cache_shape(CHATGLM) == (40, 2, 128)
    assert config_json.vocab_size(CHATGLM) == 151552 and config_json.max_positions(CHATGLM) == 131072
    assert config_json.dtype(CHATGLM) == "bfloat16" and config_json.dtype({}) == "float16"
    with pytest.raises(UserError, match="no 'architectures' entry"):
        config_json.architecture({"model_type": "glm"})


def test_quantization_facts():
    fp8 = {**TEXT, "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                           "kv_cache_scheme": {"type": "float", "num_bits": 8,
                                                               "strategy": "attn_head"}}}
    assert config_json.is_compressed_tensors(fp8)
    assert config_json.kv_cache_scheme(fp8)["strategy"] == "attn_head" and config_json.kv_cache_scheme(TEXT) is None


def test_generation_eos(tmp_path):
    model = write(tmp_path, json.dumps(TEXT))
    assert config_json.generation_eos(model) is None
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [151329, 151336]}))
    assert config_json.generation_eos(model) == [151329, 151336]
    (model / "generation_config.json").write_text("{broken")
    assert config_json.generation_eos(model) is None


def _reads_config_json(node: ast.AST) -> bool:
    """A call whose arguments or receiver mention the constant "config.json" and that reads (read_text,
    open, json.load/loads): a second reader of the file."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in ("read_text", "read_bytes", "open", "load", "loads", "from_pretrained"):
        return False
    mentioned = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value == "config.json"]
    return bool(mentioned) and name != "from_pretrained"


def test_no_other_module_reads_config_json_or_digs_out_text_config():
    """Every stage asks config_json; `text_config` as a key and reads of config.json appear nowhere else."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "config_json.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == "text_config":
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: the key 'text_config'")
            if _reads_config_json(node):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: reads config.json")
    assert offenders == []


def test_a_checkpoint_is_read_once_per_process_and_again_when_rewritten(tmp_path, monkeypatch):
    """pipeline/checkpoints/checkpoint.py: the stages ask for the same checkpoint in many places; config.json is
    parsed once for the process, each caller gets its own copy, and a rewritten file is read again."""
    import os

    from pipeline.checkpoints import checkpoint

    model = write(tmp_path, json.dumps(TEXT))
    reads = []
    real_read = config_json.read
    monkeypatch.setattr(config_json, "read", lambda d: reads.append(d) or real_read(d))
    first, second = checkpoint.open(model), checkpoint.open(model)
    assert len(reads) == 1 and first.config == second.config == TEXT
    assert (first.architecture, first.vocab_size, first.dtype, first.max_positions) == (
        "GlmForCausalLM", 151552, "bfloat16", 131072)
    first.config["vocab_size"] = 1  # one caller's edit is not another's
    assert checkpoint.open(model).vocab_size == 151552 and len(reads) == 1
    stat = (model / "config.json").stat()
    (model / "config.json").write_text(json.dumps({**TEXT, "vocab_size": 1000, "pad": "same length?"}))
    os.utime(model / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # an editor that keeps the time
    assert checkpoint.open(model).vocab_size == 1000 and len(reads) == 2
    with pytest.raises(UserError, match="no config.json"):
        checkpoint.open(tmp_path)


def test_config_json_is_read_in_few_modules():
    """One value per checkpoint (checkpoint.open), passed down: the file's reader is called from at most 5
    modules (issue 44), not from each stage and engine."""
    callers = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if "config_json.read(" in path.read_text() and path.name != "config_json.py")
    assert len(callers) <= 5, callers
