"""A suite's result lines (pipeline/formats/results.py) from lm-eval's logged samples and what our engine answered:
one line per item; with k samples, the k passes' lines of each item merged into one (`merged`).

A generated answer's line holds, beside the DESIGN.md contract (`output` the final answer, `n_tokens` every generated
token), how it was generated: `thinking` (the template's thinking on), `reasoning` (the reasoning split off before the
answer, "" when none), `reasoning_tokens`, `answer_tokens`, and `cut` (null, or where max_new_tokens cut it:
"reasoning", "answer"). With k samples the line carries `samples` (per sample: seed, output, score, correct,
reasoning_tokens, answer_tokens, cut), its `score` is avg@k (the samples' mean), `correct` null, and a right/wrong
suite's `pass_at_k` whether any sample is right; output, cut and the token counts are the first sample's.
"""

from __future__ import annotations

import math

SAMPLE_FIELDS = ("output", "score", "correct", "reasoning_tokens", "answer_tokens", "cut")


def arguments(sample: dict) -> list[tuple]:
    """The sample's request arguments, one tuple per request (lm-eval logs a list or a dict of them)."""
    args = sample["arguments"]
    if isinstance(args, dict):
        return [tuple(a[k] for k in sorted(a, key=lambda k: int(k.split("_")[-1]))) for a in args.values()]
    return [tuple(a) if isinstance(a, (list, tuple)) else (a,) for a in args]


def result_line(sample: dict, suite: str, variant: str, metric: str, lm) -> dict:
    """One item's line from lm-eval's logged sample and the engine's completion (lm.stats) or scores."""
    args = arguments(sample)
    prompt = args[0][0]
    doc = sample.get("doc", {})
    line = {"id": str(doc.get("id", f"{suite}-{sample['doc_id']}")), "suite": suite, "variant": variant,
            "prompt": prompt, "target": str(sample.get("target", ""))}
    if prompt in lm.documents and len(args) == 1 and len(args[0]) == 1:  # loglikelihood_rolling
        loglikelihood, n_tokens = lm.documents[prompt]
        return {**line, "target": "", "output": "", "score": math.exp(-loglikelihood / max(n_tokens, 1)),
                "correct": None, "loglikelihood": loglikelihood, "n_tokens": n_tokens, "seconds": None}
    score = float(sample.get(metric, 0.0))
    if len(args[0]) == 2 and isinstance(args[0][1], str):  # loglikelihood: the likeliest choice
        lls = [resp[0][0] if isinstance(resp[0], (list, tuple)) else resp[0] for resp in sample["resps"]]
        best = max(range(len(lls)), key=lambda i: lls[i]) if lls else None
        return {**line, "output": args[best][1] if best is not None else "", "score": score,
                "correct": score >= 1.0, "loglikelihoods": lls, "n_tokens": None, "seconds": None}
    output = sample["resps"][0][0] if sample["resps"] and sample["resps"][0] else ""
    completion = lm.stats.get(prompt)
    return {
        **line,
        "output": output,
        "score": score,
        "correct": score >= 1.0,
        "n_tokens": completion.n_tokens if completion else None,
        "seconds": round(completion.seconds, 4) if completion else None,
        **generation_fields(completion),
        # suites that run model-written code: whether it ran in the bubblewrap sandbox
        **({"isolated": bool(sample["isolated"])} if "isolated" in sample else {}),
        # a generated item's difficulty (font size, element count, image size: evals/visual/), its table's bins
        **({"difficulty": dict(doc["difficulty"])} if isinstance(doc.get("difficulty"), dict) else {}),
    }


def generation_fields(completion) -> dict:
    """How an answer was generated: thinking, its reasoning and tokens on either side, and where the budget cut it."""
    if completion is None:
        return {"thinking": False, "reasoning": "", "reasoning_tokens": None, "answer_tokens": None, "cut": None}
    return {"thinking": completion.thinking, "reasoning": completion.reasoning,
            "reasoning_tokens": completion.reasoning_tokens, "answer_tokens": completion.answer_tokens,
            "cut": completion.cut}


def merged(passes: list[list[dict]], seeds: tuple[int, ...], right_wrong: bool) -> list[dict]:
    """Each item's line from its k samples (passes[j]: sample j's lines, seed seeds[j], in the same item order)."""
    lines = []
    for first, *others in zip(*passes):
        samples = [{"seed": seed, **{key: line.get(key) for key in SAMPLE_FIELDS}}
                   for seed, line in zip(seeds, [first, *others])]
        line = {**first, "score": sum(s["score"] for s in samples) / len(samples), "correct": None, "samples": samples}
        if right_wrong:
            line["pass_at_k"] = any(s["correct"] for s in samples)
        lines.append(line)
    return lines
