"""A report re-rendered on the CPU from a stored, compressed copy of what `quantize report` reads.

    python benchmarks/report_bundle.py pack PROJECT BUNDLE.tar.gz     # on the machine that ran `dvc repro`
    python benchmarks/report_bundle.py render BUNDLE.tar.gz OUT_DIR   # anywhere: OUT_DIR/index.html, verdict.json, cards/
    python benchmarks/report_bundle.py render VERDICT.json OUT_DIR --params P [--base-config C]

`pack` stores, relative to PROJECT: params.yaml, dvc.lock, results/*/*.json and *.jsonl (every result line and
summary: kl, judge, bench), models/*/quant.json and models/*/config.json (sizes, serving, the base's vocabulary and
whether its weights were made up), models/base/source.json (the base's licence, for the model cards), the
calibration stats (params.yaml's calib.out/stats.json), and the run's own `environment` (from
PROJECT/reports/verdict.json) as environment.json. No weights, no server logs.

`render` unpacks it into a temporary folder (refusing any member that is not a plain file under it), runs the report
stage there with the bundle's params.yaml and the run's environment, and writes OUT_DIR/index.html, verdict.json and
the model cards (OUT_DIR/cards/<variant>/README.md);
`make example-gpu-report` does it for reports/example-gpu from benchmarks/results/gpu_dvc_repro_full_inputs.tar.xz
and takes the screenshots. From a verdict.json alone (the copy an older run left), the page is re-rendered from
the verdict as it stands: its first screen and decisions in full, the per-item tables said to be absent.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATTERNS = ("params.yaml", "dvc.lock", "results/*/*.json", "results/*/*.jsonl",
            "models/*/quant.json", "models/*/config.json", "models/base/source.json")


class Refused(Exception):
    """A bundle or input this script will not read: one line, exit 2."""


def pack(project: Path, bundle: Path) -> list[str]:
    """BUNDLE (.tar.gz, or .tar.xz by its suffix: a third of the size) of what the report reads in PROJECT; returns
    the members written."""
    import io

    sys.path.insert(0, str(REPO))
    from pipeline.settings.params import load

    params = load(project / "params.yaml")
    stats = Path(params.calib.out) / "stats.json"
    members = sorted({str(p.relative_to(project)) for pattern in (*PATTERNS, str(stats)) for p in project.glob(pattern)
                      if p.is_file() and not p.is_symlink()})
    verdict = project / "reports" / "verdict.json"
    with tarfile.open(bundle, "w:xz" if bundle.suffix == ".xz" else "w:gz") as out:
        for member in members:
            out.add(project / member, arcname=member, recursive=False)
        if verdict.is_file():  # the run's own machine, packages and revision, not the re-rendering machine's
            data = json.dumps(json.loads(verdict.read_text())["environment"], indent=1).encode()
            info = tarfile.TarInfo("environment.json")
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
            members.append("environment.json")
    return members


def _unpack(bundle: Path, into: Path) -> None:
    """Every member a plain file under `into` (no absolute path, no '..', no link or device), else Refused."""
    try:
        with tarfile.open(bundle, "r:*") as archive:
            for member in archive.getmembers():
                parts = Path(member.name).parts
                if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
                    raise Refused(f"{bundle}: member {member.name!r} is not a plain file inside the bundle; "
                                  "make the bundle again with `report_bundle.py pack`")
            archive.extractall(into, filter="data")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise Refused(f"{bundle}: not a readable .tar.gz or .tar.xz ({exc}); make it with `report_bundle.py pack`") from None


def render_bundle(bundle: Path, out_dir: Path, leave_out: tuple[str, ...] = ()) -> dict:
    """The report stage run in the unpacked bundle, as in the project it came from (params.yaml's checks read
    models/base there, not this checkout's). `leave_out`: globs of members removed first (what an older run wrote
    in a form this report refuses, e.g. kl.json without its per-sequence kl.jsonl: the page then says not measured)."""
    import contextlib

    sys.path.insert(0, str(REPO))
    from pipeline.stages import report
    from pipeline.settings.params import load

    out_dir, bundle = out_dir.resolve(), bundle.resolve()  # before the chdir below
    with tempfile.TemporaryDirectory(prefix="report-bundle-") as tmp, contextlib.chdir(tmp):
        _unpack(bundle, Path(tmp))
        for pattern in leave_out:
            for member in Path(tmp).glob(pattern):
                member.unlink()
                print(f"left out {member.relative_to(tmp)} (--leave-out {pattern})")
        if not Path("params.yaml").is_file() or not Path("results").is_dir():
            raise Refused(f"{bundle}: holds no params.yaml or no results/; make it with `report_bundle.py pack PROJECT`")
        _tables_under_their_key(Path("results"))
        params = load(Path("params.yaml"))
        environment = Path("environment.json")
        result = report.run(Path("results"), Path("reports"), params, models_dir=Path("models"),
                            calib_stats=Path(params.calib.out) / "stats.json",
                            environment=json.loads(environment.read_text()) if environment.is_file() else None)
        _publish(Path("reports"), out_dir)
    return result.verdict


OLD_TABLE_KEY = "long_context"  # where a run before issue 65 kept a suite's table (<suite>.json) and the tables (verdict.json)


def _tables_under_their_key(results: Path) -> None:
    """A bundle of a run before issue 65 (the GPU run of 2026-12-02): its long-context suite's <suite>.json kept the
    table under `long_context`; the pipeline reads it under `table`, as every summary is written since."""
    for path in results.glob("*/*.json"):
        summary = json.loads(path.read_text())
        if isinstance(summary, dict) and OLD_TABLE_KEY in summary and "table" not in summary:
            summary["table"] = summary.pop(OLD_TABLE_KEY)
            path.write_text(json.dumps(summary, indent=2))


def _publish(rendered: Path, out_dir: Path) -> None:
    """index.html, verdict.json and the model cards as plain files in OUT_DIR (as the committed examples are kept,
    beside their screenshots), replacing those there."""
    import shutil

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("index.html", "verdict.json"):
        (out_dir / name).unlink(missing_ok=True)
        (out_dir / name).write_bytes((rendered / name).read_bytes())
    shutil.rmtree(out_dir / "cards", ignore_errors=True)
    if (rendered / "cards").is_dir():
        shutil.copytree(rendered / "cards", out_dir / "cards")  # through the link: the run's own folder


def render_verdict(verdict_file: Path, out_dir: Path, params_file: Path, base_config: Path | None) -> dict:
    """index.html again from a stored verdict.json (its headline and decisions recomputed by this code)."""
    sys.path.insert(0, str(REPO))
    from pipeline.outputs import human_size
    from pipeline.report.publish import write_pair
    from pipeline.settings.params import load
    from pipeline.checkpoints.config_json import base_facts
    from pipeline.verdict.headline import with_headline
    from pipeline.report.render import render_html

    from pipeline.verdict.decision import TABLES_KEY

    stored = json.loads(verdict_file.read_text())
    if OLD_TABLE_KEY in stored and TABLES_KEY not in stored:  # a verdict written before issue 65
        stored[TABLES_KEY] = stored.pop(OLD_TABLE_KEY)
    for key in ("headline", "synthetic", "decisions"):
        stored.pop(key, None)
    import contextlib

    config = json.loads(base_config.read_text()) if base_config else None
    params_file = params_file.resolve()
    with tempfile.TemporaryDirectory() as elsewhere, contextlib.chdir(elsewhere):  # not this checkout's models/base
        params = load(params_file)
    verdict = with_headline(stored, base_facts(config), params.verdict.floor_ceiling)
    html = render_html(verdict=verdict, results={}, params=params, calib=None, base={}, human_size=human_size)
    with tempfile.TemporaryDirectory() as tmp:
        write_pair(tmp, {"index.html": html, "verdict.json": json.dumps(verdict, indent=2, default=str) + "\n"},
                   "report", {"verdict": verdict_file})
        _publish(Path(tmp), out_dir)
    return verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("pack", help="store what the report reads in PROJECT as BUNDLE.tar.gz")
    p.add_argument("project", type=Path)
    p.add_argument("bundle", type=Path)
    r = sub.add_parser("render", help="OUT_DIR/index.html and verdict.json from a bundle (or a stored verdict.json)")
    r.add_argument("source", type=Path)
    r.add_argument("out_dir", type=Path)
    r.add_argument("--params", type=Path, default=None, help="with a verdict.json: the params.yaml it was decided under")
    r.add_argument("--base-config", type=Path, default=None, help="with a verdict.json: the base's config.json")
    r.add_argument("--leave-out", action="append", default=[], metavar="GLOB",
                   help="with a bundle: members not read (e.g. 'results/*/kl.json' from a run older than kl.jsonl)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from pipeline.errors import UserError

    try:
        if args.action == "pack":
            members = pack(args.project, args.bundle)
            print(f"wrote {args.bundle}: {len(members)} files ({sum(m.endswith('.jsonl') for m in members)} result files)")
            return 0
        if not args.source.is_file():
            raise Refused(f"{args.source}: no such file; `report_bundle.py pack PROJECT {args.source}` on the machine "
                          "that ran `dvc repro` makes it")
        if args.source.suffix == ".json":
            if args.params is None:
                raise Refused("a verdict.json alone needs --params: the params.yaml it was decided under")
            verdict = render_verdict(args.source, args.out_dir, args.params, args.base_config)
        else:
            verdict = render_bundle(args.source, args.out_dir, tuple(args.leave_out))
    except (Refused, UserError) as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir / 'index.html'} and verdict.json: {verdict['headline']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
