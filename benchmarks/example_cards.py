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
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INPUTS = "card_inputs"


def rendered(example: Path) -> dict[str, str]:
    """{cards/<variant>/README.md: text} as the report stage writes them, from EXAMPLE/verdict.json and EXAMPLE/card_inputs."""
    sys.path.insert(0, str(REPO))
    from pipeline.settings.params import load
    from pipeline.stages.report import card_files

    inputs = (example / INPUTS).resolve()
    verdict = json.loads((example / "verdict.json").read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as elsewhere, contextlib.chdir(elsewhere):  # not this checkout's models/
        params = load(inputs / "params.yaml")
    source = json.loads((inputs / "source.json").read_text(encoding="utf-8"))
    calib = json.loads((inputs / "stats.json").read_text(encoding="utf-8"))
    return card_files(verdict, params, source, calib)


def write(example: Path) -> list[Path]:
    """EXAMPLE/cards/ replaced by the cards rendered now; returns the files written."""
    cards = rendered(example)
    shutil.rmtree(example / "cards", ignore_errors=True)
    written = []
    for name, text in sorted(cards.items()):
        path = example / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("example", type=Path, nargs="?", default=REPO / "reports" / "example")
    args = parser.parse_args()
    missing = [str(args.example / f) for f in ("verdict.json", f"{INPUTS}/params.yaml", f"{INPUTS}/source.json",
                                               f"{INPUTS}/stats.json") if not (args.example / f).is_file()]
    if missing:
        print(f"{', '.join(missing)}: missing; `make demo`, then `make example-report` keeps them", file=sys.stderr)
        return 2
    for path in write(args.example):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
