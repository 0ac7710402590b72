"""`quantize judge`: an LLM judge compares the variant's answers with the base model's.

Both models answer the held-out user prompts (same greedy decoding, cached like `quantize
eval`). Pairwise mode (the default) shows the judge each pair twice, positions swapped; the
verdict must be exactly one of [[A]], [[B]], [[C]] (tie), anything else is retried once and
then left unjudged; when the two orders disagree the pair counts as a tie. The win rate is
(W + T/2) / N. Its interval: a win scores +1, a loss -1, a tie 0, so 2 x win rate - 1 is a
paired difference of proportions (wins minus losses over judged pairs), and Tango's score
interval with continuity correction (pipeline.verdict.tango_interval) covers it at every n;
the win rate's interval is that one, halved and shifted by 0.5.

Reliability is measured, not assumed: position-swap consistency, a control run judging the
base against itself (the win rate should be 0.5; the gap is the judge's noise floor), and the
correlation of preference with answer-length difference (verbosity bias). Below
`judge.min_consistency` the judge is reported unreliable and its verdict does not count.

Every judgment is appended to a cache keyed by (judge, prompt, answers, order): a rerun asks
the judge nothing and a crash loses at most one chunk. Failed requests (after the engine's
retries) are counted as unjudged and asked again on the next run; they never stop the stage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import numpy as np

from pipeline.engines import Completion, Engine, GenRequest
from pipeline.errors import UserError
from pipeline.evaluate import EVALS_DIR, GenerationCache, model_fingerprint
from pipeline.outputs import Stopwatch, write_atomic, write_json
from pipeline.verdict import GO, INCONCLUSIVE, NO_GO, TANGO, decide, min_items_for_go, paired_bootstrap, tango_interval

log = logging.getLogger(__name__)

TEMPLATES = EVALS_DIR / "judge"
UNRELIABLE = "UNRELIABLE"
VERDICT = re.compile(r"\[\[([ABC])\]\]")
GRADE = re.compile(r"\[\[([1-5])\]\]")
SCORE = {"win": 1.0, "tie": 0.5, "loss": 0.0}
WIN_RATE_INTERVAL = f"{TANGO} on wins against losses, halved and shifted by 0.5"
REMINDER = {
    "pairwise": "Your reply did not end with a verdict in the required format. Reply with exactly one of "
                "[[A]], [[B]] or [[C]] and nothing else.",
    "reference": "Your reply did not contain a rating in the required format. Reply with exactly one rating "
                 "from [[1]] to [[5]] and nothing else.",
}
# The two orders of a pair: which side the variant's answer sits on.
ORDERS = (("base-first", False), ("variant-first", True))


# ---------------------------------------------------------------- parsing and scoring

def parse_verdict(text: str) -> str | None:
    """'A', 'B' or 'C' when the text holds exactly one distinct [[X]] verdict; else None."""
    found = set(VERDICT.findall(text or ""))
    return found.pop() if len(found) == 1 else None


def parse_grade(text: str) -> int | None:
    found = set(GRADE.findall(text or ""))
    return int(found.pop()) if len(found) == 1 else None


def order_outcome(verdict: str | None, variant_is_a: bool) -> str | None:
    """The verdict of one order from the variant's side: win, tie, loss (None: unjudged)."""
    if verdict is None:
        return None
    if verdict == "C":
        return "tie"
    return "win" if (verdict == "A") == variant_is_a else "loss"


def combine(first: str | None, second: str | None) -> tuple[str, bool | None]:
    """Outcome of a pair from its two orders, and whether they agreed (None: not both judged)."""
    if first is None or second is None:
        return "unjudged", None
    if first == second:
        return first, True
    return "tie", False


def win_rate(outcomes: list[str], *, confidence: float = 0.95) -> dict:
    """Win rate (W + T/2) / N over judged pairs, with Tango's continuity-corrected score interval for
    (W - L) / N mapped onto the win-rate scale (0.5 + change / 2): exact coverage >= 0.95 for n = 4..200
    (benchmarks/interval_coverage.py), where a percentile bootstrap covered 0.89 at n = 4."""
    counts = Counter(outcomes)
    wins, ties, losses = counts["win"], counts["tie"], counts["loss"]
    judged = wins + ties + losses
    low = high = None
    if judged:
        change_low, change_high = tango_interval(wins, losses, judged, confidence)
        low, high = 0.5 + change_low / 2, 0.5 + change_high / 2
    return {
        "n": judged, "wins": wins, "ties": ties, "losses": losses, "unjudged": counts["unjudged"],
        "win_rate": (wins + ties / 2) / judged if judged else None,
        "ci_low": low, "ci_high": high, "ci_method": WIN_RATE_INTERVAL,
    }


def correlation(x: list[float], y: list[float]) -> float | None:
    """Pearson correlation, None when undefined (fewer than 3 points or a constant series)."""
    if len(x) < 3 or np.std(x) == 0 or np.std(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def decide_judge(summary: dict, margin: float, min_consistency: float) -> str:
    """GO when the win rate's interval lies above 0.5 - margin, NO-GO when below; UNRELIABLE when
    the judge contradicts itself too often for its verdict to count."""
    if summary.get("mode", "pairwise") != "pairwise" or not summary.get("n"):
        return INCONCLUSIVE
    consistency = summary.get("consistency")
    if consistency is None or consistency < min_consistency:
        return UNRELIABLE
    return decide(summary["ci_low"] - 0.5, summary["ci_high"] - 0.5, margin)


def explain_judge(summary: dict, decision: str, margin: float, min_consistency: float) -> list[str]:
    reasons = []
    if summary.get("weak_judge"):
        reasons.append("the judge is the base model itself: a weak judge, biased towards its own answers "
                       "and often unable to tell answers apart; use a stronger model for a real verdict")
    if summary.get("mode") == "reference":
        return reasons + ["reference mode grades the variant 1-5 against the base answer; it has no GO "
                          "threshold, so it informs but does not decide (use judge.mode: pairwise)"]
    if not summary.get("n"):
        return reasons + ["no pair was judged: every prompt is unjudged"]
    if decision == UNRELIABLE:
        consistency = summary.get("consistency")
        shown = "n/a" if consistency is None else f"{consistency:.0%}"
        return reasons + [f"position-swap consistency {shown} is below judge.min_consistency "
                          f"{min_consistency:.0%}: the judge is unreliable and its verdict is not counted"]
    interval = f"win rate {summary['win_rate']:.3f}, interval [{summary['ci_low']:.3f}, {summary['ci_high']:.3f}]"
    floor = 0.5 - margin
    text = {GO: f"{interval} lies above {floor:.3f} (0.5 - margin): the variant is not judged worse",
            NO_GO: f"{interval} lies below {floor:.3f} (0.5 - margin): the judge prefers the base",
            INCONCLUSIVE: f"{interval} straddles {floor:.3f} (0.5 - margin): not enough evidence either way"}
    reasons.append(text[decision])
    fewest = min_judged_pairs_for_go(margin, summary.get("confidence", 0.95))
    if fewest and summary["n"] < fewest and decision != NO_GO:
        reasons.append(f"too few judged pairs to ever show a GO: with {summary['n']} even all ties leave the "
                       f"interval's lower end below {floor:.3f}; a GO needs at least {fewest} judged pairs")
    if summary.get("noise_floor") is not None and summary["noise_floor"] > margin:
        reasons.append(f"the control run (base against itself) is off 0.5 by {summary['noise_floor']:.3f}, "
                       f"more than the margin {margin:.3f}: read the verdict with care")
    return reasons


def min_judged_pairs_for_go(margin: float, confidence: float = 0.95) -> int | None:
    """Fewest judged pairs with which the judge can show a GO at all (every pair a tie): the win
    rate's lower end is 0.5 + change / 2, so the change must clear -2 x margin."""
    return min_items_for_go(2 * margin, confidence) if margin > 0 else None


def judge_sentence(summary: dict, decision: str, margin: float, min_consistency: float) -> str:
    """The judge's decision in one sentence a reviewer can check: the counts, the interval (which
    method, its ends), the threshold 0.5 - margin and what follows."""
    if summary.get("mode") == "reference":
        grade = summary.get("mean_grade")
        shown = "no answer graded" if grade is None else f"mean grade {grade:.2f} of 5 over {summary['n']} answers"
        return (f"judge (reference mode): {decision}: {shown}; reference mode has no GO threshold, so it informs "
                "but does not decide.")
    if not summary.get("n"):
        return (f"judge: {decision}: no pair was judged ({summary.get('unjudged', 0)} unjudged), so the judge "
                "says nothing about the variant.")
    counts = (f"of {summary['n']} judged pairs the judge preferred the variant in {summary['wins']}, the base in "
              f"{summary['losses']} and tied {summary['ties']} (win rate {summary['win_rate']:.3f})")
    if decision == UNRELIABLE:
        consistency = summary.get("consistency")
        shown = "n/a" if consistency is None else f"{consistency:.0%}"
        return (f"judge: UNRELIABLE (not counted): {counts}, but it gave the same verdict with the answers swapped "
                f"in only {shown} of pairs, below judge.min_consistency {min_consistency:.0%}.")
    floor = 0.5 - margin
    method = summary.get("ci_method") or "a bootstrap interval"
    interval = (f"{method} puts the win rate at [{summary['ci_low']:.3f}, {summary['ci_high']:.3f}] with "
                f"{summary.get('confidence', 0.95):.0%} confidence")
    threshold = f"{floor:.3f} (0.5 - margin {margin:.2f})"
    if decision == GO:
        end = f"entirely above {threshold}, so the judge does not find the variant worse by more than the margin"
    elif decision == NO_GO:
        end = f"entirely below {threshold}, so the judge prefers the base by more than the margin"
    else:
        end = f"which straddles {threshold}, so the judgments settle nothing"
        fewest = min_judged_pairs_for_go(margin, summary.get("confidence", 0.95))
        if fewest and summary["n"] < fewest:
            end += f" (below {fewest} judged pairs not even all ties could show a GO)"
    return f"judge: {decision}: {counts}; {interval}, {end}."


# ---------------------------------------------------------------- prompts

def render(template: str, **values: str) -> str:
    """Fills {name} placeholders in one pass, so braces inside answers are left alone."""
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), template)


def conversation_text(messages: list[dict]) -> str:
    if len(messages) == 1:
        return messages[0]["content"]
    return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)


def load_template(mode: str) -> str:
    path = TEMPLATES / f"{mode}.txt"
    if not path.exists():
        raise UserError(f"{path}: judge prompt missing; it ships with the project (evals/judge/)")
    return path.read_text(encoding="utf-8")


def load_prompts(path: Path, limit: int | None) -> list[dict]:
    if not path.exists():
        raise UserError(f"{path}: no held-out prompts; run `quantize calib` first (it writes holdout.jsonl)")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not record["messages"] or record["messages"][-1]["role"] != "user":
                raise ValueError("messages must end with a user turn")
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise UserError(f"{path}:{number}: not a holdout record ({exc}); expected "
                            '{"id", "messages": [... ending with the user turn], "prompt"}') from None
        records.append(record)
    if not records:
        raise UserError(f"{path}: no held-out prompts in the file")
    return records[:limit] if limit else records


# ---------------------------------------------------------------- the judgment cache and the judge

class JudgmentCache:
    """Append-only JSONL of finished judgments by key; a torn last line (SIGKILL) is ignored."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, dict] = {}
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self.entries[entry["key"]] = entry
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue

    @staticmethod
    def key(*parts) -> str:
        return hashlib.sha256(json.dumps(parts, ensure_ascii=False).encode()).hexdigest()

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put_many(self, entries: list[dict]) -> None:
        if not entries:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            for entry in entries:
                self.entries[entry["key"]] = entry
                handle.write(json.dumps(entry, ensure_ascii=False) + "\n")
            handle.flush()


@dataclass
class Ask:
    key: str
    messages: list[dict]


class Judge:
    """Sends judge prompts through any Engine, parses strictly, retries an unparsable reply once.

    The engine is made on the first cache miss, so a fully cached rerun loads no model and
    sends no request. Judgments that the judge actually gave (parsable or not) are cached;
    failed requests are not, so the next run asks again.
    """

    def __init__(self, engine_factory: Callable[[], Engine], judge_id: str, cache: JudgmentCache, *,
                 mode: str = "pairwise", max_new_tokens: int = 512, chunk: int = 16):
        self._factory, self._engine = engine_factory, None
        self.judge_id, self.cache, self.mode = judge_id, cache, mode
        self.parse = parse_verdict if mode == "pairwise" else parse_grade
        self.template = load_template(mode)
        self.template_hash = hashlib.sha256(self.template.encode()).hexdigest()[:16]
        self.max_new_tokens, self.chunk = max_new_tokens, chunk
        self.requests = 0  # sent to the engine this run

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = self._factory()
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def key(self, *parts) -> str:
        return JudgmentCache.key(self.judge_id, self.mode, self.template_hash, *parts)

    def ask_pairwise(self, key: str, question: str, answer_a: str, answer_b: str) -> Ask:
        content = render(self.template, question=question, answer_a=answer_a, answer_b=answer_b)
        return Ask(key, [{"role": "user", "content": content}])

    def ask_reference(self, key: str, question: str, reference: str, answer: str) -> Ask:
        content = render(self.template, question=question, reference=reference, answer=answer)
        return Ask(key, [{"role": "user", "content": content}])

    def judge(self, asks: list[Ask]) -> dict[str, dict]:
        """key -> {"raw", "parsed", "attempts", "error"} for every ask."""
        results = {a.key: self.cache.get(a.key) for a in asks if self.cache.get(a.key)}
        todo = list({a.key: a for a in asks if a.key not in results}.values())
        for start in range(0, len(todo), self.chunk):
            part = todo[start:start + self.chunk]
            done = self._judge_chunk(part)
            self.cache.put_many([done[a.key] for a in part if done[a.key]["error"] is None])
            results.update(done)
        return results

    def _judge_chunk(self, asks: list[Ask]) -> dict[str, dict]:
        first = self._generate([a.messages for a in asks])
        results = {a.key: self._record(a.key, c, attempts=1) for a, c in zip(asks, first)}
        retry = [(a, c) for a, c in zip(asks, first) if results[a.key]["error"] is None
                 and results[a.key]["parsed"] is None]
        if retry:
            again = self._generate([a.messages + [{"role": "assistant", "content": c.text},
                                                  {"role": "user", "content": REMINDER[self.mode]}]
                                    for a, c in retry])
            for (ask, old), new in zip(retry, again):
                record = self._record(ask.key, new, attempts=2)
                record["raw_first"] = old.text
                results[ask.key] = record
        return results

    def _generate(self, conversations: list[list[dict]]) -> list[Completion]:
        requests = [GenRequest(self.engine.apply_chat_template(m), self.max_new_tokens) for m in conversations]
        self.requests += len(requests)
        return self.engine.generate(requests)

    def _record(self, key: str, completion: Completion, attempts: int) -> dict:
        if completion.error:
            log.warning("judge request failed: %s", completion.error)
        parsed = None if completion.error else self.parse(completion.text)
        return {"key": key, "raw": completion.text, "parsed": parsed, "attempts": attempts,
                "error": completion.error}


# ---------------------------------------------------------------- the stage

@dataclass
class JudgeResult:
    lines: Path
    out: Path
    summary: dict

    def summary_line(self) -> str:
        s = self.summary
        if s["mode"] == "reference":
            grade = "n/a" if s["mean_grade"] is None else f"{s['mean_grade']:.2f}"
            figures = f"{s['n']} graded, {s['unjudged']} unjudged; mean grade {grade} of 5"
        else:
            rate = "n/a" if s["win_rate"] is None else (f"{s['win_rate']:.3f} "
                                                         f"[{s['ci_low']:.3f}, {s['ci_high']:.3f}]")
            consistency = "n/a" if s["consistency"] is None else f"{s['consistency']:.0%}"
            figures = (f"{s['wins']} wins, {s['ties']} ties, {s['losses']} losses, {s['unjudged']} unjudged; "
                       f"win rate {rate}, consistency {consistency}")
        weak = ", weak judge" if s["weak_judge"] else ""
        return f"judge: wrote {self.out} ({figures}{weak}): {s['decision']} in {s['seconds']:.0f} s"


def run(variant_dir: Path | str, base_dir: Path | str, prompts: Path | str, out_dir: Path | str,
        judge_params, engine_options: dict | None = None, *, answer_engine: str = "hf", iterations: int = 2000,
        confidence: float = 0.95, seed: int = 0, judge_engine_options: dict | None = None) -> JudgeResult:
    """answer_engine: the engine (hf, vllm or lmdeploy) that writes base and variant answers, the same for
    both; judge_engine_options: settings of judge.backend's engine (default: engine_options)."""
    watch = Stopwatch()
    variant_dir, base_dir, out_dir = Path(variant_dir), Path(base_dir), Path(out_dir)
    from pipeline.checkpoints import inspect

    for model_dir in (variant_dir, base_dir):  # both whole before either loads
        inspect.check(model_dir)
    jp = judge_params
    records = load_prompts(Path(prompts), jp.limit)
    options = dict(engine_options or {})
    judge_options = dict(judge_engine_options if judge_engine_options is not None else options)
    factory, judge_id, description, weak = judge_engine(jp, base_dir, judge_options)  # bad judge settings fail first
    base_answers = generate_answers(base_dir, records, out_dir, "base", jp.max_new_tokens, options, answer_engine)
    variant_answers = generate_answers(variant_dir, records, out_dir, "variant", jp.max_new_tokens, options,
                                       answer_engine)
    judge = Judge(factory, judge_id, JudgmentCache(out_dir / ".cache" / "judgments.jsonl"), mode=jp.mode,
                  max_new_tokens=jp.judge_max_new_tokens, chunk=max(jp.concurrency * 4, 16))
    try:
        if jp.mode == "pairwise":
            lines, summary = judge_pairwise(judge, records, base_answers, variant_answers, jp.control,
                                            iterations=iterations, confidence=confidence, seed=seed)
        else:
            lines, summary = judge_reference(judge, records, base_answers, variant_answers,
                                             iterations=iterations, confidence=confidence, seed=seed)
    finally:
        judge.close()
    summary = _finish_summary(summary, jp, variant_dir, base_dir, description, weak, judge, confidence, watch)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines_path = out_dir / "judge.jsonl"
    write_atomic(lines_path, "".join(json.dumps(l, ensure_ascii=False) + "\n" for l in lines))
    write_json(out_dir / "judge.json", summary)
    return JudgeResult(lines_path, out_dir / "judge.json", summary)


def _finish_summary(summary, jp, variant_dir, base_dir, description, weak, judge, confidence, watch) -> dict:
    summary = {"variant": variant_dir.name, "base": str(base_dir), "mode": jp.mode, "judge": description,
               "judge_backend": jp.backend, "weak_judge": weak, "confidence": confidence,
               "margin": jp.margin, "min_consistency": jp.min_consistency, **summary}
    summary["reliable"] = _reliable(summary, jp.min_consistency)
    summary["decision"] = decide_judge(summary, jp.margin, jp.min_consistency)
    summary["reasons"] = explain_judge(summary, summary["decision"], jp.margin, jp.min_consistency)
    summary["sentence"] = judge_sentence(summary, summary["decision"], jp.margin, jp.min_consistency)
    summary["judge_requests"] = judge.requests
    summary["seconds"] = round(watch.seconds, 2)
    return summary


def _reliable(summary: dict, min_consistency: float) -> bool:
    if summary["mode"] != "pairwise":
        return bool(summary["n"])
    return summary["consistency"] is not None and summary["consistency"] >= min_consistency


def generate_answers(model_dir: Path, records: list[dict], out_dir: Path, label: str, max_new_tokens: int,
                     engine_options: dict, engine_name: str = "hf") -> list[str]:
    """Greedy answers to each held-out conversation, through the eval stage's resume cache. The
    engine is made only when something is missing, and closed after (a GPU engine holds memory)."""
    from transformers import AutoTokenizer

    from pipeline.engines import chat_prompt, make_engine

    cache = GenerationCache(out_dir / ".cache" / f"judge-answers-{label}.jsonl", model_fingerprint(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = [GenRequest(chat_prompt(tokenizer, r["messages"]), max_new_tokens) for r in records]
    todo = list({cache.key(r): r for r in requests if cache.get(r) is None}.values())
    if todo:
        engine = make_engine(engine_name, model_dir, **engine_options)
        chunk = engine_options.get("batch_size", 32)
        try:
            for start in range(0, len(todo), chunk):
                part = todo[start:start + chunk]
                cache.put_many(part, engine.generate(part))
        finally:
            engine.close()
    return [cache.get(r).text for r in requests]


def judge_engine(jp, base_dir: Path, engine_options: dict) -> tuple[Callable[[], Engine], str, str, bool]:
    """(factory, cache id, description for the report, weak: the judge is the base model itself)."""
    from pipeline.engines import make_engine

    if jp.backend == "openai":
        parts = urlsplit(jp.base_url or "")
        where = f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"
        if not jp.base_url:
            raise UserError("params.yaml: judge.base_url: the openai backend needs the endpoint's base URL, "
                            "e.g. http://127.0.0.1:8000/v1")
        if jp.model == "base":
            raise UserError("params.yaml: judge.model: with the openai backend, set the served model's name "
                            "(e.g. gpt-4o-mini, or the name your vLLM/lmdeploy server was started with)")
        options = dict(base_url=jp.base_url, model=jp.model, api_key_env=jp.api_key_env, concurrency=jp.concurrency,
                       timeout=jp.timeout, retries=jp.retries, backoff=jp.backoff, retry_on_length=True)
        make_engine("openai", None, **options)  # fail now, not mid-run, on a missing key or URL
        return (lambda: make_engine("openai", None, **options)), f"openai:{where}:{jp.model}", \
            f"{jp.model} at {where} (openai API)", False
    model_dir = base_dir if jp.model == "base" else Path(jp.model)
    if not (model_dir / "config.json").exists():
        raise UserError(f"params.yaml: judge.model: {model_dir} has no config.json; use 'base' or a checkpoint dir")
    if model_dir != base_dir:
        from pipeline.checkpoints import inspect

        inspect.check(model_dir)
    if jp.backend == "lmdeploy":
        from pipeline.engines.lmdeploy import require_lmdeploy

        require_lmdeploy()  # fail now, not after the answers, when the GPU extra is missing
    weak = model_dir.resolve() == base_dir.resolve()
    description = f"{model_dir} ({jp.backend})" + (" - the base model judging itself" if weak else "")
    return (lambda: make_engine(jp.backend, model_dir, **engine_options)), \
        f"{jp.backend}:{model_fingerprint(model_dir)}", description, weak


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
    return lines, _pairwise_summary(lines, control, **stats)


def _pair_asks(judge: Judge, question: str, base: str, variant: str) -> list[Ask]:
    asks = []
    for order, variant_is_a in ORDERS:
        a, b = (variant, base) if variant_is_a else (base, variant)
        asks.append(judge.ask_pairwise(judge.key(question, a, b, order), question, a, b))
    return asks


def _pair_result(records: list[dict]) -> dict:
    judgments = []
    for (order, variant_is_a), r in zip(ORDERS, records):
        judgments.append({"order": order, "raw": r["raw"], "verdict": r["parsed"],
                          "outcome": order_outcome(r["parsed"], variant_is_a), "attempts": r["attempts"],
                          "error": r["error"], **({"raw_first": r["raw_first"]} if "raw_first" in r else {})})
    outcome, consistent = combine(judgments[0]["outcome"], judgments[1]["outcome"])
    reason = None
    if outcome == "unjudged":
        failed = next(j for j in judgments if j["outcome"] is None)
        reason = "request failed" if failed["error"] else "unparsable verdict"
    return {"judgments": judgments, "outcome": outcome, "consistent": consistent, "unjudged_reason": reason}


def _pairwise_summary(lines: list[dict], control: bool, *, confidence: float = 0.95, **_bootstrap) -> dict:
    summary = win_rate([l["outcome"] for l in lines], confidence=confidence)
    both = [l["consistent"] for l in lines if l["consistent"] is not None]
    summary["consistency"] = sum(both) / len(both) if both else None
    summary["unjudged_reasons"] = dict(Counter(l["unjudged_reason"] for l in lines if l["unjudged_reason"]))
    judged = [l for l in lines if l["outcome"] in SCORE]
    summary["length_bias"] = correlation([l["length_diff"] for l in judged], [SCORE[l["outcome"]] for l in judged])
    summary["control_win_rate"] = summary["noise_floor"] = summary["control_consistency"] = None
    if control:
        ctrl = win_rate([l["control"]["outcome"] for l in lines], confidence=confidence)
        both = [l["control"]["consistent"] for l in lines if l["control"]["consistent"] is not None]
        summary["control_win_rate"] = ctrl["win_rate"]
        summary["control_n"] = ctrl["n"]
        summary["noise_floor"] = abs(ctrl["win_rate"] - 0.5) if ctrl["n"] else None
        summary["control_consistency"] = sum(both) / len(both) if both else None
    return summary


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
                      "judgment": {k: r[k] for k in ("raw", "attempts", "error") if k in r},
                      "grade": r["parsed"], "outcome": "graded" if r["parsed"] else "unjudged",
                      "unjudged_reason": None if r["parsed"] else
                      ("request failed" if r["error"] else "unparsable grade"),
                      "length_diff": len(variant_answers[i]) - len(base_answers[i])})
    return lines, _reference_summary(lines, **stats)


def _reference_summary(lines: list[dict], *, iterations: int, confidence: float, seed: int) -> dict:
    graded = [l for l in lines if l["grade"]]
    grades = np.array([l["grade"] for l in graded], dtype=float)
    low, high = paired_bootstrap(grades, iterations, confidence, seed)
    return {
        "n": len(graded), "unjudged": len(lines) - len(graded),
        "unjudged_reasons": dict(Counter(l["unjudged_reason"] for l in lines if l["unjudged_reason"])),
        "mean_grade": float(grades.mean()) if len(grades) else None,
        "ci_low": low if len(grades) else None, "ci_high": high if len(grades) else None,
        "grades": {str(g): int((grades == g).sum()) for g in range(1, 6)},
        "consistency": None,
        "length_bias": correlation([l["length_diff"] for l in graded], list(grades)),
    }
