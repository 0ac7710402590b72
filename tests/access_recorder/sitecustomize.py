"""Test instrumentation, never installed: tests/test_dvc_pipeline.py puts this directory on PYTHONPATH
of `dvc repro`, so every Python process it starts imports this module first (the run's warm interpreter too:
there it keeps pipeline modules out of the preload, and each forked command records from the fork on). When
QUANTIZE_ACCESS_LOG names a file, each process that ran `pipeline.cli.app` appends one JSON line on exit:

    {"argv": [...], "params": [dotted params.yaml keys its command read], "files": [paths it read]}

params: the keys read after params.yaml was loaded (attribute reads of each section's fields, item
reads and iteration of its dicts; a model_dump, such as Params.digest, reads everything below it).
files: every file under the working directory or the source tree of `pipeline` that the process
opened for reading and did not write itself, outside params.yaml's own loading (which reads dvc.yaml
and the base checkpoint's config.json to validate it), plus every module it imported, relative to its root.
"""

import atexit
import json
import os
import sys

LOG = os.environ.get("QUANTIZE_ACCESS_LOG")


def _install() -> None:
    import importlib
    import importlib.abc
    import importlib.util

    start = os.getcwd()
    reads, writes, params = set(), set(), set()
    registry: dict[int, str] = {}  # id(section or dict) -> its dotted path, "" for the whole file
    loading = []  # non-empty while params.yaml loads: its validation reads (dvc.yaml, the base's config) are no input

    def audit(event, args):
        if event != "open" or loading or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path, mode, flags = (list(args) + [None, None])[:3]
        path = os.path.abspath(os.fsdecode(path))
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writing:
            writes.add(path)
        elif os.path.isfile(path):
            reads.add(path)

    sys.addaudithook(audit)

    class RecordingDict(dict):
        """A params dict that records item reads as PATH.KEY and iteration as PATH."""

        def __getitem__(self, key):
            params.add(f"{registry[id(self)]}.{key}")
            return dict.__getitem__(self, key)

        def get(self, key, default=None):
            params.add(f"{registry[id(self)]}.{key}")
            return dict.get(self, key, default)

        def __contains__(self, key):
            params.add(f"{registry[id(self)]}.{key}")
            return dict.__contains__(self, key)

        def _whole(self):
            params.add(registry[id(self)])

        def __iter__(self):
            self._whole()
            return dict.__iter__(self)

        def __len__(self):
            self._whole()
            return dict.__len__(self)

        def keys(self):
            self._whole()
            return dict.keys(self)

        def items(self):
            self._whole()
            return dict.items(self)

        def values(self):
            self._whole()
            return dict.values(self)

    def track(value, path):
        from pydantic import BaseModel

        if isinstance(value, BaseModel):
            registry[id(value)] = path
            for name in type(value).model_fields:
                child = value.__dict__.get(name)
                tracked = track(child, f"{path}.{name}" if path else name)
                if tracked is not child:
                    value.__dict__[name] = tracked
            return value
        if isinstance(value, dict) and not isinstance(value, RecordingDict):
            recording = RecordingDict({k: track(v, f"{path}.{k}") for k, v in value.items()})
            registry[id(recording)] = path
            return recording
        return value

    def patch(module):
        section = module.Section
        load = module.load

        def recorded_load(*args, **kwargs):
            loading.append(True)
            try:
                loaded = load(*args, **kwargs)
            finally:
                loading.pop()
            return track(loaded, "")

        def getattribute(self, name):
            value = object.__getattribute__(self, name)
            path = registry.get(id(self))
            if path is not None and name in type(self).model_fields and not isinstance(value, (dict, section)):
                params.add(f"{path}.{name}" if path else name)
            return value

        dump, copy = section.model_dump, section.model_copy

        def model_dump(self, *args, **kwargs):
            if id(self) in registry:
                params.add(registry[id(self)] or "*")
            return dump(self, *args, **kwargs)

        def model_copy(self, *args, **kwargs):
            copied = copy(self, *args, **kwargs)
            if id(self) in registry:
                registry[id(copied)] = registry[id(self)]
            return copied

        module.load = recorded_load
        section.__getattribute__ = getattribute
        section.model_dump = model_dump
        section.model_copy = model_copy

    class AfterParamsImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "pipeline.settings.params":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, AfterParamsImport())

    # The run's warm interpreter (`python -m pipeline.cli.forkserver`) forks each stage's command: here it preloads
    # the libraries only, never a pipeline module (its preload imports each by importlib.import_module and skips one
    # that fails), so each forked command imports, and is charged with, the pipeline modules it needs itself; the
    # child starts with nothing recorded and counts only the modules it imported.
    preloaded: set[str] = set()
    if "pipeline.cli.forkserver" in getattr(sys, "orig_argv", []):
        real_import_module = importlib.import_module

        def libraries_only(name, package=None):
            if name == "pipeline" or name.startswith("pipeline."):
                raise ImportError(f"{name}: not preloaded while recording (each command imports its own)")
            return real_import_module(name, package)

        importlib.import_module = libraries_only
        os.register_at_fork(after_in_child=lambda: setattr(importlib, "import_module", real_import_module))

    def forked() -> None:
        reads.clear(), writes.clear(), params.clear(), registry.clear()
        preloaded.update(sys.modules)

    os.register_at_fork(after_in_child=forked)

    def write():
        main = getattr(sys.modules.get("__main__"), "__spec__", None)
        if "pipeline.cli.app" not in sys.modules and getattr(main, "name", None) != "pipeline.cli.app":
            return
        code_root = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["pipeline"].__file__)))
        files = set()
        for name, module in list(sys.modules.items()):
            if name in preloaded:  # imported by the warm interpreter before the fork: not this command's doing
                continue
            file = getattr(module, "__file__", None)
            if file:
                reads.add(os.path.abspath(file))
        for path in reads - writes - {os.path.abspath(__file__)}:
            if not os.path.isfile(path):
                continue
            if "__pycache__" in path:  # pkg/__pycache__/name.cpython-311.pyc -> pkg/name.py
                folder, name = os.path.split(path)
                path = os.path.join(os.path.dirname(folder), name.split(".")[0] + ".py")
            for root in (start, code_root):
                if os.path.commonpath([root, path]) == root:
                    files.add(os.path.relpath(path, root))
                    break
        line = {"argv": sys.argv, "params": sorted(params), "files": sorted(files)}
        with open(LOG, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    atexit.register(write)


if LOG:
    _install()
