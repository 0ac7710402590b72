"""The suite registry: a suite is one folder under evals/ (an lm-eval task YAML, its data, its `utils.py`), and what
the product needs to know of it is declared once, in the task YAML's `metadata.suite` (lm-eval's `metadata` is
free-form; the task's loader gets it as keywords and ignores what it does not name):

    metadata:
      version: 2.0
      primary_metric: acc
      suite:
        name: math               # its name in params.yaml (suites.<name>), the report and the cards
        kind: right-wrong        # right-wrong | score | perplexity | retrieval-table
        needs: []                # what it takes to run: images, sandbox, context, thinking
        held_out: false          # true: it scores the publisher's held-out conversations (options.data)
        card:                    # how a model card names what it scores (model-index)
          dataset: openai/gsm8k  # the Hub's dataset id, or the task's own name where the data is not on the Hub
          describes: GSM8K test questions
          config: main           # optional, as the split
          split: test
          task_type: text-generation   # the Hub's task (the default)
        bench: {}                # files of the folder the bench's workloads take (when params.yaml runs the suite:
                                 # bench_suites): text (a long text), images
        hooks: hooks.py          # optional: the suite's own module (below)

Every YAML under evals/ that names a `task` is a suite and declares this block; a folder named by
`suites.<name>.tasks_dir` may hold suites too (its YAMLs without the block are plain lm-eval tasks the registry does
not know). A suite whose results need more than its lines (the long-context suite: what only the model knows goes
to the task, and a table per length and depth comes back) names its own module, `hooks`, with any of:

    options_problem(options) -> str | None        what is wrong with suites.<name>.options (params.yaml refuses it)
    task_metadata(model_dir, engine=None, **options) -> dict   lm-eval metadata for this model (engine: the started
                                                   server that will answer, for a suite that needs `context`)
    not_applicable(metadata) -> str | None        why it cannot run on this model
    summarize(lines, metadata) -> dict            its table, kept in <suite>.json as `table`
    table_from_lines(lines) -> dict               the table's figures recomputed from the lines (the report), a
                                                   ValueError naming what is wrong with a line
    bench_images(n) -> list[dict]                 a suite with images: its first n items as the bench sends them,
                                                   {"image": PIL image at the size scored, "question", "suite"}

A mistake in the block is a UserError naming the file, its line, the key and the fix. Nothing in pipeline/ names a
task: every reader asks this registry.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from pipeline import safe_yaml
from pipeline.errors import UserError

EVALS_DIR = Path(__file__).resolve().parents[2] / "evals"
KINDS = {"right-wrong": "each item right or wrong (accuracy)",
         "score": "each item scored in [0, 1] (mean score)",
         "perplexity": "every token of each document scored (perplexity, paired per document)",
         "retrieval-table": "each item right or wrong, and a table of scores by length and needle depth (its hooks)"}
NEEDS = {"images": "an engine and a model that take images (else: not applicable)",
         "sandbox": "bubblewrap: it runs model-written code (suites.<name>.allow_unsandboxed otherwise)",
         "context": "the model's context length (and the served engine's bounds) before its items are made",
         "thinking": "a model whose chat template thinks (else: not applicable)"}
BENCH_FILES = {"text": "a long text the fixed-length workload cuts its prompts from",
               "images": "items (JSON lines with an `image` path) the image workload takes its images from"}
HOOKS = ("options_problem", "task_metadata", "not_applicable", "summarize", "table_from_lines", "bench_images")
TABLE_HOOKS = ("summarize", "table_from_lines")  # what a retrieval-table suite's module must hold
_INCLUDED: list[Path] = []  # folders of the user's own suites (include), after evals/
DEFAULT_TASK_TYPE = "text-generation"
FIELDS = ("name", "kind", "needs", "held_out", "card", "bench", "hooks")
CARD_FIELDS = ("dataset", "describes", "config", "split", "task_type")


@dataclass(frozen=True)
class CardData:
    """How a model card names what a suite scores: model-index's dataset (type, name, config, split) and task type."""
    dataset: str
    describes: str
    config: str | None = None
    split: str | None = None
    task_type: str = DEFAULT_TASK_TYPE


@dataclass(frozen=True)
class Suite:
    task: str
    name: str
    kind: str
    yaml: Path  # the task YAML that declares it
    needs: tuple[str, ...] = ()
    held_out: bool = False
    card: CardData | None = None
    bench: dict = field(default_factory=dict)  # role (BENCH_FILES) -> file of the suite's folder
    hooks_file: Path | None = None

    @property
    def folder(self) -> Path:
        return self.yaml.parent

    @property
    def hooks(self) -> ModuleType | None:
        """The suite's own module (metadata.suite.hooks), loaded once; None when it names none."""
        return _load_hooks(self.hooks_file) if self.hooks_file else None

    def hook(self, name: str):
        """The hook function `name` of the suite's module, or None."""
        return getattr(self.hooks, name, None) if self.hooks_file else None


def _problem(path: Path, lines: dict, key: tuple, text: str) -> UserError:
    line = next((lines[key[:n]] for n in range(len(key), 0, -1) if key[:n] in lines), None)
    where = f"{path}:{line}" if line else str(path)
    return UserError(f"{where}: {'.'.join(key)}: {text}")


def _words(path: Path, lines: dict, key: tuple, value, allowed: dict) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _problem(path, lines, key, f"give a list of {', '.join(allowed)} (e.g. [{next(iter(allowed))}])")
    if unknown := [v for v in value if v not in allowed]:
        raise _problem(path, lines, key, f"{unknown[0]!r} is not one of {', '.join(allowed)}; fix or remove it")
    return tuple(value)


def _card(path: Path, lines: dict, task: str, value) -> CardData:
    key = ("metadata", "suite", "card")
    if value is None:
        return CardData(task, task)
    if not isinstance(value, dict):
        raise _problem(path, lines, key, "give a mapping: {dataset: <Hub id or the task's name>, describes: <text>}")
    if unknown := sorted(set(value) - set(CARD_FIELDS)):
        raise _problem(path, lines, (*key, str(unknown[0])), f"unknown key; use {', '.join(CARD_FIELDS)}")
    for name in CARD_FIELDS:
        if value.get(name) is not None and (not isinstance(value[name], str) or not value[name].strip()):
            raise _problem(path, lines, (*key, name), "give a text")
    return CardData(value.get("dataset") or task, value.get("describes") or task, value.get("config"),
                    value.get("split"), value.get("task_type") or DEFAULT_TASK_TYPE)


def _file_of(path: Path, lines: dict, key: tuple, name) -> Path:
    if not isinstance(name, str) or not name.strip():
        raise _problem(path, lines, key, "give a file name in the suite's folder")
    found = (path.parent / name).resolve()
    if not found.exists() or path.parent.resolve() not in found.parents:
        raise _problem(path, lines, key, f"{name} is not a file in {path.parent}; name one there")
    return found


def read_suite(path: Path | str) -> Suite | None:
    """The suite one task YAML declares (metadata.suite), None when it declares none; a UserError naming the file,
    line and key of a mistake."""
    path = Path(path)
    data, lines = safe_yaml.load(path, "an lm-eval task YAML", task=True)
    if not isinstance(data, dict) or not isinstance(data.get("task"), str):
        return None
    block = (data.get("metadata") or {}).get("suite") if isinstance(data.get("metadata"), dict) else None
    if block is None:
        return None
    key = ("metadata", "suite")
    if not isinstance(block, dict):
        raise _problem(path, lines, key, "give a mapping: {name: <suites.NAME>, kind: right-wrong}")
    if unknown := sorted(set(map(str, block)) - set(FIELDS)):
        raise _problem(path, lines, (*key, unknown[0]), f"unknown key; use {', '.join(FIELDS)}")
    name, kind = block.get("name"), block.get("kind")
    if not isinstance(name, str) or not name.strip():
        raise _problem(path, lines, (*key, "name"), "required: the suite's name in params.yaml (suites.<name>)")
    if kind not in KINDS:
        raise _problem(path, lines, (*key, "kind"), f"{kind!r} is not a suite kind; use one of {', '.join(KINDS)}")
    rolling = data.get("output_type") == "loglikelihood_rolling"  # every token of each document scored
    if (kind == "perplexity") != rolling:
        fix = ("its task scores every token: declare kind: perplexity" if rolling else
               f"a perplexity suite's task has output_type: loglikelihood_rolling, not {data.get('output_type')}; "
               "declare the kind its scorer gives")
        raise _problem(path, lines, (*key, "kind"), f"{kind}: {fix}")
    if not isinstance(block.get("held_out", False), bool):
        raise _problem(path, lines, (*key, "held_out"), "give true or false")
    bench = block.get("bench") or {}
    if not isinstance(bench, dict) or (unknown := sorted(set(bench) - set(BENCH_FILES))):
        raise _problem(path, lines, (*key, "bench"), f"map {' or '.join(BENCH_FILES)} to a file of the suite's folder")
    suite = Suite(
        task=data["task"], name=name, kind=kind, yaml=path, needs=_words(path, lines, (*key, "needs"),
                                                                         block.get("needs"), NEEDS),
        held_out=block.get("held_out", False), card=_card(path, lines, data["task"], block.get("card")),
        bench={role: _file_of(path, lines, (*key, "bench", role), f) for role, f in bench.items()},
        hooks_file=_file_of(path, lines, (*key, "hooks"), block["hooks"]) if block.get("hooks") is not None else None)
    missing = [h for h in TABLE_HOOKS if kind == "retrieval-table" and suite.hook(h) is None]
    if missing:
        where = f"{suite.hooks_file.name} lacks {', '.join(missing)}" if suite.hooks_file else "name it (hooks: hooks.py)"
        raise _problem(path, lines, (*key, "hooks"), f"a retrieval-table suite's own module defines "
                                                     f"{' and '.join(TABLE_HOOKS)}; {where}")
    return suite


@lru_cache(maxsize=None)
def _folder(folder: Path) -> dict[str, Suite]:
    """{task: Suite} of every task YAML under `folder` that declares a suite; a task or a name declared twice is a
    UserError naming both files."""
    found: dict[str, Suite] = {}
    for path in sorted(folder.rglob("*.yaml")):
        if "__pycache__" in path.parts or (suite := read_suite(path)) is None:
            continue
        twice = found.get(suite.task) or next((s for s in found.values() if s.name == suite.name), None)
        if twice is not None:
            what = f"task {suite.task!r}" if twice.task == suite.task else f"suite name {suite.name!r}"
            raise UserError(f"{path}: {what} is declared in {twice.yaml} too; give each suite its own")
        found[suite.task] = suite
    return found


def shipped() -> dict[str, Suite]:
    """{task: Suite} of the suites under evals/, in their folders' order."""
    return _folder(EVALS_DIR)


def include(folder: Path | str) -> None:
    """Let the registry know a folder of the user's own tasks (params.yaml suites.<name>.tasks_dir): its suites are
    found by task from now on, after evals/'s (read when first asked for)."""
    folder = Path(folder).resolve()
    if folder not in _INCLUDED and folder != EVALS_DIR:
        _INCLUDED.append(folder)


def named(name: str) -> Suite | None:
    """The suite whose YAML declares `name` (metadata.suite.name): the shipped ones, then those of every folder
    included; None for a name none declares."""
    return next((suite for suite in known().values() if suite.name == name), None)


def included() -> tuple[Path, ...]:
    """The folders of the user's own tasks the registry was told of (include), in that order."""
    return tuple(_INCLUDED)


def known() -> dict[str, Suite]:
    """{task: Suite}: the shipped suites, then those of every folder included."""
    found = dict(shipped())
    for folder in _INCLUDED:
        if folder.is_dir():
            found |= {task: suite for task, suite in _folder(folder).items() if task not in found}
    return found


def find(task: str, tasks_dir: Path | str | None = None) -> Suite | None:
    """The suite that runs `task`: its own tasks_dir's first (params.yaml suites.<name>.tasks_dir), then evals/, then
    the folders included (read only for a task evals/ lacks); None for a task no suite declares (an lm-eval task of
    its own: its lines and summary say what it is)."""
    if tasks_dir is not None and Path(tasks_dir).is_dir() and task in (own := _folder(Path(tasks_dir).resolve())):
        return own[task]
    return shipped().get(task) or known().get(task)


def bench_suites(role: str, configured=()) -> list[Suite]:
    """The suites a bench workload takes `role` from (BENCH_FILES; images: also those whose hooks hand their items,
    bench_images): the run's own (`configured`: the Suites of params.yaml `suites`), in their order; where none of
    them gives it, the shipped ones (a text model's bench takes the long-context book whether or not it runs the
    suite; a vision model benched with no image suite configured, the shipped suites' images)."""
    def gives(suite: Suite) -> bool:
        return role in suite.bench or (role == "images" and "images" in suite.needs and bool(suite.hook("bench_images")))

    return [s for s in configured if gives(s)] or [s for s in shipped().values() if gives(s)]


def bench_file(role: str, configured=()) -> Path:
    """The file a bench workload takes (BENCH_FILES): the first suite that declares one for `role` (`bench_suites`)."""
    for suite in bench_suites(role, configured):
        if role in suite.bench:
            return suite.bench[role]
    raise UserError(f"no suite under {EVALS_DIR} declares metadata.suite.bench.{role} ({BENCH_FILES[role]}); "
                    "declare it in the task YAML of the suite whose data it is")


def configured(suites: dict) -> tuple[Suite, ...]:
    """The Suites of params.yaml `suites` ({name: SuiteParams}) that a YAML declares, in params.yaml's order."""
    return tuple(found for s in suites.values() if (found := find(s.task, s.tasks_dir)) is not None)


@lru_cache(maxsize=None)
def _load_hooks(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"suite_hooks_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # a suite's own code: its mistake is named with the file, not as a traceback
        raise UserError(f"{path}: the suite's hooks module (metadata.suite.hooks) cannot be loaded: "
                        f"{type(exc).__name__}: {exc}; fix it there") from None
    return module
