"""`quantize judge`: an LLM judge compares the variant's answers with the base model's.

Both models answer the held-out user prompts (same greedy decoding, cached like `quantize
eval`). Pairwise mode (the default) shows the judge each pair twice, positions swapped; the
verdict is one of A, B and C (tie). Where the judge's engine gives log-probabilities (hf, vllm;
`judge.scoring: auto`) it is the likeliest of the three, each scored as the continuation of the
judge prompt and the cue "Final verdict: [[" (pipeline/judge/client.py): every judgment has a
verdict. Otherwise (`text`: a chat API) the reply must hold exactly one of [[A]], [[B]], [[C]];
anything else is retried once and then left unjudged. When the two orders disagree the pair counts
as a tie. The win rate is
(W + T/2) / N. Its interval: a win scores +1, a loss -1, a tie 0, so 2 x win rate - 1 is a
paired difference of proportions (wins minus losses over judged pairs), and Tango's score
interval with continuity correction (pipeline.verdict.intervals.tango_interval) covers it at every n;
the win rate's interval is that one, halved and shifted by 0.5.

Reliability is measured, not assumed: position-swap consistency, a control run judging the
base against itself (the win rate should be 0.5; the gap is the judge's noise floor), and the
correlation of preference with answer-length difference (verbosity bias). Below
`judge.min_consistency` the judge is reported unreliable and its verdict does not count.

Every judgment is appended to a cache keyed by (judge, method, prompt, answers, order): a rerun asks
the judge nothing and a crash loses at most one chunk. judge.jsonl says how each verdict was read
(`by`: logprobs, with each choice's log-probability, or text, with the reply). Failed requests (after the engine's
retries) are counted as unjudged and asked again on the next run; they never stop the stage. A reply
whose fields are not what the API specifies (a `usage` count given as text, NaN, a missing content) is
such a failure: retried, then unjudged with the reason (pipeline/engines/replies.py). Characters of a
reply that no UTF-8 file can hold (a lone "\\ud800" escape) are written as U+FFFD; judge.json counts
them (`replaced_characters`) and the report says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from pipeline.checkpoints import config_json
from pipeline.engines import Engine, EngineSettings, GenRequest
from pipeline.errors import UserError
from pipeline.scoring.eval_cache import GenerationCache, answers_fingerprint
from pipeline.formats.holdout import read_holdout
from pipeline.judge.client import Ask, Judge, JudgmentCache
from pipeline.judge.prompts import conversation_text
from pipeline.judge.scoring import ORDERS, combine, order_outcome
from pipeline.checkpoints.fingerprint import hold_weights
from pipeline.outputs import Stopwatch, json_text, write_together
from pipeline.settings.params import JudgeParams, VerdictParams, sections_with_overrides
from pipeline.verdict.judge import decide_judge, explain_judge, judge_sentence, pairwise_figures, reference_figures


SCORING_WORDS = {"logprobs": "from log-probabilities", "text": "parsed from replies"}  # judge.json's `scoring`


@dataclass
class JudgeResult:
    lines: Path
    out: Path
    figures: dict  # what the stage's JSON summary holds

    def summary(self) -> str:
        s = self.figures
        if s["mode"] == "reference":
            grade = "n/a" if s["mean_grade"] is None else f"{s['mean_grade']:.2f}"
            figures = f"{s['n']} graded, {s['unjudged']} unjudged; mean grade {grade} of 5"
        else:
            rate = "n/a" if s["win_rate"] is None else (f"{s['win_rate']:.3f} "
                                                         f"[{s['ci_low']:.3f}, {s['ci_high']:.3f}]")
            consistency = "n/a" if s["consistency"] is None else f"{s['consistency']:.0%}"
            control = ""
            if s["control_win_rate"] is not None:
                both = "n/a" if s["control_consistency"] is None else f"{s['control_consistency']:.0%}"
                control = f"; control (base vs base): win rate {s['control_win_rate']:.3f}, consistency {both}"
            figures = (f"{s['wins']} wins, {s['ties']} ties, {s['losses']} losses, {s['unjudged']} unjudged; "
                       f"win rate {rate}, consistency {consistency}{control}")
        figures += f"; verdicts {SCORING_WORDS[s['scoring']]}"
        weak = ", weak judge" if s["weak_judge"] else ""
        n = s.get("replaced_characters") or 0
        replaced = (f"; {n} character{'s' if n > 1 else ''} of the judge's replies that UTF-8 cannot hold written "
                    "as U+FFFD") if n else ""
        return f"judge: wrote {self.out} ({figures}{weak}{replaced}): {s['decision']} in {s['seconds']:.0f} s"


def run(variant_dir: Path | str, base_dir: Path | str, prompts: Path | str, out_dir: Path | str,
        settings: JudgeParams | None = None, engine: EngineSettings | None = None,
        verdict: VerdictParams | None = None, **overrides) -> JudgeResult:
    """settings: params.yaml `judge`; engine: params.yaml `engine`, whose engine (hf when it is openai: a
    server serves one checkpoint only) writes base and variant answers, the same for both, and whose
    settings an hf / vllm / lmdeploy judge runs with; verdict: params.yaml `verdict` (bootstrap,
    confidence, seed, margins.judge). Defaults in params.py and the engine's module. `overrides` (e.g. limit=3, batch_size=8, bootstrap=200)
    replace the field of that name in the first of judge, engine, verdict that has it, validated again."""
    from pipeline.engines import DEFAULT, STARTS, capability, default_settings, settings_for

    jp, e, v = sections_with_overrides(settings or JudgeParams, engine or default_settings(), verdict or VerdictParams,
                                       **overrides)
    iterations, confidence, seed = v.bootstrap, v.confidence, v.seed

    watch = Stopwatch()
    watch.starts_before = len(STARTS)
    variant_dir, base_dir, out_dir = Path(variant_dir), Path(base_dir), Path(out_dir)
    # a running server answers for no checkpoint dir: the default engine writes the answers
    answer_engine = e.name if capability(e.name, "local_weights") else DEFAULT
    options = (settings_for(e, answer_engine),
               {"log_path": out_dir / "judge.vllm.log"} if capability(answer_engine, "starts_server") else {})
    # an openai judge (weights held by a running server): the judge section's own settings
    judge_options = (settings_for(e, jp.backend) if capability(jp.backend, "local_weights") else None,
                     {"log_path": out_dir / "judge-model.vllm.log"} if capability(jp.backend, "starts_server") else {})
    from pipeline.checkpoints import headers

    for model_dir in (variant_dir, base_dir):  # both whole before either loads
        headers.check(model_dir)
    held = hold_weights(variant_dir)  # whose answers are judged: checked again before the results are written
    records = read_holdout(Path(prompts), limit=jp.limit, purpose="judge prompts")
    factory, judge_id, description, weak = judge_engine(jp, base_dir, judge_options)  # bad judge settings fail first
    base_answers = generate_answers(base_dir, records, out_dir, "base", jp, options, answer_engine)
    variant_answers = generate_answers(variant_dir, records, out_dir, "variant", jp, options, answer_engine)
    judge = Judge(factory, judge_id, JudgmentCache(out_dir / ".cache" / "judgments.jsonl"), mode=jp.mode,
                  scoring=jp.scoring_method, max_new_tokens=jp.judge_max_new_tokens, chunk=max(jp.concurrency * 4, 16))
    try:
        if jp.mode == "pairwise":
            lines, summary = judge_pairwise(judge, records, base_answers, variant_answers, jp.control,
                                            iterations=iterations, confidence=confidence, seed=seed)
        else:
            lines, summary = judge_reference(judge, records, base_answers, variant_answers,
                                             iterations=iterations, confidence=confidence, seed=seed)
    finally:
        judge.close()
    summary["replaced_characters"] = replaced_characters(lines)
    summary["checkpoint"] = held.checked("judge stage")  # whose answers were judged: the report checks it
    summary = _finish_summary(summary, jp, v.margins.judge, variant_dir, base_dir, description, weak, judge,
                              confidence, watch)
    lines_path = out_dir / "judge.jsonl"
    write_together({lines_path: "".join(json.dumps(l, ensure_ascii=False) + "\n" for l in lines),
                    out_dir / "judge.json": json_text(summary)})  # both or neither: a refused write changes none
    return JudgeResult(lines_path, out_dir / "judge.json", summary)


def _finish_summary(summary, jp, margin, variant_dir, base_dir, description, weak, judge, confidence,
                    watch) -> dict:
    summary = {"variant": variant_dir.name, "base": str(base_dir), "mode": jp.mode, "judge": description,
               "judge_backend": jp.backend, "scoring": judge.scoring, "weak_judge": weak, "confidence": confidence,
               "margin": margin, "min_consistency": jp.min_consistency, **summary}
    summary["reliable"] = _reliable(summary, jp.min_consistency)
    summary["decision"] = decide_judge(summary, margin, jp.min_consistency)
    summary["reasons"] = explain_judge(summary, summary["decision"], margin, jp.min_consistency)
    summary["sentence"] = judge_sentence(summary, summary["decision"], margin, jp.min_consistency)
    summary["judge_requests"] = judge.requests
    from pipeline.engines import engine_start_seconds

    summary["engine_start_s"] = engine_start_seconds(watch.starts_before)  # answer and judge engines made
    summary["seconds"] = round(watch.seconds, 2)
    return summary


def replaced_characters(lines: list[dict]) -> int:
    """Characters of the judge's replies that no UTF-8 file can hold (unpaired UTF-16 surrogates), written
    to judge.jsonl as U+FFFD: every judgment's `replaced`, the control run's included."""
    judgments = [j for l in lines for j in l.get("judgments", []) + (l.get("control") or {}).get("judgments", [])]
    judgments += [l["judgment"] for l in lines if "judgment" in l]
    return sum(j.get("replaced", 0) for j in judgments)


def _reliable(summary: dict, min_consistency: float) -> bool:
    if summary["mode"] != "pairwise":
        return bool(summary["n"])
    return summary["consistency"] is not None and summary["consistency"] >= min_consistency


def generate_answers(model_dir: Path, records: list[dict], out_dir: Path, label: str, jp,
                     engine_options: tuple[EngineSettings, dict], engine_name: str) -> list[str]:
    """Greedy answers to each held-out conversation, through the eval stage's resume cache, as the model is served:
    a reasoning model thinking as judge.thinking says (its template's default), its answer the text after the
    reasoning, which the judge sees alone. The engine is made only when something is missing, and closed after (a
    GPU engine holds memory)."""
    from transformers import AutoTokenizer

    from pipeline.engines import make_engine
    from pipeline.engines.reasoning import resolve_thinking
    from pipeline.formats.chat import render_prompt

    cache = GenerationCache(out_dir / ".cache" / f"judge-answers-{label}.jsonl",
                            answers_fingerprint(model_dir, engine_name, engine_options[0]))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    thinking = resolve_thinking(jp.thinking, tokenizer, key="judge.thinking", model=str(model_dir))
    budget = jp.thinking_max_new_tokens if thinking else jp.max_new_tokens
    requests = [GenRequest(render_prompt(tokenizer, r["messages"], thinking), budget, thinking=thinking)
                for r in records]
    todo = list({cache.key(r): r for r in requests if cache.get(r) is None}.values())
    if todo:
        from pipeline.console import progress

        settings, stage = engine_options
        engine = make_engine(engine_name, model_dir, settings, **stage)
        chunk = len(todo) if getattr(engine, "in_flight", None) else settings.batch_size  # a server: all at once
        try:
            with progress(f"judge: {label} answers", len(todo), "answers") as advance:
                for start in range(0, len(todo), chunk):
                    part = todo[start:start + chunk]

                    def done(i: int, completion, part=part) -> None:  # cached as each answer finishes
                        if not completion.error:  # a refused request is asked again on the rerun
                            cache.put(part[i], completion)
                        advance(1)

                    failed = [c.error for c in engine.generate(part, on_done=done) if c.error]
                    if failed:
                        raise UserError(f"engine {engine_name}: {len(failed)} of {len(part)} {label} answers failed "
                                        f"(the first: {failed[0]}); the finished ones are cached, rerun the same "
                                        "command to resume once the engine answers")
        finally:
            engine.close()
    return [cache.get(r).text for r in requests]


def judge_engine(jp, base_dir: Path, engine_options: tuple[EngineSettings | None, dict]
                 ) -> tuple[Callable[[], Engine], str, str, bool]:
    """(factory, cache id, description for the report, weak: the judge is the base model itself). engine_options:
    a local judge's (settings, what the stage supplies make_engine); a served judge takes the judge section's."""
    from pipeline.engines import ENGINES, capability, make_engine, require

    if not capability(jp.backend, "local_weights"):  # a server already running holds the judge's weights
        parts = urlsplit(jp.base_url or "")
        where = f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"
        if not jp.base_url:
            raise UserError(f"params.yaml: judge.base_url: the {jp.backend} backend needs the endpoint's base URL, "
                            "e.g. http://127.0.0.1:8000/v1")
        if jp.model == "base":
            raise UserError(f"params.yaml: judge.model: with the {jp.backend} backend, set the served model's name "
                            "(e.g. gpt-4o-mini, or the name your vLLM/lmdeploy server was started with)")
        served = ENGINES[jp.backend].settings(base_url=jp.base_url, model=jp.model, api_key_env=jp.api_key_env,
                                              concurrency=jp.concurrency, timeout=jp.timeout, retries=jp.retries,
                                              prompt_format="chat")
        options = dict(params_section="judge", backoff=jp.backoff, retry_on_length=True)
        make_engine(jp.backend, None, served, **options)  # fail now, not mid-run, on a missing key or URL
        return (lambda: make_engine(jp.backend, None, served, **options)), f"{jp.backend}:{where}:{jp.model}", \
            f"{jp.model} at {where} ({jp.backend} API)", False
    model_dir = base_dir if jp.model == "base" else Path(jp.model)
    if not config_json.present(model_dir):
        raise UserError(f"params.yaml: judge.model: {model_dir} has no config.json; use 'base' or a checkpoint dir")
    if model_dir != base_dir:
        from pipeline.checkpoints import headers

        headers.check(model_dir)
    require(jp.backend)  # fail now, not after the answers, when the engine's extra is missing (lmdeploy)
    weak = model_dir.resolve() == base_dir.resolve()
    description = f"{model_dir} ({jp.backend})" + (" - the base model judging itself" if weak else "")
    settings, stage = engine_options
    return (lambda: make_engine(jp.backend, model_dir, settings, **stage)), \
        f"{jp.backend}:{answers_fingerprint(model_dir, jp.backend, settings)}", description, weak


def judge_pairwise(judge: Judge, records: list[dict], base_answers: list[str], variant_answers: list[str],
                   control: bool, **stats) -> tuple[list[dict], dict]:
    questions = [conversation_text(r["messages"]) for r in records]
    main = [_pair_asks(judge, q, b, v) for q, b, v in zip(questions, base_answers, variant_answers)]
    ctrl = [_pair_asks(judge, q, b, b) for q, b in zip(questions, base_answers)] if control else []
    results = judge.judge([a for pair in main + ctrl for a in pair])
    lines = []
    for i, record in enumerate(records):
        line = {"id": record.get("id", str(i)), "prompt": record.get("prompt", questions[i]),
                "base_answer": base_answers[i], "variant_answer": variant_answers[i],
                **_pair_result([results[a.key] for a in main[i]])}
        if control:
            line["control"] = _pair_result([results[a.key] for a in ctrl[i]])
        line["length_diff"] = len(variant_answers[i]) - len(base_answers[i])
        lines.append(line)
    return lines, pairwise_figures(lines, control, **stats)


def _pair_asks(judge: Judge, question: str, base: str, variant: str) -> list[Ask]:
    asks = []
    for order, variant_is_a in ORDERS:
        a, b = (variant, base) if variant_is_a else (base, variant)
        asks.append(judge.ask_pairwise(judge.key(question, a, b, order), question, a, b))
    return asks


def _judgment(r: dict) -> dict:
    """What judge.jsonl keeps of a judgment: how it was read, the reply (text) or each choice's log-probability
    (logprobs), the attempts and any error."""
    return {"by": r["by"], **{k: r[k] for k in ("raw", "logprobs") if k in r}, "attempts": r["attempts"],
            "error": r["error"], **({"raw_first": r["raw_first"]} if "raw_first" in r else {}),
            **({"replaced": r["replaced"]} if r.get("replaced") else {})}


def _unjudged_reason(r: dict, what: str) -> str:
    if r["error"]:
        return "request failed"
    return "no single likeliest choice" if r["by"] == "logprobs" else f"unparsable {what}"


def _pair_result(records: list[dict]) -> dict:
    judgments = []
    for (order, variant_is_a), r in zip(ORDERS, records):
        judgments.append({"order": order, "verdict": r["parsed"], "outcome": order_outcome(r["parsed"], variant_is_a),
                          **_judgment(r)})
    outcome, consistent = combine(judgments[0]["outcome"], judgments[1]["outcome"])
    reason = None
    if outcome == "unjudged":
        reason = _unjudged_reason(next(j for j in judgments if j["outcome"] is None), "verdict")
    return {"judgments": judgments, "outcome": outcome, "consistent": consistent, "unjudged_reason": reason}


def judge_reference(judge: Judge, records: list[dict], base_answers: list[str], variant_answers: list[str],
                    **stats) -> tuple[list[dict], dict]:
    questions = [conversation_text(r["messages"]) for r in records]
    asks = [judge.ask_reference(judge.key(q, b, v, "reference"), q, b, v)
            for q, b, v in zip(questions, base_answers, variant_answers)]
    results = judge.judge(asks)
    lines = []
    for i, (record, ask) in enumerate(zip(records, asks)):
        r = results[ask.key]
        lines.append({"id": record.get("id", str(i)), "prompt": record.get("prompt", questions[i]),
                      "base_answer": base_answers[i], "variant_answer": variant_answers[i],
                      "judgment": _judgment(r), "grade": r["parsed"], "outcome": "graded" if r["parsed"] else "unjudged",
                      "unjudged_reason": None if r["parsed"] else _unjudged_reason(r, "grade"),
                      "length_diff": len(variant_answers[i]) - len(base_answers[i])})
    return lines, reference_figures(lines, **stats)
