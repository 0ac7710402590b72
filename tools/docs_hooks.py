"""mkdocs hooks (mkdocs.yml `hooks:`): the generated pages (tools/gen_docs.py) are made from the code at every build
and added to the site as files of their own; none is written to docs/, so none can go stale."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gen_docs  # noqa: E402  (beside this file)

_PAGES: dict[str, str] = {}


def on_config(config):
    """The benchmark tables' pages join the nav under the page that lists them."""
    _PAGES.clear()
    _PAGES.update(gen_docs.pages())
    tables = [{p.split("/")[-1][:-3].replace("_", " "): p} for p in _PAGES if p.startswith("results/tables/") and
              not p.endswith("index.md")]
    for entry in config.nav or []:
        if isinstance(entry, dict) and "Measured results" in entry:
            entry["Measured results"].append({"Benchmark tables": ["results/tables/index.md", *tables]})
    return config


def on_files(files, config):
    from mkdocs.structure.files import File

    for path, text in _PAGES.items():
        files.append(File.generated(config, path, content=text))
    # the example reports' screenshots, served from where `make example-report` writes them (no copy in docs/)
    for folder in ("example", "example-gpu"):
        for shot in sorted((gen_docs.REPO / "reports" / folder).glob("*.png")):
            files.append(File.generated(config, f"assets/{folder}/{shot.name}", abs_src_path=str(shot)))
    return files
