"""The openai engine and the judge check that the server serves the model asked for (issue 70.3): its /v1/models
before the first request, the `model` of every reply. A server of another model stops the stage with one message
naming both (exit 2), never scored as the model asked for. Real local servers: tests/openai_server.py (a tiny model
behind vLLM's API) and tests/chat_server.py (a chat server whose replies a test edits)."""

import json

import pytest

from chat_server import ChatServer
from clients import openai_client
from conftest import TINY_PARAMS, read_jsonl, write_params
from openai_server import CompletionsServer
from pipeline.engines import GenRequest
from pipeline.engines.served_model import WrongModel

IMPOSTOR = "Qwen2.5-72B-Instruct-NOT-THE-ONE-ASKED-FOR"


@pytest.fixture(scope="module")
def server(tiny_llama):
    with CompletionsServer(str(tiny_llama), "served") as running:
        yield running


def test_a_server_that_lists_another_model_is_refused_before_any_request(server, tiny_llama):
    client = openai_client(tiny_llama, base_url=server.base_url, model="glm-4-9b", prompt_format="text", retries=0,
                           params_section="engine")
    asked = len(server.requests) if hasattr(server, "requests") else None
    with pytest.raises(WrongModel) as refused:
        client.generate([GenRequest("Where is my order?", 4)])
    message = str(refused.value)
    assert f"{server.base_url} serves 'served' (its /v1/models), not the model asked for, 'glm-4-9b' (engine.model)" \
        in message
    if asked is not None:
        assert len(server.requests) == asked  # nothing was asked of it


@pytest.mark.parametrize("prompt_format", ["tokens", "text"])
def test_a_reply_naming_another_model_stops_the_call(server, tiny_llama, prompt_format):
    client = openai_client(tiny_llama, base_url=server.base_url, model="served", prompt_format=prompt_format,
                           retries=2, backoff=0.001, concurrency=1, params_section="engine")
    server.edits[:] = [lambda reply: {**reply, "model": IMPOSTOR}]
    try:
        with pytest.raises(WrongModel) as refused:
            client.generate([GenRequest("Where is my order?", 4), GenRequest("Name a colour.", 4)])
    finally:
        server.edits.clear()
    assert f"answered as the model '{IMPOSTOR}', not the model asked for, 'served' (engine.model)" in str(refused.value)


def test_a_dated_snapshot_of_the_model_asked_for_is_the_same_model(server, tiny_llama):
    client = openai_client(tiny_llama, base_url=server.base_url, model="served", prompt_format="text", retries=0,
                           params_section="engine")
    server.edits[:] = [lambda reply: {**reply, "model": "served-2024-08-06"}]
    try:
        [answer] = client.generate([GenRequest("Where is my order?", 4)])
    finally:
        server.edits.clear()
    assert answer.error is None


def prefers_longer(body: dict) -> str:
    return "Reasoning. [[B]]"


@pytest.mark.parametrize("how", ["its /v1/models", "its replies"])
def test_quantize_judge_against_a_server_of_another_model_exits_2_naming_both(tmp_path, tiny_llama, tiny_calib,
                                                                               monkeypatch, how):
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    with ChatServer(prefers_longer) as server:
        if how == "its /v1/models":
            server.served = IMPOSTOR
        else:  # no /v1/models to read: the first reply names the other model
            server.script = [("edit", lambda body: {**body, "model": IMPOSTOR})]
        write_params(tmp_path, {**TINY_PARAMS, "judge": {
            "backend": "openai", "model": "test-judge", "base_url": server.base_url, "retries": 2, "backoff": 0.01,
            "concurrency": 1, "control": False, "limit": 2, "max_new_tokens": 6, "judge_max_new_tokens": 8}})
        monkeypatch.chdir(tmp_path)
        result = CliRunner().invoke(app, ["judge", str(tiny_llama), "--base", str(tiny_llama), "--prompts",
                                          str(tiny_calib / "holdout.jsonl"), "--out", "out"])
        asked = len([r for r in server.requests if r["path"].endswith("/chat/completions")])
    assert result.exit_code == 2, result.output
    assert f"'{IMPOSTOR}'" in result.output and "'test-judge' (judge.model)" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out" / "judge.json").exists()
    assert asked == (0 if how == "its /v1/models" else 1)  # stopped at once, not retried, no other request
    judgments = tmp_path / "out" / ".cache" / "judgments.jsonl"
    assert not judgments.exists() or not read_jsonl(judgments)  # no verdict of the other model kept for a rerun


def test_quantize_eval_against_a_server_of_another_model_exits_2(tmp_path, tiny_llama, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    settings = json.loads(json.dumps(TINY_PARAMS))
    with ChatServer(lambda body: "The answer is 7.") as server:
        server.served = IMPOSTOR
        settings["engine"] = dict(name="openai", base_url=server.base_url, model="served-tiny", prompt_format="chat")
        write_params(tmp_path, settings)
        monkeypatch.chdir(tmp_path)
        result = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--out", "r"])
    assert result.exit_code == 2, result.output
    assert f"serves '{IMPOSTOR}' (its /v1/models), not the model asked for, 'served-tiny' (engine.model)" \
        in " ".join(result.output.split())
    assert not (tmp_path / "r" / "math.json").exists()


def test_quantize_bench_against_a_server_answering_as_another_model_exits_2(server, tmp_path, tiny_llama, monkeypatch):
    """bench's streamed chunks are checked as every other reply is: timings of another model are not this one's."""
    from typer.testing import CliRunner

    from pipeline.cli.app import app
    from test_bench import write_holdout

    settings = json.loads(json.dumps(TINY_PARAMS))
    settings["engine"] = dict(name="openai", base_url=server.base_url, model="served", prompt_format="tokens")
    write_params(tmp_path, settings)
    holdout = write_holdout(tmp_path / "holdout.jsonl")
    monkeypatch.chdir(tmp_path)
    server.edits[:] = [lambda event: {**event, "model": IMPOSTOR}]
    try:
        result = CliRunner().invoke(app, ["bench", str(tiny_llama), "--concurrency", "1", "--input-len", "16",
                                          "--output-len", "4", "--holdout", str(holdout), "--out", "r/bench.json"])
    finally:
        server.edits.clear()
    assert result.exit_code == 2, result.output
    assert f"answered as the model '{IMPOSTOR}', not the model asked for, 'served'" in " ".join(result.output.split())
    assert not (tmp_path / "r" / "bench.json").exists()


@pytest.mark.parametrize("kind", ["one of k samples, with its seed", "thinking, its reasoning apart"])
def test_every_kind_of_request_checks_the_model_its_reply_names(server, tiny_llama, kind):
    """The request paths added since the check (issue 66: k samples with seeds, answers with thinking and a
    `reasoning` field) go through the same call: the right model's reply is read, another model's stops the call."""
    from pipeline.engines.base import Sampling

    if kind.startswith("one of k"):
        request = GenRequest("Where is my order?", 4, seed=7, sampling=Sampling(0.6, 0.95, 20))
    else:
        request = GenRequest("Where is my order?", 4, thinking=True)

    def named(model):
        def edit(reply):
            choice = reply["choices"][0]
            if request.thinking:  # a reasoning parser's reply: the reasoning apart from the answer
                choice = {**choice, "reasoning_content": "The user asks about an order.", "text": "It ships today."}
            return {**reply, "model": model, "choices": [choice]}
        return edit
    client = openai_client(tiny_llama, base_url=server.base_url, model="served", prompt_format="text", retries=2,
                           backoff=0.001, concurrency=1, params_section="engine")
    server.edits[:] = [named("served")]
    try:
        [answer] = client.generate([request])
        assert answer.error is None
        sent = server.requests[-1]["body"]
        assert sent.get("seed") == 7 if request.seed else True
        server.edits[:] = [named(IMPOSTOR)] * 3
        with pytest.raises(WrongModel) as refused:
            client.generate([request])
    finally:
        server.edits.clear()
    assert f"answered as the model '{IMPOSTOR}', not the model asked for, 'served' (engine.model)" in str(refused.value)


def test_a_judge_reply_with_its_reasoning_from_another_model_exits_2(tmp_path, tiny_llama, tiny_calib, monkeypatch):
    """A reasoning judge's reply (its `reasoning` apart, as vLLM's reasoning parser gives it) naming another model
    stops the stage as a plain reply does."""
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    with ChatServer(prefers_longer) as server:
        server.script = [("edit", lambda body: {**body, "model": IMPOSTOR, "choices": [{
            **body["choices"][0], "message": {**body["choices"][0]["message"], "reasoning": "Both answer."}}]})]
        write_params(tmp_path, {**TINY_PARAMS, "judge": {
            "backend": "openai", "model": "test-judge", "base_url": server.base_url, "retries": 2, "backoff": 0.01,
            "concurrency": 1, "control": False, "limit": 2, "max_new_tokens": 6, "judge_max_new_tokens": 8}})
        monkeypatch.chdir(tmp_path)
        result = CliRunner().invoke(app, ["judge", str(tiny_llama), "--base", str(tiny_llama), "--prompts",
                                          str(tiny_calib / "holdout.jsonl"), "--out", "out"])
        bodies = [r["body"] for r in server.requests if r["path"].endswith("/chat/completions")]
    assert result.exit_code == 2, result.output
    assert f"answered as the model '{IMPOSTOR}'" in " ".join(result.output.split())
    assert len(bodies) == 1  # stopped at the first reply, not retried
    assert not (tmp_path / "out" / "judge.json").exists()
