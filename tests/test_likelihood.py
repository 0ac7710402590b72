"""Log-likelihoods through the hf engine, checked against lm-eval's own HFLM and a plain transformers
forward pass on the same tiny model; lm-eval multiple-choice and perplexity tasks run by name."""

import json
import math

import pytest
import torch

from conftest import REPO, read_jsonl
from pipeline.stages import evaluate
from pipeline.scoring import likelihood
from pipeline.errors import UserError

TINY_MC = REPO / "tests" / "data" / "tiny_mc"


def _hflm_samples(model_dir, task, include_path, **hflm_options):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", **hflm_options)
    manager = TaskManager(include_path=[str(p) for p in include_path], include_defaults=False)
    results = simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=True, limit=3,
                              apply_chat_template=True, bootstrap_iters=0, verbosity="ERROR")
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_multiple_choice_task_from_the_users_folder_matches_lm_evals_hflm(tmp_path, tiny_llama):
    """A local multiple-choice task (tests/data/tiny_mc) runs by name; every choice's log-likelihood
    equals HFLM's on the same model, and so does the accuracy."""
    result = evaluate.run(tiny_llama, suite="mc", task="tiny_mc", variant="base", out_dir=tmp_path,
                          tasks_dir=TINY_MC, batch_size=3)
    ours = read_jsonl(tmp_path / "mc.jsonl")
    assert [line["id"] for line in ours] == ["mc-0", "mc-1", "mc-2", "mc-3"]
    theirs = _hflm_samples(tiny_llama, "tiny_mc", [TINY_MC], batch_size=2)
    worst = 0.0
    for line, sample in zip(ours, theirs):
        reference = [resp[0][0] for resp in sample["resps"]]
        assert len(line["loglikelihoods"]) == len(reference) >= 3
        worst = max(worst, max(abs(a - b) for a, b in zip(line["loglikelihoods"], reference)))
        assert line["correct"] == bool(sample["acc"])
        best = max(range(len(reference)), key=reference.__getitem__)
        assert line["output"].strip() == sample["doc"]["choices"][best].strip()
    print(f"largest |difference| from HFLM over {sum(len(l['loglikelihoods']) for l in ours[:3])} choices: {worst:.2e}")
    assert worst < 1e-3
    assert result.figures["metric"] == "acc" and result.figures["n"] == 4


def test_perplexity_suite_matches_hflm_rolling_loglikelihood_over_several_windows(tmp_path, tiny_llama):
    """quant_ppl_book: each document's rolling log-likelihood equals HFLM's. The tiny model's context is
    512 and our windows predict at most 511 tokens, so HFLM runs with max_length 511: the same windows."""
    evaluate.run(tiny_llama, suite="ppl-book", task="quant_ppl_book", variant="base", out_dir=tmp_path, limit=3,
                 batch_size=4)
    ours = read_jsonl(tmp_path / "ppl-book.jsonl")
    assert any(line["n_tokens"] > 511 for line in ours)  # at least one document spans two windows
    theirs = _hflm_samples(tiny_llama, "quant_ppl_book", [REPO / "evals"], batch_size=2, max_length=511)
    worst = max(abs(line["loglikelihood"] - sample["resps"][0][0]) / line["n_tokens"]
                for line, sample in zip(ours, theirs))
    print(f"largest per-token |difference| from HFLM: {worst:.2e}")
    assert worst < 1e-5
    for line in ours:
        assert line["correct"] is None and line["score"] == pytest.approx(math.exp(-line["loglikelihood"] / line["n_tokens"]))
    summary = json.loads((tmp_path / "ppl-book.json").read_text())
    total = sum(line["n_tokens"] for line in ours)
    assert summary["metric"] == "perplexity" and summary["tokens"] == total
    assert summary["score"] == pytest.approx(math.exp(-sum(line["loglikelihood"] for line in ours) / total))


def test_token_logprobs_equal_a_plain_forward_pass_per_request(tiny_llama):
    """Batched, right-padded, split by the token budget: each request's score equals an unpadded
    transformers forward pass over that request alone, computed here from the logits."""
    from transformers import AutoModelForCausalLM

    from pipeline.engines import hf as hf_engine
    from pipeline.engines.hf import HFEngine

    engine = HFEngine(tiny_llama, hf_engine.Settings(batch_size=4, max_batch_tokens=120))
    generator = torch.Generator().manual_seed(0)
    vocab = len(engine.tokenizer)
    requests = [(torch.randint(0, vocab, (n_ctx,), generator=generator).tolist(),
                 torch.randint(0, vocab, (n_cont,), generator=generator).tolist())
                for n_ctx, n_cont in [(1, 40), (7, 3), (30, 1), (2, 2), (50, 9), (12, 12), (1, 1)]]
    assert len(engine.scoring_batches(requests)) > 2  # the budget split them
    ours = engine.token_logprobs(requests)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for (context, continuation), (logprob, greedy) in zip(requests, ours):
        ids = torch.tensor([context + continuation])
        with torch.no_grad():
            logits = model(ids).logits[0, len(context) - 1:-1].double()
        reference = logits.log_softmax(-1).gather(1, torch.tensor(continuation)[:, None]).sum().item()
        assert logprob == pytest.approx(reference, abs=1e-4)
        assert greedy == bool((logits.argmax(-1) == torch.tensor(continuation)).all())
    with torch.no_grad():
        first = int(model(torch.tensor([[1]])).logits[0, -1].argmax())
        second = int(model(torch.tensor([[1, first]])).logits[0, -1].argmax())
    greedy_path, other = engine.token_logprobs([([1], [first, second]), ([1], [first, (second + 1) % vocab])])
    assert greedy_path[1] is True and other[1] is False and other[0] < greedy_path[0]


def test_one_token_choices_after_one_context_share_one_row_of_the_forward_pass(tiny_llama):
    """A multiple-choice question (a judge's verdict): its one-token choices feed the model the same tokens, so the
    batch holds one row for them, asked twice or not; each score still equals its own plain forward pass."""
    from transformers import AutoModelForCausalLM

    from pipeline.engines import hf as hf_engine
    from pipeline.engines.hf import HFEngine

    engine = HFEngine(tiny_llama, hf_engine.Settings(batch_size=4))
    generator = torch.Generator().manual_seed(1)
    vocab = len(engine.tokenizer)
    first, second = (torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (20, 9))
    requests = [(first, [t]) for t in (5, 6, 7, 5)] + [(second, [8]), (second, [9, 10])]
    rows = []
    hook = engine.model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                                  with_kwargs=True)
    try:
        ours = engine.token_logprobs(requests)
    finally:
        hook.remove()
    assert rows == [3]  # first (four requests), second, second + its choice's first token: one batch, three rows
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for (context, continuation), (logprob, _) in zip(requests, ours):
        with torch.no_grad():
            logits = model(torch.tensor([context + continuation])).logits[0, len(context) - 1:-1].double()
        assert logprob == pytest.approx(logits.log_softmax(-1).gather(1, torch.tensor(continuation)[:, None]).sum().item(),
                                        abs=1e-4)
    assert ours[0] == ours[3]


def test_encoding_follows_lm_eval_for_trailing_spaces_and_empty_contexts(tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    context, continuation = likelihood.encode_pair(tokenizer, "Answer: ", "seven")
    assert context == tokenizer.encode("Answer:") and context + continuation == tokenizer.encode("Answer: seven")
    context, continuation = likelihood.encode_pair(tokenizer, "", "seven days")
    assert context == [tokenizer.bos_token_id] and continuation == tokenizer.encode("seven days")
    document = likelihood.rolling_windows(tokenizer, "order " * 300, max_length=64)
    assert sum(len(c) for _, c in document.windows) == document.n_tokens == len(tokenizer.encode("order " * 300))
    assert all(len(ctx) + len(cont) <= 64 for ctx, cont in document.windows)
    with pytest.raises(UserError, match="does not fit the model's context of 8 tokens"):
        likelihood.fit(([1], list(range(8))), 8, "task t")


def test_a_rerun_scores_nothing_again(tmp_path, tiny_llama):
    """Token scores go through the resume cache: a second run of the same model reads them all back."""
    first = evaluate.run(tiny_llama, suite="mc", task="tiny_mc", variant="base", out_dir=tmp_path, tasks_dir=TINY_MC)
    lines = read_jsonl(tmp_path / "mc.jsonl")
    again = evaluate.run(tiny_llama, suite="mc", task="tiny_mc", variant="base", out_dir=tmp_path, tasks_dir=TINY_MC)
    assert first.figures["scored_tokens"] > 0 and "scored_tokens" not in again.figures
    cached = read_jsonl(tmp_path / ".cache" / "mc.jsonl")
    assert len(cached) == 13 and all(entry["key"].startswith("ll:") for entry in cached)  # 13 choices, once each
    assert read_jsonl(tmp_path / "mc.jsonl") == lines


def test_an_engine_that_cannot_score_is_refused_by_name():
    class GenerateOnly:
        name = "openai"

    with pytest.raises(UserError, match="engine 'openai' cannot score text.*use an engine that can: hf"):
        likelihood.require_scoring(GenerateOnly())


def test_chat_perplexity_needs_the_holdout_file(tmp_path, tiny_llama):
    with pytest.raises(UserError, match=r"suites.ppl-chat.options.data: .*missing.jsonl does not exist.*quantize calib"):
        evaluate.run(tiny_llama, suite="ppl-chat", task="quant_ppl_chat", variant="base", out_dir=tmp_path,
                     options={"data": str(tmp_path / "missing.jsonl")})


def test_chat_perplexity_renders_the_holdout_with_the_chat_template(tmp_path, tiny_llama, tiny_calib):
    evaluate.run(tiny_llama, suite="ppl-chat", task="quant_ppl_chat", variant="base", out_dir=tmp_path, limit=2,
                 options={"data": str(tiny_calib / "holdout.jsonl")})
    lines = read_jsonl(tmp_path / "ppl-chat.jsonl")
    held = read_jsonl(tiny_calib / "holdout.jsonl")[:2]
    assert [line["id"] for line in lines] == [row["id"] for row in held]
    for line, row in zip(lines, held):
        assert line["prompt"].startswith("<|im_start|>user\n" + row["messages"][0]["content"])
        assert line["prompt"].rstrip().endswith(row["reference"].strip() + "<|im_end|>")
        assert line["n_tokens"] > 20 and line["loglikelihood"] < 0
