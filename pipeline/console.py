"""What a stage shows the user while it works: one logging setup, one kind of progress bar, one summary line.

`setup(verbosity)` is called once by the CLI (`-v` for debug detail, `--quiet` for warnings and
errors only): messages go to stderr through Python's logging (rich formatting on a terminal), Python
warnings are routed into it, and the chatter of the libraries underneath (transformers, datasets,
lm-eval, llm-compressor) is held back to warnings unless `-v`; a command run by hand writes those warnings to
LOG_DIR/<command>.log (`-v` or QUANTIZE_STAGE_OUTPUT=terminal: to the terminal) and says once where they are. Stage modules log through
`logging.getLogger(__name__)` and never print; the CLI prints each stage's one-line summary (`summary`).

Inside `dvc repro` (DVC_STAGE set; not with -v, nor with QUANTIZE_STAGE_OUTPUT=terminal) a stage keeps the
terminal to itself and its libraries: everything written to its standard output and error, by Python or by a
library's C code or a child process, goes to the stage's log file (LOG_DIR/<stage>.log, written afresh each
run), with the stage's own detail lines (plans, per-suite lines, lists); the terminal gets the stage's progress
bar, its warnings, its one-line summary, and on failure the error with the log's path (`error`).

`progress(description, total)` is a context manager giving an `advance(n)` callable: a rich bar on
the terminal that moves per item (per request, per judgment, per sequence, per byte), transient,
silent when the terminal is not one or with `--quiet` (and so are the libraries' tqdm bars). Where the bar is
silent because the output is not a terminal (piped to a file, a CI log), a line says the stage still works after
every HEARTBEAT_S seconds without one: the bar's description and count when a bar runs (`heartbeat`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

LIBRARIES = ("transformers", "datasets", "lm_eval", "lm-eval", "llmcompressor", "compressed_tensors", "accelerate",
             "httpx", "urllib3", "filelock", "fsspec", "torch", "numexpr")
LOG_DIR = Path(".cache") / "logs"  # in the project (git-ignored): each DVC stage's log, by stage name
OUTPUT_ENV = "QUANTIZE_STAGE_OUTPUT"  # "terminal": a DVC stage writes everything to the terminal, as outside DVC
HEARTBEAT_S = 25.0  # output not a terminal: a line at least this often (under 30 s, with room for a busy machine)
HEARTBEAT_ENV = "QUANTIZE_HEARTBEAT_S"  # another interval (the tests' short one)
_state: dict = {"quiet": False, "configured": False, "terminal": None, "log": None, "console": None,
                "said": 0.0, "task": None, "heartbeat": None}


def setup(verbosity: int = 0, quiet: bool = False) -> None:
    """verbosity 0: info; 1 (-v): debug; quiet: warnings and errors only."""
    from rich.console import Console
    from rich.logging import RichHandler

    level = logging.WARNING if quiet else logging.DEBUG if verbosity > 0 else logging.INFO
    stage = os.environ.get("DVC_STAGE")
    if stage and verbosity == 0 and os.environ.get(OUTPUT_ENV) != "terminal" and _state["terminal"] is None:
        _to_stage_log(stage)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_quantize", False):
            root.removeHandler(handler)
    terminal = _state["terminal"]
    if terminal is not None and _state.get("console") is None:
        _state["console"] = Console(file=terminal)  # one: the stage's warnings print above its bar, not into it
    handler = RichHandler(console=_state.get("console") or Console(stderr=True), show_time=False,
                          show_path=verbosity > 0, markup=False, rich_tracebacks=False)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handlers = [handler]
    if terminal is not None:  # the terminal: the stage's own warnings; the log: everything at info and above
        handler.setLevel(logging.WARNING)
        handler.addFilter(lambda record: record.name.startswith("pipeline"))
        to_log = logging.StreamHandler(sys.stderr)
        to_log.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handlers.append(to_log)
    elif verbosity == 0 and os.environ.get(OUTPUT_ENV) != "terminal":  # a command run by hand: the libraries'
        handler.addFilter(_ours_or_an_error)  # warnings (lm-eval's, several lines each) go to its log, not the terminal
        handlers.append(_LibraryLog(LOG_DIR / f"{_command_name()}.log", handler))
    for one in handlers:
        one._quantize = True
        root.addHandler(one)
    root.setLevel(level)
    for name in LIBRARIES:
        logging.getLogger(name).setLevel(logging.DEBUG if verbosity > 1 else logging.INFO if terminal else logging.WARNING)
    logging.captureWarnings(True)  # warnings.warn(...) -> logger "py.warnings" -> the handler above
    warnings.simplefilter("default")
    _silence_loguru(level, keep_info=terminal is not None)
    if quiet or terminal is not None or (verbosity == 0 and not Console(stderr=True).is_terminal):  # -v keeps them
        # the libraries' tqdm bars (llm-compressor's grid search, transformers' loading) would write a line
        # per update into a log; ours are silent there too. tqdm reads TQDM_* when a bar is made.
        os.environ.setdefault("TQDM_DISABLE", "1")
    _state.update(quiet=quiet, configured=True)
    if not quiet and not (_state.get("console") or Console(stderr=True)).is_terminal:
        heartbeat()


def heartbeat(interval: float | None = None) -> None:
    """From now on, while nothing else is said for `interval` seconds (HEARTBEAT_S, or QUANTIZE_HEARTBEAT_S), one
    line on the stage's output: what it does and for how long (a daemon thread: it ends with the process)."""
    if interval is None:
        try:
            interval = float(os.environ.get(HEARTBEAT_ENV) or HEARTBEAT_S)
        except ValueError:
            interval = HEARTBEAT_S
    started = _state["said"] = time.monotonic()
    if _state["heartbeat"] is not None and _state["heartbeat"].is_alive():
        _state["heartbeat_s"] = interval
        return
    _state["heartbeat_s"] = interval
    name = os.environ.get("DVC_STAGE") or "quantize " + next((a for a in sys.argv[1:] if not a.startswith("-")), "")

    def beat() -> None:
        while True:
            wait = _state["said"] + _state["heartbeat_s"] - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, 1.0))
                continue
            _say(f"{_doing() or name + ': working'} ({_elapsed(time.monotonic() - started)} so far)")

    _state["heartbeat"] = threading.Thread(target=beat, name="quantize-heartbeat", daemon=True)
    _state["heartbeat"].start()


def _doing() -> str:
    task = _state["task"]
    if task is None:
        return ""
    bar, task_id, unit = task
    found = next((t for t in bar.tasks if t.id == task_id), None)
    if found is None:
        return ""
    done = f"{found.completed:,.0f}" + (f" of {found.total:,.0f}" if found.total else "")
    return f"{found.description}: {done} {unit}"


def _elapsed(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{int(seconds // 60)} min {int(seconds % 60)} s"


def _say(line: str) -> None:
    """A line on the stage's output stream (the terminal's, inside dvc repro; else standard error)."""
    _state["said"] = time.monotonic()
    stream = _state["terminal"] or sys.stderr
    with contextlib.suppress(Exception):
        print(line, file=stream, flush=True)


def _ours_or_an_error(record: logging.LogRecord) -> bool:
    return record.name.startswith("pipeline") or record.levelno >= logging.ERROR


def _command_name() -> str:
    """The subcommand this process runs (`eval` of `quantize eval ...`), for its log's name."""
    import re

    name = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), "quantize")
    return re.sub(r"[^A-Za-z0-9_.@-]", "_", name)[:60] or "quantize"


class _LibraryLog(logging.Handler):
    """The libraries' warnings of a command run by hand, appended to LOG_DIR/<command>.log (made at the first one,
    when one comes); the terminal is told once where they are. A log that cannot be written drops them, silently."""

    def __init__(self, path: Path, terminal: logging.Handler) -> None:
        super().__init__(logging.WARNING)
        self.path, self.terminal, self.stream = path, terminal, None
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.addFilter(lambda record: not _ours_or_an_error(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self.stream is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.stream = open(self.path, "a", encoding="utf-8")
                told = logging.LogRecord("pipeline.console", logging.INFO, __file__, 0,
                                         f"the libraries' warnings are in {self.path} (-v shows them here)", None, None)
                self.terminal.handle(told)
            self.stream.write(self.format(record) + "\n")
            self.stream.flush()
        except Exception:  # a full disk, a read-only project: the warning is dropped, never a traceback
            pass


def _to_stage_log(stage: str) -> None:
    """Standard output and error (the descriptors: whatever writes them) go to the stage's log from here on; the
    terminal stays reachable through _state["terminal"] (standard error's) and _state["summary"] (standard
    output's)."""
    path = LOG_DIR / (stage.replace("/", "_").replace(" ", "_") + ".log")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log = open(path, "w", encoding="utf-8")
    except OSError:
        return  # no log there: the stage writes to the terminal, as outside DVC
    terminal = {fd: os.dup(fd) for fd in (1, 2)}
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    for fd in (1, 2):
        os.dup2(log.fileno(), fd)
    log.close()
    _state.update(log=path, terminal=_stream(terminal[2]), summary=_stream(terminal[1]))


def _stream(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=True), encoding="utf-8", errors="backslashreplace",
                            line_buffering=True)


SHELL_PATH_ENV = "QUANTIZE_SHELL_PATH"  # the PATH of the shell the user types in, where it is not this one's (make's)
_COMMANDS = re.compile(r"`((?:quantize|dvc)(?:\s[^`]*)?)`")  # a command a message tells the user to run


def run_hint(text: str) -> str:
    """'' when every `quantize ...` / `dvc ...` command `text` tells the user to run works as written in their shell;
    else one line that makes it so: the activation of the environment this process runs from (`make demo` and
    `make test` use .venv without activating it, so a new shell has neither command on its PATH)."""
    names = {m.group(1).split()[0] for m in _COMMANDS.finditer(text)}
    if not names:
        return ""
    bin_dir = Path(sys.executable).parent.absolute()  # the environment's bin (not resolved: a venv's python links out)
    path = os.environ.get(SHELL_PATH_ENV) or os.environ.get("PATH", "")
    found = {name: shutil.which(name, path=path) for name in names}
    if all(where and Path(where).parent.absolute() == bin_dir for where in found.values()):
        return ""
    shown = Path(os.path.relpath(bin_dir)) if bin_dir.is_relative_to(Path.cwd()) else bin_dir
    if (bin_dir / "activate").is_file():
        return f"(these commands run in the project's environment: in a new shell, first `source {shown}/activate`)"
    return f"(these commands are in {shown}: add it to PATH first, `export PATH={shown}:$PATH`)"


def log_path() -> Path | None:
    """The stage's log, when its output goes there (inside dvc repro)."""
    return _state["log"]


def summary(line: str) -> None:
    """The stage's one-line summary: on standard output, and inside dvc repro on the terminal and in the log."""
    import typer

    _state["said"] = time.monotonic()
    if _state["terminal"] is None:
        typer.echo(line)
        return
    print(line, file=sys.stdout, flush=True)
    print(line, file=_state["summary"], flush=True)


def error(message: str) -> None:
    """A failure: on standard error (red), and inside dvc repro on the terminal with the log's path."""
    import typer

    _state["said"] = time.monotonic()
    hint = run_hint(message)
    message = f"{message}\n{hint}" if hint else message
    if _state["terminal"] is None:
        typer.secho(message, fg=typer.colors.RED, err=True)
        return
    print(message, file=sys.stderr, flush=True)
    where = f"(the stage's whole output: {_state['log']})"
    typer.secho(f"{message}\n{where}" if len(message) + len(where) > 150 or "\n" in message else f"{message} {where}",
                fg=typer.colors.RED, file=_state["terminal"])


def _silence_loguru(level: int, keep_info: bool = False) -> None:
    """llm-compressor logs through loguru to stderr at INFO: keep its warnings, drop its chatter (keep_info: the
    stage's log takes it)."""
    try:
        from loguru import logger
    except ImportError:
        return
    logger.remove()
    logger.add(sys.stderr, level="INFO" if level <= logging.DEBUG or keep_info else "WARNING",
               format="{level}: {message}")


@contextlib.contextmanager
def progress(description: str, total: int | None, unit: str = "items") -> Iterator[Callable[[int], None]]:
    """A per-item progress bar on stderr; yields advance(n). unit "bytes": counts shown as sizes. total None:
    unknown until advance.expect(n) adds n items to it (a stage that learns its work in parts, e.g. eval from
    lm-eval's requests)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, \
        TimeElapsedColumn, TimeRemainingColumn

    console = _state.get("console") or Console(stderr=True)
    disable = _state["quiet"] or not console.is_terminal
    counts = [DownloadColumn()] if unit == "bytes" else [MofNCompleteColumn(), TextColumn(unit)]
    columns = [TextColumn("{task.description}"), BarColumn(), *counts, TimeElapsedColumn(), TimeRemainingColumn()]
    # rich shows what is written to sys.stdout and sys.stderr above the bar while it runs; inside dvc repro those
    # are the stage's log, and stay so
    logged = _state["terminal"] is not None
    with Progress(*columns, console=console, transient=True, disable=disable, redirect_stdout=not logged,
                  redirect_stderr=not logged) as bar:
        task = bar.add_task(description, total=total)
        outer, _state["task"] = _state["task"], (bar, task, "bytes" if unit == "bytes" else unit)
        try:
            yield _Advance(bar, task)
        finally:
            _state["task"] = outer


class _Advance:
    """advance(n): n more items done; advance.expect(n): n more items to do."""

    def __init__(self, bar, task) -> None:
        self.bar, self.task = bar, task

    def __call__(self, n: int = 1) -> None:
        self.bar.advance(self.task, n)

    def expect(self, n: int) -> None:
        total = next(t.total for t in self.bar.tasks if t.id == self.task)
        self.bar.update(self.task, total=(total or 0) + n)
