"""A reasoning model's answer as it is served: thinking on or off as its chat template switches it (`resolve_thinking`,
per suite), the reasoning split off the generated tokens before the answer is read (`split_reasoning`: the answer is
what follows `</think>`), and vLLM's reasoning parser for the model (`vllm_reasoning_parser`, by config.json's
model_type: the one place that names them).

The split reads token ids, so the hf, vLLM and lmdeploy engines split the very same tokens the same way: where the
tokenizer holds `</think>` as one token (GLM-4.5V/4.6V, Qwen3) the answer starts after that token; elsewhere after the
first tokens whose text holds it. Generation that opened a reasoning block (`<think>` generated, or ending the prompt)
and never closed it is all reasoning, with no answer: cut there by max_new_tokens, the item is cut "inside the
reasoning". A template that does not think (SmolLM2, the demo's model) is never split.
"""

from __future__ import annotations

from pipeline.errors import UserError
from pipeline.formats.chat import END_OF_THINKING, template_thinking

START_OF_THINKING = "<think>"
THINKING_SETTINGS = ("auto", "on", "off")  # suites.<name>.thinking

# vLLM's --reasoning-parser for a checkpoint whose template thinks, by config.json's model_type (vLLM's reasoning
# outputs page: GLM-4.5 series glm45, Qwen3 series qwen3); vLLM applies it to /v1/chat/completions, whose reply then
# holds the reasoning apart (`reasoning`; `reasoning_content` in older vLLM, vllm-project/vllm#27752)
VLLM_REASONING_PARSERS = {
    "glm4_moe": "glm45",  # GLM-4.5, GLM-4.6
    "glm4v": "glm45",  # GLM-4.1V-Thinking, GLM-4.6V-Flash
    "glm4v_moe": "glm45",  # GLM-4.5V, GLM-4.6V
    "glm46v": "glm45",  # GLM-4.6V as transformers writes it
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "deepseek_v3": "deepseek_r1",  # DeepSeek-R1
}


def resolve_thinking(setting: str, tokenizer, *, key: str, model: str) -> bool | None:
    """A thinking setting (`key`: its params.yaml key, suites.<suite>.thinking or judge.thinking) for this
    checkpoint's template: True / False (handed to the template as enable_thinking, the reasoning split off the
    answer), or None (a template that does not think: nothing passed, nothing split). auto: the template's own
    default. No tokenizer (an openai engine sending chat messages, the server's template): on / off as asked, auto
    None."""
    if tokenizer is None:
        return None if setting == "auto" else setting == "on"
    found = template_thinking(tokenizer)
    if found is None:
        if setting == "on":
            raise UserError(f"params.yaml: {key}: on, but {model}'s chat template does not think "
                            f"(it neither reads enable_thinking nor closes reasoning with {END_OF_THINKING}); use auto or off")
        return None
    if not found.switchable:
        if setting == "off":
            raise UserError(f"params.yaml: {key}: off, but {model}'s chat template always thinks (it "
                            "does not read enable_thinking); use auto or on")
        return True
    return found.default if setting == "auto" else setting == "on"


def model_thinks(model_dir) -> bool | None:
    """Whether the checkpoint's chat template thinks (`template_thinking`: switchable or always), None where its
    tokenizer cannot be read here (a server's model: its template is the server's)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None
    return template_thinking(tokenizer) is not None


def _one_token(tokenizer, text: str) -> int | None:
    """The id of `text` when the tokenizer holds it as one token, else None."""
    token = tokenizer.convert_tokens_to_ids(text)
    if token is None or token == getattr(tokenizer, "unk_token_id", None):
        return None
    return token if tokenizer.convert_ids_to_tokens(token) == text else None


def _marker_end(tokenizer, tokens: list[int]) -> int | None:
    """The fewest leading tokens whose text holds END_OF_THINKING (a tokenizer that spells it in pieces), or None."""
    if END_OF_THINKING not in tokenizer.decode(tokens, skip_special_tokens=True):
        return None
    low, high = 1, len(tokens)
    while low < high:
        middle = (low + high) // 2
        if END_OF_THINKING in tokenizer.decode(tokens[:middle], skip_special_tokens=True):
            high = middle
        else:
            low = middle + 1
    return low


def _cleaned(text: str) -> str:
    return text.split(END_OF_THINKING)[0].strip().removeprefix(START_OF_THINKING).strip()


def split_reasoning(tokenizer, tokens: list[int], prompt: str) -> tuple[str, list[int], bool]:
    """(reasoning text, the answer's token ids, closed) of generated ids (already cut at EOS): the answer follows the
    first END_OF_THINKING; without one, a generation that opened reasoning (its prompt ends with `<think>`, or it
    starts with it) is all reasoning and not closed, any other all answer."""
    end = _one_token(tokenizer, END_OF_THINKING)
    if end is not None and end in tokens:
        at = tokens.index(end)
        return _cleaned(tokenizer.decode(tokens[:at], skip_special_tokens=True)), tokens[at + 1:], True
    if end is None and (at := _marker_end(tokenizer, tokens)) is not None:
        return _cleaned(tokenizer.decode(tokens[:at], skip_special_tokens=True)), tokens[at:], True
    opened = prompt.rstrip().endswith(START_OF_THINKING) or \
        tokenizer.decode(tokens, skip_special_tokens=False).lstrip().startswith(START_OF_THINKING)
    if opened:
        return _cleaned(tokenizer.decode(tokens, skip_special_tokens=True)), [], False
    return "", tokens, True


def split_text(text: str, prompt_opened: bool = False) -> tuple[str, str, bool]:
    """(reasoning, answer, closed) of a reply's text (a server that sends text, not token ids)."""
    if END_OF_THINKING in text:
        reasoning, answer = text.split(END_OF_THINKING, 1)
        return _cleaned(reasoning), answer, True
    if prompt_opened or text.lstrip().startswith(START_OF_THINKING):
        return _cleaned(text), "", False
    return "", text, True


def vllm_reasoning_parser(config: dict, model_dir) -> str | None:
    """The --reasoning-parser vLLM serves this checkpoint with: its model_type's (VLLM_REASONING_PARSERS) when its
    chat template thinks (its tokenizer read only then), else None."""
    parser = VLLM_REASONING_PARSERS.get(config.get("model_type"))
    if parser is None:
        return None
    from transformers import AutoTokenizer

    return parser if template_thinking(AutoTokenizer.from_pretrained(model_dir)) is not None else None
