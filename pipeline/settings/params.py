"""params.yaml schema: every stage's defaults, validated at load (a variant's: its method's module in
pipeline/methods/, whose section params.yaml's `variants` entries are).

A bad file stops with the key's dotted path (and its line), what is wrong and what is allowed, e.g.
``params.yaml: variants.awq-w4a16.group_size: 100 does not divide 576 (hidden size of models/base)``.
The file is read through pipeline/safe_yaml.py (size, aliases, nesting and duplicate keys bounded);
every number that sizes memory or time has an upper bound here, and no float may be NaN or infinite.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import (BeforeValidator, Field, SerializeAsAny, ValidationError, WrapValidator, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from pipeline import engines, methods, safe_yaml
from pipeline.engines.settings import MAX_TIMEOUT_S, EngineSettings, env_var_name
from pipeline.errors import UserError
from pipeline.settings.checks import (check_against_dvc, check_against_model, check_margins_name_suites,  # noqa: F401
                                    check_moved_keys, check_suite_models)
from pipeline.settings.errors import format_error, kind_of, sections_with_overrides, with_overrides  # noqa: F401
from pipeline.section import OutPath, SafePath, Section
from pipeline.settings import suites

DEFAULT_PARAMS = Path("params.yaml")
SEED_MAX = 2**32 - 1  # numpy and torch take seeds below 2**32
MAX_NEW_TOKENS = 32768  # per answer: engines preallocate the KV cache for prompt + new tokens
THINKING_MAX_NEW_TOKENS = 8192  # a thinking answer's budget, reasoning and answer (suites, judge): docs/reasoning.md
MAX_CALIB_TOKENS = 1 << 24  # seq_len x num_blocks: every block is held in memory while packing


def _registered_engine(value):
    """An engine name: one of the registry's (pipeline/engines), read when params are validated."""
    if isinstance(value, str) and value in engines.ENGINES:
        return value
    # told as a Literal's error: "'tgi' is not allowed; input should be 'hf', 'vllm', 'lmdeploy' or 'openai'"
    raise PydanticCustomError("literal_error", "Input should be {expected}",
                              {"expected": engines.engine_names(quote=True)})


EngineName = Annotated[str, BeforeValidator(_registered_engine)]


# `engine`: the section of the engine `engine.name` names (pipeline/engines/: each engine's module holds its fields,
# their defaults and bounds; the fields every engine shares are in pipeline/engines/settings.py), chosen when the
# file is validated
EngineSection = SerializeAsAny[Annotated[EngineSettings, WrapValidator(lambda value, _: engines.validate_section(value))]]


class ModelParams(Section):
    source: str = Field("demo", min_length=1)
    base_dir: OutPath = Path("models/base")
    dtype: Literal["float16", "bfloat16"] = "float16"


class CalibParams(Section):
    source: SafePath = Path("calib_data/support_logs.jsonl")
    out: OutPath = Path("calib_data/build")
    seq_len: int = Field(256, ge=16, le=32768)
    num_blocks: int = Field(32, ge=1, le=16384)
    holdout: int = Field(32, ge=0, le=10000)
    max_bad_fraction: float = Field(0.05, ge=0, le=1)
    redact: bool = True
    redact_patterns: list[Annotated[str, Field(min_length=1, max_length=1000)]] = Field([], max_length=100)
    seed: int = Field(0, ge=0, le=SEED_MAX)
    # image parts of the conversations (OpenAI's image_url, a data URL or a path; pipeline/formats/image_parts.py):
    # an image over either limit makes its record bad (checked before its pixels are decoded)
    max_image_bytes: int = Field(20 << 20, ge=1024, le=1 << 30)  # encoded bytes of one image
    max_image_pixels: int = Field(4096 * 4096, ge=64, le=1 << 28)  # width x height of one image
    image_samples: int = Field(16, ge=0, le=4096)  # conversations with images kept as calibration samples (VLM)

    @model_validator(mode="after")
    def _tokens_bounded(self):
        if self.seq_len * self.num_blocks > MAX_CALIB_TOKENS:
            raise ValueError(f"seq_len x num_blocks = {self.seq_len * self.num_blocks:,} tokens, over the limit of "
                             f"{MAX_CALIB_TOKENS:,}; use fewer blocks")
        return self

    @field_validator("redact_patterns")
    @classmethod
    def _patterns_compile(cls, patterns: list[str]) -> list[str]:
        import re

        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a valid regex: {exc}") from None
        return patterns


# a variant's section is its method's (pipeline/methods/: fields, bounds and help live in the method's module)
VariantParams = Annotated[Union[methods.sections()], Field(discriminator="method")]


# k samples' sampling where neither suites.<name>.sampling nor the checkpoint's generation_config.json says: plain
# sampling (no top-p, no top-k cut)
SAMPLING_FALLBACK = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


class SamplingParams(Section):
    """How a suite's k samples are drawn; a field left out (null): the checkpoint's generation_config.json, else
    SAMPLING_FALLBACK."""

    temperature: float | None = Field(None, ge=0, le=10)  # 0: greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1_000_000)  # 0: no top-k cut


class SuiteParams(Section):
    task: str = Field(min_length=1)
    limit: int | None = Field(None, ge=1, le=10_000_000)
    max_new_tokens: int = Field(256, ge=1, le=MAX_NEW_TOKENS)
    # a reasoning model (its chat template reads enable_thinking, or closes reasoning with </think>): auto, its
    # template's own default; on / off, enable_thinking handed to the template (hf, vLLM, lmdeploy) or the server
    # (openai chat: chat_template_kwargs). A template that does not think (SmolLM2): auto and off change nothing
    thinking: Literal["auto", "on", "off"] = "auto"
    thinking_max_new_tokens: int = Field(THINKING_MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS)  # reasoning and answer
    samples: int = Field(1, ge=1, le=64)  # k: 1, one greedy answer per item; k > 1, k sampled answers (avg@k, pass@k)
    sampling: SamplingParams = SamplingParams()  # the k samples' sampling (default: generation_config.json's)
    seed: int = Field(0, ge=0, le=SEED_MAX)  # sample j of every item and model draws with seed + j
    options: dict = {}  # the task's settings (its loader's metadata), e.g. long context: {lengths: [1024], repeats: 1}
    # suites that run model-written code (code): true runs it without bubblewrap where bubblewrap is
    # unusable (rlimits + an audit hook only; the report marks those results); false refuses instead
    allow_unsandboxed: bool = False
    tasks_dir: Path | None = None  # a folder of the user's own lm-eval task YAMLs, searched before lm-eval's
    # a local copy of the task's dataset in place of its YAML's dataset_path (a folder datasets.load_dataset reads:
    # a Hub snapshot of it, parquet files named by split); for a task that downloads its data (lm-eval's own)
    dataset_path: Path | None = None
    models: list[str] | None = None  # which of base and the variants run it (None: all); see check_against_dvc

    @model_validator(mode="after")
    def _suite_options(self):
        """The options a suite's own module checks (its hooks: pipeline/settings/suites.py); a tasks_dir's suites join
        the registry (read when first asked for)."""
        if self.tasks_dir is not None:
            suites.include(self.tasks_dir)
        suite = suites.find(self.task, self.tasks_dir) if self.options else None
        check = suite.hook("options_problem") if suite else None
        if check and (problem := check(self.options)):
            raise ValueError(f"options.{problem}")
        return self


class JudgeParams(Section):
    backend: EngineName = engines.DEFAULT
    model: str = "base"  # hf/lmdeploy: "base" or a checkpoint dir; openai: the served model's name
    min_consistency: float = Field(0.6, ge=0, le=1)
    mode: Literal["pairwise", "reference"] = "pairwise"
    # how the verdict is read: logprobs, the likeliest choice (A, B, C; a grade 1-5) scored as the continuation of the
    # judge prompt (hf, vllm); text, parsed from the judge's reply (any backend); auto: logprobs where the backend
    # gives log-probabilities, else text
    scoring: Literal["auto", "logprobs", "text"] = "auto"
    limit: int | None = Field(None, ge=1, le=100_000)  # held-out prompts to judge; None: all
    max_new_tokens: int = Field(256, ge=1, le=MAX_NEW_TOKENS)  # base and variant answers
    # a reasoning model's answers as served (as suites.<name>.thinking): auto, its template's default; the judge sees
    # the answers after the reasoning, which gets thinking_max_new_tokens instead of max_new_tokens
    thinking: Literal["auto", "on", "off"] = "auto"
    thinking_max_new_tokens: int = Field(THINKING_MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS)
    judge_max_new_tokens: int = Field(512, ge=1, le=MAX_NEW_TOKENS)  # the judge's reasoning and verdict (scoring text)
    control: bool = True  # also judge the base against itself: the noise floor
    base_url: str | None = None  # openai: e.g. http://127.0.0.1:8000/v1
    api_key_env: str | None = None  # openai: NAME of the environment variable holding the key, never the key
    concurrency: int = Field(4, ge=1, le=256)
    timeout: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S)
    retries: int = Field(3, ge=0, le=20)
    backoff: float = Field(1.0, ge=0, le=300)  # seconds before the first retry; doubles each time, with jitter

    _key_is_named = field_validator("api_key_env")(lambda value: env_var_name(value))

    @field_validator("scoring")
    @classmethod
    def _logprobs_need_a_backend_that_scores(cls, scoring: str, info):
        backend = info.data.get("backend")  # validated before: declared above
        if scoring == "logprobs" and backend is not None and not engines.capability(backend, "likelihoods"):
            scorers = engines.engine_names(where=lambda spec: spec.likelihoods)
            raise ValueError(f"logprobs needs a backend that gives log-probabilities ({scorers}); the {backend} "
                             "backend gives none: use auto or text")
        return scoring

    @property
    def scoring_method(self) -> str:
        """How this judge's verdicts are read: logprobs or text (auto resolved for the backend)."""
        if self.scoring == "auto":
            return "logprobs" if engines.capability(self.backend, "likelihoods") else "text"
        return self.scoring


class MarginParams(Section):
    """The largest acceptable loss before a variant is NO-GO: one per kind of suite, each in its own unit,
    and per suite (in that suite's unit)."""

    accuracy: float = Field(0.02, ge=0, le=1)  # right/wrong suites: drop in accuracy, absolute (0.02: 2 points)
    perplexity: float = Field(0.05, gt=0, le=1)  # perplexity suites: rise in perplexity, relative (0.05: +5 %)
    judge: float = Field(0.05, ge=0, le=0.5)  # the judge: GO when the win rate's interval lies above 0.5 - this
    suites: dict[str, Annotated[float, Field(ge=0, le=1)]] = {}  # per suite, e.g. {math: 0.03, ppl-chat: 0.03}

    @model_validator(mode="before")
    @classmethod
    def _suites_go_under_suites(cls, data):
        """`margins: {math: 0.03}` (the earlier layout) says where a suite's margin goes now."""
        if isinstance(data, dict):
            stray = [key for key in data if key not in cls.model_fields]
            if stray:
                shown = ", ".join(f"{key}: {data[key]}" for key in stray[:3])
                raise ValueError(f"{stray[0]}: a suite's own margin goes under verdict.margins.suites (e.g. "
                                 f"suites: {{{shown}}}); the defaults are accuracy, perplexity and judge")
        return data


class KlParams(Section):
    """`quantize kl`: per-token KL divergence from the base and top-1 agreement on held-out conversations."""

    sequences: int = Field(32, ge=1, le=10_000)  # held-out conversations scored
    max_tokens: int = Field(512, ge=16, le=16384)  # tokens per conversation (logits: tokens x vocabulary)


MIXED = methods.method("mixed")  # the fix's method (pipeline/methods/mixed.py): its budget's bounds and default


class FixParams(Section):
    """`quantize fix V` (the fix stage of dvc.yaml, one per W4A16 variant it lists): V-mixed built from V's ranking
    (the rank stage's `quantize kl --rank`) with the `mixed` method on V's own settings within this budget.
    `variants`: the W4A16 variants whose fix the run builds and decides, the fix stage's list (checked against
    dvc.yaml; `quantize profile --fix V` / `--unfix V` edit both), which the report reads: a fix taken out
    reruns the report, and its old results are named and ignored."""

    max_bits: MIXED.MaxBits = MIXED.DEFAULT_MAX_BITS
    variants: list[str] = Field(default_factory=list)


class VerdictParams(Section):
    confidence: float = Field(0.95, gt=0.5, lt=1)
    # the paired bootstrap holds iterations x items resampled indices (pipeline/verdict/intervals.py)
    bootstrap: int = Field(2000, ge=100, le=20_000)
    seed: int = Field(0, ge=0, le=SEED_MAX)
    margins: MarginParams = MarginParams()
    floor_ceiling: float = Field(0.05, ge=0, le=0.5)
    # a suite whose base has more than this share of its items cut at the token budget inside the reasoning is shown,
    # not counted: "budget too small for this model" (raise suites.<name>.thinking_max_new_tokens)
    max_cut_share: float = Field(0.10, ge=0, le=1)
    # Speed (from `quantize bench`, when both base and variant were benched with the same engine):
    # when true, a variant whose batch-1 decode rate is below the base's by more than speed_tolerance
    # is NO-GO; when false, the report only shows it.
    nogo_if_slower_at_batch1: bool = False
    speed_tolerance: float = Field(0.05, ge=0, le=1)
    # The engine the variants will be deployed on: speed counts only when measured there.
    speed_engine: EngineName | None = None

    @model_validator(mode="after")
    def _speed_needs_its_engine(self):
        if self.nogo_if_slower_at_batch1 and self.speed_engine is None:
            raise ValueError("nogo_if_slower_at_batch1: true needs verdict.speed_engine: the engine the variants "
                             "will be deployed on (e.g. vllm); speed measured on another engine cannot stop a variant")
        return self

    def margin_for(self, suite: str) -> float:
        return self.margins.suites.get(suite, self.margins.accuracy)

    def perplexity_margin_for(self, suite: str) -> float:
        return self.margins.suites.get(suite, self.margins.perplexity)


class SloParams(Section):
    """Service-level objectives: a request is good when it meets every one that is set (goodput)."""

    ttft_ms: float | None = Field(None, gt=0, le=3.6e6)
    tpot_ms: float | None = Field(None, gt=0, le=3.6e6)
    e2el_ms: float | None = Field(None, gt=0, le=3.6e6)


class BenchParams(Section):
    engine: EngineName | None = None  # None: engine.name
    concurrency: list[int] = Field([1, 4, 16, 64], max_length=32)
    request_rates: list[float] = Field([], max_length=32)  # requests/s with Poisson arrivals (server engines: vllm, openai)
    rate_seconds: float = Field(30.0, gt=0, le=3600)  # each rate sends about rate x rate_seconds requests
    input_len: int = Field(128, ge=1, le=1 << 20)
    output_len: int = Field(256, ge=2, le=1 << 20)
    requests_per_level: int = Field(2, ge=1, le=1000)  # requests per level, as a multiple of the concurrency
    holdout: bool = True  # also the held-out prompts' real lengths
    # a model with a vision tower: also requests with this many images each (the visual suites' items, in turn), one
    # workload per count beside the text-only ones; [] for none. A text-only model ignores it
    images: list[int] = Field([1, 4], max_length=8)
    # pixels on the longest side the images are sent at (aspect kept); null: each at the size its suite scored it at
    image_size: int | None = Field(None, ge=16, le=8192)
    slo: SloParams = SloParams()

    @field_validator("images")
    @classmethod
    def _image_counts(cls, counts: list[int]) -> list[int]:
        if any(c < 1 or c > 64 for c in counts):
            raise ValueError("must be a list of image counts per request from 1 to 64, e.g. [1, 4] ([] for none)")
        return sorted(set(counts))

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, levels: list[int]) -> list[int]:
        if not levels or any(c < 1 or c > 4096 for c in levels):
            raise ValueError("must be a non-empty list of integers from 1 to 4096, e.g. [1, 4, 16, 64]")
        return sorted(set(levels))

    @field_validator("request_rates")
    @classmethod
    def _rates(cls, rates: list[float]) -> list[float]:
        if any(not 0 < r <= 10000 for r in rates):
            raise ValueError("each rate must be above 0 and at most 10000 requests/s, e.g. [1, 4, 16]")
        return sorted(set(rates))


class Params(Section):
    model: ModelParams = ModelParams()
    calib: CalibParams = CalibParams()
    variants: dict[str, VariantParams] = {}
    suites: dict[str, SuiteParams] = {}
    judge: JudgeParams = JudgeParams()
    kl: KlParams = KlParams()
    fix: FixParams = FixParams()
    verdict: VerdictParams = VerdictParams()
    engine: EngineSection = Field(default_factory=lambda: engines.default_settings())
    bench: BenchParams = BenchParams()

    @field_validator("variants", "suites")
    @classmethod
    def _safe_names(cls, entries: dict, info) -> dict:
        """Each name a folder (models/<variant>, results/<variant>) or file (results/<model>/<suite>.jsonl) can be
        given on this file system, with the temporary names the writers make of it (pipeline/outputs.py)."""
        import re

        from pipeline.outputs import name_problem, shown_name

        folder, suffix = (Path("models"), "") if info.field_name == "variants" else (Path("results") / "base", ".jsonl")
        for name in entries:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or name == "base":
                raise ValueError(
                    f"name {shown_name(name)} must be letters, digits, '-', '_' or '.', and not 'base'"
                )
            if (problem := name_problem(name, folder, suffix)) is not None:
                raise ValueError(f"name {shown_name(name)} {problem}")
        return entries

    def variant(self, name: str) -> VariantParams:
        if name not in self.variants:
            known = ", ".join(self.variants) or "none"
            raise UserError(f"params.yaml: variants.{name}: no such variant (defined: {known})")
        return self.variants[name]

    def suite(self, name: str) -> SuiteParams:
        if name not in self.suites:
            known = ", ".join(self.suites) or "none"
            raise UserError(f"params.yaml: suites.{name}: no such suite (defined: {known})")
        return self.suites[name]

    def digest(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


SECTIONS = "model, calib, variants, suites, judge, kl, fix, verdict, engine, bench"


def load(path: Path | str = DEFAULT_PARAMS) -> Params:
    """params.yaml validated; no file at the default path gives the defaults, any other problem a UserError."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        if path == DEFAULT_PARAMS:
            return Params()
        raise UserError(f"{path}: no such file; pass --params with an existing params.yaml (or leave it out to "
                        "use ./params.yaml)")
    raw, lines = safe_yaml.load(path, "a params.yaml")
    if raw is None:
        raise UserError(f"{path}: holds no settings (empty, or only comments); give it the sections {SECTIONS} "
                        "as in the project's params.yaml, or delete the file to use the defaults")
    if not isinstance(raw, dict):
        raise UserError(f"{path}:1: the top level is {kind_of(raw)}; it must be a mapping of sections ({SECTIONS})")
    check_moved_keys(raw, path, lines)
    try:
        params = Params.model_validate(raw)
    except ValidationError as exc:
        raise UserError(format_error(path, exc, lines)) from None
    check_margins_name_suites(params, path, lines)
    check_against_model(params, path, lines)
    check_suite_models(params, path)
    check_against_dvc(params, path.parent / "dvc.yaml")
    return params
