"""Issue 66: a reasoning model judged as it is served. Thinking on or off as its chat template switches it, reaching
the template (hf) and the request (openai); the answer read after `</think>`; where the token budget cut an answer
(inside the reasoning, inside the answer); a suite whose base is cut inside its reasoning shown, not counted; k
samples drawn with recorded seeds and drawn again the same; lines and cache entries written before all this still
read. The reasoning model is a tiny Llama trained here for a few hundred steps to answer with a known script."""

import hashlib
import json
import shutil
from html import unescape
from pathlib import Path

import pytest

from conftest import TINY_PARAMS, read_jsonl, with_variants
from tiny import CHATML, GLM_THINKING_TEMPLATE, THINKING_TEMPLATE, save_thinking_llama, thinking_tokenizer, tiny_tokenizer

TASKS = Path(__file__).parent / "data" / "tiny_think"
REASONING = "7 is wrong; six times seven"
SCRIPT = f"<think>{REASONING}</think> 42"
QUESTIONS = ["What is six times seven?", "What is three plus four?"]
THINK = dict(suite="think", task="tiny_think", variant="base", tasks_dir=str(TASKS))


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> Path:
    """A reasoning model: it answers the tiny task's questions (thinking on) with SCRIPT."""
    from pipeline.formats.chat import render_prompt

    tok = thinking_tokenizer()
    prompts = [render_prompt(tok, [{"role": "user", "content": q}], True)
               for q in QUESTIONS + ["Hello there", "Solve this math problem."]]
    return save_thinking_llama(tmp_path_factory.mktemp("thinker"), SCRIPT, prompts)


def test_the_template_says_whether_and_how_the_model_thinks():
    from pipeline.engines.reasoning import resolve_thinking
    from pipeline.errors import UserError
    from pipeline.formats.chat import TemplateThinking, render_prompt, template_thinking

    qwen, glm, plain = thinking_tokenizer(), thinking_tokenizer(GLM_THINKING_TEMPLATE), tiny_tokenizer()
    always = thinking_tokenizer(CHATML.replace("message['content']", "message['content'].split('</think>')[-1]"))
    off_by_default = thinking_tokenizer(THINKING_TEMPLATE.replace("enable_thinking is defined and not enable_thinking",
                                                                  "not enable_thinking"))
    assert template_thinking(qwen) == template_thinking(glm) == TemplateThinking(switchable=True, default=True)
    assert template_thinking(off_by_default) == TemplateThinking(switchable=True, default=False)
    assert template_thinking(always) == TemplateThinking(switchable=False, default=True)
    assert template_thinking(plain) is None  # SmolLM2's case: nothing to switch
    user = [{"role": "user", "content": "Hi"}]
    assert render_prompt(glm, user, False).endswith("Hi/nothink<|assistant|>\n<think></think>")  # GLM-4.5V's switch
    assert render_prompt(glm, user, True) == render_prompt(glm, user)
    where = dict(key="suites.math.thinking", model="models/base")
    assert [resolve_thinking(s, qwen, **where) for s in ("auto", "on", "off")] == [True, True, False]
    assert resolve_thinking("auto", off_by_default, **where) is False
    assert resolve_thinking("auto", plain, **where) is None and resolve_thinking("off", plain, **where) is None
    assert resolve_thinking("auto", always, **where) is True
    with pytest.raises(UserError, match=r"suites\.math\.thinking: on, but models/base's chat template does not think"):
        resolve_thinking("on", plain, **where)
    with pytest.raises(UserError, match=r"suites\.math\.thinking: off, but models/base's chat template always thinks"):
        resolve_thinking("off", always, **where)


def test_hf_reads_the_answer_after_the_reasoning_and_where_the_budget_cut(thinker):
    from pipeline.engines import GenRequest
    from pipeline.engines.hf import HFEngine

    engine = HFEngine(thinker)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    on, off = engine.apply_chat_template(messages, True), engine.apply_chat_template(messages, False)
    assert on == engine.apply_chat_template(messages) and off == on + "<think>\n\n</think>\n\n"  # reaches the template
    whole = engine.tokenizer(SCRIPT, add_special_tokens=False)["input_ids"]
    reasoning_tokens = whole.index(engine.tokenizer.convert_tokens_to_ids("</think>")) + 1
    budgets = [64, 3, reasoning_tokens + 1]  # room for all; cut inside the reasoning; cut one token into the answer
    done = engine.generate([GenRequest(on, n, ["Question:"], thinking=True) for n in budgets])
    assert [c.cut for c in done] == [None, "reasoning", "answer"]
    assert done[0].text == " 42" and done[0].reasoning == REASONING and done[0].thinking
    assert (done[0].n_tokens, done[0].reasoning_tokens, done[0].answer_tokens) == (len(whole), reasoning_tokens,
                                                                                  len(whole) - reasoning_tokens)
    assert done[1].text == "" and done[1].reasoning_tokens == done[1].n_tokens == 3
    assert done[2].answer_tokens == 1 and done[2].text == engine.tokenizer.decode(whole[reasoning_tokens:][:1])
    plain = engine.generate([GenRequest(on, 64)])[0]  # a request of a template that does not think: nothing split
    assert plain.text == engine.tokenizer.decode(whole) and plain.reasoning == "" and plain.reasoning_tokens == 0


def test_a_tokenizer_that_spells_the_marker_in_pieces_splits_at_the_same_place():
    from pipeline.engines.reasoning import split_reasoning, split_text

    tok = tiny_tokenizer()  # no <think> token: "</think>" is several tokens

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    reasoning, answer, closed = split_reasoning(tok, ids("<think>think hard</think> 42"), "p")
    assert (reasoning, tok.decode(answer), closed) == ("think hard", " 42", True)
    assert split_reasoning(tok, ids("<think>think hard"), "p") == ("think hard", [], False)  # opened, never closed
    assert split_reasoning(tok, ids("no reasoning"), "p") == ("", ids("no reasoning"), True)
    assert split_reasoning(tok, ids("still thinking"), "assistant\n<think>\n")[2] is False  # the prompt opened it
    assert split_text("<think>a</think>b") == ("a", "b", True) and split_text("<think>a") == ("a", "", False)


def _scripted(text: str, finish: str):
    def edit(reply):
        reply["choices"][0].update(text=text, finish_reason=finish)
        return reply
    return edit


def test_openai_engine_renders_thinking_and_reads_the_answer_after_the_reasoning(thinker):
    """Prompts rendered here (tokens): thinking is in the prompt's tokens; the server's text is split here."""
    from openai_server import CompletionsServer
    from pipeline.engines import GenRequest
    from pipeline.engines.openai import OpenAIEngine, Settings

    with CompletionsServer(str(thinker)) as server:
        engine = OpenAIEngine(thinker, Settings(base_url=server.base_url, model="model", concurrency=1))
        off = engine.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], enable_thinking=False)
        on = engine.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], enable_thinking=True)
        server.edits = [_scripted(SCRIPT + "Question: next", "stop"), _scripted("<think>still going", "length"),
                        _scripted(" 42", "length")]
        done = engine.generate([GenRequest(on, 64, ["Question:"], thinking=True), GenRequest(on, 8, thinking=True),
                                GenRequest(off, 8, thinking=False)])
    bodies = [r["body"] for r in server.requests]
    assert bodies[0]["prompt"] == engine.encode(on) and bodies[2]["prompt"] == engine.encode(off)
    assert "stop" not in bodies[0]  # a stop string ends the answer, never the reasoning: applied here
    assert not any("chat_template_kwargs" in b for b in bodies)  # rendered here, not by the server
    assert (done[0].text, done[0].reasoning, done[0].cut) == (" 42", REASONING, None)
    assert (done[1].text, done[1].reasoning, done[1].cut) == ("", "still going", "reasoning")
    assert (done[2].text, done[2].cut, done[2].thinking) == (" 42", "answer", False)


def test_chat_requests_carry_enable_thinking_and_read_the_servers_reasoning():
    """prompt_format chat: the server's template gets chat_template_kwargs, its reasoning parser's split is read."""
    from chat_server import ChatServer
    from pipeline.engines import GenRequest
    from pipeline.engines.openai import OpenAIEngine, Settings

    def reasoned(content, reasoning, finish="stop", key="reasoning"):
        def edit(body):
            body["choices"][0]["message"].update({"content": content, key: reasoning})
            body["choices"][0]["finish_reason"] = finish
            return body
        return ("edit", edit)

    with ChatServer() as server:
        engine = OpenAIEngine(None, Settings(base_url=server.base_url, model="m", prompt_format="chat", concurrency=1))
        prompt = engine.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], enable_thinking=True)
        server.script = [reasoned(" 42", "six times seven"), reasoned(None, "still", "length", "reasoning_content")]
        done = engine.generate([GenRequest(prompt, 64, thinking=True), GenRequest(prompt, 8, thinking=False)])
    assert [r["body"]["chat_template_kwargs"] for r in server.requests] == [{"enable_thinking": True},
                                                                           {"enable_thinking": False}]
    assert (done[0].text, done[0].reasoning, done[0].cut) == (" 42", "six times seven", None)
    assert (done[1].text, done[1].reasoning, done[1].cut) == ("", "still", "reasoning")


def test_a_thinking_suite_scores_the_answer_and_records_the_reasoning_and_the_cut(tmp_path, thinker):
    from pipeline.formats.results import read_lines
    from pipeline.stages import evaluate

    evaluate.run(thinker, out_dir=tmp_path / "fits", thinking="on", thinking_max_new_tokens=64, **THINK)
    lines = read_jsonl(tmp_path / "fits" / "think.jsonl")
    assert [line["output"] for line in lines] == [" 42", " 42"]
    assert [line["score"] for line in lines] == [1.0, 0.0]  # the 7 in the reasoning is not the answer
    assert all(line["thinking"] and line["reasoning"] == REASONING and line["cut"] is None for line in lines)
    assert all(line["reasoning_tokens"] + line["answer_tokens"] == line["n_tokens"] for line in lines)
    generation = json.loads((tmp_path / "fits" / "think.json").read_text())["generation"]
    assert generation == {"thinking": True, "max_new_tokens": 64, "samples": 1, "seeds": None, "sampling": None}

    said = evaluate.run(thinker, out_dir=tmp_path / "short", thinking="auto", thinking_max_new_tokens=4, **THINK)
    assert "2 cut inside the reasoning (raise suites.think.thinking_max_new_tokens)" in said.summary()
    short = read_lines(tmp_path / "short" / "think.jsonl")  # the reader takes the new fields
    assert [(line["cut"], line["output"], line["score"]) for line in short.values()] == [("reasoning", "", 0.0)] * 2

    evaluate.run(thinker, out_dir=tmp_path / "off", thinking="off", max_new_tokens=5, **THINK)
    off = read_jsonl(tmp_path / "off" / "think.jsonl")
    assert all(line["prompt"].endswith("<think>\n\n</think>\n\n") and not line["thinking"] for line in off)
    assert all(line["n_tokens"] <= 5 for line in off)  # thinking off: max_new_tokens, not thinking_max_new_tokens


def _write(folder: Path, suite: str, lines: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{suite}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def _thinking_lines(model: str, right: int, cut_in_reasoning: int, n: int = 40) -> list[dict]:
    return [{"id": f"q{i}", "suite": "math", "variant": model, "prompt": f"q {i}", "target": "1",
             "output": "" if i < cut_in_reasoning else "1", "score": float(i >= n - right),
             "correct": i >= n - right, "n_tokens": 64, "seconds": 0.1, "thinking": True, "reasoning": "hmm",
             "reasoning_tokens": 64 if i < cut_in_reasoning else 60, "answer_tokens": 0 if i < cut_in_reasoning else 4,
             "cut": "reasoning" if i < cut_in_reasoning else None} for i in range(n)]


def test_a_suite_whose_base_is_cut_inside_its_reasoning_says_the_budget_is_too_small(tmp_path):
    from pipeline.settings.params import Params
    from pipeline.stages import report

    params = Params.model_validate(with_variants(TINY_PARAMS, "v"))
    for cut, counted in ((12, False), (4, True)):  # 30 % of the base's items, then 10 %: verdict.max_cut_share 0.10
        results = tmp_path / f"results-{cut}"
        _write(results / "base", "math", _thinking_lines("base", 20, cut))
        _write(results / "v", "math", _thinking_lines("v", 20, cut))
        out = report.run(results, tmp_path / f"reports-{cut}", params, models_dir=tmp_path / "models")
        coverage = out.verdict["variants"]["v"]["coverage"]["suites"]["math"]
        assert out.verdict["budgets"]["math"]["models"]["base"] == {"n": 40, "reasoning": cut, "answer": 0,
                                                                    "thinking": True, "share": cut / 40}
        html = unescape(out.html.read_text())
        assert 'id="budget-table"' in html
        if counted:
            assert coverage["state"] == "decided" and "budget too small" not in html
            continue
        why = ("budget too small for this model (30.0% of the base's items cut inside the reasoning): raise "
               "suites.math.thinking_max_new_tokens")
        assert coverage == {"state": "not counted", "kind": "accuracy", "decision": coverage["decision"], "why": why,
                            "label": "shown, not counted"}
        assert why in html and out.verdict["variants"]["v"]["suites"]["math"]["sentence"].startswith(
            f"math: not counted, {why}.")


def test_k_samples_are_drawn_with_recorded_seeds_and_drawn_again_the_same(tmp_path, tiny_llama):
    from pipeline.formats.results import read_lines
    from pipeline.stages import evaluate

    k = dict(suite="math", task="quant_gsm8k", variant="base", limit=2, max_new_tokens=6, samples=3, seed=5,
             sampling={"temperature": 1.0})
    evaluate.run(tiny_llama, out_dir=tmp_path / "a", batch_size=4, **k)
    evaluate.run(tiny_llama, out_dir=tmp_path / "b", batch_size=4, **k)  # drawn again, nothing cached: the same
    a, b = read_jsonl(tmp_path / "a" / "math.jsonl"), read_jsonl(tmp_path / "b" / "math.jsonl")
    assert [[s["seed"] for s in line["samples"]] for line in a] == [[5, 6, 7]] * 2
    assert [[s["output"] for s in line["samples"]] for line in a] == [[s["output"] for s in line["samples"]] for line in b]
    assert len({s["output"] for s in a[0]["samples"]}) > 1  # sampled, not three greedy copies
    for line in a:
        assert line["correct"] is None and line["score"] == sum(s["score"] for s in line["samples"]) / 3
        assert line["pass_at_k"] == any(s["correct"] for s in line["samples"])
        assert line["output"] == line["samples"][0]["output"] and line["cut"] == line["samples"][0]["cut"]
    assert len(read_lines(tmp_path / "a" / "math.jsonl")) == 2
    generation = json.loads((tmp_path / "a" / "math.json").read_text())["generation"]
    assert generation["seeds"] == [5, 6, 7] and generation["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    cache = read_jsonl(tmp_path / "a" / ".cache" / "math.jsonl")
    assert len(cache) == 6  # every sample generated once (the first pass), read back by the others


def test_sampling_comes_from_generation_config_unless_params_say_and_the_server_gets_the_seed(tmp_path, tiny_llama):
    from openai_server import CompletionsServer
    from pipeline.engines import GenRequest, Sampling
    from pipeline.engines.openai import OpenAIEngine, Settings
    from pipeline.scoring.generation_plan import plan_for
    from pipeline.settings.params import SuiteParams

    model = shutil.copytree(tiny_llama, tmp_path / "model")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "temperature": 0.8,
                                                              "top_p": 0.6, "top_k": 2}))
    suite = SuiteParams(task="t", samples=2, sampling={"top_p": 0.9})
    plan = plan_for(model, suite, suite="s", tokenizer=tiny_tokenizer())
    assert (plan.seeds, plan.sampling, plan.thinking) == ((0, 1), Sampling(0.8, 0.9, 2), None)
    assert plan_for(model, SuiteParams(task="t"), suite="s", tokenizer=tiny_tokenizer()).seeds is None  # k = 1: greedy
    with CompletionsServer(str(model)) as server:
        engine = OpenAIEngine(model, Settings(base_url=server.base_url, model="model", concurrency=1))
        engine.generate([GenRequest("Hi", 4, seed=seed, sampling=plan.sampling) for seed in plan.seeds])
    assert [{k: r["body"][k] for k in ("seed", "temperature", "top_p", "top_k")} for r in server.requests] == [
        {"seed": seed, "temperature": 0.8, "top_p": 0.9, "top_k": 2} for seed in (0, 1)]


def test_lines_and_cache_entries_written_before_thinking_still_read(tmp_path):
    from pipeline.engines import Completion, GenRequest
    from pipeline.errors import UserError
    from pipeline.formats.results import read_lines
    from pipeline.scoring.eval_cache import GenerationCache

    old = {"id": "q0", "suite": "math", "variant": "base", "prompt": "p", "target": "1", "output": "1", "score": 1.0,
           "correct": True, "n_tokens": 3, "seconds": 0.1}
    _write(tmp_path, "math", [old])
    assert read_lines(tmp_path / "math.jsonl")["q0"] == old
    sample = {"seed": 0, "output": "1", "score": 1.0, "correct": True, "reasoning_tokens": 0, "answer_tokens": 3,
              "cut": None}
    for broken, message in (({**old, "cut": "middle"}, "cut: 'middle' is not where a budget cuts an answer"),
                            ({**old, "correct": None, "samples": [sample, {**sample, "score": 0.0, "correct": False}]},
                             "score: 1 is not the mean of its 2 samples' scores"),
                            ({**old, "correct": None, "score": 0.5, "pass_at_k": False,
                              "samples": [sample, {**sample, "score": 0.0, "correct": False}]}, "pass_at_k: false")):
        _write(tmp_path, "math", [broken])
        with pytest.raises(UserError, match=message):
            read_lines(tmp_path / "math.jsonl")
    request = GenRequest("prompt", 8, ["stop"])
    assert GenerationCache.key(request) == hashlib.sha256(json.dumps(["prompt", 8, ["stop"]]).encode()).hexdigest()
    keys = {GenerationCache.key(r) for r in (request, GenRequest("prompt", 8, ["stop"], thinking=True),
                                             GenRequest("prompt", 8, ["stop"], thinking=False),
                                             GenRequest("prompt", 8, ["stop"], seed=1))}
    assert len(keys) == 4  # a greedy answer of a model that does not think keeps its key; thinking and seeds do not
    cache = GenerationCache(tmp_path / "cache.jsonl", "fp")
    cache.append([{"model": "fp", "key": GenerationCache.key(request), "text": "t", "n_tokens": 2, "seconds": 0.1}])
    assert cache.get(request) is None  # written before answers recorded their cut: asked again
    cache.put(request, Completion("t", 8, 0.1, cut="answer"))
    assert GenerationCache(tmp_path / "cache.jsonl", "fp").get(request).cut == "answer"


def test_vllm_serves_a_thinking_checkpoint_with_its_reasoning_parser(tmp_path):
    from tiny import save_tiny_glm4v
    from transformers import AutoTokenizer

    from pipeline.engines.sections import VLLMSettings
    from pipeline.engines.vllm_server import server_args

    model = save_tiny_glm4v(tmp_path / "glm4v")
    assert "--reasoning-parser" not in server_args(model, None, VLLMSettings())  # its template does not think
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = GLM_THINKING_TEMPLATE
    tok.save_pretrained(model)
    args = server_args(model, None, VLLMSettings())
    assert args[args.index("--reasoning-parser") + 1] == "glm45"
    own = server_args(model, None, VLLMSettings(server_args=["--reasoning-parser", "deepseek_r1"]))
    assert own.count("--reasoning-parser") == 1 and own[own.index("--reasoning-parser") + 1] == "deepseek_r1"


def test_the_judge_sees_a_thinking_models_answer_after_its_reasoning_with_the_thinking_budget(tmp_path, thinker):
    """judge.thinking (auto: the template's default) renders the held-out prompt as served; the answer the judge
    compares is the text after the reasoning, and the reasoning gets judge.thinking_max_new_tokens."""
    from pipeline.engines import default_settings
    from pipeline.settings.params import JudgeParams
    from pipeline.stages.judge import generate_answers

    records = [{"messages": [{"role": "user", "content": QUESTIONS[0]}]}]
    options = (default_settings("hf"), {})
    served = generate_answers(thinker, records, tmp_path / "a", "base", JudgeParams(max_new_tokens=3), options, "hf")
    assert served == [" 42"]  # max_new_tokens 3 would cut the reasoning: the thinking budget (8192) applies
    cut = generate_answers(thinker, records, tmp_path / "b", "base",
                           JudgeParams(thinking_max_new_tokens=3), options, "hf")
    assert cut == [""]  # cut inside the reasoning: no answer, and none of the reasoning shown to the judge
