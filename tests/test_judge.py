import json
import logging
import re
import time

import pytest

from chat_server import ChatServer
from conftest import read_jsonl
from pipeline.stages import judge
from pipeline.verdict import intervals, judge as judge_rule
from pipeline.judge import client, prompts, scoring
from pipeline.engines import GenRequest
from clients import openai_client
from pipeline.errors import UserError
from pipeline.settings.params import JudgeParams

FAKE_KEY = "sk-test-NEVER-LEAK-7f3a9c2e81d4"


# ---------------------------------------------------------------- parsing and scoring

@pytest.mark.parametrize("text, verdict", [
    ("A is more precise. [[A]]", "A"),
    ("[[B]]", "B"),
    ("Equally good.\n[[C]]", "C"),
    ("Final verdict: [[A]] ... again [[A]]", "A"),  # the same verdict repeated is still one verdict
    ("[[A]] or maybe [[B]]", None),  # two different verdicts
    ("[A]", None), ("[[a]]", None), ("[[D]]", None), ("A is better", None), ("", None),
    ("[[ A ]]", None), ("Rating: [[4]]", None),
])
def test_verdict_parsing_is_strict(text, verdict):
    assert scoring.parse_verdict(text) == verdict


@pytest.mark.parametrize("text, grade", [
    ("Rating: [[4]]", 4), ("[[1]]", 1), ("[[5]] [[5]]", 5),
    ("[[0]]", None), ("[[6]]", None), ("Rating: 4", None), ("[[3]] then [[4]]", None), ("[[A]]", None),
])
def test_grade_parsing_is_strict(text, grade):
    assert scoring.parse_grade(text) == grade


def test_orders_map_to_the_variants_side_and_disagreement_is_a_tie():
    # base-first: the variant is B; variant-first: the variant is A
    assert scoring.order_outcome("B", variant_is_a=False) == "win"
    assert scoring.order_outcome("A", variant_is_a=False) == "loss"
    assert scoring.order_outcome("A", variant_is_a=True) == "win"
    assert scoring.order_outcome("C", variant_is_a=True) == "tie"
    assert scoring.order_outcome(None, variant_is_a=True) is None
    assert scoring.combine("win", "win") == ("win", True)
    assert scoring.combine("win", "loss") == ("tie", False)  # position bias: always picks the same slot
    assert scoring.combine("tie", "win") == ("tie", False)
    assert scoring.combine("win", None) == ("unjudged", None)


def test_win_rate_counts_ties_as_half_and_brackets_it():
    outcomes = ["win"] * 30 + ["tie"] * 20 + ["loss"] * 10 + ["unjudged"] * 5
    s = judge_rule.win_rate(outcomes)
    assert (s["n"], s["wins"], s["ties"], s["losses"], s["unjudged"]) == (60, 30, 20, 10, 5)
    assert s["win_rate"] == pytest.approx((30 + 10) / 60)
    assert s["ci_low"] < s["win_rate"] < s["ci_high"]
    assert 0.55 < s["ci_low"] and s["ci_high"] < 0.78  # SE of the mean is about 0.05 here
    # the interval is Tango's on wins against losses, mapped onto the win-rate scale
    low, high = intervals.tango_interval(30, 10, 60)
    assert (s["ci_low"], s["ci_high"]) == pytest.approx((0.5 + low / 2, 0.5 + high / 2))
    assert judge_rule.win_rate(["unjudged"])["win_rate"] is None


def test_four_ties_are_not_evidence_and_the_sentence_says_how_many_pairs_a_go_needs():
    s = {**judge_rule.win_rate(["tie"] * 4), "mode": "pairwise", "consistency": 1.0, "confidence": 0.95}
    assert s["ci_low"] < 0.2 and s["ci_high"] > 0.8  # a bootstrap gave [0.5, 0.5] here
    decision = judge_rule.decide_judge(s, 0.05, 0.6)
    assert decision == "INCONCLUSIVE" and judge_rule.min_judged_pairs_for_go(0.05) == 53
    sentence = judge_rule.judge_sentence(s, decision, 0.05, 0.6)
    assert sentence.startswith("judge: INCONCLUSIVE: of 4 judged pairs the judge preferred the variant in 0")
    assert "[15.0%, 85.0%]" in sentence and "45.0% (50% - margin 5.0%)" in sentence
    assert "below 53 judged pairs not even all ties could show a GO" in sentence
    assert any("a GO needs at least 53 judged pairs" in r for r in judge_rule.explain_judge(s, decision, 0.05, 0.6))


def test_decision_against_half_minus_margin_and_unreliable_judge():
    base = {"mode": "pairwise", "n": 50, "consistency": 0.9}
    assert judge_rule.decide_judge({**base, "ci_low": 0.47, "ci_high": 0.6}, 0.05, 0.6) == "GO"
    assert judge_rule.decide_judge({**base, "ci_low": 0.3, "ci_high": 0.44}, 0.05, 0.6) == "NO-GO"
    assert judge_rule.decide_judge({**base, "ci_low": 0.40, "ci_high": 0.55}, 0.05, 0.6) == "INCONCLUSIVE"
    low_consistency = {**base, "consistency": 0.5, "ci_low": 0.47, "ci_high": 0.6}
    assert judge_rule.decide_judge(low_consistency, 0.05, 0.6) == "UNRELIABLE"
    reasons = judge_rule.explain_judge(low_consistency, "UNRELIABLE", 0.05, 0.6)
    assert "unreliable" in reasons[0] and "50.0%" in reasons[0]
    assert judge_rule.decide_judge({**base, "n": 0}, 0.05, 0.6) == "INCONCLUSIVE"


def test_length_bias_is_the_correlation_with_length_difference():
    from scipy.stats import pearsonr

    assert judge_rule.correlation([10, 20, 30, 40], [0, 0.5, 0.5, 1]) == pytest.approx(pearsonr([10, 20, 30, 40], [0, 0.5, 0.5, 1])[0])
    assert judge_rule.correlation([1, 1, 1], [0, 1, 0.5]) is None


def test_answers_with_braces_do_not_break_the_prompt():
    filled = prompts.render("Q {question} A {answer_a} B {answer_b}", question="q", answer_a="{answer_b}", answer_b="x")
    assert filled == "Q q A {answer_b} B x"


# ---------------------------------------------------------------- the judge over HTTP, faults injected

def prefers_longer(body: dict) -> str:
    """A deterministic judge: the longer answer wins, equal lengths tie."""
    text = body["messages"][0]["content"]
    a = re.search(r"Assistant A's Answer\]\n(.*?)\n\[The End", text, re.S).group(1)
    b = re.search(r"Assistant B's Answer\]\n(.*?)\n\[The End", text, re.S).group(1)
    return "Reasoning. " + ("[[A]]" if len(a) > len(b) else "[[B]]" if len(b) > len(a) else "[[C]]")


def make_judge(server, tmp_path, retries=2, timeout=0.5, concurrency=1, mode="pairwise"):
    engine_options = dict(base_url=server.base_url, model="test-judge", concurrency=concurrency, timeout=timeout,
                          retries=retries, backoff=0.01, retry_on_length=True)
    return client.Judge(lambda: openai_client(**engine_options), "test", client.JudgmentCache(tmp_path / "cache.jsonl"),
                       mode=mode, max_new_tokens=64)


def one_pair(j, base="short", variant="a longer answer"):
    return judge.judge_pairwise(j, [{"id": "p1", "messages": [{"role": "user", "content": "Where is my order?"}],
                                     "prompt": "Where is my order?"}], [base], [variant], control=False)


@pytest.mark.parametrize("fault", [
    ("sleep", 2.0), ("status", 500), ("status", 503), ("429", 0), ("malformed", None), ("length", "cut off [[A"),
])
def test_each_fault_is_retried_then_succeeds(tmp_path, fault):
    with ChatServer(prefers_longer) as server:
        server.script = [fault]
        lines, summary = one_pair(make_judge(server, tmp_path))
    assert len(server.requests) == 3  # the faulty one, its retry, then the other order
    assert lines[0]["outcome"] == "win" and summary["unjudged"] == 0 and summary["consistency"] == 1.0


def test_429_waits_as_long_as_retry_after_says(tmp_path):
    with ChatServer(prefers_longer) as server:
        server.script = [("429", 1)]
        one_pair(make_judge(server, tmp_path))
    assert server.requests[1]["time"] - server.requests[0]["time"] >= 0.95


@pytest.mark.parametrize("fault", [("sleep", 2.0), ("status", 503), ("malformed", None), ("length", "[[A")])
def test_persistent_fault_leaves_the_item_unjudged_and_uncached(tmp_path, fault):
    with ChatServer(prefers_longer) as server:
        server.script = [fault] * 3  # every attempt of the first order fails (retries=2)
        lines, summary = one_pair(make_judge(server, tmp_path))
        assert lines[0]["outcome"] == "unjudged" and lines[0]["unjudged_reason"] == "request failed"
        assert "gave up after 3 attempts" in lines[0]["judgments"][0]["error"]
        assert summary["unjudged"] == 1 and summary["n"] == 0 and summary["win_rate"] is None
        # the next run asks again for the failed order only: the good one came from the cache
        server.requests.clear()
        lines, _ = one_pair(make_judge(server, tmp_path))
        assert len(server.requests) == 1 and lines[0]["outcome"] == "win"


def with_usage(value):
    return ("edit", lambda body: {**body, "usage": value})


def with_message(value):
    return ("edit", lambda body: {**body, "choices": [{**body["choices"][0], "message": value}]})


BAD_REPLIES = [  # (case, the server's action, the field the reason names)
    ("a count as text", with_usage({"prompt_tokens": 10, "completion_tokens": "12"}), "usage.completion_tokens"),
    ("a count NaN", with_usage({"completion_tokens": float("nan")}), "found the number nan"),
    ("a count Infinity", with_usage({"completion_tokens": float("inf")}), "found the number inf"),
    ("a count negative", with_usage({"completion_tokens": -4}), "found the number -4"),
    ("usage a string", with_usage("12 tokens"), "usage: expected an object, found text '12 tokens'"),
    ("content null", with_message({"role": "assistant", "content": None}), "choices[0].message.content"),
    ("message a string", with_message("[[B]]"), "choices[0].message: expected an object"),
    ("no choices", ("edit", lambda body: {**body, "choices": []}), "choices: expected a non-empty array"),
    ("finish_reason a list", ("edit", lambda body: {**body, "choices": [{**body["choices"][0], "finish_reason": []}]}),
     "choices[0].finish_reason"),
]


@pytest.mark.parametrize("case, action, named", BAD_REPLIES, ids=[c[0] for c in BAD_REPLIES])
def test_a_reply_that_breaks_the_api_is_retried_then_unjudged_with_the_reason(tmp_path, case, action, named):
    with ChatServer(prefers_longer) as server:
        server.script = [action]  # once: the retry is judged
        lines, summary = one_pair(make_judge(server, tmp_path / "once"))
        assert len(server.requests) == 3 and lines[0]["outcome"] == "win" and summary["unjudged"] == 0
        server.requests.clear()
        server.script = [action] * 3  # every attempt of the first order (retries=2): that order alone fails
        lines, summary = one_pair(make_judge(server, tmp_path / "always"))
    assert len(server.requests) == 4 and lines[0]["outcome"] == "unjudged"
    assert lines[0]["unjudged_reason"] == "request failed" and summary["unjudged_reasons"] == {"request failed": 1}
    error = lines[0]["judgments"][0]["error"]
    assert error.startswith("gave up after 3 attempts: malformed reply: ") and named in error
    assert lines[0]["judgments"][1]["outcome"] == "win"  # the other order was judged


def test_a_lone_surrogate_in_a_verdict_is_replaced_counted_and_written(tmp_path):
    surrogate = ("edit", lambda body: {**body, "choices": [{**body["choices"][0], "message": {
        "role": "assistant", "content": "B is longer \ud83d. [[B]]"}}]})
    with ChatServer(prefers_longer) as server:
        server.script = [surrogate]
        j = make_judge(server, tmp_path)
        lines, _ = one_pair(j)
    first = lines[0]["judgments"][0]
    assert first["verdict"] == "B" and first["raw"] == "B is longer \ufffd. [[B]]" and first["replaced"] == 1
    assert judge.replaced_characters(lines) == 1
    cached = (tmp_path / "cache.jsonl").read_text(encoding="utf-8")  # written, as UTF-8
    assert "\ufffd" in json.loads(cached.splitlines()[0])["raw"] + json.loads(cached.splitlines()[1])["raw"]


@pytest.mark.parametrize("edit", [
    lambda entry: entry.update(raw="\udc00 [[B]]"),  # a lone surrogate: no UTF-8 file can hold it
    lambda entry: entry.pop("attempts"),
    lambda entry: entry.update(parsed="D"),
    lambda entry: entry.update(replaced=-1),
])
def test_a_judgment_cache_line_edited_by_hand_is_refused_with_its_line(tmp_path, edit):
    with ChatServer(prefers_longer) as server:
        one_pair(make_judge(server, tmp_path))
        cache = tmp_path / "cache.jsonl"
        entries = [json.loads(line) for line in cache.read_text(encoding="utf-8").splitlines()]
        edit(entries[1])
        cache.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")
        with pytest.raises(UserError, match=f"{cache}, line 2: not a cache entry .* Delete that line, or the file"):
            one_pair(make_judge(server, tmp_path))


def test_client_error_is_not_retried(tmp_path):
    with ChatServer(prefers_longer) as server:
        server.script = [("status", 401)]
        lines, _ = one_pair(make_judge(server, tmp_path))
    assert len(server.requests) == 2 and "HTTP 401" in lines[0]["judgments"][0]["error"]


def test_unparsable_verdict_is_retried_once_with_a_reminder(tmp_path):
    with ChatServer(prefers_longer) as server:
        server.script = [("ok", "I think A is better.")]  # then the default: B, the longer answer
        lines, _ = one_pair(make_judge(server, tmp_path))
        retry = server.requests[2]["body"]["messages"]  # both orders go first, then the retry
    first = lines[0]["judgments"][0]
    assert first["attempts"] == 2 and first["verdict"] == "B" and first["raw_first"] == "I think A is better."
    assert retry[-2] == {"role": "assistant", "content": "I think A is better."} and "[[A]]" in retry[-1]["content"]


def test_unparsable_twice_is_unjudged_and_counted(tmp_path):
    with ChatServer(prefers_longer) as server:
        server.script = [("ok", "A, clearly."), ("ok", "[[A]]"), ("ok", "Still A.")]
        lines, summary = one_pair(make_judge(server, tmp_path))
    assert len(server.requests) == 3  # one retry, no more
    assert lines[0]["outcome"] == "unjudged" and lines[0]["unjudged_reason"] == "unparsable verdict"
    assert summary["unjudged_reasons"] == {"unparsable verdict": 1}


def test_swapped_orders_that_disagree_make_a_tie(tmp_path):
    with ChatServer(lambda body: "[[A]]") as server:  # pure position bias
        lines, summary = one_pair(make_judge(server, tmp_path))
    assert lines[0]["outcome"] == "tie" and lines[0]["consistent"] is False
    assert summary["consistency"] == 0.0 and summary["ties"] == 1


def test_rerun_is_served_from_the_cache(tmp_path):
    with ChatServer(prefers_longer) as server:
        first, _ = one_pair(make_judge(server, tmp_path))
        sent = len(server.requests)
        j = make_judge(server, tmp_path)
        second, _ = one_pair(j)
    assert sent == 2 and len(server.requests) == 2 and j.requests == 0
    assert first == second


def test_many_prompts_with_concurrency(tmp_path):
    records = [{"id": str(i), "messages": [{"role": "user", "content": f"q{i}"}], "prompt": f"q{i}"}
               for i in range(12)]
    base = ["mid" * 3] * 12
    variant = ["x" * (9 + (i % 3) - 1) for i in range(12)]  # shorter, equal, longer in turn
    with ChatServer(prefers_longer) as server:
        j = make_judge(server, tmp_path, concurrency=4)
        lines, summary = judge.judge_pairwise(j, records, base, variant, control=True)
    assert (summary["wins"], summary["ties"], summary["losses"]) == (4, 4, 4)
    assert summary["control_win_rate"] == 0.5 and summary["noise_floor"] == 0.0
    assert summary["length_bias"] > 0.9  # this judge is all verbosity bias
    assert len(server.requests) == 12 * 4


# ---------------------------------------------------------------- the whole stage

@pytest.fixture(scope="module")
def two_models(tmp_path_factory, tiny_llama):
    """The tiny base and a second tiny Llama (another seed) standing in for a variant."""
    from tiny import save_tiny_llama

    return tiny_llama, save_tiny_llama(tmp_path_factory.mktemp("other") / "variant-x", seed=1)


@pytest.fixture(scope="module")
def holdout(tiny_calib, tmp_path_factory):
    lines = (tiny_calib / "holdout.jsonl").read_text(encoding="utf-8").splitlines()[:3]
    path = tmp_path_factory.mktemp("prompts") / "holdout.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


SMALL = dict(max_new_tokens=6, judge_max_new_tokens=8)


def test_openai_judge_end_to_end_never_leaks_the_key(tmp_path, two_models, holdout, monkeypatch, caplog, capsys):
    base, variant = two_models
    monkeypatch.setenv("JUDGE_TEST_KEY", FAKE_KEY)
    params = JudgeParams(backend="openai", model="test-judge", base_url=None, api_key_env="JUDGE_TEST_KEY",
                         retries=1, backoff=0.01, timeout=2, concurrency=1, **SMALL)
    caplog.set_level(logging.DEBUG)
    with ChatServer(prefers_longer) as server:
        params.base_url = server.base_url
        server.script = [("status", 500)] * 2  # the key echoed in an error body, twice: one order unjudged
        result = judge.run(variant, base, holdout, tmp_path / "out", params, batch_size=4,
                           bootstrap=200)
        print(result.summary())
        assert {r["headers"].get("Authorization") for r in server.requests} == {f"Bearer {FAKE_KEY}"}
        assert not any(FAKE_KEY in r["raw"] for r in server.requests)  # only in the header
    s = result.figures
    assert s["n"] + s["unjudged"] == 3 and s["unjudged"] == 1 and s["control_n"] == 3
    assert s["weak_judge"] is False and "test-judge" in s["judge"]
    lines = read_jsonl(tmp_path / "out" / "judge.jsonl")
    assert "[REDACTED]" in json.dumps(lines)  # the echoed key was scrubbed, not dropped silently
    outputs = [(tmp_path / "out" / "judge.jsonl").read_text(), (tmp_path / "out" / "judge.json").read_text(),
               caplog.text, capsys.readouterr().out]
    outputs += [p.read_text() for p in (tmp_path / "out" / ".cache").iterdir()]
    assert not any(FAKE_KEY in text for text in outputs)


def test_quantize_judge_behind_a_bad_gateway_finishes_the_stage(tmp_path, two_models, holdout, monkeypatch):
    """`quantize judge` against a real server whose replies break the API (a usage count as text, then NaN: one
    order fails both attempts) or hold a lone surrogate: exit 0, everything written, the failed order unjudged
    with its reason, and the replaced character counted and named."""
    from typer.testing import CliRunner

    from conftest import TINY_PARAMS, write_params
    from pipeline.cli.app import app

    base, variant = two_models
    surrogate = ("edit", lambda body: {**body, "choices": [{**body["choices"][0], "message": {
        "role": "assistant", "content": body["choices"][0]["message"]["content"] + " \ud800"}}]})
    with ChatServer(prefers_longer) as server:
        write_params(tmp_path, {**TINY_PARAMS, "judge": {
            "backend": "openai", "model": "test-judge", "base_url": server.base_url, "retries": 1, "backoff": 0.01,
            "concurrency": 1, "control": False, "limit": 3, "max_new_tokens": 6, "judge_max_new_tokens": 8}})
        monkeypatch.chdir(tmp_path)
        server.script = [with_usage("12"), with_usage({"completion_tokens": float("nan")}), surrogate]
        result = CliRunner().invoke(app, ["judge", str(variant), "--base", str(base), "--prompts", str(holdout),
                                          "--out", "out"])
    assert result.exit_code == 0, result.output
    assert "1 character of the judge's replies that UTF-8 cannot hold written as U+FFFD" in result.output
    assert "stands as U+FFFD in judge.jsonl" in result.output and "Traceback" not in result.output
    s = json.loads((tmp_path / "out" / "judge.json").read_text(encoding="utf-8"))
    assert s["n"] + s["unjudged"] == 3 and s["unjudged"] == 1 and s["unjudged_reasons"] == {"request failed": 1}
    assert s["replaced_characters"] == 1
    lines = read_jsonl(tmp_path / "out" / "judge.jsonl")
    [failed] = [j for l in lines for j in l["judgments"] if j["error"]]
    assert failed["error"].startswith("gave up after 2 attempts: malformed reply: usage.completion_tokens: expected "
                                      "a whole number from 0 to 8, found the number nan")
    assert [j["replaced"] for l in lines for j in l["judgments"] if "\ufffd" in j["raw"]] == [1]


def test_the_page_says_how_many_characters_of_the_judges_replies_were_replaced_and_how_verdicts_were_read(tmp_path):
    from html import unescape

    from conftest import TINY_PARAMS, with_variants
    from pipeline.stages import report
    from pipeline.settings.params import Params
    from report_fixture import write_judge
    from test_report import judge_pairs, write_results

    results = tmp_path / "results"
    for name in ("base", "v"):
        write_results(results, name, [1] * 120 + [0] * 80)
    write_judge(results / "v", judge_pairs(), replaced_characters=3, scoring="text")
    params = Params.model_validate(with_variants(TINY_PARAMS, "v"))
    report.run(results, tmp_path / "reports", params, models_dir=tmp_path / "models")
    html = unescape((tmp_path / "reports" / "index.html").read_text(encoding="utf-8"))
    assert "3 characters of the judge's replies could not be written as UTF-8 (unpaired UTF-16 surrogates) and " \
           "stand as U+FFFD in judge.jsonl" in html
    assert "tiny judge (verdicts parsed from its replies)" in re.sub(r"<[^>]+>", "", html)
    write_judge(results / "v", judge_pairs(), scoring="logprobs")
    report.run(results, tmp_path / "reports", params, models_dir=tmp_path / "models")
    text = re.sub(r"<[^>]+>", "", unescape((tmp_path / "reports" / "index.html").read_text(encoding="utf-8")))
    assert "tiny judge (verdicts from log-probabilities)" in text and "verdicts parsed" not in text


def test_missing_key_variable_is_a_clear_error(tmp_path, two_models, holdout, monkeypatch):
    monkeypatch.delenv("JUDGE_TEST_KEY", raising=False)
    params = JudgeParams(backend="openai", model="m", base_url="http://127.0.0.1:9/v1",
                         api_key_env="JUDGE_TEST_KEY", **SMALL)
    with pytest.raises(UserError, match="JUDGE_TEST_KEY is not set"):
        judge.judge_engine(params, two_models[0], {})


def test_openai_backend_needs_url_and_model_name(two_models):
    with pytest.raises(UserError, match="judge.base_url"):
        judge.judge_engine(JudgeParams(backend="openai", model="m"), two_models[0], {})
    with pytest.raises(UserError, match="judge.model"):
        judge.judge_engine(JudgeParams(backend="openai", base_url="http://127.0.0.1:9/v1"), two_models[0], {})


def test_a_key_pasted_as_api_key_env_is_refused_without_echoing_it(tmp_path):
    from pipeline.settings import params as params_mod

    path = tmp_path / "params.yaml"
    path.write_text(f"judge:\n  backend: openai\n  api_key_env: {FAKE_KEY}\n")
    with pytest.raises(UserError) as info:
        params_mod.load(path)
    assert "judge.api_key_env" in str(info.value) and FAKE_KEY not in str(info.value)


def test_openai_engine_repr_and_errors_hide_the_key(monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", FAKE_KEY)
    with ChatServer() as server:
        server.script = [("status", 503)] * 2
        engine = openai_client(base_url=server.base_url, model="m", api_key_env="JUDGE_TEST_KEY", retries=1,
                              backoff=0.01)
        [completion] = engine.generate([GenRequest("hi", 4)])
    assert FAKE_KEY not in repr(engine) and FAKE_KEY not in completion.error and "[REDACTED]" in completion.error


def test_control_run_of_a_deterministic_judge_is_half(tmp_path, two_models, holdout):
    base, _ = two_models
    params = JudgeParams(backend="openai", model="test-judge", retries=0, **SMALL)
    with ChatServer(prefers_longer) as server:
        params.base_url = server.base_url
        result = judge.run(base, base, holdout, tmp_path, params, bootstrap=200)
    s = result.figures
    assert s["control_win_rate"] == 0.5 and s["noise_floor"] == 0.0 and s["win_rate"] == 0.5


def test_reference_mode_grades_one_to_five(tmp_path, two_models, holdout):
    base, variant = two_models
    params = JudgeParams(backend="openai", model="test-judge", mode="reference", retries=0, concurrency=1,
                         **SMALL)
    grades = iter(["Rating: [[4]]", "no idea", "Rating: [[2]]", "[[5]]"])
    with ChatServer(lambda body: next(grades)) as server:
        params.base_url = server.base_url
        result = judge.run(variant, base, holdout, tmp_path, params, bootstrap=200)
        assert "Reference Answer" in server.requests[0]["body"]["messages"][0]["content"]
    s = result.figures
    assert len(server.requests) == 4  # three prompts, one unparsable retried once
    assert s["mode"] == "reference" and s["n"] == 3 and s["unjudged"] == 0
    assert s["mean_grade"] == pytest.approx(11 / 3) and s["grades"] == {"1": 0, "2": 1, "3": 0, "4": 1, "5": 1}
    assert s["decision"] == "INCONCLUSIVE" and "reference" in result.summary()


def test_lmdeploy_backend_says_what_it_needs(tmp_path, two_models, holdout):
    params = JudgeParams(backend="lmdeploy", model="base", **SMALL)
    with pytest.raises(UserError, match="lmdeploy extra"):
        judge.run(two_models[1], two_models[0], holdout, tmp_path, params)


def test_missing_prompts_file_is_a_clear_error(tmp_path, two_models):
    with pytest.raises(UserError, match="run `quantize calib` first"):
        judge.run(two_models[1], two_models[0], tmp_path / "nope.jsonl", tmp_path, JudgeParams())


@pytest.mark.parametrize("line, problem", [
    ('{"id": "x", "messages": [{"role": "user", "content": "half \\ud83d"}], "prompt": "p", "reference": null}',
     "messages[0].content holds an unpaired UTF-16 surrogate, which is not text"),
    ('{"id": "x", "messages": [{"role": "narrator", "content": "hi"}, {"role": "user", "content": "q"}]}',
     "messages must be a list of system, user and assistant turns ending with the user's"),
])
def test_a_broken_holdout_record_is_refused_with_its_line_before_anything_is_asked(tmp_path, two_models, holdout,
                                                                                   line, problem):
    prompts = tmp_path / "holdout.jsonl"
    prompts.write_text(holdout.read_text(encoding="utf-8").splitlines()[0] + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(UserError) as info:
        judge.run(two_models[1], two_models[0], prompts, tmp_path / "out", JudgeParams(**SMALL))
    assert str(info.value).startswith(f"{prompts}:2: not a holdout record ({problem})")
    assert not (tmp_path / "out").exists()



# ---------------------------------------------------------------- verdicts read from log-probabilities

QUESTION, GOOD, POOR = "Where is my order?", "Your parcel ships today; the tracking number follows.", "No idea."
LONG_CONTEXT = 2048  # positions: a judge prompt of the tiny tokenizer is ~700 tokens, over the tiny Llama's 512


def judge_context(tokenizer, mode: str = "pairwise", **answers) -> str:
    """The judge prompt as the judge's own chat template renders it, followed by the mode's answer cue."""
    content = prompts.render(prompts.load_template(mode), question=QUESTION, **answers)
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True) + prompts.ANSWER_CUE[mode]


def forward_logprobs(model_dir, context: str, choices) -> dict[str, float]:
    """Each choice's log-probability after `context`, here from one transformers forward pass per choice over the
    whole text (the choice's tokens: those of context + choice after the context's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    found = {}
    for choice in choices:
        ids = tokenizer(context + choice, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        found[choice] = float(sum(logprobs[i - 1, ids[i]] for i in range(n, len(ids))))
    return found


def teach(path, verdicts: dict[tuple[str, str], str], seed: int = 3):
    """A tiny Llama taught, by Adam on these judge prompts alone ((answer A, answer B) -> verdict), to answer each
    with its verdict by a margin of 2 nats at least: a judge whose every preference is known."""
    import torch
    from transformers import AutoModelForCausalLM

    from tiny import save_tiny_llama, tiny_tokenizer

    save_tiny_llama(path, seed=seed, dtype=torch.float32, max_position_embeddings=LONG_CONTEXT)
    tokenizer, model = tiny_tokenizer(), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = []
    for (a, b), verdict in verdicts.items():
        context = judge_context(tokenizer, answer_a=a, answer_b=b)
        ids = tokenizer(context + verdict, add_special_tokens=False)["input_ids"]
        rows.append((torch.tensor([ids[:-1]]), ids[-1]))
    choices = tokenizer.convert_tokens_to_ids(list("ABC"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        logits = [model(ids).logits[0, -1] for ids, _ in rows]
        with torch.no_grad():
            margins = [(l.log_softmax(-1)[t] - max(l.log_softmax(-1)[c] for c in choices if c != t)).item()
                       for l, (_, t) in zip(logits, rows)]
        if min(margins) > 2:
            model.save_pretrained(path)
            return path
        loss = sum(torch.nn.functional.cross_entropy(l[None], torch.tensor([t])) for l, (_, t) in zip(logits, rows))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    raise AssertionError(f"the tiny judge did not learn its verdicts (margins {margins})")


@pytest.fixture(scope="module")
def taught_judges(tmp_path_factory):
    """fair: prefers GOOD over POOR wherever it stands; biased: answers A whatever the answers."""
    root = tmp_path_factory.mktemp("judges")
    return {"fair": teach(root / "fair", {(POOR, GOOD): "B", (GOOD, POOR): "A"}),
            "biased": teach(root / "biased", {(POOR, GOOD): "A", (GOOD, POOR): "A"})}


@pytest.fixture(scope="module")
def long_models(tmp_path_factory):
    """Random tiny Llamas, base and a variant, with room for a judge prompt: the base judges itself (as in the demo)."""
    from tiny import save_tiny_llama

    root = tmp_path_factory.mktemp("long")
    return (save_tiny_llama(root / "base", max_position_embeddings=LONG_CONTEXT),
            save_tiny_llama(root / "variant-long", seed=1, max_position_embeddings=LONG_CONTEXT))


def engine_judge(factory, tmp_path, scoring="logprobs", mode="pairwise"):
    return client.Judge(factory, "test", client.JudgmentCache(tmp_path / "cache.jsonl"), mode=mode, scoring=scoring)


def hf_factory(model_dir):
    from pipeline.engines import make_engine

    return lambda: make_engine("hf", model_dir)


def orders_of(line) -> dict[str, dict]:
    return {j["order"]: j for j in line["judgments"]}


def test_a_verdict_read_from_log_probabilities_is_the_likeliest_choice_of_a_forward_pass(tmp_path, taught_judges):
    """The fair judge through the hf engine: each order's choice log-probabilities equal a plain forward pass over
    the prompt its chat template renders, the verdict is their argmax, and with the answers swapped it is mirrored
    (B, then A: the variant's answer both times), so the pair is a consistent win."""
    j = engine_judge(hf_factory(taught_judges["fair"]), tmp_path)
    lines, summary = one_pair(j, base=POOR, variant=GOOD)
    from tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    shown = {"base-first": (POOR, GOOD), "variant-first": (GOOD, POOR)}
    for order, judgment in orders_of(lines[0]).items():
        a, b = shown[order]
        expected = forward_logprobs(taught_judges["fair"], judge_context(tokenizer, answer_a=a, answer_b=b), "ABC")
        assert judgment["logprobs"] == pytest.approx(expected, abs=1e-4)
        assert judgment["verdict"] == max(expected, key=expected.get)
        assert judgment["by"] == "logprobs" and judgment["attempts"] == 1 and "raw" not in judgment
    assert orders_of(lines[0])["base-first"]["verdict"] == "B" and orders_of(lines[0])["variant-first"]["verdict"] == "A"
    assert lines[0]["outcome"] == "win" and lines[0]["consistent"] is True and summary["wins"] == 1
    assert j.requests == 6  # three choices, two orders: nothing generated, nothing asked twice
    j.close()


def test_a_judge_behind_a_server_reads_the_same_verdicts_from_its_prompt_logprobs(tmp_path, taught_judges):
    """The vllm backend, against a real server (tests/openai_server.py, started as `vllm serve` is): the choices'
    log-probabilities come from its prompt_logprobs and equal the hf engine's, and so do the verdicts."""
    from pipeline.engines import make_engine
    from pipeline.engines.vllm import Settings
    from test_vllm_engine import SERVER

    settings = Settings(server_command=SERVER, start_timeout=120, share_server=False)
    served = engine_judge(lambda: make_engine("vllm", taught_judges["fair"], settings, log_path=tmp_path / "log"),
                          tmp_path / "served")
    try:
        lines, _ = one_pair(served, base=POOR, variant=GOOD)
    finally:
        served.close()
    local, _ = one_pair(engine_judge(hf_factory(taught_judges["fair"]), tmp_path / "local"), base=POOR, variant=GOOD)
    for order, judgment in orders_of(lines[0]).items():
        assert judgment["logprobs"] == pytest.approx(orders_of(local[0])[order]["logprobs"], abs=1e-4)
        assert judgment["verdict"] == orders_of(local[0])[order]["verdict"]
    assert lines[0]["outcome"] == "win" and lines[0]["consistent"] is True


def test_a_position_biased_judge_judges_every_pair_and_its_checks_decide_whether_it_counts(tmp_path, taught_judges):
    """Read from log-probabilities, a judge always has a verdict; whether it counts is still the rule's: the biased
    judge answers A in both orders (a tie that contradicts itself, consistency 0, its control the same) and is
    UNRELIABLE, not counted; the fair one is consistent and counted."""
    from pipeline.settings.params import Params
    from pipeline.verdict.next_steps import next_steps

    figures = {}
    for name, path in taught_judges.items():
        j = engine_judge(hf_factory(path), tmp_path / name)
        lines, summary = judge.judge_pairwise(j, [{"id": "p1", "messages": [{"role": "user", "content": QUESTION}],
                                                   "prompt": QUESTION}], [POOR], [GOOD], control=True)
        j.close()
        figures[name] = (lines[0], judge_rule.judge_verdict({"mode": "pairwise", **summary}, Params()))
    line, verdict = figures["biased"]
    assert {j["verdict"] for j in line["judgments"]} == {"A"} and line["outcome"] == "tie" and line["consistent"] is False
    assert verdict["decision"] == "UNRELIABLE" and verdict["counted"] is False
    assert verdict["summary"]["unjudged"] == 0 and verdict["summary"]["control_n"] == 1
    [step] = next_steps("biased", [], {}, verdict, {}, Params())
    assert step["text"].startswith("judge: unreliable: it gave the same verdict with the answers swapped in 0.0% of "
                                   "pairs; a stronger judge is needed") and step["counted"] is False
    line, verdict = figures["fair"]
    assert line["outcome"] == "win" and verdict["counted"] is True and verdict["decision"] == "INCONCLUSIVE"


def test_reference_mode_grades_by_the_log_probabilities_of_one_to_five(tmp_path, long_models):
    base, _ = long_models
    j = engine_judge(hf_factory(base), tmp_path, mode="reference")
    ask = j.ask_reference(j.key("q", "ref", "answer"), QUESTION, GOOD, POOR)
    [record] = j.judge([ask]).values()
    j.close()
    from tiny import tiny_tokenizer

    context = judge_context(tiny_tokenizer(), "reference", reference=GOOD, answer=POOR)
    expected = forward_logprobs(base, context, "12345")
    assert record["logprobs"] == pytest.approx(expected, abs=1e-4)
    assert record["parsed"] == int(max(expected, key=expected.get)) and record["by"] == "logprobs"


def test_the_hf_judge_judges_every_pair_and_the_cache_keeps_the_two_methods_apart(tmp_path, long_models, holdout):
    """The demo's judge (the base judging itself, hf): every pair judged from log-probabilities, judge.json says
    so; a rerun asks nothing; a rerun with scoring text does not reuse those verdicts (it generates and parses,
    mostly unparsable from a random model) and the first method's are still cached beside them."""
    base, variant = long_models
    params = JudgeParams(backend="hf", model="base", **SMALL)
    started = time.perf_counter()
    result = judge.run(variant, base, holdout, tmp_path, params, batch_size=8, bootstrap=200)
    s = result.figures
    assert s["scoring"] == "logprobs" and s["n"] == 3 and s["unjudged"] == 0 and s["control_n"] == 3
    assert s["judge_requests"] == 3 * 4 * 3  # prompts x (two orders, variant and control) x choices
    assert s["weak_judge"] is True and "weak judge" in " ".join(s["reasons"])
    assert s["wins"] + s["ties"] + s["losses"] == 3 and "verdicts from log-probabilities" in result.summary()
    lines = read_jsonl(tmp_path / "judge.jsonl")
    assert all(j["by"] == "logprobs" and set(j["logprobs"]) == {"A", "B", "C"}
               for l in lines for j in l["judgments"] + l["control"]["judgments"])
    again = judge.run(variant, base, holdout, tmp_path, params, batch_size=8, bootstrap=200)
    assert again.figures["judge_requests"] == 0 and read_jsonl(tmp_path / "judge.jsonl") == lines
    text = judge.run(variant, base, holdout, tmp_path, params, scoring="text", batch_size=8, bootstrap=200)
    assert text.figures["scoring"] == "text" and text.figures["judge_requests"] >= 12
    assert all(j["by"] == "text" and "raw" in j for l in read_jsonl(tmp_path / "judge.jsonl") for j in l["judgments"])
    assert judge.run(variant, base, holdout, tmp_path, params, batch_size=8, bootstrap=200).figures["judge_requests"] == 0
    assert time.perf_counter() - started < 120


def test_an_engine_without_log_probabilities_has_its_replies_parsed(tmp_path, two_models, holdout):
    """scoring auto with the openai backend (a chat API: no log-probabilities): every verdict parsed from a reply."""
    base, _ = two_models
    params = JudgeParams(backend="openai", model="test-judge", retries=0, **SMALL)
    assert params.scoring == "auto" and params.scoring_method == "text"
    with ChatServer(prefers_longer) as server:
        params.base_url = server.base_url
        result = judge.run(base, base, holdout, tmp_path, params, bootstrap=200)
    assert result.figures["scoring"] == "text" and "verdicts parsed from replies" in result.summary()
    assert all(j["by"] == "text" and scoring.parse_verdict(j["raw"]) == j["verdict"]
               for l in read_jsonl(tmp_path / "judge.jsonl") for j in l["judgments"])


def test_logprobs_asked_of_a_backend_that_gives_none_is_refused_with_its_line(tmp_path):
    from pipeline.settings import params as params_mod

    path = tmp_path / "params.yaml"
    path.write_text("judge:\n  backend: openai\n  scoring: logprobs\n")
    with pytest.raises(UserError, match=r"params.yaml:3: judge.scoring: logprobs needs a backend that gives "
                                        r"log-probabilities \(hf or vllm\); the openai backend gives none"):
        params_mod.load(path)
    with pytest.raises(UserError, match="--scoring logprobs: logprobs needs a backend"):
        params_mod.with_overrides(JudgeParams(backend="openai"), scoring="logprobs")


def test_a_judge_prompt_longer_than_the_judges_context_is_unjudged_with_the_reason(tmp_path, two_models, holdout):
    """The tiny Llama holds 512 positions, a judge prompt ~700 tokens: not cut (its start holds the instructions),
    unjudged with the reason, not cached (asked again next run)."""
    base, variant = two_models
    result = judge.run(variant, base, holdout, tmp_path, JudgeParams(backend="hf", model="base", **SMALL),
                       batch_size=8, bootstrap=200)
    assert result.figures["n"] == 0 and result.figures["unjudged_reasons"] == {"request failed": 3}
    errors = {j["error"] for l in read_jsonl(tmp_path / "judge.jsonl") for j in l["judgments"]}
    assert all(re.fullmatch(r"the judge prompt is \d+ tokens, over the judge's context of 512", e) for e in errors)
    assert not (tmp_path / ".cache" / "judgments.jsonl").exists()


@pytest.mark.parametrize("edit, valid", [
    ({}, True),
    ({"parsed": "B"}, False),  # not the likeliest choice
    ({"logprobs": {"A": 0.5, "B": -2.0, "C": -3.0}}, False),  # a probability above 1
    ({"logprobs": {}}, False),
    ({"attempts": 2}, False),  # nothing is asked twice
    ({"by": "guess"}, False),
])
def test_a_logprob_judgment_in_the_cache_is_checked_like_a_parsed_one(tmp_path, edit, valid):
    entry = {"key": "k", "by": "logprobs", "logprobs": {"A": -0.1, "B": -2.0, "C": -3.0}, "parsed": "A",
             "attempts": 1, "error": None, **edit}
    path = tmp_path / "cache.jsonl"
    path.write_text(json.dumps(entry) + "\n", encoding="utf-8")
    if valid:
        assert client.JudgmentCache(path).get("k") == entry
    else:
        with pytest.raises(UserError, match="line 1: not a cache entry"):
            client.JudgmentCache(path)


def test_a_choice_the_tokenizer_joins_with_the_cue_is_not_scored():
    """A tokenizer with a token '[[A' writes the cue's '[[' and the choice A as one token: P(A) cannot be read after
    the cue's tokens, so that judgment fails with the reason (and a way out) instead of scoring other tokens."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(" :ABCdeirtv[")}
    vocab.update({"[[": len(vocab), "[[A": len(vocab) + 1})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[("[", "["),
                                                                                                   ("[[", "A")])))
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert encode("verdict: [[A")[-1] == vocab["[[A"]  # the merge the test is about
    with pytest.raises(ValueError, match=r"joins choice 'A' with the end of the prompt '.*\[\[' into one token: .* "
                                         "use judge.scoring: text"):
        client.choice_requests(tokenizer, encode, "verdict: [[", "ABC")
    context = encode("verdict: [[")
    assert client.choice_requests(tokenizer, encode, "verdict: [[", "BC") == [(context, [vocab["B"]]),
                                                                             (context, [vocab["C"]])]
