"""Replies that break the OpenAI API, sent on purpose by a real local server (tests/openai_server.py, backed
by the tiny model): vLLM's token-id answers, its prompt log-probabilities and the chunks `quantize bench`
streams. Each bad reply is that one request's failure, asked again first, with the field named; never an
exception out of the engine (issue 37). The judge's side is in tests/test_judge.py."""

import json

import pytest

from openai_server import CompletionsServer
from pipeline.engines import GenRequest, replies
from clients import openai_client
from pipeline.errors import UserError


@pytest.fixture(scope="module")
def server(tiny_llama):
    with CompletionsServer(str(tiny_llama), "served") as running:
        yield running


@pytest.fixture()
def vllm_client(server, tiny_llama):
    """The client VLLMEngine talks to its server with (token ids both ways), one request at a time."""
    server.edits.clear()
    yield openai_client(tiny_llama, base_url=server.base_url, model="served", prompt_format="tokens", retries=1,
                       backoff=0.001, concurrency=1, params_section="engine",
                       extra_body={"return_token_ids": True, "skip_special_tokens": False})
    server.edits.clear()


def in_choice(**fields):
    return lambda reply: {**reply, "choices": [{**reply["choices"][0], **fields}]}


def in_usage(value):
    return lambda reply: {**reply, "usage": value}


NAN, INF = float("nan"), float("inf")
BAD_COMPLETIONS = [  # (case, edit of a good reply, the field the error names)
    ("token id as text", in_choice(token_ids=["12"]), "choices[0].token_ids[0]: expected a whole number from 0 to"),
    ("negative token id", in_choice(token_ids=[5, -1]), "choices[0].token_ids[1]"),
    ("token id past the vocabulary", in_choice(token_ids=[10 ** 9]), "choices[0].token_ids[0]"),
    ("token id as true", in_choice(token_ids=[True]), "found true"),
    ("token ids as text", in_choice(token_ids="1,2"), "choices[0].token_ids: expected an array of token ids"),
    ("more token ids than asked", in_choice(token_ids=[5] * 9), "(at most 4), found an array of 9"),
    ("text null", in_choice(text=None), "choices[0].text: expected text, found null"),
    ("finish_reason a number", in_choice(finish_reason=7), "choices[0].finish_reason"),
    ("choices an object", lambda reply: {**reply, "choices": {"0": reply["choices"][0]}}, "choices: expected a non-empty"),
    ("choices empty", lambda reply: {**reply, "choices": []}, "choices: expected a non-empty array"),
    ("a choice that is text", lambda reply: {**reply, "choices": ["hello"]}, "choices[0]: expected an object"),
    ("usage a string", in_usage("4 tokens"), "usage: expected an object, found text '4 tokens'"),
    ("usage a list", in_usage([4]), "usage: expected an object"),
    ("count as text", in_usage({"completion_tokens": "4"}), "usage.completion_tokens: expected a whole number from 0 to 4"),
    ("count NaN", in_usage({"completion_tokens": NAN}), "found the number nan"),
    ("count Infinity", in_usage({"completion_tokens": INF}), "found the number inf"),
    ("count negative", in_usage({"completion_tokens": -1}), "found the number -1"),
    ("count a fraction", in_usage({"completion_tokens": 2.5}), "found the number 2.5"),
    ("count past max_tokens", in_usage({"completion_tokens": 10 ** 6}), "found the number 1000000"),
]


@pytest.mark.parametrize("case, edit, named", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_a_bad_completion_is_retried_then_fails_that_request_alone(server, vllm_client, tiny_llama, case, edit, named):
    requests = [GenRequest("Where is my order?", 4), GenRequest("Name a colour.", 4)]
    expected = vllm_client.generate(requests)  # the good answers, unedited
    assert not any(c.error for c in expected)
    server.edits[:] = [edit, edit]  # both attempts of the first request (retries=1); the second is left alone
    first, second = vllm_client.generate(requests)
    assert first.error and "gave up after 2 attempts: malformed reply: " in first.error and named in first.error
    assert first.text == "" and second.error is None and second.text == expected[1].text
    server.edits[:] = [edit]  # once only: the retry gets the good answer
    [again] = vllm_client.generate(requests[:1])
    assert again.error is None and again.text == expected[0].text


def test_a_lone_surrogate_in_answer_text_is_replaced_and_counted(server, tiny_llama):
    client = openai_client(tiny_llama, base_url=server.base_url, model="served", prompt_format="text", retries=0)
    server.edits[:] = [in_choice(text="ok \ud83d then \udc00 end")]
    [completion] = client.generate([GenRequest("hi", 4)])
    assert completion.error is None and completion.replaced == 2
    assert completion.text == "ok \ufffd then \ufffd end"
    completion.text.encode("utf-8")  # writable


def test_usage_is_what_a_text_answer_counts(server, tiny_llama):
    client = openai_client(tiny_llama, base_url=server.base_url, model="served", prompt_format="text", retries=0)
    server.edits[:] = [in_usage({"completion_tokens": 3, "prompt_tokens": "ignored"})]
    [completion] = client.generate([GenRequest("hi", 4)])
    assert completion.error is None and completion.n_tokens == 3


# ---------------------------------------------------------------- prompt log-probabilities (likelihood suites)

def in_last_entry(**fields):
    """Changes the scored token's entry at the last prompt position."""
    def edit(reply):
        positions = json.loads(json.dumps(reply["choices"][0]["prompt_logprobs"]))
        token = next(iter(positions[-1]))
        positions[-1][token].update(fields)
        return in_choice(prompt_logprobs=positions)(reply)
    return edit


def without_last_entry(reply):
    positions = reply["choices"][0]["prompt_logprobs"]
    return in_choice(prompt_logprobs=positions[:-1] + [{"0": {"logprob": -1.0, "rank": 1}}])(reply)


BAD_LOGPROBS = [
    ("logprob NaN", in_last_entry(logprob=NAN), ".logprob: expected a log-probability (a finite number <= 0), found the number nan"),
    ("logprob Infinity", in_last_entry(logprob=-INF), "found the number -inf"),
    ("logprob above 0", in_last_entry(logprob=0.5), "found the number 0.5"),
    ("logprob as text", in_last_entry(logprob="-1.5"), "found text '-1.5'"),
    ("rank 0", in_last_entry(rank=0), ".rank: expected a whole number >= 1, found the number 0"),
    ("the scored token missing", without_last_entry, "']: expected an object, found null"),
    ("one entry short", lambda reply: in_choice(prompt_logprobs=reply["choices"][0]["prompt_logprobs"][:-1])(reply),
     "choices[0].prompt_logprobs: expected an array of"),
]


@pytest.mark.parametrize("case, edit, named", BAD_LOGPROBS, ids=[c[0] for c in BAD_LOGPROBS])
def test_bad_prompt_logprobs_are_retried_then_stop_the_likelihood_suite(server, vllm_client, case, edit, named):
    from pipeline.engines.vllm import prompt_logprobs

    pairs = [([1, 40, 41, 42], [43, 44])]
    [good] = prompt_logprobs(vllm_client, pairs)
    server.edits[:] = [edit]  # once: the retry is scored as if nothing happened
    assert prompt_logprobs(vllm_client, pairs) == [good]
    server.edits[:] = [edit, edit]
    with pytest.raises(UserError) as info:  # a likelihood without an answer cannot be scored: the stage stops
        prompt_logprobs(vllm_client, pairs)
    assert "prompt_logprobs failed: gave up after 2 attempts: malformed reply: choices[0].prompt_logprobs" in str(info.value)
    assert named in str(info.value)


def test_no_prompt_logprobs_at_all_says_the_server_may_be_too_old(server, vllm_client):
    from pipeline.engines.vllm import prompt_logprobs

    server.edits[:] = [in_choice(prompt_logprobs=None)]
    with pytest.raises(UserError, match="no prompt_logprobs in its answer; it may be too old"):
        prompt_logprobs(vllm_client, [([1, 40], [41])])


# ---------------------------------------------------------------- bench's streamed chunks

def on_choices(**fields):
    return lambda event: {**event, "choices": [{**c, **fields} for c in event["choices"]]}


BAD_CHUNKS = [
    ("an event that is an array", lambda event: [event], "malformed event"),
    ("choices an object", lambda event: {**event, "choices": {"0": {}}}, "choices: expected an array"),
    ("a choice that is a number", lambda event: {**event, "choices": [7]}, "choices[0]: expected an object"),
    ("token ids as text", on_choices(token_ids="5"), "choices[0].token_ids: expected an array of token ids"),
    ("a token id as text", on_choices(token_ids=["5"]), "choices[0].token_ids[0]: expected a whole number"),
    ("text a number", on_choices(text=5), "choices[0].text: expected text, found the number 5"),
    ("more tokens than asked", on_choices(token_ids=[5, 5]), "choices[0].token_ids: expected 4 tokens in all"),
    ("usage a string", lambda event: {**event, "usage": "4"}, "usage: expected an object, found text '4'"),
    ("usage count NaN", lambda event: {**event, "usage": {"completion_tokens": NAN}}, "found the number nan"),
    ("an error holding a lone surrogate", lambda event: {"error": "overloaded \ud800"}, "overloaded \ufffd"),
]


@pytest.mark.parametrize("case, edit, named", BAD_CHUNKS, ids=[c[0] for c in BAD_CHUNKS])
def test_a_bad_streamed_chunk_fails_that_timed_request_alone(server, vllm_client, tiny_llama, case, edit, named):
    from pipeline.stages.bench import HttpTiming

    timer = HttpTiming(vllm_client, vllm_extras=True)
    prompt = vllm_client.encode("Where is my order?")
    server.edits[:] = [edit]  # the first request's every event
    bad, good = timer.timed_generate([prompt, prompt], [4, 4], 1)
    assert bad.error and named in bad.error and bad.n_tokens == 0
    bad.error.encode("utf-8")
    assert good.error is None and good.n_tokens == 4 and len(good.itl) == 3


def test_every_timed_request_to_vllm_carries_a_cache_salt_of_its_own(server, vllm_client):
    """bench sends the same prompts at every level: a salt per request keeps vLLM's prefix cache from serving a later
    level the KV blocks of an earlier one (the first block's hash includes the salt)."""
    from pipeline.stages.bench import HttpTiming

    prompt = vllm_client.encode("Where is my order?")
    sent = len(server.requests)
    for _ in range(2):  # two levels of the same two prompts
        assert all(t.error is None for t in HttpTiming(vllm_client, vllm_extras=True).timed_generate([prompt] * 2, [2, 2], 2))
    salts = [r["body"].get("cache_salt") for r in server.requests[sent:]]
    assert len(salts) == 4 and all(isinstance(s, str) and s for s in salts) and len(set(salts)) == 4


def test_an_openai_engine_streams_for_bench_and_counts_by_usage(server, tiny_llama):
    """`quantize bench --engine openai` times a server it did not start: tokens counted from the reply's usage."""
    from pipeline.stages.bench import HttpTiming

    client = openai_client(tiny_llama, base_url=server.base_url, model="served", prompt_format="tokens", retries=0)
    timer = HttpTiming(client, vllm_extras=False)
    sent = len(server.requests)
    [timing] = timer.timed_generate([client.encode("Name a colour.")], [3], 1)
    assert timing.error is None and 1 <= timing.n_tokens <= 3
    assert "cache_salt" not in server.requests[sent]["body"]  # vLLM's field: not sent to a server of unknown make


# ---------------------------------------------------------------- the checks themselves

def test_counts_and_token_ids_accept_numpy_integers_and_nothing_looser():
    import numpy as np

    assert replies.token_ids([np.int64(3), 4], "token_ids", 10) == [3, 4]  # lmdeploy's in-process ids
    for bad in ([10], [3.0], [None]):
        with pytest.raises(replies.BadReply):
            replies.token_ids(bad, "token_ids", 10)
    assert replies.version("0.11.0") == "0.11.0"
    assert replies.version("x" * 500) is None and replies.version({"v": 1}) is None and replies.version("a\x00b") is None
