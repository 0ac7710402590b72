"""`quantize eval`: a model's suites through lm-eval with our engine; one result line per item.

`quantize eval MODEL` (the evaluate stage of dvc.yaml, one per model) runs every suite of params.yaml on
the model in one process with one engine (`run_model`); `--suite S` runs one (`run`). Each suite's
summary records a digest of what its results come from (`inputs`: settings, engine, checkpoint, code,
data), so a rerun keeps a suite whose inputs did not change as it is and scores only the others.

lm-eval builds the prompts, extracts answers and scores (the suite is data under evals/); our
engine generates (`generate_until`) or scores tokens (`loglikelihood` for multiple choice,
`loglikelihood_rolling` for perplexity: pipeline/scoring/likelihood.py turns lm-eval's requests into
token requests, the same for every engine). Every finished generation and token score is
appended to a cache beside the output (pipeline/scoring/eval_cache.py), keyed by the model's fingerprint
and the request, so a killed run resumes where it stopped and a rerun of an unchanged model
costs nothing. A perplexity suite's lines carry each document's log-likelihood and token count,
so the verdict pairs the models per document. A reasoning model answers as it is served (thinking as its template
switches it, the budget that fits, k samples per item: pipeline/scoring/generation_plan.py); its lines say how
(pipeline/scoring/result_lines.py).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.scoring import sandbox
from pipeline.checkpoints import checkpoint
from pipeline.engines import Engine, EngineSettings, capability, default_settings, engine_names, settings_for
from pipeline.errors import UserError
from pipeline.scoring.eval_cache import GenerationCache, answers_fingerprint
from pipeline.scoring.result_lines import merged, result_line
from pipeline.scoring.suite_inputs import EVALS_DIR, suite_inputs, watch as suite_reads
from pipeline.formats.results import lines_path, write_results
from pipeline.outputs import Stopwatch
from pipeline.settings import fixes, lm_eval_tasks, suites
from pipeline.settings.params import SuiteParams, sections_with_overrides

log = logging.getLogger(__name__)


def _lm_class():
    """lm-eval's view of our engine (pipeline/scoring/lm_eval_model.py), imported when a suite first runs: lm-eval is a
    heavy import a stage that keeps every suite as it is never needs."""
    from pipeline.scoring.lm_eval_model import PipelineLM

    return PipelineLM


def _task_manager(task: str, suite: str, metadata: dict | None = None, tasks_dir: Path | None = None):
    """Our suites (and the suite's own task folder, if any) first: indexing lm-eval's thousands of
    built-in tasks takes many seconds."""
    from lm_eval.tasks import TaskManager

    include = [str(EVALS_DIR)]
    if tasks_dir is not None:
        if not Path(tasks_dir).is_dir():
            raise UserError(f"params.yaml: suites.{suite}.tasks_dir: {tasks_dir} is not a directory; "
                            "point it at the folder holding the task's YAML")
        include.append(str(tasks_dir))
    ours = TaskManager(include_path=include, include_defaults=False, metadata=metadata)
    if task in ours.all_tasks:
        return ours
    everything = TaskManager(include_path=include, metadata=metadata)
    if task not in everything.all_tasks:
        where = " or ".join(include)
        raise UserError(f"params.yaml: suites.{suite}.task: lm-eval task {task!r} not found in {where} "
                        "or lm-eval's built-in tasks")
    return everything


@dataclass
class EvalResult:
    lines: Path
    figures: dict  # what the stage's JSON summary holds

    def summary(self) -> str:
        s = self.figures
        if s.get("status") in ("not applicable", "not run"):
            return f"eval: {s['suite']} {s['status']} on {s['variant']}: {s['reason']}"
        work = (f"{s['scored_tokens']} tokens scored" if s.get("scored_tokens")
                else f"{s['generated_tokens']} tokens")
        kept = " (unchanged: kept)" if s.get("kept") else ""
        cut = (s.get("cut") or {}).get("reasoning")  # the budget too small: said where it is seen first
        cut = f", {cut} cut inside the reasoning (raise suites.{s['suite']}.thinking_max_new_tokens)" if cut else ""
        return (f"eval: {self.lines} ({s['n']} items, {s['metric']} {s['score']:.3f}, "
                f"{work} at {s['tokens_per_second']:.0f} tok/s{cut}) in {s['seconds']:.0f} s{kept}")


class SharedEngine:
    """The one engine a stage's suites share: made the first time a suite needs it (a suite whose results
    are current needs none), closed once at the end. A server engine (vLLM) starts or attaches to its server
    only when the first request goes out (pipeline/engines/vllm.py), so a suite whose items are all in the
    resume cache costs no server start either."""

    def __init__(self, name: str, model_dir: Path, settings: EngineSettings, stage: dict | None = None):
        """settings: the engine's (settings_for); stage: what the stage supplies make_engine (a server's log_path)."""
        self.name, self.model_dir, self.settings, self.stage = name, Path(model_dir), settings, stage or {}
        self._engine: Engine | None = None

    def get(self) -> Engine:
        if self._engine is None:
            from pipeline.engines import make_engine

            self._engine = make_engine(self.name, self.model_dir, self.settings, **self.stage)
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


def run(model_dir: Path | str, settings: SuiteParams | None = None, engine_settings: EngineSettings | None = None, *,
        suite: str, variant: str, out_dir: Path | str, engine: str | None = None, log_path: Path | str | None = None,
        shared: SharedEngine | None = None, keep_current: bool = False, **overrides) -> EvalResult:
    """One suite on one model. settings: params.yaml `suites.<suite>`; engine_settings: params.yaml `engine` (an
    engine's section, pipeline/engines/; default: the default engine's); `overrides` (e.g. limit=3,
    max_new_tokens=8, batch_size=2) replace the field of that name in the suite section, else in the engine
    section, and are validated again; without `settings` a `task=` override names the lm-eval task. engine: the
    engine's name (default: engine_settings.name; another engine takes what it shares of the section: settings_for).
    log_path: where a vLLM server's log goes (default: <out_dir>/<suite>.vllm.log). shared: the engine of the
    stage's other suites (run_model); without it the suite makes its own and closes it. keep_current: when
    the suite's results were written from the same inputs (`inputs` in <suite>.json), keep them as they are."""
    watch = Stopwatch()
    s, e = sections_with_overrides(settings or SuiteParams, engine_settings or default_settings(engine), **overrides)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if shared is None:
        engine = engine or e.name
        options = settings_for(e, engine)  # a missing setting (openai: engine.model) stops before any work
        stage = {"log_path": Path(log_path) if log_path else out_dir / f"{suite}.vllm.log"} \
            if capability(engine, "starts_server") else {}  # a server's log: beside the results
    else:
        engine, options, stage = shared.name, shared.settings, shared.stage
    checkpoint.open(model_dir)  # a missing or broken config.json: one message naming it and the fix (read once)
    watched, inputs = suite_reads(model_dir, s), suite_inputs(model_dir, suite, s, engine, options)  # checked later
    if keep_current and (kept := _current(out_dir, suite, inputs)) is not None:
        return kept
    own = shared is None
    shared = shared or SharedEngine(engine, model_dir, options, stage)
    try:
        return _run_suite(model_dir, s, shared, suite=suite, variant=variant, out_dir=out_dir, inputs=inputs,
                          watch=watch, watched=watched)
    finally:
        if own:
            shared.close()


def _run_suite(model_dir: Path, s: SuiteParams, shared: SharedEngine, *, suite: str, variant: str, out_dir: Path,
               inputs: str, watch: Stopwatch, watched) -> EvalResult:
    from pipeline.engines import STARTS, engine_start_seconds

    starts_before, sandbox_before = len(STARTS), sandbox.SECONDS[0]
    engine, task = shared.name, s.task
    declared = suites.find(task, s.tasks_dir)  # what the suite's YAML declares (None: a task of lm-eval's own)
    # a plain lm-eval task (chartqa): what its YAML says, read as a suite (pipeline/settings/lm_eval_tasks.py)
    plain = lm_eval_tasks.plain(task, s.tasks_dir, suite) if declared is None else None
    tailored = declared is not None and declared.hook("task_metadata") is not None
    # a suite that needs the context (long context: its ladder goes as far as the served engine holds, its
    # max_model_len and KV cache) has a server engine up before its items are made (and that one answers them)
    needs = declared.needs if declared else plain.suite.needs if plain else ()
    serving = _started(shared) if "context" in needs and capability(engine, "starts_server") else None
    metadata = _task_metadata(model_dir, suite, s.options, declared, serving)
    task_manager = _task_manager(task, suite, metadata, Path(s.tasks_dir) if s.tasks_dir else None)
    raw_config = task_manager.task_index[task].cfg or {}  # the task's YAML, functions unresolved
    if tailored:
        metadata = (raw_config.get("metadata") or {}) | metadata  # as the task will see it (the long-context ladder)
    if "images" in needs:  # an include's doc_to_image (mmmu_val_art) counts: the index's YAML is the file alone
        raw_config = {**raw_config, "doc_to_image": raw_config.get("doc_to_image") or True}
    spec = lm_eval_tasks.task_spec(task, s.dataset_path, suite, raw_config, task_manager.task_index[task].yaml_path)
    reason = _not_applicable_reason(model_dir, suite, engine, raw_config, declared, metadata if tailored else None,
                                    needs)
    if reason is not None:
        return _not_applicable(out_dir, suite=suite, task=task, variant=variant, model_dir=model_dir,
                               engine=engine, reason=reason, inputs=inputs, seconds=round(watch.seconds, 2))
    sandbox_method = None
    if "sandbox" in needs:  # refuse before any generation
        sandbox_method = sandbox.require_isolation(allowed=s.allow_unsandboxed,
                                                   setting=f"suites.{suite}.allow_unsandboxed")
    kind = declared.kind if declared else plain.suite.kind if plain else None
    metric = plain.metric if plain else None  # a plain task's primary metric (its config dump holds no name)
    lm, passes = _evaluate(model_dir, s, shared, suite=suite, variant=variant, out_dir=out_dir,
                           task_manager=task_manager, spec=spec, metric=metric,
                           generates=raw_config.get("output_type", "generate_until") == "generate_until")
    lines, summary = _lines_and_summary(lm, passes, suite=suite, task=task, variant=variant, model_dir=model_dir,
                                        engine=engine, right_wrong=kind in (None, "right-wrong", "retrieval-table"),
                                        metric=metric, kind=kind)
    summary.update(inputs=inputs, checkpoint=None,  # what it was scored on (below): the report checks
                   engine_start_s=engine_start_seconds(starts_before),
                   scoring_seconds=round(sandbox.SECONDS[0] - sandbox_before, 2), seconds=round(watch.seconds, 2),
                   **_fixed_and_work(lm, watch, starts_before))
    if sandbox_method is not None:
        summary["sandbox"] = sandbox_method  # "rlimits+audit": ran unsandboxed (allow_unsandboxed)
    if declared is not None and (summarize := declared.hook("summarize")):
        summary["table"] = summarize(lines, metadata)  # the suite's own table (long context: per length x depth)
    summary["checkpoint"] = watched.check(suite)  # the weights, option files or dataset changed: nothing kept
    return EvalResult(write_results(out_dir, suite, lines, summary), summary)


def _fixed_and_work(lm, watch: Stopwatch, starts_before: int) -> dict:
    """A suite's time split: setup_seconds, building the task, its documents and requests before lm-eval asks
    the engine anything (a model load made meanwhile excluded: that is engine start); work_seconds, scoring the
    items from then on: the engine's answers (less any wait for its start), lm-eval's metrics, the sandbox.
    The rest of `seconds` is engine start."""
    from pipeline.engines import engine_start_seconds

    first = lm.first_request_at or time.perf_counter()
    at_first = getattr(lm, "starts_at_first_request", None)
    after = engine_start_seconds(at_first) if at_first is not None else 0.0
    before = engine_start_seconds(starts_before) - after
    return {"setup_seconds": round(max(0.0, first - watch.start - before), 2),
            "work_seconds": round(max(0.0, watch.seconds - (first - watch.start) - after), 2)}


def _started(shared: SharedEngine) -> Engine:
    engine = shared.get()
    if hasattr(engine, "start"):
        engine.start()
    return engine


def _not_applicable_reason(model_dir: Path, suite: str, engine: str, raw_config: dict, declared: suites.Suite | None,
                           tailored_metadata: dict | None, needs: tuple[str, ...] = ()) -> str | None:
    """Why the suite cannot run on this model (e.g. VQA on a text-only checkpoint, a suite that needs thinking on a
    model whose template does not think, a context below the long-context ladder: the suite's own hook), before any
    engine work."""
    from pipeline.engines import vision
    from pipeline.engines.reasoning import model_thinks

    reason = vision.not_applicable(model_dir, raw_config)
    if reason is None and "thinking" in needs and model_thinks(model_dir) is False:
        reason = (f"{Path(model_dir).name}: its chat template does not think (it neither reads enable_thinking nor "
                  "closes reasoning with </think>); the suite needs a model that reasons before answering")
    if reason is None and raw_config.get("doc_to_image") and not capability(engine, "images"):
        raise UserError(f"suite {suite}: its prompts carry images, which the {engine} engine does not take here; "
                        f"evaluate it with {engine_names(where=lambda spec: spec.images)} (engine.name, or "
                        "quantize eval --engine)")
    if reason is None and tailored_metadata is not None and (check := declared.hook("not_applicable")):
        reason = check(tailored_metadata)
    return reason


def _evaluate(model_dir: Path, s: SuiteParams, shared: SharedEngine, *, suite: str, variant: str, out_dir: Path,
              task_manager, spec: str | dict, generates: bool = True, metric: str | None = None):
    """lm-eval's run of the task (`spec`: its name, or its config with a local dataset) through the shared engine
    and the suite's resume cache, once per sample (k samples of a task that generates:
    pipeline/scoring/generation_plan.py): (lm, [(lm-eval's results, lines) of each pass])."""
    from lm_eval import simple_evaluate

    from pipeline.console import progress
    from pipeline.scoring.generation_plan import plan_for

    cache = GenerationCache(out_dir / ".cache" / f"{suite}.jsonl",
                            answers_fingerprint(model_dir, shared.name, shared.settings))
    engine = shared.get()
    plan = plan_for(getattr(engine, "model_dir", None), s if generates else s.model_copy(update={"samples": 1}),
                    suite=suite, tokenizer=getattr(engine, "tokenizer", None))
    passes = []
    # the code suite's scoring runs model-written code (evals/code/utils.py): sandboxed unless allowed
    with progress(f"eval {variant}/{suite}", None, "requests") as advance, \
            sandbox.allow_unsandboxed(s.allow_unsandboxed):
        lm = _lm_class()(engine, cache, chunk=shared.settings.batch_size, on_done=advance, task=s.task,
                         on_items=advance.expect, plan=plan)
        for sample in range(plan.samples):
            lm.sample = sample
            results = simple_evaluate(
                model=lm, tasks=[spec], task_manager=task_manager, limit=s.limit, log_samples=True,
                apply_chat_template=True, gen_kwargs={"max_gen_toks": plan.max_new_tokens},
                bootstrap_iters=0, verbosity="ERROR",
            )
            passes.append((results, _pass_lines(lm, results, suite=suite, task=s.task, variant=variant,
                                                metric=metric)))
    lm.cache = cache
    return lm, passes


def _pass_lines(lm, results: dict, *, suite: str, task: str, variant: str, metric: str | None = None) -> list[dict]:
    """One pass's line per item, in lm-eval's document order (its answers are lm.stats' until the next pass).
    metric: the primary metric a plain task's YAML names (lm-eval's config dump holds a metric function's source, not
    its name); default: the config's."""
    samples = sorted(results["samples"][task], key=lambda sample: sample["doc_id"])
    return [result_line(sample, suite, variant, metric or _metric(results, task), lm) for sample in samples]


def _metric(results: dict, task: str) -> str:
    task_config = results["configs"][task]
    return (task_config.get("metadata") or {}).get("primary_metric") or task_config["metric_list"][0]["metric"]


def _metrics(every: list[dict]) -> dict:
    """lm-eval's figures of the task (k samples: their mean over the passes)."""
    numbers = {k: v for k, v in every[0].items() if isinstance(v, (int, float))}
    if len(every) == 1:
        return numbers
    return {k: sum(m[k] for m in every) / len(every) for k in numbers
            if all(isinstance(m.get(k), (int, float)) for m in every)}


def _lines_and_summary(lm, passes: list, *, suite: str, task: str, variant: str, model_dir: Path, engine: str,
                       right_wrong: bool, metric: str | None = None, kind: str | None = None) -> tuple[list[dict], dict]:
    results, lines = passes[0]
    if len(passes) > 1:  # k samples: each item's line from its k
        lines = merged([p[1] for p in passes], lm.plan.seeds, right_wrong)
    every = [r["results"][task] for r, _ in passes]
    summary = {
        "suite": suite, "task": task, "variant": variant, "model_dir": str(model_dir), "engine": engine,
        "metric": metric or _metric(results, task), "n": len(lines), "score": sum(l["score"] for l in lines) / max(len(lines), 1),
        # the items the task has before the limit (lm-eval's count): no next step asks for more
        **({"available": available} if isinstance(available := ((results.get("n-samples") or {}).get(task) or {})
                                                  .get("original"), int) else {}),
        "metrics": _metrics(every),
        "generation": lm.plan.describe(),
        # answers the token budget cut, by where (every sample counted)
        "cut": {where: sum(a.get("cut") == where for line in lines for a in line.get("samples") or [line])
                for where in ("reasoning", "answer")},
        **_speed(lines, lm),
        "cache": {"path": str(lm.cache.path), "lines_dropped": lm.cache.dropped},
    }
    if defects := getattr(lm.engine, "defects", lambda: [])():  # known engine defects it met (vllm), and if avoided
        summary["engine_defects"] = defects
    # a perplexity suite (its declared kind; a task no YAML describes: its lines are documents): per token, over all
    if lines and (kind == "perplexity" or kind is None and all("loglikelihood" in line for line in lines)):
        tokens = sum(line["n_tokens"] for line in lines)
        summary.update(metric="perplexity", tokens=tokens,
                       score=math.exp(-sum(line["loglikelihood"] for line in lines) / max(tokens, 1)))
    return lines, summary


# ------------------------------------------------------------------ what a suite's results were computed from

def _current(out_dir: Path, suite: str, inputs: str) -> EvalResult | None:
    """The suite's results when they were written from these very inputs (and are whole), else None."""
    summary_path, lines = out_dir / f"{suite}.json", lines_path(out_dir, suite)
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        n_lines = sum(1 for line in lines.read_text(encoding="utf-8").splitlines() if line.strip())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("inputs") != inputs or summary.get("n") != n_lines:
        return None
    return EvalResult(lines, {**summary, "kept": True})


# ------------------------------------------------------------------ every suite of one model (the DVC stage)

@dataclass
class ModelEvalResult:
    model_dir: Path
    suites: list[EvalResult]
    seconds: float
    skipped: list[str] = field(default_factory=list)  # left for the stage: their data not written yet

    def summary(self) -> str:
        states = [r.figures.get("status") or ("kept" if r.figures.get("kept") else "scored") for r in self.suites]
        counts = ", ".join(f"{states.count(k)} {k}" for k in ("scored", "kept", "not applicable", "not run")
                           if states.count(k))
        return f"eval: {self.model_dir.name}: {len(self.suites)} suites ({counts}) in {self.seconds:.0f} s"


def run_model(model_dir: Path | str, params, *, out_dir: Path | str, engine: str | None = None,
              variant: str | None = None, skip_missing_data: bool = False) -> ModelEvalResult:
    """Every suite of params.yaml on one model, in one process with one engine (`quantize eval MODEL`, the
    evaluate stage of dvc.yaml): a suite whose `suites.<name>.models` leaves this model out is recorded as
    not run (and why); a suite whose results were written from the same inputs is kept as it is (only a
    suite whose settings, engine, checkpoint, code or data changed is scored again, from the resume cache
    where its items are unchanged); the engine is made once, when the first suite needs it. skip_missing_data (a
    job working ahead of its stage, pipeline/scoring/ahead.py): a suite whose options name a file not written yet (ppl-chat
    before the calib stage) is left for the stage, not recorded."""
    watch, model_dir, out_dir = Stopwatch(), Path(model_dir), Path(out_dir)
    variant, engine = variant or model_dir.name, engine or params.engine.name
    options = settings_for(params.engine, engine)
    stage = {"log_path": out_dir / "vllm-server.log"} if capability(engine, "starts_server") else {}
    shared = SharedEngine(engine, model_dir, options, stage)
    done: list[EvalResult] = []
    skipped: list[str] = []
    try:
        for name, settings in params.suites.items():
            if not fixes.runs_on(settings.models, variant):  # a fix runs what its variant runs
                done.append(_not_run(out_dir, suite=name, task=settings.task, variant=variant, model_dir=model_dir,
                                     engine=engine, models=settings.models))
                continue
            if skip_missing_data and _files_not_yet_written(settings):
                skipped.append(name)
                continue
            done.append(run(model_dir, settings, params.engine, suite=name, variant=variant, out_dir=out_dir,
                            engine=engine, shared=shared, keep_current=True))
    finally:
        shared.close()
    return ModelEvalResult(model_dir, done, watch.seconds, skipped)


def _files_not_yet_written(s: SuiteParams) -> list[str]:
    """The files a suite's options name that do not exist (yet): option values that are paths (they hold a '/')."""
    return [v for v in s.options.values() if isinstance(v, str) and "/" in v and not Path(v).exists()]


def _speed(lines: list[dict], lm) -> dict:
    """Generation (or scoring) throughput of this run; cached items cost nothing and count nothing."""
    if lm.scored_requests:
        return {"generated_tokens": 0, "scored_tokens": lm.scored_tokens,
                "tokens_per_second": lm.scored_tokens / lm.generate_seconds if lm.generate_seconds else 0.0,
                "generate_seconds": round(lm.generate_seconds, 2),
                "items_per_second": lm.scored_requests / lm.generate_seconds if lm.generate_seconds else None}
    generated = sum(line["n_tokens"] or 0 for line in lines if "loglikelihood" not in line)
    gen_seconds = sum(line["seconds"] or 0 for line in lines)
    return {
        "generated_tokens": generated,
        "tokens_per_second": (lm.generated_tokens / lm.generate_seconds if lm.generate_seconds
                              else generated / gen_seconds if gen_seconds else 0.0),
        "generate_seconds": round(lm.generate_seconds, 2),
        "items_per_second": lm.generated_items / lm.generate_seconds if lm.generate_seconds else None,
    }


def _task_metadata(model_dir: Path, suite: str, options: dict, declared: suites.Suite | None,
                   engine=None) -> dict | None:
    """What the task's loader gets (lm-eval metadata): the suite's options, the checkpoint (whose
    tokenizer and chat template a task may need, e.g. to render conversations), and for a suite with its
    own `task_metadata` hook (long context) what only the model knows."""
    if declared is not None and (tailored := declared.hook("task_metadata")):
        return tailored(model_dir, engine=engine, **options)
    data = options.get("data")
    if data is not None and not Path(data).exists():
        raise UserError(f"params.yaml: suites.{suite}.options.data: {data} does not exist; build it first "
                        "(the held-out conversations: `quantize calib`) or point it at a file that does")
    return {**options, "model_dir": str(model_dir)} if options else None


def _not_applicable(out_dir: Path, *, reason: str, inputs: str | None = None, **fields) -> EvalResult:
    """No items, score None, status "not applicable": the report shows n/a, never 0 %."""
    return _no_items(out_dir, status="not applicable", reason=reason, inputs=inputs, **fields)


def _not_run(out_dir: Path, *, models: list[str], **fields) -> EvalResult:
    """A suite params.yaml runs on other models only: recorded as not run, with the key that says so."""
    reason = (f"suites.{fields['suite']}.models lists {', '.join(models)}; {fields['variant']} is not among them "
              "(add it, or the variant it fixes, there to run the suite on it)")
    return _no_items(out_dir, status="not run", reason=reason, inputs=None, **fields)


def _no_items(out_dir: Path, *, status: str, reason: str, inputs: str | None, seconds: float = 0.0,
              **fields) -> EvalResult:
    summary = {**fields, "model_dir": str(fields["model_dir"]), "metric": None, "n": 0, "score": None,
               "status": status, "reason": reason, "metrics": {}, "generated_tokens": 0,
               "tokens_per_second": 0.0, "seconds": seconds, "setup_seconds": seconds, "work_seconds": 0.0,
               **({"inputs": inputs} if inputs else {})}
    return EvalResult(write_results(out_dir, fields["suite"], [], summary), summary)
