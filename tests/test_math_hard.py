"""Issue 66, item 4: the hard math suite (evals/math_hard/, MATH-500). Its data are OpenAI's bytes; its scorer
(evals/math_hard/utils.py) agrees with every hand grade of a corpus of model-style answers
(tests/data/math500_graded.jsonl: equivalent forms, wrong forms that look close, no box, several boxes, cut outputs,
reasoning before the answer), beside two peers whose agreement is measured, not required: math-verify (the suite's
`math_verify` figure) and lm-eval's hendrycks_math `is_equiv` (the MATH authors' normaliser); `python
tests/test_math_hard.py` prints where each disagrees. The suite runs end to end through `quantize eval` on the tiny
model and against the project's chat test server."""

import gzip
import hashlib
import importlib.util
import json
import re
import threading
import time

import pytest

from conftest import REPO, TINY_PARAMS, read_jsonl, write_params

CORPUS = read_jsonl(REPO / "tests" / "data" / "math500_graded.jsonl")
# prm800k's Git LFS pointer for prm800k/math_splits/test.jsonl (commit 7ecc794) names this object id
PRM800K_TEST_SHA256 = "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132"
# MATH-500's subjects as published with it (HuggingFaceH4/MATH-500's card, prm800k's split)
SUBJECTS = {"Algebra": 124, "Intermediate Algebra": 97, "Prealgebra": 82, "Number Theory": 62, "Precalculus": 56,
            "Geometry": 41, "Counting & Probability": 38}


def _load_scorer():
    spec = importlib.util.spec_from_file_location("math_hard_utils", REPO / "evals" / "math_hard" / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scorer():
    return _load_scorer()


@pytest.fixture(scope="module")
def items(scorer):
    return scorer.load_math500()["test"]


def test_the_data_are_openais_math500(scorer, items):
    assert hashlib.sha256(gzip.decompress(scorer.DATA.read_bytes())).hexdigest() == PRM800K_TEST_SHA256
    assert len(items) == 500 and len(set(list(items["id"]))) == 500
    assert {s: list(items["subject"]).count(s) for s in SUBJECTS} == SUBJECTS
    first = items[0]
    assert first["id"] == "math500-precalculus-807" and scorer.doc_to_target(first) == r"\left( 3, \frac{\pi}{2} \right)"
    assert scorer.doc_to_text(first).endswith(first["problem"]) and "\\boxed{}" in scorer.doc_to_text(first)


def test_the_corpus_is_big_balanced_and_its_golds_are_the_datas(items):
    gold = dict(zip(list(items["id"]), list(items["answer"])))
    assert len(CORPUS) >= 80 and len({case["case"] for case in CORPUS}) == len(CORPUS)
    assert 30 <= sum(case["grade"] for case in CORPUS) <= len(CORPUS) - 30
    for case in CORPUS:
        assert gold[case["id"]] == case["gold"] and case["reason"].strip(), case["case"]


@pytest.mark.parametrize("case", CORPUS, ids=[case["case"] for case in CORPUS])
def test_the_scorer_agrees_with_the_hand_grade(scorer, case):
    assert scorer.is_correct(case["output"], case["gold"]) is case["grade"], scorer.final_answer(case["output"])
    assert scorer.process_results({"answer": case["gold"]}, [case["output"]])["acc"] == float(case["grade"])


def test_every_solution_of_the_data_scores_right_and_no_gold_passes_for_another(scorer, items):
    """The MATH authors wrote each solution and its answer: all 500 solutions (their last boxes) score right. Each gold
    against another item's gold (a fixed shuffle) scores wrong unless the two are the same value."""
    assert [row["id"] for row in items if not scorer.is_correct(row["solution"], row["answer"])] == []
    golds = list(items["answer"])
    others = golds[1:] + golds[:1]
    same = [(a, b) for a, b in zip(golds, others) if scorer.equivalent(a, b)]
    assert all(re.sub(r"^x=", "", scorer.normalize(a)) == re.sub(r"^x=", "", scorer.normalize(b)) for a, b in same), same
    assert ("5", "x=5") in same  # the one pair of different texts: x = 5 is 5


def test_the_answer_is_the_last_closed_box_after_the_reasoning(scorer):
    assert scorer.final_answer(r"\boxed{1} then \boxed{\frac{2}{3}}") == r"\frac{2}{3}"
    assert scorer.final_answer(r"$\boxed{1}$ and $\boxed{-2}$") == "1, -2"  # boxes that close the answer together
    assert scorer.final_answer(r"\boxed{1} is wrong; after checking every case the answer is \boxed{2}") == "2"
    assert scorer.final_answer(r"so \boxed{\frac{1}{") is None  # cut at the cap
    assert scorer.final_answer("<think>\\boxed{3}") is None  # cut in its reasoning
    assert scorer.final_answer("<think>\\boxed{3}</think>so 3") is None and scorer.final_answer("x = 3") is None


def test_normal_forms(scorer):
    assert scorer.normalize(r"\$32,\!348") == "32348"
    assert scorer.normalize(r"11,\! 111,\! 111,\! 100") == "11111111100"
    assert scorer.normalize(r"\frac{270}7\text{ degrees}") == r"\frac{270}{7}"
    assert scorer.normalize(r"864 \mbox{ inches}^2") == "864"
    assert scorer.normalize(r"x \in [-2,7]") == "[-2,7]" and scorer.normalize(r"-2 \leq x < 7") == "[-2, 7)"
    assert scorer.normalize(r"\left( 3, \dfrac{\pi}{2} \right)") == r"( 3, \frac{\pi}{2} )"


def test_the_models_text_never_runs(scorer, tmp_path):
    """sympy's parse_expr evaluates Python: nothing but numbers, operators, single letters and a list of function
    names reaches it."""
    marker = tmp_path / "ran"
    for attack in (f"__import__('os').system('touch {marker}')", "exec(chr(116)+chr(111))", "eval(x)",
                   "().__class__", "lambda: 1", "x.real", "open(x)"):
        assert scorer.to_python(attack) is None or "_" not in scorer.to_python(attack), attack
        assert not scorer.is_correct(f"\\boxed{{{attack}}}", "5")
    assert not marker.exists()
    assert scorer.to_python("eval(x)") == "e*v*a*l(x)"  # an unknown word is a product of letters, never a name


def test_a_comparison_is_time_limited_in_the_main_thread_and_in_others(scorer):
    start = time.monotonic()
    assert scorer._within(0.2, time.sleep, 3) is None
    assert time.monotonic() - start < 1.5
    box = []
    worker = threading.Thread(target=lambda: box.append(scorer._within(0.2, time.sleep, 3)))
    start = time.monotonic()
    worker.start()
    worker.join()
    assert box == [None] and time.monotonic() - start < 1.5
    assert scorer._within(1.0, lambda: 7) == 7
    start = time.monotonic()  # a power tower is refused before sympy works on it
    assert not scorer.is_correct(r"\boxed{9^{9^{9^{9}}}}", "5") and time.monotonic() - start < 1.0


def test_sympy_is_imported_before_the_timer_starts():
    """The first comparison of a process imports sympy, which takes seconds on a busy machine: outside the time limit
    (it cut the first comparison of a run, scored wrong, before)."""
    import subprocess
    import sys

    code = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("u", {str(REPO / "evals" / "math_hard" / "utils.py")!r})
u = importlib.util.module_from_spec(spec)
spec.loader.exec_module(u)
assert "sympy" not in sys.modules
real, seen = u._within, []
u._within = lambda *args: seen.append("sympy.parsing.sympy_parser" in sys.modules) or real(*args)
assert u.equivalent(r"\\sqrt{{117}}", r"3\\sqrt{{13}}") and seen == [True], seen
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------- peers

def math_verify_verdict(scorer, case) -> bool:
    return scorer.math_verify_correct(case["output"], case["gold"])


def hendrycks_verdict(scorer, case) -> bool:
    """lm-eval's hendrycks_math: the last box of the answer text, `is_equiv` with the gold (its string normaliser)."""
    from lm_eval.tasks.hendrycks_math.utils import is_equiv, last_boxed_only_string, remove_boxed

    boxed = last_boxed_only_string(scorer.answer_text(case["output"]))
    try:
        return bool(boxed) and bool(is_equiv(remove_boxed(boxed), case["gold"]))
    except (AssertionError, IndexError):  # remove_boxed asserts the \boxed{ form (an \fbox{} or `\boxed 5` fails)
        return False


KINDS = {"form": "an equivalent form of the gold answer", "close miss": "a wrong answer that looks close",
         "placement": "where the answer is: no box, several boxes, cut at the cap, after or inside the reasoning",
         "hostile": "a power tower, code in the box"}


def peer_agreement(scorer) -> dict[str, dict]:
    """{scorer: {"agree": count, "disagree": [case names], "agree_ours": count, "by_kind": {kind: count}}} over the
    corpus (agreement with the hand grade; agree_ours: with our scorer)."""
    table = {name: {"agree": 0, "disagree": [], "agree_ours": 0, "by_kind": dict.fromkeys(KINDS, 0)}
             for name in ("ours", "math-verify", "hendrycks")}
    for case in CORPUS:
        ours = scorer.is_correct(case["output"], case["gold"])
        for name, verdict in (("ours", ours), ("math-verify", math_verify_verdict(scorer, case)),
                              ("hendrycks", hendrycks_verdict(scorer, case))):
            table[name]["agree"] += verdict == case["grade"]
            table[name]["by_kind"][case["kind"]] += verdict == case["grade"]
            table[name]["agree_ours"] += verdict == ours
            if verdict != case["grade"]:
                table[name]["disagree"].append(case["case"])
    return table


def peer_rows(table: dict) -> list[str]:
    """The docs' table (docs/decision.md): per kind of case, how many each scorer grades as the hand grade does."""
    counts = {kind: sum(case["kind"] == kind for case in CORPUS) for kind in KINDS}
    rows = ["| cases | n | ours | math-verify | hendrycks_math `is_equiv` |", "|---|---|---|---|---|"]
    rows += [f"| {what} | {counts[kind]} | " + " | ".join(str(table[name]["by_kind"][kind]) for name in table) + " |"
             for kind, what in KINDS.items()]
    return rows + [f"| all | {len(CORPUS)} | " + " | ".join(str(table[name]["agree"]) for name in table) + " |"]


def test_peers_agreement_is_measured_and_stated_in_the_docs(scorer):
    table = peer_agreement(scorer)
    assert table["ours"]["disagree"] == []
    n = len(CORPUS)
    page = (REPO / "docs" / "decision.md").read_text(encoding="utf-8")
    line = next(line for line in page.splitlines() if line.startswith("| MATH-500 scoring |"))
    assert f"ours {n}/{n}" in line
    for name, shown in (("math-verify", "math-verify"), ("hendrycks", "lm-eval's hendrycks_math `is_equiv`")):
        assert f"{shown} {table[name]['agree']}/{n}" in line, (name, table[name])
    assert "\n".join(peer_rows(table)) in page
    # math-verify reads an answer where the model boxed none, and inside a box the token cap cut
    assert {"no box", "cut inside the box"} <= set(table["math-verify"]["disagree"])


# ---------------------------------------------------------------- end to end

def test_the_registry_knows_the_suite_and_the_gpu_profile_runs_it():
    import yaml

    from pipeline.profiles import stored
    from pipeline.settings import suites

    suite = suites.find("quant_math500")
    assert suite.name == "math-hard" and suite.kind == "right-wrong" and suite.card.dataset == "HuggingFaceH4/MATH-500"
    gpu = yaml.safe_load(stored("gpu", "params.yaml").read_text())
    assert gpu["suites"]["math-hard"]["task"] == "quant_math500" and gpu["suites"]["math-hard"]["max_new_tokens"] >= 8192
    demo = yaml.safe_load(stored("cpu-demo", "params.yaml").read_text())
    assert "math-hard" not in demo["suites"]  # the demo keeps its 10 minutes


def test_quantize_eval_scores_the_suite_against_a_served_model(tmp_path, tiny_llama, monkeypatch, scorer, items):
    """`quantize eval --engine openai` against the chat test server: the first five problems answered as a model
    would (reasoning, then a box), three right; the figures come back through lm-eval and the pipeline."""
    from typer.testing import CliRunner

    from chat_server import ChatServer
    from pipeline.cli.app import app

    replies = [  # the first five items: (3, pi/2), p - q, 14/3, 9, Evelyn
        "<think>r = 3, theta = pi/2</think>\n\nThe point is $\\boxed{\\left(3,\\dfrac{\\pi}{2}\\right)}$.",
        "Counting pairs gives $p - q$.\n\n$\\boxed{-q+p}$",
        "$\\boxed{4.67}$",
        "So the sum is $\\boxed{9}$.",
        "The fastest student is Evelyn.",
    ]
    problems = list(items["problem"])[:5]

    def answer(body):
        asked = body["messages"][-1]["content"]
        return next(reply for problem, reply in zip(problems, replies) if problem in asked)

    settings = json.loads(json.dumps(TINY_PARAMS))
    settings["suites"]["math-hard"] = {"task": "quant_math500", "limit": 5, "max_new_tokens": 64}
    with ChatServer(answer) as server:
        settings["engine"] = dict(name="openai", base_url=server.base_url, model="served-tiny", prompt_format="chat")
        write_params(tmp_path, settings)
        monkeypatch.chdir(tmp_path)
        result = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math-hard", "--out", "r"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "r" / "math-hard.json").read_text())
    lines = read_jsonl(tmp_path / "r" / "math-hard.jsonl")
    assert summary["n"] == 5 and summary["score"] == 3 / 5 and summary["metric"] == "acc"
    assert [line["correct"] for line in lines] == [True, True, False, True, False]
    assert [line["id"] for line in lines][:2] == ["math500-precalculus-807", "math500-intermediate_algebra-1994"]
    assert lines[2]["target"] == r"\frac{14}{3}" and "\\boxed{}" in lines[0]["prompt"]
    peer = [scorer.math_verify_correct(reply, gold) for reply, gold in zip(replies, list(items["answer"])[:5])]
    assert summary["metrics"]["math_verify,none"] == pytest.approx(sum(peer) / 5)  # the peer figure, beside acc


def test_the_suite_runs_on_the_tiny_model(tmp_path, tiny_llama):
    """The hf engine and a real (random) model: every line written with its id and gold, the outputs scored."""
    from pipeline.settings.params import Params
    from pipeline.stages import evaluate

    settings = {**TINY_PARAMS, "suites": {"math-hard": {"task": "quant_math500", "limit": 2, "max_new_tokens": 4}},
                "verdict": {**TINY_PARAMS["verdict"], "margins": {"suites": {"math-hard": 0.03}}}}
    done = evaluate.run_model(tiny_llama, Params.model_validate(settings), out_dir=tmp_path / "r", variant="base")
    [suite] = done.suites
    assert suite.figures["suite"] == "math-hard" and suite.figures["n"] == 2
    lines = read_jsonl(suite.lines)
    assert [line["target"] for line in lines] == [r"\left( 3, \frac{\pi}{2} \right)", "p - q"]
    assert all(line["correct"] is False and line["n_tokens"] <= 4 for line in lines)  # noise, cut at 4 tokens


if __name__ == "__main__":
    agreement = peer_agreement(_load_scorer())
    for name, row in agreement.items():
        print(f"{name}: {row['agree']}/{len(CORPUS)} agree with the hand grades, {row['agree_ours']} with ours; "
              f"disagree on: {', '.join(row['disagree']) or '-'}")
    print("\n".join(peer_rows(agreement)))
