"""The decision's subcommands: `report` (the verdict per variant, the HTML page, the CI gate), `card` (one variant's
model card from the verdict) and `show-verdict` (the last verdict, read back). pipeline/cli/app.py registers them on
the `quantize` app (`register`), in the order `quantize --help` lists them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from pipeline import console
from pipeline.cli.common import PARAMS_OPTION, load_params, refuse_overlap, stage, working
from pipeline.errors import UserError


@stage
def report(
    results: Path = typer.Option(Path("results"), help="Results dir (results/<model>/<suite>.jsonl)"),
    out: Path = typer.Option(Path("reports"), help="Where index.html and verdict.json go"),
    models: Path = typer.Option(Path("models"), help="Where the variants' quant.json files are"),
    fail_on: Optional[str] = typer.Option(None, help="Exit 1 when a variant is no-go; inconclusive: anything but GO; "
                                          "incomplete: also a GO that rests on fewer suites than the base ran. A "
                                          "variant whose fix passes passes (ship the fix)"),
    params_file: Path = PARAMS_OPTION,
):
    """Paired statistics, GO / NO-GO / INCONCLUSIVE per variant, and the HTML report."""
    from pipeline.stages import report as report_stage
    from pipeline.outputs import Stopwatch
    from pipeline.verdict.decision import FAIL_ON, failing, fix_gate_lines

    if fail_on is not None and fail_on not in FAIL_ON:
        raise UserError(f"--fail-on {fail_on}: use {', '.join(FAIL_ON[:-1])} or {FAIL_ON[-1]}")
    p = load_params(params_file)
    refuse_overlap(out, results_dir=results, models_dir=models, calibration_stats=p.calib.out / "stats.json",
                    params_file=params_file)
    watch = Stopwatch()
    with working():
        result = report_stage.run(results, out, p, models_dir=models, calib_stats=p.calib.out / "stats.json")
    console.summary(f"{result.summary()} in {watch}")
    failed = failing(result.verdict, fail_on)
    for line in fix_gate_lines(result.verdict, fail_on):
        typer.echo(line)
    if failed:
        console.error("\n".join([f"gate: {', '.join(failed)} did not pass --fail-on {fail_on}",
                                 *(f"  {name}: {why}" for name, why in failed.items())]))
        raise typer.Exit(1)


@stage
def card(
    variant_dir: Path = typer.Argument(..., help="The variant's folder (models/<variant>): one the verdict decided"),
    verdict: Path = typer.Option(Path("reports/verdict.json"), help="The verdict the card is written from"),
    out: Path = typer.Option(Path("cards"), help="Where <variant>/README.md goes (the report stage writes every "
                                                "decided variant's into reports/cards/)"),
    repo_id: Optional[str] = typer.Option(None, help="The Hub repository the card is published in (ORG/NAME): its "
                                          "title, first sentence and model-index name, and what its snippets load "
                                          "(without it: a local record, not a Hub card, loading models/<variant>)"),
    params_file: Path = PARAMS_OPTION,
):
    """One variant's model card (README.md, Hub front matter included), written from the verdict: what the report
    stage writes into reports/cards/ for every decided variant, with the repository it is published in."""
    from pipeline.report import card_file

    p = load_params(params_file)
    stats = p.calib.out / "stats.json"
    refuse_overlap(out, variant=variant_dir, verdict=verdict, base=p.model.base_dir, calibration_stats=stats,
                   params_file=params_file)
    with working():
        result = card_file.run(variant_dir, verdict, out, p, calib_stats=stats, repo_id=repo_id)
    console.summary(result.summary())


@stage
def show_verdict(path: Path = typer.Argument(Path("reports/verdict.json"))):
    """Print the verdict of the last report: per variant, each suite's and the judge's decision sentence."""
    if not path.exists():
        raise UserError(f"{path}: no verdict yet; run `dvc repro` or `quantize report`")
    from pipeline.verdict.show import verdict_lines

    try:
        verdict = json.loads(path.read_text(encoding="utf-8"))
        lines = verdict_lines(verdict)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"{path}: not a verdict written by `quantize report`; rerun `quantize report`") from None
    from pipeline.profiles.fix import fix_items, offers

    lines += offers(verdict, fix_items(Path.cwd()))  # a NO-GO W4A16 variant without a fix: the command that adds it
    hint = console.run_hint("\n".join(lines))  # a new shell after `make demo` has no `quantize` nor `dvc`
    typer.echo("\n".join([*lines, *([hint] if hint else [])]))
    typer.echo(f"report: {path.parent.resolve() / 'index.html'}")


def register(app: typer.Typer) -> None:
    app.command()(report)
    app.command()(card)
    app.command("show-verdict")(show_verdict)
