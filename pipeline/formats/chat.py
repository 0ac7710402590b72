"""The one chat renderer: a conversation as a checkpoint's own chat template turns it into text.

Every stage that shows a model a conversation renders it here: calibration text, the KL stage's
held-out conversations, the per-layer check's blocks (whole conversations), and every engine's prompts
(`reply=True`: ready for the assistant's turn). A template that rejects the turns as given is tried
once more with them reshaped to strict user/assistant alternation (system folded into the first user
turn, leading assistant turns dropped, repeated roles merged). A tokenizer without a template gets the
turns' contents joined by blank lines. Templates that print today's date (Llama 3) get a fixed one, so
the same conversation renders the same way every day.

A reasoning model's template (GLM-4.5V/4.6V, Qwen3) reads `enable_thinking`: `render_prompt(..., enable_thinking=)`
hands it over (None: not passed, the template's own default), and `template_thinking` says what a template does
with it: switchable (and its default), always thinking, or no thinking at all.
"""

from __future__ import annotations

from dataclasses import dataclass

FIXED_DATE = "26 Jul 2024"
END_OF_THINKING = "</think>"  # what closes a reasoning model's reasoning (GLM-4.5V/4.6V, Qwen3, DeepSeek-R1)
PROBE = [{"role": "user", "content": "What is 1 + 1?"}]  # the conversation a template's thinking switch is read on


def strict_turns(messages: list[dict]) -> list[dict]:
    """The same text shaped for templates that demand user/assistant alternation starting with the user."""
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    turns: list[dict] = []
    for message in messages:
        if message["role"] == "system" or (not turns and message["role"] != "user"):
            continue
        if turns and turns[-1]["role"] == message["role"]:
            turns[-1] = {"role": message["role"], "content": turns[-1]["content"] + "\n" + message["content"]}
        else:
            turns.append(dict(message))
    if turns and system:
        turns[0] = {"role": "user", "content": system + "\n\n" + turns[0]["content"]}
    return turns


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer, messages: list[dict], *, reply: bool = False,
                enable_thinking: bool | None = None) -> str | None:
    """The conversation as text; `reply`: followed by the template's opening of the assistant's turn;
    `enable_thinking`: handed to the template (None: not passed). None when the template rejects the turns in both
    shapes."""
    if not has_template(tokenizer):
        return "\n\n".join(m["content"] for m in messages)
    from jinja2 import TemplateError

    switch = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    for turns in (messages, strict_turns(messages)):
        if not turns:  # no user turn to start from
            continue
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=reply,
                                                 date_string=FIXED_DATE, **switch)
        except TemplateError:
            continue
    return None


@dataclass(frozen=True)
class TemplateThinking:
    """What a chat template does about reasoning: `switchable` (it reads enable_thinking: its renders with true and
    false differ), and `default` (whether it thinks when nothing is passed)."""

    switchable: bool
    default: bool


def template_thinking(tokenizer) -> TemplateThinking | None:
    """A template that reads enable_thinking (GLM-4.5V/4.6V, Qwen3): switchable, thinking by default when its render
    without the flag is its render with true; a template that does not but knows the end of a reasoning block
    (GLM-4.1V-Thinking, DeepSeek-R1: it always thinks): not switchable, thinking; any other (SmolLM2, Llama): None."""
    if not has_template(tokenizer):
        return None
    on, off, plain = (render_chat(tokenizer, PROBE, reply=True, enable_thinking=flag) for flag in (True, False, None))
    if on != off:
        return TemplateThinking(switchable=True, default=plain == on)
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
    return TemplateThinking(switchable=False, default=True) if END_OF_THINKING in template else None


def render_prompt(tokenizer, messages: list[dict], enable_thinking: bool | None = None) -> str:
    """The prompt an engine sends for the assistant's next turn (`enable_thinking`: handed to the template, None: not
    passed); a UserError when the template rejects it."""
    text = render_chat(tokenizer, messages, reply=True, enable_thinking=enable_thinking)
    if text is None:
        from pipeline.errors import UserError

        roles = "/".join(m.get("role", "?") for m in messages)
        raise UserError(f"the checkpoint's chat template rejects a conversation with turns {roles}, also reshaped "
                        "to strict user/assistant turns; fix the data or the template (tokenizer_config.json)")
    return text
