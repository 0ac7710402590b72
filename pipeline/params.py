"""params.yaml schema: every stage's defaults, validated at load.

A bad file stops with the key's dotted path, what is wrong and what is allowed, e.g.
``params.yaml: variants.awq-w4a16.group_size: 100 does not divide 576 (hidden size of models/base)``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeline.errors import UserError

DEFAULT_PARAMS = Path("params.yaml")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelParams(Section):
    source: str = "demo"
    base_dir: Path = Path("models/base")
    dtype: Literal["float16", "bfloat16"] = "float16"


class CalibParams(Section):
    source: Path = Path("calib_data/support_logs.jsonl")
    out: Path = Path("calib_data/build")
    seq_len: int = Field(256, ge=16, le=32768)
    num_blocks: int = Field(32, ge=1)
    holdout: int = Field(32, ge=0)
    max_bad_fraction: float = Field(0.05, ge=0, le=1)
    redact: bool = True
    redact_patterns: list[str] = []
    seed: int = 0

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


class AwqParams(Section):
    method: Literal["awq"]
    group_size: int | Literal["auto"] = "auto"
    symmetric: bool = False
    batch_size: int = Field(32, ge=1)
    n_grid: int = Field(20, ge=3, le=100)  # AWQ scale candidates per layer group (llm-compressor divides by n_grid - 2)
    # how each candidate is scored: "gram" computes llm-compressor's loss from X^T X where a mapping's
    # output is one Linear's (pipeline/quantize/awq_gram.py); "forward" is llm-compressor's own search
    search: Literal["gram", "forward"] = "gram"

    @field_validator("group_size")
    @classmethod
    def _power_of_two(cls, value):
        if value != "auto" and (value < 16 or value & (value - 1)):
            raise ValueError(f"{value} is not one of auto, 16, 32, 64, 128, 256")
        return value


class Fp8Params(Section):
    method: Literal["fp8"]
    activations: Literal["static", "dynamic"] = "static"
    kv: Literal["per-head", "per-tensor", "none"] = "per-head"


VariantParams = Annotated[Union[AwqParams, Fp8Params], Field(discriminator="method")]


class SuiteParams(Section):
    task: str
    limit: int | None = Field(None, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    options: dict = {}  # task settings, e.g. long_context: {lengths: [1024, 2048], repeats: 1}


def env_var_name(value: str | None) -> str | None:
    import re

    if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        # never echo the value: it may be a key pasted by mistake
        raise ValueError("must be the name of an environment variable (e.g. OPENAI_API_KEY), not the key itself")
    return value


class JudgeParams(Section):
    backend: Literal["hf", "openai", "lmdeploy"] = "hf"
    model: str = "base"  # hf/lmdeploy: "base" or a checkpoint dir; openai: the served model's name
    margin: float = Field(0.05, ge=0, le=0.5)
    min_consistency: float = Field(0.6, ge=0, le=1)
    mode: Literal["pairwise", "reference"] = "pairwise"
    limit: int | None = Field(None, ge=1)  # held-out prompts to judge; None: all
    max_new_tokens: int = Field(256, ge=1)  # base and variant answers
    judge_max_new_tokens: int = Field(512, ge=1)  # the judge's reasoning and verdict
    control: bool = True  # also judge the base against itself: the noise floor
    base_url: str | None = None  # openai: e.g. http://127.0.0.1:8000/v1
    api_key_env: str | None = None  # openai: NAME of the environment variable holding the key, never the key
    concurrency: int = Field(4, ge=1, le=256)
    timeout: float = Field(60.0, gt=0)
    retries: int = Field(3, ge=0, le=20)
    backoff: float = Field(1.0, ge=0)  # seconds before the first retry; doubles each time, with jitter

    _key_is_named = field_validator("api_key_env")(lambda value: env_var_name(value))


class VerdictParams(Section):
    confidence: float = Field(0.95, gt=0.5, lt=1)
    bootstrap: int = Field(2000, ge=100)
    seed: int = 0
    default_margin: float = Field(0.02, ge=0, le=1)
    margins: dict[str, float] = {}
    floor_ceiling: float = Field(0.05, ge=0, le=0.5)
    kl_sequences: int = Field(32, ge=1)  # held-out conversations scored for KL / top-1 agreement
    kl_max_tokens: int = Field(512, ge=16)  # tokens per conversation
    # Speed (from `quantize bench`, when both base and variant were benched with the same engine):
    # when true, a variant whose batch-1 decode rate is below the base's by more than speed_tolerance
    # is NO-GO; when false, the report only shows it.
    nogo_if_slower_at_batch1: bool = False
    speed_tolerance: float = Field(0.05, ge=0, le=1)

    def margin_for(self, suite: str) -> float:
        return self.margins.get(suite, self.default_margin)


class EngineParams(Section):
    name: Literal["hf", "lmdeploy", "openai"] = "hf"
    batch_size: int = Field(32, ge=1)
    max_batch_tokens: int = Field(65536, ge=1)  # hf: rows x (longest prompt + new tokens) per batch
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    threads: int = Field(0, ge=0)
    # GPUs one model is split over (tensor parallelism) by the engines that serve it: lmdeploy (tp)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    # openai: the server that serves the checkpoint being evaluated (vLLM, lmdeploy api_server, ...)
    base_url: str | None = None
    model: str | None = None  # the served model's name
    api_key_env: str | None = None  # NAME of the environment variable holding the key
    concurrency: int = Field(8, ge=1, le=256)
    timeout: float = Field(120.0, gt=0)
    retries: int = Field(3, ge=0, le=20)

    _key_is_named = field_validator("api_key_env")(lambda value: env_var_name(value))

    def options(self, engine: str) -> dict:
        """What make_engine takes for `engine`, from this section."""
        if engine == "lmdeploy":
            return {"batch_size": self.batch_size, "max_batch_tokens": self.max_batch_tokens, "dtype": self.dtype,
                    "threads": self.threads, "tensor_parallel_size": self.tensor_parallel_size}
        if engine != "openai":
            return {"batch_size": self.batch_size, "max_batch_tokens": self.max_batch_tokens, "dtype": self.dtype,
                    "threads": self.threads}
        if not self.model:
            raise UserError("params.yaml: engine.model: with the openai engine, set the served model's name")
        return {"base_url": self.base_url, "model": self.model, "api_key_env": self.api_key_env,
                "concurrency": self.concurrency, "timeout": self.timeout, "retries": self.retries,
                "batch_size": self.concurrency * 4, "params_section": "engine"}


class BenchParams(Section):
    engine: Literal["hf", "lmdeploy"] | None = None  # None: engine.name
    concurrency: list[int] = [1, 4, 16, 64]
    input_len: int = Field(128, ge=1)
    output_len: int = Field(256, ge=2)
    requests_per_level: int = Field(2, ge=1)  # requests per level, as a multiple of the concurrency
    holdout: bool = True  # also the held-out prompts' real lengths

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, levels: list[int]) -> list[int]:
        if not levels or any(c < 1 for c in levels):
            raise ValueError("must be a non-empty list of positive integers, e.g. [1, 4, 16, 64]")
        return sorted(set(levels))


class Params(Section):
    model: ModelParams = ModelParams()
    calib: CalibParams = CalibParams()
    variants: dict[str, VariantParams] = {}
    suites: dict[str, SuiteParams] = {}
    judge: JudgeParams = JudgeParams()
    verdict: VerdictParams = VerdictParams()
    engine: EngineParams = EngineParams()
    bench: BenchParams = BenchParams()

    @field_validator("variants", "suites")
    @classmethod
    def _safe_names(cls, entries: dict) -> dict:
        import re

        for name in entries:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or name == "base":
                raise ValueError(
                    f"name {name!r} must be letters, digits, '-', '_' or '.', and not 'base'"
                )
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


def _format_error(path: Path, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"] if not str(part).startswith("function-"))
        # Pydantic names the union member it tried ("awq"/"fp8"); drop that noise.
        loc = loc.replace(".awq.", ".").replace(".fp8.", ".")
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key; remove it or check its spelling"
        elif err["type"] == "literal_error":
            message = f"{err['input']!r} is not allowed; {message.lower()}"
        elif err["type"] == "union_tag_invalid":
            message = f"method {err['input'].get('method')!r} is not one of 'awq', 'fp8'" if isinstance(err["input"], dict) else message
        lines.append(f"{path}: {loc}: {message}")
    return "\n".join(lines)


def load(path: Path | str = DEFAULT_PARAMS) -> Params:
    path = Path(path)
    if not path.exists():
        return Params()
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: the top level must be a mapping of sections")
    try:
        params = Params.model_validate(raw)
    except ValidationError as exc:
        raise UserError(_format_error(path, exc)) from None
    check_against_model(params, path)
    check_against_dvc(params, path.parent / "dvc.yaml")
    return params


def check_against_dvc(params: Params, dvc_file: Path) -> None:
    """DVC's matrix takes lists only, so dvc.yaml repeats the variant and suite names: keep them in step."""
    if not dvc_file.exists():
        return
    stages = (yaml.safe_load(dvc_file.read_text(encoding="utf-8")) or {}).get("stages", {})
    matrix = (stages.get("evaluate") or {}).get("matrix")
    if not matrix:
        return
    expected = {"model": ["base", *params.variants], "suite": list(params.suites)}
    for key, names in expected.items():
        listed = matrix.get(key, [])
        if sorted(listed) != sorted(names):
            raise UserError(
                f"{dvc_file}: stages.evaluate.matrix.{key} lists {listed}, but params.yaml defines {names}; "
                f"set it to [{', '.join(names)}]"
            )


def check_against_model(params: Params, path: Path | str = DEFAULT_PARAMS) -> None:
    """Checks that need the base checkpoint (group size vs layer widths), when it exists."""
    config_file = params.model.base_dir / "config.json"
    if not config_file.exists():
        return
    from pipeline.quantize.plan import group_size_problem

    config = json.loads(config_file.read_text())
    for name, variant in params.variants.items():
        if isinstance(variant, AwqParams) and variant.group_size != "auto":
            problem = group_size_problem(config, variant.group_size, params.model.base_dir)
            if problem:
                raise UserError(f"{path}: variants.{name}.group_size: {problem}")
