"""lm-eval's likelihood requests as token-level requests, for any engine with `token_logprobs`.

An engine that can score text implements one method (`/work/notes/ENGINE_API.md`):

    token_logprobs([(context_ids, continuation_ids), ...]) -> [(sum of log P(continuation), all greedy), ...]

and exposes `tokenizer` (the checkpoint's own) and `max_length` (its context window). Everything
lm-eval-specific lives here, once, so the hf engine and a served engine score the same tokens:

- `loglikelihood` (multiple choice): context and continuation split as lm-eval's HFLM does
  (`TemplateLM._encode_pair`: trailing spaces of the context move to the continuation, the whole
  string is encoded and cut at the context's length; an empty context becomes the prefix token,
  BOS or else EOS);
- `loglikelihood_rolling` (perplexity): the document encoded as HFLM encodes it, cut into disjoint
  windows by lm-eval's own `get_rolling_token_windows`, the first conditioned on the prefix token.
  A window predicts at most `max_length - 1` tokens, so that context plus continuation fits the
  context of an engine that scores the whole prompt (a server's prompt logprobs); HFLM's windows
  predict `max_length` tokens, which changes the windows only of documents longer than that;
- the order engines see: longest first, so a batch holds requests of similar length.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import UserError

TokenRequest = tuple[list[int], list[int]]  # (context ids, continuation ids)


def require_scoring(engine) -> None:
    """An engine without token_logprobs cannot run likelihood tasks: say which can."""
    if not callable(getattr(engine, "token_logprobs", None)):
        from pipeline.engines import engine_names

        scoring = engine_names(where=lambda spec: spec.likelihoods)  # engines that implement token_logprobs
        raise UserError(f"engine {engine.name!r} cannot score text (no token_logprobs), which this suite's "
                        f"log-likelihood requests need; use an engine that can: {scoring} "
                        "(params.yaml engine.name or --engine)")


def prefix_token_id(tokenizer) -> int:
    """What an empty context is conditioned on: BOS, or EOS when the tokenizer has no BOS (as HFLM)."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def tok_encode(tokenizer, text: str) -> list[int]:
    """HFLM's `tok_encode` with its defaults: the tokenizer's own special tokens, none added when
    the text already starts with the prefix token."""
    prefix = tokenizer.decode(prefix_token_id(tokenizer))
    if prefix and text.startswith(prefix):
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def encode_pair(tokenizer, context: str, continuation: str, encode=None) -> TokenRequest:
    """lm-eval's split for causal models (TemplateLM.loglikelihood and _encode_pair). encode: how a text becomes
    ids (default: HFLM's tok_encode); a prompt the chat template rendered holds the template's own special tokens,
    so the judge passes the engine's `encode`, which adds none, as the engine encodes a prompt it generates from."""
    encode = encode or (lambda text: tok_encode(tokenizer, text))
    if context == "":
        continuation_ids = tokenizer.encode(continuation, add_special_tokens=False)
        prefix = prefix_token_id(tokenizer)
        if continuation_ids and continuation_ids[0] == prefix:
            return continuation_ids[:1], continuation_ids[1:]
        return [prefix], continuation_ids
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encode(context + continuation)
    context_ids = encode(context)
    return context_ids, whole[len(context_ids):]


def fit(request: TokenRequest, max_length: int, where: str) -> TokenRequest:
    """Context cut from the left so that context + continuation is at most max_length tokens (HFLM
    keeps max_length + 1, of which the last is never fed; a server scoring the prompt needs it all)."""
    context, continuation = request
    if not continuation:
        raise UserError(f"{where}: a continuation encodes to no tokens; the task's choices must be non-empty text")
    if len(continuation) >= max_length:
        raise UserError(f"{where}: a continuation of {len(continuation)} tokens does not fit the model's "
                        f"context of {max_length} tokens")
    keep = max_length - len(continuation)
    return context[-keep:], continuation


def loglikelihood_requests(tokenizer, pairs: list[tuple[str, str]], max_length: int, where: str) -> list[TokenRequest]:
    return [fit(encode_pair(tokenizer, context, continuation), max_length, where) for context, continuation in pairs]


@dataclass
class Document:
    """One `loglikelihood_rolling` request: its windows and how many tokens they predict."""

    windows: list[TokenRequest]
    n_tokens: int


def rolling_windows(tokenizer, text: str, max_length: int) -> Document:
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    tokens = tok_encode(tokenizer, text)
    windows = [make_disjoint_window(pair) for pair in get_rolling_token_windows(
        token_list=tokens, prefix_token=prefix_token_id(tokenizer), max_seq_len=max_length - 1, context_len=1)]
    return Document([(list(c), list(p)) for c, p in windows], len(tokens))


def longest_first(requests: list[TokenRequest]) -> list[int]:
    """Indices, longest context + continuation first (ties by content, so the order is stable)."""
    return sorted(range(len(requests)), key=lambda i: (-(len(requests[i][0]) + len(requests[i][1])), i))
