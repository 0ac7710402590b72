"""What a `quantize` command imports, found from the source without running it, for its DVC stage's code file
(pipeline/cli/code_deps.py writes and checks those). A stage's command is `quantize <subcommand> ...`; what it reaches
is followed at the level of functions and classes ("units"), so that a module imported by every command (params.py
and the registries it validates with) does not hand every command what only one of them calls:

- the roots: the CLI's top level (what `quantize` imports before it parses the command line), the function the
  subcommand runs (typer's registry says which, and the `stage` wrapper around it), typer's callback, and the
  .py files under the stage's non-pipeline deps (evals/: lm-eval imports them, and they import pipeline modules);
- a reached unit reaches the modules it imports (function-level imports included: a lazy import is a dependency
  once its function runs) and the units and top-level data it names; a module's top level runs on import and
  reaches its classes (their bodies run then, their methods are called by whoever holds an instance); importing
  a module imports its parent packages;
- in the CLI's own modules (pipeline/cli/) the top level reaches no function: it only registers the
  commands, and each command is its own root;
- a function reaches the modules its "pipeline.x[:attr]" strings name (`python -m pipeline.engines.supervisor`),
  and, when it calls importlib's `import_module`, those of its module's top level (the engine registry's
  targets); a call `x.f()` on something that is no module reaches the function `f` of every
  module held as a value (the method registry: `METHODS = (awq, fp8, ...)`, whose `recipe` the quantize stage
  calls).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pipeline"
TARGET = re.compile(r"^(pipeline(?:\.\w+)+)(?::(\w+))?$")
TOP = ""  # a module's top level, as a unit name
# the run's warm interpreter (started by the launcher, `python -m pipeline.cli.forkserver`): it only forks, and the
# command runs in the child as it would in a process of its own, so what it preloads is no input of any stage
NOT_A_DEPENDENCY = {"pipeline.cli.forkserver"}


@dataclass
class Unit:
    imports: list = field(default_factory=list)  # (module, [(name, as)]) of a from-import, (module, as) of an import
    names: set = field(default_factory=set)  # Name ids read
    attributes: set = field(default_factory=set)  # (base Name id, attr) read
    duck_calls: set = field(default_factory=set)  # attr of `x.attr(...)` whose x is not a Name of a module
    values: set = field(default_factory=set)  # Name ids used as a value (not as the base of an attribute)
    import_module: bool = False  # calls importlib's import_module
    strings: set = field(default_factory=set)  # "pipeline.x[:attr]" strings (a program run with -m, a target)


@dataclass
class Module:
    name: str
    path: Path
    units: dict = field(default_factory=dict)  # unit name -> Unit (TOP: the top level; defs, classes, data)
    kinds: dict = field(default_factory=dict)  # unit name -> "def" | "class" | "data"
    bindings: dict = field(default_factory=dict)  # name -> ("module", m) | ("member", m, attr), top-level imports
    targets: set = field(default_factory=set)  # "pipeline.x[:attr]" strings of its top level (a registry's)
    cli: bool = False


# ---------------------------------------------------------------- reading the source

def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _collect(unit: Unit, nodes) -> None:
    """Imports, names, attributes and calls in `nodes` (not descending into nested defs' decorators twice)."""
    parents = {}
    for node in nodes:
        for parent in ast.walk(node):
            for child in ast.iter_child_nodes(parent):
                parents[child] = parent
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Import):
                unit.imports += [(alias.name, alias.asname) for alias in sub.names]
            elif isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
                unit.imports.append((sub.module, [(alias.name, alias.asname) for alias in sub.names]))
            elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                unit.names.add(sub.id)
                parent = parents.get(sub)
                if not (isinstance(parent, ast.Attribute) and parent.value is sub):
                    unit.values.add(sub.id)
            elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
                unit.attributes.add((sub.value.id, sub.attr))
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and TARGET.match(sub.value):
                unit.strings.add(sub.value)
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
                if sub.func.attr == "import_module":
                    unit.import_module = True
                unit.duck_calls.add((sub.func.value.id if isinstance(sub.func.value, ast.Name) else None, sub.func.attr))


def _is_type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _top_statements(body):
    """Top-level statements, descending into if/try/with blocks (but not `if TYPE_CHECKING:`)."""
    for node in body:
        if _is_type_checking(node):
            continue
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, []) or []:
                    yield from _top_statements(child.body if isinstance(child, ast.ExceptHandler) else [child])
        else:
            yield node


def read_module(path: Path, name: str | None = None) -> Module:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module = Module(name or module_name(path), path)
    module.cli = module.name == "pipeline.cli" or module.name.startswith("pipeline.cli.")
    top = Unit()
    for node in _top_statements(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            unit = Unit()
            _collect(unit, [node])
            module.units[node.name] = unit
            module.kinds[node.name] = "class" if isinstance(node, ast.ClassDef) else "def"
            # what runs when the module is imported: decorators, default values, base classes
            evaluated = list(node.decorator_list)
            if isinstance(node, ast.ClassDef):
                evaluated += node.bases + [k.value for k in node.keywords]
            else:
                evaluated += node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
            _collect(top, evaluated)
            continue
        _collect(top, [node])
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        for target in targets:
            if isinstance(target, ast.Name):
                data = Unit()
                _collect(data, [node.value])
                module.units[target.id] = data
                module.kinds[target.id] = "data"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    module.bindings[alias.asname] = ("module", alias.name)
                else:
                    module.bindings[alias.name.split(".")[0]] = ("module", alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                module.bindings[alias.asname or alias.name] = ("member", node.module, alias.name)
    module.units[TOP] = top
    module.targets = set(top.strings)
    return module


def read_package() -> dict[str, Module]:
    return {module.name: module for module in map(read_module, sorted(PACKAGE.rglob("*.py")))}


# ---------------------------------------------------------------- what a command reaches

class Reach:
    def __init__(self, modules: dict[str, Module]):
        self.modules = modules
        self.reached: set[tuple[str, str]] = set()
        self.todo: list[tuple[str, str]] = []
        self.duck: set[str] = set()
        self.held: set[str] = set()  # modules held as values

    def add(self, module: str, unit: str = TOP) -> None:
        if module not in self.modules or (module, unit) in self.reached or module in NOT_A_DEPENDENCY:
            return
        self.reached.add((module, unit))
        self.todo.append((module, unit))
        parts = module.split(".")
        for i in range(1, len(parts)):  # importing a module imports its parent packages
            self.add(".".join(parts[:i]))
        if unit != TOP:
            self.add(module)

    def member(self, module: str, attr: str) -> None:
        """`from module import attr`, or `module.attr`: a submodule, a unit, or nothing of ours."""
        if f"{module}.{attr}" in self.modules:
            self.add(f"{module}.{attr}")
        elif module in self.modules:
            self.add(module)
            if attr in self.modules[module].units:
                self.add(module, attr)
            else:
                binding = self.modules[module].bindings.get(attr)  # a name the module imported (a re-export)
                if binding:
                    self._bound(binding)

    def _bound(self, binding) -> None:
        if binding[0] == "module":
            self.add(binding[1])
        else:
            self.member(binding[1], binding[2])

    def _resolve(self, module: Module, local: dict, name: str):
        binding = local.get(name) or module.bindings.get(name)
        if binding is None and name in module.units and name:
            return ("unit", module.name, name)
        return binding

    def run(self) -> set[str]:
        while True:
            while self.todo:
                self._visit(*self.todo.pop())
            before = len(self.reached)
            for held in sorted(self.held):
                for attr in sorted(self.duck):
                    if self.modules[held].kinds.get(attr) == "def":
                        self.add(held, attr)
            if len(self.reached) == before and not self.todo:
                return {name for name, _ in self.reached}

    def _target(self, binding) -> str | None:
        """The module of ours a binding names, if it names one (`signal` in `hasattr(signal, ...)` names none)."""
        if binding and binding[0] == "module":
            return binding[1] if binding[1] in self.modules else None
        if binding and binding[0] == "member" and f"{binding[1]}.{binding[2]}" in self.modules:
            return f"{binding[1]}.{binding[2]}"
        return None

    def _cli_function(self, binding) -> bool:
        """A function of the CLI's own modules: registered as a command at the top level, not run there."""
        if binding[0] == "unit":
            module, attr = binding[1], binding[2]
        elif binding[0] == "member" and binding[1] in self.modules:
            module, attr = binding[1], binding[2]
        else:
            return False
        return self.modules[module].cli and self.modules[module].kinds.get(attr) == "def"

    def _visit(self, name: str, unit_name: str) -> None:
        module = self.modules[name]
        unit = module.units[unit_name]
        local = {}
        for target, names in unit.imports:
            if not target.startswith("pipeline"):
                continue
            self.add(target)
            if isinstance(names, list):  # `from m import f` imports m (and m.f if a module); f runs when named
                for attr, alias in names:
                    self.add(f"{target}.{attr}")
                    local[alias or attr] = ("member", target, attr)
            else:  # import pipeline.x.y [as z]
                local[names or target.split(".")[0]] = ("module", target if names else target.split(".")[0])
        if unit_name == TOP:
            for other, kind in module.kinds.items():
                if kind == "class":
                    self.add(name, other)
        registering = module.cli and unit_name == TOP  # the CLI's top level registers its commands, runs none
        for ident in unit.names:
            binding = self._resolve(module, local, ident)
            if binding is None or (registering and self._cli_function(binding)):
                continue
            if binding[0] == "unit":
                self.add(name, ident)
            else:
                self._bound(binding)
            held = self._target(binding)
            if held and ident in unit.values:
                self.held.add(held)
        for base, attr in unit.attributes:
            target = self._target(self._resolve(module, local, base))
            if target and not (registering and self._cli_function(("member", target, attr))):
                self.member(target, attr)
        for base, attr in unit.duck_calls:
            if not self._target(self._resolve(module, local, base) if base else None):
                self.duck.add(attr)
        strings = set(unit.strings) if module.kinds.get(unit_name) in ("def", "class") else set()
        if unit.import_module and unit_name != TOP:
            strings |= module.targets
        for text in sorted(strings):
            target, attr = TARGET.match(text).groups()
            self.member(target, attr) if attr else self.add(target)


def command_roots(subcommand: str, app) -> list[tuple[str, str]]:
    """The units `quantize <subcommand>` runs: the console script's launcher (pipeline/cli/launcher.py), the CLI's
    top level, typer's callback, the command's function and the `stage` wrapper around it, as typer registered
    them on `app` (pipeline.cli.app's, handed in by the caller: this module is one of its commands')."""

    def unit_of(function) -> tuple[str, str]:
        module = function.__module__  # `python -m pipeline.cli.app`: __main__, whose spec names the module
        spec = getattr(sys.modules.get(module), "__spec__", None) if module == "__main__" else None
        return (spec.name if spec else module), function.__qualname__.split(".")[0]

    roots = [("pipeline.cli.launcher", TOP), ("pipeline.cli.launcher", "main"), ("pipeline.cli.app", TOP)]
    if app.registered_callback is not None:
        roots.append(unit_of(app.registered_callback.callback))
    for command in app.registered_commands:
        name = command.name or command.callback.__name__.replace("_", "-")
        if name == subcommand:
            function = command.callback
            while function is not None:
                roots.append(unit_of(function))
                function = getattr(function, "__wrapped__", None)
            return roots
    raise SystemExit(f"quantize {subcommand}: no such subcommand registered on pipeline.cli.app's app")


def derive(subcommand: str, other_deps: list[str], app, modules: dict[str, Module] | None = None) -> list[str]:
    """The pipeline/ deps of a stage whose command is `quantize <subcommand>` and whose other deps are `other_deps`."""
    modules = modules or read_package()
    reach = Reach(modules)
    for module, unit in command_roots(subcommand, app):
        reach.add(module, unit)
    for dep in other_deps:  # python files lm-eval (or anything) imports from the stage's other inputs
        path = REPO / dep
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.suffix == ".py" else []
        for file in files:
            try:
                extra = read_module(file, name=f"<{file.relative_to(REPO)}>")
            except (SyntaxError, UnicodeDecodeError):  # not Python this interpreter reads: nothing it imports
                continue
            reach.modules = {**reach.modules, extra.name: extra}
            for unit in extra.units:
                reach.add(extra.name, unit)
    names = {name for name in reach.run() if not name.startswith("<")}
    return listing({modules[name].path for name in names})


def listing(files: set[Path]) -> list[str]:
    """Files as dvc.yaml lists them: a fully reached package directory as the directory, package data beside."""
    chosen: set[Path] = set()
    for directory in sorted({p.parent for p in files}, key=lambda d: len(d.parts)):
        if directory == PACKAGE or any(parent in chosen for parent in directory.parents):
            continue
        sources = set(directory.rglob("*.py"))
        if sources <= files:
            chosen.add(directory)
    out = set(chosen)
    for path in files:
        if not any(parent in chosen for parent in path.parents):
            out.add(path)
            for data in path.parent.iterdir():  # templates and data files a reached package reads
                if data.is_file() and data.suffix not in (".py", ".pyc") and path.parent != PACKAGE:
                    out.add(data)
    return sorted(p.relative_to(REPO).as_posix() for p in out)
