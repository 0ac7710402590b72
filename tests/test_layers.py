"""The package's layers hold: no import cycles, no stage importing another stage, no layer importing one above.

Every import counts, also those inside functions (a lazy import is still a dependency). The layers are the
folders of pipeline/, bottom to top (docs/architecture.md):

    foundation   pipeline/*.py: errors, outputs, safe_yaml, console, runs (the run a process belongs to), imports
                 (the package's own import graph); at most 8 modules at the top
    formats      pipeline/formats/        one reader/writer per file format, the chat renderer
    checkpoints  pipeline/checkpoints/    a checkpoint on disk: config, headers, loading, where it is served
    engines      pipeline/engines/        one module per engine with its settings; long_context (the vLLM engine
                                          asks it the model's context length)
    settings     pipeline/settings/, pipeline/methods/   every params.yaml section, a method's included (params.py
                                          validates `variants` with the method registry)
    libraries    pipeline/verdict/ (every decision rule), scoring/ (lm-eval's model, likelihoods, the sandbox, the
                 resume cache), quantize/, calib/, judge/, report/ (each stage's parts), profiles/
    stages       pipeline/stages/         one module per stage of dvc.yaml
    cli          pipeline/cli/            the `quantize` command: launcher, app, commands, the run's warm interpreter

A module may import modules of its own layer or below; a stage imports no other stage.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pipeline"

LAYERS = {  # layer: the folders of pipeline/ it holds ("" : the modules at the top)
    "foundation": ("",),
    "formats": ("formats",),
    "checkpoints": ("checkpoints",),
    "engines": ("engines",),
    "settings": ("settings", "methods"),
    "libraries": ("verdict", "scoring", "quantize", "calib", "judge", "report", "profiles"),
    "stages": ("stages",),
    "cli": ("cli",),
}
LAYER_NAMES = list(LAYERS)
FOLDER_LAYER = {folder: LAYER_NAMES.index(layer) for layer, folders in LAYERS.items() for folder in folders}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def graph() -> dict[str, set[str]]:
    """Every module's imports of the package (pipeline/imports.py reads them from the source, lazy ones included)."""
    from pipeline.imports import direct_imports

    return {name: direct_imports(name) for name in modules()}


def folder_of(name: str) -> str:
    """The folder of pipeline/ a module lives in ("" for pipeline itself and the modules at the top)."""
    parts = name.split(".")
    if len(parts) == 1 or (len(parts) == 2 and (PACKAGE / f"{parts[1]}.py").is_file()):
        return ""
    return parts[1]


def stage_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "stages" else None


def layer_of(name: str) -> int:
    return FOLDER_LAYER[folder_of(name)]


def test_every_folder_is_a_layer_and_few_modules_stay_at_the_top():
    """A new folder is placed in a layer here before it is used; the top of pipeline/ keeps the foundation only."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == set(FOLDER_LAYER) - {""}
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top
    stages = {p.stem for p in (PACKAGE / "stages").glob("*.py")} - {"__init__"}
    assert stages == {"calib", "resave", "quantize", "evaluate", "kl", "sensitivity", "fix", "judge", "bench", "report",
                      "warm"}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), package-to-own-submodule
    edges included: `pipeline.x` importing `pipeline.x.y` that imports `pipeline.x` is a cycle too."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_is_read():
    edges = graph()
    assert "pipeline.cli.app" in edges and "pipeline.settings.params" in edges["pipeline.cli.app"]
    assert len(edges) > 40


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_no_stage_imports_another_stage():
    wrong = [f"{name} ({stage_of(name)}) imports {target} ({stage_of(target)})"
             for name, targets in graph().items() for target in sorted(targets)
             if stage_of(name) and stage_of(target) and stage_of(name) != stage_of(target)]
    assert wrong == []


def test_no_layer_imports_one_above_it():
    wrong = [f"{name} ({LAYER_NAMES[layer_of(name)]}) imports {target} ({LAYER_NAMES[layer_of(target)]})"
             for name, targets in graph().items() for target in sorted(targets)
             if layer_of(target) > layer_of(name) and not stage_of(name)]
    assert wrong == []


def test_the_verdict_is_decided_in_one_package_and_the_report_only_renders_it():
    """Every decision rule lives in pipeline/verdict/, which opens no file (the report hands it the evidence) and
    imports only the settings (params, the method registry: which methods a method is compared with, the fixes'
    names: which variant fixes which, and the suite registry: which suites ship);
    the report stage takes the decision from pipeline.verdict.decision, its words for the reviewer from headline
    (what to ship, each variant's label) and coverage (each suite's state), what a decision means (counted, NO-GO
    on, not settled on, coverage by state: issue 65) from facts, its number formats from figures, and computes no
    statistic itself."""
    edges = graph()
    from_report = {target for name, targets in edges.items()
                   if stage_of(name) == "report" or name.split(".")[:2] == ["pipeline", "report"]
                   for target in targets if target.startswith("pipeline.verdict")}
    assert from_report == {"pipeline.verdict.decision", "pipeline.verdict.figures", "pipeline.verdict.headline",
                           "pipeline.verdict.coverage", "pipeline.verdict.facts"}
    outside = {f"{name} imports {target}" for name, targets in edges.items() if name.startswith("pipeline.verdict")
               for target in targets if not target.startswith("pipeline.verdict")
               and target not in ("pipeline", "pipeline.settings", "pipeline.settings.params", "pipeline.methods",
                                  "pipeline.settings.fixes", "pipeline.settings.suites")}
    # settings: the method registry, the fixes' names, the suite registry (which suites ship)
    assert outside == set()
    assert not (PACKAGE / "verdict.py").exists() and not list(PACKAGE.glob("verdict_*.py"))


@pytest.mark.parametrize("bad, expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_cycle_finder_finds_cycles(bad, expected):
    assert cycles(bad) == expected


@pytest.mark.parametrize("importer, imported", [
    ("pipeline.checkpoints.headers", "pipeline.quantize.compat"),  # the four of issue 34, each moved down
    ("pipeline.checkpoints.export", "pipeline.engines.support"),
    ("pipeline.engines.shared", "pipeline.scoring.eval_cache"),
    ("pipeline.settings.checks", "pipeline.quantize.plan"),
    ("pipeline.methods.awq", "pipeline.stages.quantize"),
])
def test_the_layers_rank_these_imports_as_upward(importer, imported):
    """The layering is fine enough to see each import issue 34 found running up (and a method reaching for the stage)."""
    assert layer_of(imported) > layer_of(importer)


def test_no_function_is_over_60_lines():
    """Code an engineer can read at a glance: a function that grows past 60 lines is split by concern."""
    long = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60]
    assert not long, long
