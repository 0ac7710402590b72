"""How a suite's answers are generated on one model, decided once before lm-eval asks for any: thinking on or off as
the model's chat template and suites.<name>.thinking say (pipeline/engines/reasoning.py), the token budget that fits
(max_new_tokens, or thinking_max_new_tokens when the model thinks), and k samples per item (suites.<name>.samples:
1, one greedy answer; k > 1, sample j drawn with seed suites.<name>.seed + j, the base and every variant alike, with
suites.<name>.sampling, else the checkpoint's generation_config.json, else SAMPLING_FALLBACK).

k samples are k passes of lm-eval over the suite, sample j's answers in pass j (`PipelineLM.sample`): the first
pass generates every sample of every item at once (all in flight on a server), the others read them back from the
resume cache. lm-eval's own `repeats` hands a task's process_results all k answers of an item and reduces them through
the task's filters (take_first by default) to one score; our suites score one answer each, and per-sample scores are
what avg@k, pass@k and the per-item mean need, so each pass scores one answer per item with the suite's own filters
and scorer, unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.checkpoints import config_json
from pipeline.engines import Sampling
from pipeline.engines.reasoning import resolve_thinking
from pipeline.settings.params import SAMPLING_FALLBACK, SamplingParams, SuiteParams


@dataclass(frozen=True)
class GenerationPlan:
    thinking: bool | None  # handed to the template (None: the template does not think, nothing passed or split)
    max_new_tokens: int  # the suite's budget on this model
    seeds: tuple[int, ...] | None = None  # one per sample; None: one greedy answer
    sampling: Sampling | None = None

    @property
    def samples(self) -> int:
        return len(self.seeds) if self.seeds else 1

    def describe(self) -> dict:
        """What <suite>.json records of it (`generation`)."""
        return {"thinking": self.thinking, "max_new_tokens": self.max_new_tokens, "samples": self.samples,
                "seeds": list(self.seeds) if self.seeds else None,
                "sampling": asdict(self.sampling) if self.sampling else None}


def resolve_sampling(model_dir: Path | str | None, chosen: SamplingParams) -> Sampling:
    """suites.<name>.sampling, each field left out taken from generation_config.json, else SAMPLING_FALLBACK."""
    recommended = config_json.generation_sampling(model_dir) if model_dir else {}
    values = {key: getattr(chosen, key) if getattr(chosen, key) is not None else recommended.get(key, fallback)
              for key, fallback in SAMPLING_FALLBACK.items()}
    return Sampling(float(values["temperature"]), float(values["top_p"]), int(values["top_k"]))


def plan_for(model_dir: Path | str | None, s: SuiteParams, *, suite: str, tokenizer) -> GenerationPlan:
    """The plan of suite `suite` (its params.yaml section `s`) on the checkpoint at model_dir, whose template the
    tokenizer holds (None: an engine that sends the server chat messages)."""
    thinking = resolve_thinking(s.thinking, tokenizer, key=f"suites.{suite}.thinking", model=str(model_dir or "the served model"))
    budget = s.thinking_max_new_tokens if thinking else s.max_new_tokens
    if s.samples == 1:
        return GenerationPlan(thinking, budget)
    return GenerationPlan(thinking, budget, tuple(s.seed + j for j in range(s.samples)), resolve_sampling(model_dir, s.sampling))
