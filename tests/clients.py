"""An OpenAIEngine from keyword arguments, as tests make them: the settings (pipeline/engines/openai.py: Settings)
and what a caller adds (backoff, extra_body, ...) in one call, with the judge's client settings as defaults."""

from pipeline.engines import openai

CALLER = ("params_section", "backoff", "retry_on_length", "temperature", "extra_body")
# what the judge's served backend (and these tests) had: its chat format, 4 in flight, 60 s, 8 MiB answers
JUDGE_LIKE = {"prompt_format": "chat", "concurrency": 4, "timeout": 60.0, "max_response_bytes": 8 << 20}


def openai_client(model_dir=None, **given) -> openai.OpenAIEngine:
    caller = {key: given.pop(key) for key in CALLER if key in given}
    return openai.OpenAIEngine(model_dir, openai.Settings(**{**JUDGE_LIKE, **given}), **{"params_section": "judge",
                                                                                          **caller})
