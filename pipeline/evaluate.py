"""`quantize eval`: run one suite through lm-eval with our engine; one result line per item.

lm-eval builds the prompts, extracts answers and scores (the suite is data under evals/);
our engine only generates. Every completed generation is appended to a cache beside the
output, keyed by the model's fingerprint and the prompt, so a killed run resumes where it
stopped and a rerun of an unchanged model costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import sandbox
from pipeline.engines import Completion, Engine, GenRequest
from pipeline.errors import UserError
from pipeline.outputs import Stopwatch, write_atomic, write_json

EVALS_DIR = Path(__file__).resolve().parent.parent / "evals"
log = logging.getLogger(__name__)


def model_fingerprint(model_dir: Path) -> str:
    """Hash of config and weights: a changed variant never reuses another's cached outputs."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.suffix in {".json", ".safetensors", ".jinja"} and path.name != "source.json":
            digest.update(path.name.encode())
            with open(path, "rb") as handle:
                while chunk := handle.read(1 << 22):
                    digest.update(chunk)
    return digest.hexdigest()[:16]


class GenerationCache:
    """Append-only JSONL of finished generations; a torn last line (SIGKILL) is ignored."""

    def __init__(self, path: Path, fingerprint: str):
        self.path, self.fingerprint = path, fingerprint
        self.entries: dict[str, dict] = {}
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if entry.get("model") == fingerprint:
                    self.entries[entry["key"]] = entry

    @staticmethod
    def key(request: GenRequest) -> str:
        parts = [request.prompt, request.max_new_tokens, request.stop]
        if getattr(request, "images", None):  # same question, other image: another answer
            from pipeline.engines.vision import image_digest

            parts.append(image_digest(request.images))
        raw = json.dumps(parts)
        return hashlib.sha256(raw.encode()).hexdigest()

    def get(self, request: GenRequest) -> Completion | None:
        entry = self.entries.get(self.key(request))
        return Completion(entry["text"], entry["n_tokens"], entry["seconds"]) if entry else None

    def put_many(self, requests: list[GenRequest], completions: list[Completion]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            for request, completion in zip(requests, completions):
                entry = {"model": self.fingerprint, "key": self.key(request), "text": completion.text,
                         "n_tokens": completion.n_tokens, "seconds": completion.seconds}
                self.entries[entry["key"]] = entry
                handle.write(json.dumps(entry, ensure_ascii=False) + "\n")
            handle.flush()


def _lm_class():
    from lm_eval.api.model import LM

    class PipelineLM(LM):
        """Presents any Engine to lm-eval; generations go through the resume cache in chunks."""

        def __init__(self, engine: Engine, cache: GenerationCache, chunk: int, on_chunk=None):
            super().__init__()
            self.engine, self.cache, self.chunk, self.on_chunk = engine, cache, chunk, on_chunk
            self.stats: dict[str, Completion] = {}
            # wall time inside the engine and what it produced, this run (cached items excluded):
            # per-item seconds are latencies, which overlap on an engine that runs requests concurrently
            self.generate_seconds, self.generated_items, self.generated_tokens = 0.0, 0, 0
            self.MULTIMODAL = bool(getattr(engine, "accepts_images", False))  # lm-eval refuses image tasks otherwise

        @property
        def tokenizer_name(self) -> str:
            return str(getattr(self.engine, "model_dir", self.engine.name))

        def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
            return self.engine.apply_chat_template(chat_history)

        def generate_until(self, requests) -> list[str]:
            from pipeline.engines.vision import request_from_lm_eval

            gen = [request_from_lm_eval(request.args) for request in requests]
            todo = [r for r in gen if self.cache.get(r) is None]
            for start in range(0, len(todo), self.chunk):
                part = todo[start:start + self.chunk]
                started = time.perf_counter()
                completions = self.engine.generate(part)
                self.generate_seconds += time.perf_counter() - started
                self.generated_items += len(part)
                self.generated_tokens += sum(c.n_tokens for c in completions)
                self.cache.put_many(part, completions)
                if self.on_chunk:
                    self.on_chunk(len(part))
            done = [self.cache.get(r) for r in gen]
            for request, completion in zip(gen, done):
                self.stats[request.prompt] = completion
            return [c.text for c in done]

        def loglikelihood(self, requests):
            raise UserError("this suite needs log-likelihoods, which the pipeline's engines do not give yet")

        def loglikelihood_rolling(self, requests):
            raise UserError("this suite needs rolling log-likelihoods, which the pipeline's engines do not give yet")

    return PipelineLM


def _task_manager(task: str, suite: str, metadata: dict | None = None):
    """Our suites first (indexing lm-eval's thousands of built-in tasks takes many seconds)."""
    from lm_eval.tasks import TaskManager

    ours = TaskManager(include_path=str(EVALS_DIR), include_defaults=False, metadata=metadata)
    if task in ours.all_tasks:
        return ours
    everything = TaskManager(include_path=str(EVALS_DIR), metadata=metadata)
    if task not in everything.all_tasks:
        raise UserError(f"params.yaml: suites.{suite}.task: lm-eval task {task!r} not found in {EVALS_DIR} "
                        "or lm-eval's built-in tasks")
    return everything


@dataclass
class EvalResult:
    lines: Path
    summary: dict

    def summary_line(self) -> str:
        s = self.summary
        if s.get("status") == "not applicable":
            return f"eval: {s['suite']} not applicable to {s['variant']}: {s['reason']}"
        return (f"eval: wrote {self.lines} ({s['n']} items, {s['metric']} {s['score']:.3f}, "
                f"{s['generated_tokens']} tokens at {s['tokens_per_second']:.0f} tok/s) in {s['seconds']:.0f} s")


def _result_line(sample: dict, suite: str, variant: str, metric: str, stats: dict[str, Completion]) -> dict:
    prompt = sample["arguments"][0][0] if isinstance(sample["arguments"], list) else sample["arguments"]["gen_args_0"]["arg_0"]
    output = sample["resps"][0][0] if sample["resps"] and sample["resps"][0] else ""
    completion = stats.get(prompt)
    doc = sample.get("doc", {})
    score = float(sample.get(metric, 0.0))
    return {
        "id": str(doc.get("id", f"{suite}-{sample['doc_id']}")),
        "suite": suite,
        "variant": variant,
        "prompt": prompt,
        "target": str(sample.get("target", "")),
        "output": output,
        "score": score,
        "correct": score >= 1.0,
        "n_tokens": completion.n_tokens if completion else None,
        "seconds": round(completion.seconds, 4) if completion else None,
        # suites that run model-written code: whether it ran in the bubblewrap sandbox
        **({"isolated": bool(sample["isolated"])} if "isolated" in sample else {}),
    }


def run(model_dir: Path | str, *, suite: str, task: str, variant: str, out_dir: Path | str,
        engine: str = "hf", limit: int | None = None, max_new_tokens: int = 256,
        engine_options: dict | None = None,
        task_options: dict | None = None, allow_unsandboxed: bool = False) -> EvalResult:
    from lm_eval import simple_evaluate
    from rich.progress import Progress

    from pipeline.engines import make_engine

    watch = Stopwatch()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").exists():
        raise UserError(f"{model_dir}: no config.json; pass a checkpoint directory (models/base or models/<variant>)")
    from pipeline import long_context
    from pipeline.engines import vision

    metadata = long_context.task_metadata(model_dir, **(task_options or {})) if task == long_context.TASK else None
    task_manager = _task_manager(task, suite, metadata)
    raw_config = task_manager.task_index[task].cfg or {}  # the task's YAML, functions unresolved
    reason = vision.not_applicable(model_dir, raw_config)
    if metadata is not None:
        metadata = (raw_config.get("metadata") or {}) | metadata  # the ladder as the task will see it
        reason = reason or long_context.not_applicable(metadata)
    if reason is not None:
        return _not_applicable(out_dir, suite=suite, task=task, variant=variant, model_dir=model_dir,
                               engine=engine, reason=reason)
    sandbox_method = None
    if (raw_config.get("metadata") or {}).get("runs_model_code"):  # refuse before any generation
        sandbox_method = sandbox.require_isolation(allowed=allow_unsandboxed,
                                                   setting=f"suites.{suite}.allow_unsandboxed")
    cache = GenerationCache(out_dir / ".cache" / f"{suite}.jsonl", model_fingerprint(model_dir))
    options = engine_options or {}
    # the code suite's scoring runs model-written code (evals/code/utils.py): sandboxed unless allowed
    with Progress(transient=True) as progress, sandbox.allow_unsandboxed(allow_unsandboxed):
        bar = progress.add_task(f"{variant}/{suite}", total=limit)
        lm_engine = make_engine(engine, model_dir, **options)
        lm = _lm_class()(lm_engine, cache, chunk=options.get("batch_size", 32),
                         on_chunk=lambda n: progress.advance(bar, n))
        try:
            results = simple_evaluate(
                model=lm, tasks=[task], task_manager=task_manager, limit=limit, log_samples=True,
                apply_chat_template=True, gen_kwargs={"max_gen_toks": max_new_tokens},
                bootstrap_iters=0, verbosity="ERROR",
            )
        finally:
            lm_engine.close()
    task_config = results["configs"][task]
    metric = (task_config.get("metadata") or {}).get("primary_metric") or task_config["metric_list"][0]["metric"]
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    lines = [_result_line(s, suite, variant, metric, lm.stats) for s in samples]
    generated = sum(line["n_tokens"] or 0 for line in lines)
    gen_seconds = sum(line["seconds"] or 0 for line in lines)
    summary = {
        "suite": suite, "task": task, "variant": variant, "model_dir": str(model_dir), "engine": engine,
        "metric": metric, "n": len(lines), "score": sum(l["score"] for l in lines) / max(len(lines), 1),
        "metrics": {k: v for k, v in results["results"][task].items() if isinstance(v, (int, float))},
        "generated_tokens": generated,
        "tokens_per_second": (lm.generated_tokens / lm.generate_seconds if lm.generate_seconds
                              else generated / gen_seconds if gen_seconds else 0.0),
        "generate_seconds": round(lm.generate_seconds, 2),
        "items_per_second": lm.generated_items / lm.generate_seconds if lm.generate_seconds else None,
        "seconds": round(watch.seconds, 2),
    }
    if sandbox_method is not None:
        summary["sandbox"] = sandbox_method  # "rlimits+audit": ran unsandboxed (allow_unsandboxed)
    if metadata is not None:
        summary["long_context"] = long_context.summarize(lines, metadata)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines_path = out_dir / f"{suite}.jsonl"
    write_atomic(lines_path, "".join(json.dumps(l, ensure_ascii=False) + "\n" for l in lines))
    write_json(out_dir / f"{suite}.json", summary)
    return EvalResult(lines_path, summary)


def _not_applicable(out_dir: Path, *, reason: str, **fields) -> EvalResult:
    """No items, score None, status "not applicable": the report shows n/a, never 0 %."""
    summary = {**fields, "model_dir": str(fields["model_dir"]), "metric": None, "n": 0, "score": None,
               "status": "not applicable", "reason": reason, "metrics": {}, "generated_tokens": 0,
               "tokens_per_second": 0.0, "seconds": 0.0}
    out_dir.mkdir(parents=True, exist_ok=True)
    lines_path = out_dir / f"{fields['suite']}.jsonl"
    write_atomic(lines_path, "")
    write_json(out_dir / f"{fields['suite']}.json", summary)
    return EvalResult(lines_path, summary)
