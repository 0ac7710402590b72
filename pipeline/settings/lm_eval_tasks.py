"""A plain lm-eval task as a suite: one of lm-eval's own (chartqa, mmmu_val_art, ...) or a task YAML of a
`suites.<name>.tasks_dir` without a `metadata.suite` block, named by its task in params.yaml
(`suites.chartqa: {task: chartqa}`). What the product needs to know of it is read off its YAML, its `include`s
followed as lm-eval follows them (an included file first, the including file's keys win), never guessed from
its name:

    kind     perplexity for output_type loglikelihood_rolling; right-wrong for multiple_choice and for a task
             whose first metric is one of RIGHT_WRONG (0 or 1 per item); score for one of SCORED (partial credit
             per item); any other metric: a UserError naming suites.<name>.task and the fix (declare the kind: a
             YAML of your own in a tasks_dir that includes the task and adds metadata.suite)
    needs    images when the task hands images (doc_to_image): a text-only model gets "not applicable"
    card     its dataset_path (the Hub's dataset id), dataset_name as the config, the split it scores
             (test_split, else validation_split), visual-question-answering for an image task
    metric   the first metric of metric_list (a function's own name for `!function utils.exact_match`, as
             lm-eval names the values it returns)

A group (mmmu_val) is not a task: the error names its tasks. A task found in no YAML (a Python task of lm-eval's)
is none of this module's: `suite` returns None and the evaluate stage runs it by name as before.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pipeline import safe_yaml
from pipeline.errors import UserError
from pipeline.settings import suites as registry

RIGHT_WRONG = ("acc", "acc_norm", "exact_match", "relaxed_accuracy", "anywhere_accuracy", "acc_all", "pass@1",
               "pass_at_1", "em", "accuracy")
SCORED = ("f1", "bleu", "chrf", "chrf++", "ter", "rouge1", "rouge2", "rougeL", "rougeLsum", "anls", "brier_score")
IMAGE_TASK_TYPE = "visual-question-answering"
DECLARE = ("declare it: a task YAML of your own in suites.{name}.tasks_dir with `include: {yaml}`, a task name of "
           "its own and a metadata.suite block (docs/extending.md, Add a suite)")
_NAMES = re.compile(rb"^(task|group|tag):[ \t]*(.*?)[ \t]*$", re.M)


@dataclass(frozen=True)
class PlainTask:
    """A plain task's YAML, its config with every include followed, and the suite the product runs it as."""
    yaml: Path
    config: dict
    suite: registry.Suite
    metric: str


def lm_eval_tasks_dir() -> Path | None:
    """lm-eval's own task folder (lm_eval/tasks), found without importing lm-eval."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


@lru_cache(maxsize=None)
def _index(folder: Path) -> dict[str, tuple[str, Path]]:
    """{name: (task | group | tag, YAML)} of every YAML under `folder`, read as text (lm-eval's own folder holds
    thousands; only the one named is parsed). A name a file gives as a list (a group's `task:` members) is none."""
    found: dict[str, tuple[str, Path]] = {}
    for path in sorted(folder.rglob("*.yaml")):
        if "__pycache__" in path.parts:
            continue
        try:
            text = path.read_bytes()
        except OSError:
            continue
        for kind, value in _NAMES.findall(text):
            name = value.split(b" #")[0].decode("utf-8", "replace").strip().strip("'\"")
            if name and not name.startswith(("[", "-", "!", "#")):
                found.setdefault(name, (kind.decode(), path))
    return found


def _located(task: str, tasks_dir: Path | str | None) -> tuple[str, Path] | None:
    folders = [Path(tasks_dir).resolve()] if tasks_dir is not None and Path(tasks_dir).is_dir() else []
    folders += [folder for folder in registry.included() if folder.is_dir() and folder not in folders]
    folders += [own] if (own := lm_eval_tasks_dir()) is not None and own.is_dir() else []
    return next((hit for folder in folders if (hit := _index(folder).get(task)) is not None), None)


def load_config(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A task YAML with its includes followed (lm-eval's order: each included file, then the file's own keys);
    `!function` values are their text ("utils.exact_match")."""
    path = path.resolve()
    if path in seen:
        raise UserError(f"{path}: includes itself (through {' -> '.join(p.name for p in seen)}); break the cycle")
    data, _ = safe_yaml.load(path, "an lm-eval task YAML", task=True)
    if not isinstance(data, dict):
        raise UserError(f"{path}: not an lm-eval task (a mapping of its settings)")
    includes = data.pop("include", None)
    merged: dict = {}
    for name in includes if isinstance(includes, list) else [includes] if includes else []:
        included = Path(name) if Path(name).is_absolute() else path.parent / name
        merged.update({k: v for k, v in load_config(included, (*seen, path)).items() if k != "task_list"})
    return merged | data


def metric_name(entry) -> str | None:
    """A metric_list entry's name: its `metric`, or a function's own name (`utils.exact_match` -> exact_match)."""
    metric = entry.get("metric") if isinstance(entry, dict) else None
    return metric.rsplit(".", 1)[-1] if isinstance(metric, str) and metric else None


def kind_of(config: dict, metric: str | None) -> str | None:
    """The suite kind a plain task's config says (module docstring), None when it says none."""
    output = config.get("output_type")
    if output == "loglikelihood_rolling":
        return "perplexity"
    if output == "multiple_choice" or metric in RIGHT_WRONG:
        return "right-wrong"
    return "score" if metric in SCORED else None


def plain(task: str, tasks_dir: Path | str | None = None, name: str | None = None) -> PlainTask | None:
    """The plain task `task` as a suite named `name` (params.yaml's suites.<name>; default: the task); None when no
    YAML of the tasks_dir or of lm-eval names it; a UserError naming suites.<name>.task where it cannot run as one."""
    name = name or task
    located = _located(task, tasks_dir)
    if located is None:
        return None
    kind, path = located
    key = f"params.yaml: suites.{name}.task: {task}"
    if kind != "task":
        members = _members(task, path) if kind == "group" else []
        shown = f" ({', '.join(members[:6])}{' ...' if len(members) > 6 else ''})" if members else ""
        raise UserError(f"{key} is an lm-eval {kind} ({path}), not a task; a suite is one task: name one of its "
                        f"tasks{shown}, each as a suite of its own")
    config = load_config(path)
    metrics = config.get("metric_list") or []
    metric = metric_name(metrics[0]) if isinstance(metrics, list) and metrics else None
    metadata = config.get("metadata") if isinstance(config.get("metadata"), dict) else {}
    metric = metadata.get("primary_metric") or metric
    suite_kind = kind_of(config, metric)
    if suite_kind is None or metric is None:
        said = f"its first metric, {metric!r}," if metric else "it names no metric (metric_list) and"
        raise UserError(f"{key}: {said} says not whether an item is right or wrong ({', '.join(RIGHT_WRONG[:4])} "
                        f"...) or scored ({', '.join(SCORED[:4])} ...); " + DECLARE.format(name=name, yaml=path))
    images = bool(config.get("doc_to_image"))
    split = config.get("test_split") or config.get("validation_split")
    dataset = config.get("dataset_path") if isinstance(config.get("dataset_path"), str) else None
    card = registry.CardData(dataset or task, f"{dataset or task} ({task}, lm-eval)",
                             config.get("dataset_name") if isinstance(config.get("dataset_name"), str) else None,
                             split if isinstance(split, str) else None,
                             IMAGE_TASK_TYPE if images else registry.DEFAULT_TASK_TYPE)
    suite = registry.Suite(task=task, name=name, kind=suite_kind, yaml=path, needs=("images",) if images else (),
                           card=card)
    return PlainTask(path, config, suite, metric)


def _members(group: str, path: Path) -> list[str]:
    try:
        members = load_config(path).get("task") or []
    except UserError:
        return []
    return [m if isinstance(m, str) else str(m.get("task")) for m in members if isinstance(m, (str, dict))]


def suite(task: str, tasks_dir: Path | str | None = None, name: str | None = None) -> registry.Suite | None:
    """The suite that runs `task`: the one its YAML declares (the registry), else the plain task's (`plain`); None
    for a task no YAML names."""
    declared = registry.find(task, tasks_dir)
    if declared is not None:
        return declared
    found = plain(task, tasks_dir, name)
    return found.suite if found else None


def suite_quietly(task: str, tasks_dir: Path | str | None = None) -> registry.Suite | None:
    """`suite` for the report and the cards, which describe what was scored and never stop on it: None where the
    task cannot run as a suite (the evaluate stage said why)."""
    try:
        return suite(task, tasks_dir)
    except UserError:
        return None


def of_params(suites: dict) -> dict[str, registry.Suite]:
    """{params.yaml suite name: Suite} of every suite of params.yaml `suites` that runs as one: declared in its YAML
    (the registry) or a plain lm-eval task (`suite_quietly`)."""
    return {name: found for name, s in suites.items() if (found := suite_quietly(s.task, s.tasks_dir)) is not None}


def task_spec(task: str, dataset_path: Path | None, name: str, raw_config: dict, yaml_path) -> str | dict:
    """The task as lm-eval loads it: by its name, or, with suites.<name>.dataset_path, its YAML's config (includes and
    functions resolved by lm-eval's own loader) reading that local copy of its dataset; a UserError naming the key
    for a path that does not exist or a task that reads none (its own loader: custom_dataset)."""
    if dataset_path is None:
        return task
    key, path = f"params.yaml: suites.{name}.dataset_path", Path(dataset_path)
    if raw_config.get("custom_dataset"):
        raise UserError(f"{key}: task {task} loads its own data (custom_dataset), it reads no dataset_path; "
                        "remove the key")
    if not path.exists():
        raise UserError(f"{key}: {path} does not exist; point it at a local copy of the task's dataset (a folder "
                        "datasets.load_dataset reads: a Hub snapshot, or parquet files named by split)")
    if yaml_path is None:
        raise UserError(f"{key}: task {task} has no YAML whose dataset_path could be replaced; remove the key")
    from lm_eval.tasks._yaml_loader import load_yaml  # the evaluate stage has imported lm-eval already

    return load_yaml(yaml_path, resolve_func=True) | {"dataset_path": str(path.resolve())}
