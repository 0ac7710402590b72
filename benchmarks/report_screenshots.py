"""Screenshots of a report's first screen at a desktop's and a phone's size, written beside it.

    python benchmarks/report_screenshots.py [REPORT_DIR]      # default: reports/example

Opens REPORT_DIR/index.html in Debian's chromium (headless, through playwright, no network) and writes
REPORT_DIR/first-screen-1280x800.png and REPORT_DIR/first-screen-390x844.png: what a reviewer sees first
on a laptop and on a phone. `make example-report` runs it on reports/example after
`cp reports/index.html reports/verdict.json reports/example/` (README: "The demo").
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

SIZES = ((1280, 800), (390, 844))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def screenshots(report_dir: Path, chromium: str) -> list[Path]:
    from playwright.sync_api import sync_playwright

    page_file = (report_dir / "index.html").resolve()
    written = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        for width, height in SIZES:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:") else route.abort())
            page.goto(page_file.as_uri())
            page.wait_for_load_state("networkidle")
            scroll = page.evaluate("document.documentElement.scrollWidth")
            if scroll > width:
                print(f"warning: the page is {scroll} px wide at a {width} px viewport (it scrolls sideways)",
                      file=sys.stderr)
            out = report_dir / f"first-screen-{width}x{height}.png"
            page.screenshot(path=str(out))
            written.append(out)
            page.close()
        browser.close()
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report_dir", nargs="?", default="reports/example", type=Path)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    if not (args.report_dir / "index.html").is_file():
        print(f"{args.report_dir / 'index.html'}: no report there; run `quantize report` (or `make demo`) first",
              file=sys.stderr)
        return 2
    if not Path(args.chromium).exists():
        print(f"{args.chromium}: no chromium; apt-get install chromium (make system-deps)", file=sys.stderr)
        return 2
    for path in screenshots(args.report_dir, args.chromium):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
