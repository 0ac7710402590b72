import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO, read_jsonl
from pipeline.stages import evaluate

FIELDS = {"id", "suite", "variant", "prompt", "target", "output", "score", "correct", "n_tokens", "seconds",
          "thinking", "reasoning", "reasoning_tokens", "answer_tokens", "cut"}  # how it was generated (issue 66)


def test_math_suite_on_three_items_writes_the_contract(tmp_path, tiny_llama):
    result = evaluate.run(tiny_llama, suite="math", task="quant_gsm8k", variant="base", out_dir=tmp_path,
                          limit=3, max_new_tokens=8, batch_size=2)
    lines = read_jsonl(tmp_path / "math.jsonl")
    assert [l["id"] for l in lines] == ["gsm8k-test-0000", "gsm8k-test-0001", "gsm8k-test-0002"]
    assert all(set(l) == FIELDS for l in lines)
    assert lines[0]["target"] == "18" and "Janet" in lines[0]["prompt"]
    assert lines[0]["prompt"].startswith("<|im_start|>user\n")  # the chat template was applied
    assert all(0 < l["n_tokens"] <= 8 for l in lines)
    # SmolLM2's case, a template that does not think: nothing split, only where the budget cut
    assert all(not l["thinking"] and l["reasoning"] == "" and l["answer_tokens"] == l["n_tokens"] for l in lines)
    assert all(l["cut"] == ("answer" if l["n_tokens"] == 8 else None) for l in lines)
    summary = json.loads((tmp_path / "math.json").read_text())
    assert summary["n"] == 3 and summary["metric"] == "acc" and summary == result.figures
    assert summary["available"] == 1319  # the suite's items before the limit: no next step asks for more (issue 69)


def test_same_prompts_for_every_variant(tmp_path, tiny_llama, tiny_variants):
    prompts = {}
    for name, model in [("base", tiny_llama), *tiny_variants.items()]:
        evaluate.run(model, suite="math", task="quant_gsm8k", variant=name, out_dir=tmp_path / name,
                     limit=2, max_new_tokens=4)
        prompts[name] = [(l["id"], l["prompt"]) for l in read_jsonl(tmp_path / name / "math.jsonl")]
    assert prompts["base"] == prompts["awq-w4a16"] == prompts["fp8-w8a8"]


def test_scoring_reads_the_final_number():
    import importlib.util

    spec = importlib.util.spec_from_file_location("math_utils", REPO / "evals" / "math" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    doc = {"question": "?", "answer": "so 1,234\n#### 1,234"}
    assert utils.process_results(doc, ["It is 5 then 1234.\nAnswer: 1,234"])["acc"] == 1.0
    assert utils.process_results(doc, ["Answer: 1235"])["acc"] == 0.0
    assert utils.process_results(doc, ["no number at all"])["acc"] == 0.0


def test_killed_run_resumes_without_recomputing(tmp_path, tiny_llama):
    """SIGKILL mid-run; the rerun reuses every finished generation and loses or duplicates none."""
    script = (
        "import sys; from pipeline.stages import evaluate\n"
        f"evaluate.run({str(tiny_llama)!r}, suite='math', task='quant_gsm8k', variant='base', "
        f"out_dir={str(tmp_path)!r}, limit=20, max_new_tokens=96, batch_size=1)\n"
    )
    cache = tmp_path / ".cache" / "math.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if cache.exists() and len(cache.read_text().splitlines()) >= 2:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len([l for l in cache.read_text().splitlines() if l.strip()])
    print(f"generations finished before the kill: {done_before} of 20")
    assert 2 <= done_before < 20 and not (tmp_path / "math.jsonl").exists()
    evaluate.run(tiny_llama, suite="math", task="quant_gsm8k", variant="base", out_dir=tmp_path,
                 limit=20, max_new_tokens=96, batch_size=1)
    entries = read_jsonl(cache)
    assert len(entries) == 20 and len({e["key"] for e in entries}) == 20  # only the missing 20 - k were generated
    assert len(read_jsonl(tmp_path / "math.jsonl")) == 20


def test_openai_engine_evaluates_against_a_real_server_with_the_same_items(tmp_path, tiny_llama, monkeypatch):
    """`quantize eval --engine openai`: the suite's chat turns go to a served model, answers are scored."""
    import yaml
    from typer.testing import CliRunner

    from chat_server import ChatServer
    from conftest import TINY_PARAMS, write_params
    from pipeline.cli.app import app

    gold = {}
    for line in (REPO / "evals" / "math" / "gsm8k_test.jsonl").read_text().splitlines()[:3]:
        row = json.loads(line)
        gold[row["question"]] = row["answer"].split("####")[-1].strip()

    def answer(body):  # a server that gets the first two right and the third wrong
        question = body["messages"][-1]["content"]
        right = [q for q in gold if q in question]
        return f"The answer is {gold[right[0]]}." if right and list(gold).index(right[0]) < 2 else "The answer is 7."

    settings = json.loads(json.dumps(TINY_PARAMS))
    monkeypatch.setenv("EVAL_TEST_KEY", "sk-eval-secret")
    with ChatServer(answer) as server:
        settings["engine"] = dict(name="openai", base_url=server.base_url, model="served-tiny", prompt_format="chat",
                                  api_key_env="EVAL_TEST_KEY")
        write_params(tmp_path, settings)
        monkeypatch.chdir(tmp_path)
        result = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--out", "r"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "r" / "math.json").read_text())
    lines = read_jsonl(tmp_path / "r" / "math.jsonl")
    assert summary["engine"] == "openai" and summary["n"] == 3 and summary["score"] == 2 / 3
    assert [l["correct"] for l in lines] == [True, True, False]
    assert len(server.requests) == 3 and {r["body"]["model"] for r in server.requests} == {"served-tiny"}
    assert all(r["headers"]["Authorization"] == "Bearer sk-eval-secret" for r in server.requests)
    assert "sk-eval-secret" not in (tmp_path / "r" / "math.jsonl").read_text() + result.output
    assert yaml.safe_load((tmp_path / "params.yaml").read_text())["engine"]["api_key_env"] == "EVAL_TEST_KEY"


def test_openai_engine_without_a_url_names_the_setting(tmp_path, tiny_llama, monkeypatch):
    from typer.testing import CliRunner

    from conftest import TINY_PARAMS, write_params
    from pipeline.cli.app import app

    settings = json.loads(json.dumps(TINY_PARAMS))
    settings["engine"] = dict(name="openai", model="m")
    write_params(tmp_path, settings)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math"])
    assert result.exit_code == 2 and "params.yaml: engine.base_url" in result.output


def test_openai_engine_hands_back_each_answer_as_it_arrives():
    """What moves the eval bar (and caches each row) for the openai and vllm engines."""
    from chat_server import ChatServer
    from pipeline.engines import GenRequest
    from clients import openai_client

    with ChatServer(lambda body: f"echo {body['messages'][-1]['content']}") as server:
        engine = openai_client(base_url=server.base_url, model="m", concurrency=3, retries=0)
        requests = [GenRequest(json.dumps([{"role": "user", "content": f"q{i}"}]), 4) for i in range(5)]
        seen = []
        completions = engine.generate(requests, on_done=lambda i, c: seen.append((i, c)))
    assert sorted(i for i, _ in seen) == list(range(5))
    assert all(completions[i] is c for i, c in seen)
    assert [c.text for c in completions] == [f"echo q{i}" for i in range(5)]


def test_a_request_the_engine_gave_up_on_stops_the_stage_and_is_asked_again(tmp_path, tiny_llama, monkeypatch):
    """An answer the server refused is not a wrong answer: eval stops with exit 2 and writes no results;
    the finished answers are cached, and the rerun asks only for the refused one."""
    from typer.testing import CliRunner

    from chat_server import ChatServer
    from conftest import TINY_PARAMS, write_params
    from pipeline.cli.app import app

    settings = json.loads(json.dumps(TINY_PARAMS))
    with ChatServer(lambda body: "The answer is 7.") as server:
        server.script = [("ok", "The answer is 7."), ("status", 400)]
        settings["engine"] = dict(name="openai", base_url=server.base_url, model="served-tiny", prompt_format="chat",
                                  concurrency=1, retries=0)
        write_params(tmp_path, settings)
        monkeypatch.chdir(tmp_path)
        failed = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--out", "r"])
        assert failed.exit_code == 2, failed.output
        assert "1 of 3 requests failed" in failed.output and "rerun the same command" in failed.output
        assert not (tmp_path / "r" / "math.jsonl").exists() and not (tmp_path / "r" / "math.json").exists()
        asked = len(server.requests)
        again = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--out", "r"])
    assert again.exit_code == 0, again.output
    assert len(server.requests) - asked == 1  # the two finished answers came from the cache
    assert len(read_jsonl(tmp_path / "r" / "math.jsonl")) == 3


class _FakeEngine:
    """A tiny in-process engine: renders chat turns as plain text and answers every GSM8K question it
    knows with its gold answer (the first two) or 7 (the rest)."""

    name = "fake"
    gold: dict = {}

    def __init__(self, model_dir, settings, **stage) -> None:
        self.model_dir, self.settings = model_dir, settings

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def generate(self, requests):
        from pipeline.engines import Completion

        out = []
        for request in requests:
            right = [q for q in self.gold if q in request.prompt]
            good = right and list(self.gold).index(right[0]) < 2
            out.append(Completion(f"The answer is {self.gold[right[0]]}." if good else "The answer is 7.", 5, 0.0))
        return out

    def close(self) -> None:
        pass


def test_an_engine_registered_alone_runs_quantize_eval(tmp_path, tiny_llama, monkeypatch):
    """Engines are asked through the registry (pipeline.engines.ENGINES): one registered alone, with its
    capability flags, is all `quantize eval --engine` and params.yaml's `engine.name` need (params validate
    engine names against the registry when they load, not when pipeline.settings.params is imported)."""
    import sys
    import types

    from typer.testing import CliRunner

    from conftest import TINY_PARAMS, write_params
    from pipeline import engines
    from pipeline.cli.app import app

    for line in (REPO / "evals" / "math" / "gsm8k_test.jsonl").read_text().splitlines()[:3]:
        row = json.loads(line)
        _FakeEngine.gold[row["question"]] = row["answer"].split("####")[-1].strip()
    module = types.ModuleType("fake_engine_for_test")
    module.FakeEngine = _FakeEngine
    monkeypatch.setitem(sys.modules, "fake_engine_for_test", module)
    class FakeSettings(engines.EngineSettings):  # its section: the shared settings (batch_size)
        name: str = "fake"

    monkeypatch.setattr(engines, "ENGINES", {"fake": engines.EngineSpec(
        "fake", FakeSettings, "fake_engine_for_test:FakeEngine", "a test's in-process engine", "in-process")})
    write_params(tmp_path, {**TINY_PARAMS, "engine": {"batch_size": 8}})  # no name: the default, not registered here
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--engine", "fake", "--out", "r"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "r" / "math.json").read_text())
    assert summary["engine"] == "fake" and summary["n"] == 3 and summary["score"] == 2 / 3
    assert engines.STARTS[-1]["engine"] == "fake"

    # params.yaml naming it: accepted, and the engine eval runs; a name no longer registered: refused
    write_params(tmp_path, {**TINY_PARAMS, "engine": {"name": "fake", "batch_size": 8}})
    result = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--out", "r2"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r2" / "math.json").read_text())["engine"] == "fake"
    write_params(tmp_path, {**TINY_PARAMS, "engine": {**TINY_PARAMS["engine"], "name": "hf"}})
    result = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--out", "r3"])
    assert result.exit_code == 2 and "engine.name: 'hf' is not allowed; input should be 'fake'" in result.output


def test_a_model_is_evaluated_on_every_suite_in_one_process_and_only_a_changed_suite_is_scored_again(
        tmp_path, tiny_llama, monkeypatch):
    """`quantize eval MODEL` (the evaluate stage, one per model): every suite of params.yaml, one engine; a suite
    params.yaml runs on other models only is recorded as not run, naming the key; a rerun keeps every suite
    whose inputs did not change byte for byte (not even rewritten), and after one suite's setting changes only
    that suite is scored again."""
    import shutil

    from typer.testing import CliRunner

    from conftest import TINY_PARAMS, write_params
    from pipeline import engines
    from pipeline.cli.app import app

    for name in ("base", "awq-w4a16"):
        shutil.copytree(tiny_llama, tmp_path / "models" / name)
    suites = {"math": {"task": "quant_gsm8k", "limit": 2, "max_new_tokens": 4, "models": ["base"]},
              "ppl-book": {"task": "quant_ppl_book", "limit": 2}, "ppl-math": {"task": "quant_ppl_gsm8k", "limit": 2}}
    settings = {**TINY_PARAMS, "suites": suites}
    write_params(tmp_path, settings)
    monkeypatch.chdir(tmp_path)
    results = tmp_path / "results"

    first = CliRunner().invoke(app, ["eval", "models/base"])
    assert first.exit_code == 0, first.output
    assert "eval: base: 3 suites (3 scored) in" in first.output
    assert [s["engine"] for s in engines.STARTS[-1:]] == ["hf"] and len(read_jsonl(results / "base" / "math.jsonl")) == 2
    variant = CliRunner().invoke(app, ["eval", "models/awq-w4a16"])
    assert variant.exit_code == 0, variant.output
    skipped = json.loads((results / "awq-w4a16" / "math.json").read_text())
    assert skipped["status"] == "not run" and "suites.math.models lists base" in skipped["reason"]
    assert (results / "awq-w4a16" / "math.jsonl").read_text() == "\n"  # no item; not empty, which DVC warns about

    files = sorted((results / "base").glob("*.json*"))
    before = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in files}
    starts = len(engines.STARTS)
    again = CliRunner().invoke(app, ["eval", "models/base"])
    assert again.exit_code == 0 and "3 suites (3 kept)" in again.output, again.output
    assert {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in files} == before
    assert len(engines.STARTS) == starts  # nothing to score: no engine made

    write_params(tmp_path, {**settings, "suites": {**suites, "ppl-book": {**suites["ppl-book"], "limit": 3}}})
    changed = CliRunner().invoke(app, ["eval", "models/base"])
    assert changed.exit_code == 0 and "3 suites (1 scored, 2 kept)" in changed.output, changed.output
    for path in files:
        same = (path.read_bytes(), path.stat().st_mtime_ns) == before[path]
        assert same == (not path.name.startswith("ppl-book")), path
    assert len(read_jsonl(results / "base" / "ppl-book.jsonl")) == 3


def test_a_suite_whose_items_are_all_cached_starts_no_server(tmp_path, tiny_llama, monkeypatch):
    """The vLLM engine starts (or attaches to) its server when the first request goes out: a suite scored
    again from its resume cache (here: after an engine setting changed) needs none, even one that could not
    start any more."""
    from typer.testing import CliRunner

    from conftest import TINY_PARAMS, write_params
    from pipeline.cli.app import app

    server = [sys.executable, str(REPO / "tests" / "openai_server.py")]
    engine = {"name": "vllm", "server_command": server, "batch_size": 4, "share_server": False}
    write_params(tmp_path, {**TINY_PARAMS, "engine": engine})
    monkeypatch.chdir(tmp_path)
    first = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "ppl-book", "--out", "r"])
    assert first.exit_code == 0, first.output
    assert json.loads((tmp_path / "r" / "ppl-book.json").read_text())["engine_start_s"] > 0.2  # a server start
    write_params(tmp_path, {**TINY_PARAMS, "engine": {**engine, "server_args": ["--fail-start"]}})
    again = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "ppl-book", "--out", "r"])
    assert again.exit_code == 0, again.output
    summary = json.loads((tmp_path / "r" / "ppl-book.json").read_text())
    # no server: one that could not start any more did not fail the run; what is left of engine_start_s is making
    # the engine object (its tokenizer: milliseconds, 0.01 s once on a loaded machine), far below a server start
    assert summary["engine_start_s"] < 0.2 and not summary.get("kept") and summary["n"] == 2


def test_eval_engine_hf_runs_on_a_params_yaml_written_for_vllm(tmp_path, tiny_llama, monkeypatch):
    """`quantize eval --engine hf` on a params.yaml whose `engine` is vllm's section: the settings both engines take
    and the file gives (batch_size, dtype) carried over, vllm's own (server_command, kv_cache_dtype, ...) ignored,
    with no error (pipeline/engines/__init__.py: settings_for)."""
    from typer.testing import CliRunner

    from conftest import TINY_PARAMS, write_params
    from pipeline import engines
    from pipeline.cli.app import app

    made = []
    real = engines.make_engine
    monkeypatch.setattr(engines, "make_engine", lambda name, model_dir, settings=None, **stage: made.append(
        settings) or real(name, model_dir, settings, **stage))
    engine = {"name": "vllm", "batch_size": 3, "dtype": "float32", "server_command": ["no-such-vllm-binary"],
              "kv_cache_dtype": "fp8", "tensor_parallel_size": 2, "timeout": 1800}
    write_params(tmp_path, {**TINY_PARAMS, "engine": engine})
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--engine", "hf", "--limit", "1",
                                      "--out", "r"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r" / "math.json").read_text())["engine"] == "hf"
    [settings] = made
    assert settings.model_dump() == {"name": "hf", "batch_size": 3, "max_batch_tokens": 65536, "dtype": "float32",
                                     "threads": 0}


def test_a_suite_scored_again_in_another_dtype_computes_its_own_scores(tmp_path, tiny_llama):
    """The resume cache is keyed by the checkpoint and the engine's answering settings: after a run in float32, a run
    in bfloat16 scores every document itself (the cache had served it the float32 scores under a bfloat16 label),
    and a rerun in float32 finds its own scores again."""
    def run(dtype):
        evaluate.run(tiny_llama, suite="ppl-book", task="quant_ppl_book", variant="base", out_dir=tmp_path, limit=2,
                     dtype=dtype)
        return [l["loglikelihood"] for l in read_jsonl(tmp_path / "ppl-book.jsonl")]

    fp32 = run("float32")
    bf16 = run("bfloat16")
    assert all(a != b for a, b in zip(fp32, bf16)), (fp32, bf16)
    assert run("float32") == fp32
