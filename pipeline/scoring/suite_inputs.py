"""What a suite's results were computed from, as one digest (`inputs` in <suite>.json): the evaluate stage
(pipeline/stages/evaluate.py) keeps a suite's results as they are while the digest is unchanged, and scores the suite
again when any input changed: its settings, the engine and its settings (not the operational ones), the checkpoint's
content, the code and data that score it, any file its options name, and the local copy of its dataset
(suites.<name>.dataset_path). And what a suite reads as it starts (`watch`): the checkpoint's weights, the files
its options name, its dataset's local copy; one changed by the time its results are written is refused (`Watched.check`),
and its results record the weights they were scored on, not what is in the folder after the eval."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pipeline.engines import EngineSettings
from pipeline.errors import UserError
from pipeline.scoring.eval_cache import model_fingerprint
from pipeline.settings.params import SuiteParams

EVALS_DIR = Path(__file__).resolve().parents[2] / "evals"
SCORED_BY = "pipeline.stages.evaluate"  # the stage that scores a suite: its code (and what it imports) is an input


# engine settings that change how a run is carried out, never what it answers (the KV pool's size stays in: the
# long-context ladder skips lengths the served KV cache cannot hold)
OPERATIONAL = {"name", "share_server", "server_idle_timeout", "max_servers", "start_timeout", "timeout", "retries",
               "max_response_bytes", "warm_servers", "score_ahead", "build_memory_fraction"}


@lru_cache(maxsize=None)
def code_digest(engine: str) -> str:
    """Content hash of the code and data a suite's scores come from: the evaluate stage, the engine's modules (the
    registry names them: they are imported by name), every module of the package those import
    (pipeline/imports.py), and evals/."""
    from pipeline.engines import ENGINES
    from pipeline.imports import source_digest

    spec = ENGINES.get(engine)
    modules = [SCORED_BY, *(t.split(":")[0] for t in (spec.target, spec.vision_target) if spec and t)]
    digest = hashlib.sha256("".join(source_digest(m) for m in modules).encode())
    for path in sorted(EVALS_DIR.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(str(path.relative_to(EVALS_DIR)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _tree_digest(path: Path) -> str:
    """Content hash of a file, or of every file under a folder with its name (a dataset's local copy)."""
    if path.is_file():
        return _file_digest(path)
    digest = hashlib.sha256()
    for found in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(found.relative_to(path)).encode() + b"\0" + _file_digest(found).encode())
    return digest.hexdigest()[:16]


def suite_inputs(model_dir: Path, suite: str, s: SuiteParams, engine: str, options: EngineSettings) -> str:
    """One digest of everything a suite's results depend on: the suite's settings, the engine and its
    settings (not the operational ones), the checkpoint's content, the code and data that score it, and
    any file the suite's options name (ppl-chat: the held-out conversations). Written as `inputs` in
    <suite>.json: a later run with the same digest keeps those results as they are."""
    files = {key: _tree_digest(path) for key, path in read_files(s).items()}
    payload = {"suite": suite, "settings": s.model_dump(mode="json"), "engine": engine,
               "engine_settings": options.model_dump(mode="json", exclude=OPERATIONAL),
               "model": model_fingerprint(model_dir), "code": code_digest(engine), "files": files}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_files(s: SuiteParams) -> dict[str, Path]:
    """The files a suite reads besides the checkpoint and its code: those its options name (by option), and the local
    copy of its dataset (dataset_path)."""
    files = {key: Path(value) for key, value in sorted(s.options.items())
             if isinstance(value, str) and Path(value).is_file()}
    if s.dataset_path is not None and Path(s.dataset_path).exists():  # a local copy of the task's dataset
        files["dataset_path"] = Path(s.dataset_path)
    return files


@dataclass
class Watched:
    """What a suite read, as the eval found it when it started: the checkpoint's weights (`held`:
    pipeline/checkpoints/fingerprint.py's HeldWeights) and the other files it reads (label -> path and
    pipeline/outputs.py's fingerprint)."""
    held: object
    files: dict[str, tuple[Path, str | None]]

    def check(self, suite: str) -> str | None:
        """The weights' fingerprint (what <suite>.json records); a UserError when any of them changed since the eval
        started: its results could mix two versions."""
        from pipeline.outputs import fingerprint

        changed = [f"{path} (suites.{suite}.{'' if label == 'dataset_path' else 'options.'}{label})"
                   for label, (path, print_) in self.files.items() if fingerprint(path) != print_]
        if changed:
            raise UserError(f"{'; '.join(changed)} changed while the eval of {suite} ran (written to, or replaced); its "
                            "results could mix two versions, so none were kept: run the command again once it stays put")
        return self.held.checked(f"eval of {suite}")


def watch(model_dir: Path, s: SuiteParams) -> Watched:
    """What the suite reads, fingerprinted as the eval starts (`Watched`)."""
    from pipeline.checkpoints.fingerprint import hold_weights
    from pipeline.outputs import fingerprint

    return Watched(hold_weights(model_dir), {label: (path, fingerprint(path)) for label, path in read_files(s).items()})
