"""What a stage shows the user while it works: one logging setup and one kind of progress bar.

`setup(verbosity)` is called once by the CLI (`-v` for debug detail, `--quiet` for warnings and
errors only): messages go to stderr through Python's logging (rich formatting on a terminal), Python
warnings are routed into it, and the chatter of the libraries underneath (transformers, datasets,
lm-eval, llm-compressor) is held back to warnings unless `-v`. Stage modules log through
`logging.getLogger(__name__)` and never print; the CLI prints each stage's one-line summary on stdout.

`progress(description, total)` is a context manager giving an `advance(n)` callable: a rich bar on
stderr that moves per item (per request, per judgment, per sequence, per byte), transient on a
terminal, silent when stderr is not one or with `--quiet` (and so are the libraries' tqdm bars).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Callable, Iterator

LIBRARIES = ("transformers", "datasets", "lm_eval", "lm-eval", "llmcompressor", "compressed_tensors", "accelerate",
             "httpx", "urllib3", "filelock", "fsspec", "torch", "numexpr")
_state = {"quiet": False, "configured": False}


def setup(verbosity: int = 0, quiet: bool = False) -> None:
    """verbosity 0: info; 1 (-v): debug; quiet: warnings and errors only."""
    from rich.console import Console
    from rich.logging import RichHandler

    level = logging.WARNING if quiet else logging.DEBUG if verbosity > 0 else logging.INFO
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_quantize", False):
            root.removeHandler(handler)
    handler = RichHandler(console=Console(stderr=True), show_time=False, show_path=verbosity > 0,
                          markup=False, rich_tracebacks=False)
    handler._quantize = True
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(level)
    for name in LIBRARIES:
        logging.getLogger(name).setLevel(logging.DEBUG if verbosity > 1 else logging.WARNING)
    logging.captureWarnings(True)  # warnings.warn(...) -> logger "py.warnings" -> the handler above
    warnings.simplefilter("default")
    _silence_loguru(level)
    if quiet or (verbosity == 0 and not Console(stderr=True).is_terminal):  # -v keeps them
        # the libraries' tqdm bars (llm-compressor's grid search, transformers' loading) would write a line
        # per update into a log; ours are silent there too. tqdm reads TQDM_* when a bar is made.
        os.environ.setdefault("TQDM_DISABLE", "1")
    _state.update(quiet=quiet, configured=True)


def _silence_loguru(level: int) -> None:
    """llm-compressor logs through loguru to stderr at INFO: keep its warnings, drop its chatter."""
    try:
        import sys

        from loguru import logger
    except ImportError:
        return
    logger.remove()
    logger.add(sys.stderr, level="INFO" if level <= logging.DEBUG else "WARNING", format="{level}: {message}")


@contextlib.contextmanager
def progress(description: str, total: int | None, unit: str = "items") -> Iterator[Callable[[int], None]]:
    """A per-item progress bar on stderr; yields advance(n). unit "bytes": counts shown as sizes. total None:
    unknown until advance.expect(n) adds n items to it (a stage that learns its work in parts, e.g. eval from
    lm-eval's requests)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, \
        TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True)
    disable = _state["quiet"] or not console.is_terminal
    counts = [DownloadColumn()] if unit == "bytes" else [MofNCompleteColumn(), TextColumn(unit)]
    columns = [TextColumn("{task.description}"), BarColumn(), *counts, TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=True, disable=disable) as bar:
        task = bar.add_task(description, total=total)
        yield _Advance(bar, task)


class _Advance:
    """advance(n): n more items done; advance.expect(n): n more items to do."""

    def __init__(self, bar, task) -> None:
        self.bar, self.task = bar, task

    def __call__(self, n: int = 1) -> None:
        self.bar.advance(self.task, n)

    def expect(self, n: int) -> None:
        total = next(t.total for t in self.bar.tasks if t.id == self.task)
        self.bar.update(self.task, total=(total or 0) + n)
