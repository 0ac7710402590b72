"""The scoring subcommands: `eval` (the suites through lm-eval), `bench` (serving speed on the engine), `warm` (a
server started early), `kl` (the variant's token distribution against the base's, and its groups ranked), `sensitivity`
(the groups ranked on their own) and `judge` (the held-out prompts, judged). pipeline/cli/app.py registers them on the
`quantize` app (`register`), in the order `quantize --help` lists them."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipeline import console
from pipeline.cli.common import (PARAMS_OPTION, WORK_SECONDS, checked_model, collecting_ahead, load_params,
                                 make_room_on_gpu, refuse_overlap, stage, start_ahead, warm_run_servers, warm_server,
                                 working)
from pipeline.engines import engine_names
from pipeline.errors import UserError
from pipeline.settings.params import with_overrides


@stage
def eval_(
    model_dir: Path = typer.Argument(..., help="Checkpoint to evaluate (models/base or models/<variant>)"),
    suite: Optional[str] = typer.Option(None, help="One suite from params.yaml (e.g. math); default: every suite "
                                                   "params.yaml runs on this model, in one process"),
    engine: Optional[str] = typer.Option(None, help=f"{engine_names(described=True)} (default: params engine.name; "
                                                    "another engine takes the settings of params engine it shares)"),
    limit: Optional[int] = typer.Option(None, help="Items to run (default: params suites.<suite>.limit); with --suite"),
    out: Optional[Path] = typer.Option(None, help="Results dir (default: results/<model dir name>)"),
    params_file: Path = PARAMS_OPTION,
):
    """Run suites through lm-eval; write one result line per item and a summary per suite. Resumes if killed;
    a suite whose settings, engine, checkpoint and code did not change since its results were written is kept."""
    from pipeline.scoring import ahead
    from pipeline.stages import evaluate

    from pipeline.engines import engine_spec

    p = load_params(params_file)
    if suite is None and limit is not None:
        raise UserError("--limit needs --suite: give the suite whose item count to change, or set "
                        "suites.<suite>.limit in params.yaml")
    settings = with_overrides(p.suite(suite), limit=limit) if suite is not None else None
    engine = engine or p.engine.name
    spec = engine_spec(engine, "--engine")
    out_dir = out or Path("results") / model_dir.name
    refuse_overlap(out_dir, checkpoint=model_dir)
    checked_model(model_dir, weights=spec.local_weights)  # openai: a server holds the weights; the dir gives the tokenizer
    if settings is None:
        with collecting_ahead("eval", model_dir, p, params_file) as mine:
            if not mine:
                return
            result = evaluate.run_model(model_dir, p, out_dir=out_dir, engine=engine, skip_missing_data=ahead.in_job())
            ahead.finished("eval", model_dir, complete=not result.skipped)
        WORK_SECONDS[0] += sum(one.figures.get("work_seconds") or 0.0 for one in result.suites
                               if not one.figures.get("kept"))
        for one in result.suites:
            typer.echo(one.summary())
        console.summary(result.summary())
        return
    warm_run_servers(p)
    result = evaluate.run(model_dir, settings, p.engine, suite=suite, variant=model_dir.name, out_dir=out_dir,
                          engine=engine)
    WORK_SECONDS[0] += result.figures.get("work_seconds") or 0.0
    console.summary(result.summary())


@stage
def bench(
    model_dir: Path = typer.Argument(..., help="Checkpoint to benchmark (models/base or models/<variant>)"),
    engine: Optional[str] = typer.Option(None, help=f"{engine_names(described=True)} (default: params bench.engine, else engine.name)"),
    concurrency: Optional[str] = typer.Option(None, help="Requests in flight, comma-separated (default: params bench.concurrency)"),
    request_rates: Optional[str] = typer.Option(None, "--request-rates", help="Requests/s with Poisson arrivals, comma-separated; "
                                                "server engines only (default: params bench.request_rates)"),
    input_len: Optional[int] = typer.Option(None, help="Prompt tokens of the fixed workload (default: params bench.input_len)"),
    output_len: Optional[int] = typer.Option(None, help="Output tokens of the fixed workload (default: params bench.output_len)"),
    holdout: Optional[Path] = typer.Option(None, help="Held-out conversations for the real-length workload (default: params "
                                           "calib.out/holdout.jsonl if bench.holdout)"),
    images: Optional[str] = typer.Option(None, help="A model with a vision tower: images per request of the image "
                                         "workloads, comma-separated, or none (default: params bench.images)"),
    image_size: Optional[int] = typer.Option(None, help="Pixels on the longest side the images are sent at "
                                             "(default: params bench.image_size; unset there: each image at the "
                                             "size its suite scored it at)"),
    out: Optional[Path] = typer.Option(None, help="Output JSON (default: results/<model dir name>/bench.json)"),
    params_file: Path = PARAMS_OPTION,
):
    """Serving speed: TTFT, TPOT, ITL, latency percentiles, tokens/s and goodput over a concurrency and a
    request-rate sweep; batch 1 beside its roofline; for a model with a vision tower, requests with images too."""
    from pipeline.stages import bench as bench_stage
    from pipeline.engines import engine_spec

    p = load_params(params_file)
    engine = engine or p.bench.engine or p.engine.name
    engine_spec(engine, "--engine")
    levels = rates = None
    if concurrency is not None:
        try:
            levels = sorted({int(c) for c in concurrency.split(",")})
        except ValueError:
            levels = []
        if not levels or min(levels) < 1:
            raise UserError(f"--concurrency {concurrency}: use positive integers separated by commas, e.g. 1,4,16,64")
    if request_rates is not None:
        try:
            rates = sorted({float(r) for r in request_rates.split(",") if r.strip()})
        except ValueError:
            rates = [-1.0]
        if any(not 0 < r <= 10000 for r in rates):
            raise UserError(f"--request-rates {request_rates}: use rates in requests/s separated by commas, e.g. 1,4,16")
    counts = None
    if images is not None:
        try:
            counts = [] if images.strip().lower() in ("", "none") else sorted({int(c) for c in images.split(",")})
        except ValueError:
            raise UserError(f"--images {images}: use image counts per request separated by commas, e.g. 1,4, or none") \
                from None
    settings = with_overrides(p.bench, concurrency=levels, request_rates=rates, input_len=input_len,
                              output_len=output_len, images=counts, image_size=image_size)
    if holdout is None and settings.holdout:
        holdout = p.calib.out / "holdout.jsonl"
    out = out or Path("results") / model_dir.name / "bench.json"
    refuse_overlap(out, checkpoint=model_dir, held_out_prompts=holdout)
    warm_run_servers(p)
    start_ahead(p, params_file)  # the others' evaluation starts now, not after this stage: it waits for a quiet GPU
    with working():
        result = bench_stage.run(model_dir, out, settings, p.engine, engine=engine, holdout=holdout, suites=p.suites)
    console.summary(result.summary())


@stage
def warm(
    model_dir: Optional[Path] = typer.Argument(None, help="Checkpoint whose server to start (models/base or "
                                               "models/<variant>)"),
    plan: bool = typer.Option(False, "--plan", help="Print the run's server plan (engine.kv_cache_memory: fitted: each "
                              "server's memory and KV tokens on this GPU, which run side by side) and start nothing"),
    params_file: Path = PARAMS_OPTION,
):
    """Inside a run: start this checkpoint's vLLM server in the background for the run's later stages, when the
    GPU has room (engine.warm_servers); returns at once. The GPU profile runs it as soon as each checkpoint exists.
    With fitted servers it prints the run's server plan first."""
    from pipeline.stages import warm as warm_stage

    p = load_params(params_file)
    if model_dir is None and not plan:
        raise UserError("quantize warm: give the checkpoint whose server to start (e.g. models/base), or --plan")
    if model_dir is not None:
        checked_model(model_dir)
    lines = warm_stage.announce(p)
    for line in lines:
        typer.echo(line)
    if plan:
        if not lines:
            typer.echo(f"no server plan: engine.kv_cache_memory is {getattr(p.engine, 'kv_cache_memory', None)} "
                       f"(engine {p.engine.name}); the GPU profile's is fitted")
        return
    console.summary(f"warm: {warm_server(p, model_dir)}")
    started = start_ahead(p, params_file)
    if started:
        typer.echo(f"warm: started ahead of their stages: {', '.join(started)} (engine.score_ahead)")


@stage
def kl(
    variant_dir: Path = typer.Argument(..., help="Variant checkpoint (models/<variant>)"),
    base: Optional[Path] = typer.Option(None, help="Base checkpoint (default: params model.base_dir)"),
    holdout: Optional[Path] = typer.Option(None, help="Held-out conversations (default: params calib.out/holdout.jsonl)"),
    out: Optional[Path] = typer.Option(None, help="Output JSON (default: results/<variant>/kl.json)"),
    rank: bool = typer.Option(False, "--rank", help="Also rank the variant's quantized groups by the KL each costs, "
                              "in the same pass (one backward pass per batch): sensitivity.json beside the output"),
    params_file: Path = PARAMS_OPTION,
):
    """Per-token KL divergence from the base and top-1 agreement on held-out conversations."""
    from pipeline.formats.sensitivity import NAME as SENSITIVITY_FILE
    from pipeline.stages import kl as kl_stage

    p = load_params(params_file)
    base, holdout = base or p.model.base_dir, holdout or p.calib.out / "holdout.jsonl"
    out = out or Path("results") / variant_dir.name / "kl.json"
    for written in [out, *([out.with_name(SENSITIVITY_FILE)] if rank else [])]:
        refuse_overlap(written, base_checkpoint=base, variant_checkpoint=variant_dir, held_out_prompts=holdout)
    with working():  # on a GPU the stage makes its own room, sized by the pass it will run (pipeline/engines/gpu_room.py)
        result = kl_stage.run(base, variant_dir, holdout, out, p.kl, p.engine, rank=rank)
    console.summary(result.summary())


@stage
def sensitivity(
    variant_dir: Path = typer.Argument(..., help="Quantized variant checkpoint (models/<variant>)"),
    base: Optional[Path] = typer.Option(None, help="Base checkpoint (default: params model.base_dir)"),
    holdout: Optional[Path] = typer.Option(None, help="Held-out conversations (default: params calib.out/holdout.jsonl)"),
    out: Optional[Path] = typer.Option(None, help="Output JSON (default: results/<variant>/sensitivity.json)"),
    sequences: Optional[int] = typer.Option(None, help="Held-out conversations scored (default: params kl.sequences)"),
    measure: str = typer.Option("taylor", help="taylor: one gradient estimates every group's share at once; "
                                "restore: one pass per group with only it restored (exact, groups + 2 passes)"),
    params_file: Path = PARAMS_OPTION,
):
    """Rank the variant's quantized groups (q/k/v, gate/up, o_proj, down_proj, experts: as vLLM fuses them) by how
    much of its KL to the base goes away when only that group is restored to the base's weights."""
    from pipeline.stages import sensitivity as sensitivity_stage

    p = load_params(params_file)
    settings = with_overrides(p.kl, sequences=sequences)
    base, holdout = base or p.model.base_dir, holdout or p.calib.out / "holdout.jsonl"
    out = out or Path("results") / variant_dir.name / "sensitivity.json"
    refuse_overlap(out, base_checkpoint=base, variant_checkpoint=variant_dir, held_out_prompts=holdout)
    make_room_on_gpu("sensitivity", [base, variant_dir], factor=1.5, last=p.model.base_dir)
    with working():
        result = sensitivity_stage.run(base, variant_dir, holdout, out, settings, p.engine, measure=measure)
    console.summary(result.summary())


@stage
def judge(
    variant_dir: Path = typer.Argument(..., help="Variant checkpoint (models/<variant>)"),
    base: Optional[Path] = typer.Option(None, help="Base checkpoint (default: params model.base_dir)"),
    prompts: Optional[Path] = typer.Option(None, help="Held-out prompts (default: params calib.out/holdout.jsonl)"),
    out: Optional[Path] = typer.Option(None, help="Results dir for judge.jsonl and judge.json (default: results/<variant>)"),
    mode: Optional[str] = typer.Option(None, help="pairwise (against the base, both orders) or reference (grade 1-5) (default: params judge.mode)"),
    backend: Optional[str] = typer.Option(None, help=f"{engine_names()} (default: params judge.backend)"),
    scoring: Optional[str] = typer.Option(None, help="How the verdict is read: logprobs (the likeliest choice), text "
                                          "(parsed from the reply) or auto (logprobs where the backend gives them) "
                                          "(default: params judge.scoring)"),
    limit: Optional[int] = typer.Option(None, help="Prompts to judge (default: params judge.limit, else all)"),
    params_file: Path = PARAMS_OPTION,
):
    """LLM-as-judge on held-out prompts: variant vs base win rate with an interval, and how far to trust the judge."""
    from pipeline.stages import judge as judge_stage

    p = load_params(params_file)
    if backend is not None:
        from pipeline.engines import engine_spec

        engine_spec(backend, "--backend")
    settings = with_overrides(p.judge, mode=mode, backend=backend, scoring=scoring, limit=limit)
    base, prompts = base or p.model.base_dir, prompts or p.calib.out / "holdout.jsonl"
    out_dir = out or Path("results") / variant_dir.name
    from pipeline.engines import capability

    judge_model = Path(settings.model) if capability(settings.backend, "local_weights") and settings.model != "base" \
        else None
    refuse_overlap(out_dir, variant_checkpoint=variant_dir, base_checkpoint=base, prompts=prompts,
                    judge_checkpoint=judge_model)
    with collecting_ahead("judge", variant_dir, p, params_file) as mine:
        if not mine:
            return
        with working():
            result = judge_stage.run(variant_dir, base, prompts, out_dir, settings, p.engine, p.verdict)
        from pipeline.scoring import ahead

        ahead.finished("judge", variant_dir, complete=True)
    console.summary(result.summary())
    for reason in result.figures["reasons"]:
        typer.echo(f"  {reason}")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_)
    app.command()(bench)
    app.command()(warm)
    app.command()(kl)
    app.command()(sensitivity)
    app.command()(judge)
