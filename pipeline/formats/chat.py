"""The one chat renderer: a conversation as a checkpoint's own chat template turns it into text.

Every stage that shows a model a conversation renders it here: calibration text, the KL stage's
held-out conversations, the per-layer check's blocks (whole conversations), and every engine's prompts
(`reply=True`: ready for the assistant's turn). A template that rejects the turns as given is tried
once more with them reshaped to strict user/assistant alternation (system folded into the first user
turn, leading assistant turns dropped, repeated roles merged). A tokenizer without a template gets the
turns' contents joined by blank lines. Templates that print today's date (Llama 3) get a fixed one, so
the same conversation renders the same way every day.
"""

from __future__ import annotations

FIXED_DATE = "26 Jul 2024"


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


def render_chat(tokenizer, messages: list[dict], *, reply: bool = False) -> str | None:
    """The conversation as text; `reply`: followed by the template's opening of the assistant's turn.
    None when the template rejects the turns in both shapes."""
    if not has_template(tokenizer):
        return "\n\n".join(m["content"] for m in messages)
    from jinja2 import TemplateError

    for turns in (messages, strict_turns(messages)):
        if not turns:  # no user turn to start from
            continue
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=reply,
                                                 date_string=FIXED_DATE)
        except TemplateError:
            continue
    return None


def render_prompt(tokenizer, messages: list[dict]) -> str:
    """The prompt an engine sends for the assistant's next turn; a UserError when the template rejects it."""
    text = render_chat(tokenizer, messages, reply=True)
    if text is None:
        from pipeline.errors import UserError

        roles = "/".join(m.get("role", "?") for m in messages)
        raise UserError(f"the checkpoint's chat template rejects a conversation with turns {roles}, also reshaped "
                        "to strict user/assistant turns; fix the data or the template (tokenizer_config.json)")
    return text
