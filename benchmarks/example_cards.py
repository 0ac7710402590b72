"""The committed example's model cards re-rendered without rerunning the demo: reports/example/cards/<variant>/README.md
from reports/example/verdict.json and what the report stage handed the cards in that run, kept beside it in
reports/example/card_inputs/ (`make example-report` copies them after `make demo`):

    params.yaml    the params.yaml the verdict was decided under (its digest is the verdict's params_sha256)
    source.json    models/base/source.json: what the base was converted from, its licence and Hub repository
    stats.json     the calibration summary (params calib.out/stats.json)

    python benchmarks/example_cards.py [EXAMPLE_DIR]       # make example-cards

tests/test_model_card.py checks that the committed cards are what this writes.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
INPUTS = "card_inputs"


def rendered(example: Path) -> dict[str, str]:
    """{cards/<variant>/README.md: text} as the report stage writes them, from EXAMPLE/verdict.json and EXAMPLE/card_inputs."""
    from pipeline.formats.source_json import read_source_json
    from pipeline.report.card_file import read_verdict
    from pipeline.report.inputs import read_json
    from pipeline.settings.params import load
    from pipeline.stages.report import card_files

    inputs = (example / INPUTS).resolve()
    verdict = read_verdict(example / "verdict.json")  # each read as the pipeline reads it: a bad file, one message
    with tempfile.TemporaryDirectory() as elsewhere, contextlib.chdir(elsewhere):  # not this checkout's models/
        params = load(inputs / "params.yaml")
    return card_files(verdict, params, read_source_json(inputs), read_json(inputs / "stats.json"))


def write(example: Path) -> list[Path]:
    """EXAMPLE/cards/ replaced by the cards rendered now; returns the files written."""
    cards = rendered(example)
    new = Path(tempfile.mkdtemp(prefix=".cards-", dir=example))  # written whole beside, then swapped in
    for name, text in sorted(cards.items()):
        path = new / Path(name).relative_to("cards")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    old = example / ".cards-old"
    shutil.rmtree(old, ignore_errors=True)
    if (example / "cards").exists():
        (example / "cards").replace(old)
    new.replace(example / "cards")
    shutil.rmtree(old, ignore_errors=True)
    return [example / name for name in sorted(cards)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("example", type=Path, nargs="?", default=REPO / "reports" / "example")
    args = parser.parse_args()
    missing = [str(args.example / f) for f in ("verdict.json", f"{INPUTS}/params.yaml", f"{INPUTS}/source.json",
                                               f"{INPUTS}/stats.json") if not (args.example / f).is_file()]
    if missing:
        print(f"{', '.join(missing)}: missing; `make demo`, then `make example-report` keeps them", file=sys.stderr)
        return 2
    from pipeline.errors import UserError

    try:
        written = write(args.example)
    except UserError as exc:
        print(exc, file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
