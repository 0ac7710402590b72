"""A newcomer's first hour (issue 69): every command the demo's closing lines, the README or a message tells the user
to run works as written in a new shell; the environment is locked; a stage piped to a file still says it works;
`--help` reads as help."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, copy_repo

BIN = Path(sys.executable).parent  # the environment `make install` built (.venv/bin): not on a new shell's PATH
NEW_SHELL = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
COMMAND = re.compile(r"`((?:quantize|dvc|make)(?:\s[^`]*)?)`")
PLACEHOLDER = re.compile(r"^(\$\{[^}]*\}|\{[^}]*\}|<[^>]*>|[A-Z][A-Z_/]*|models/(\$\{[^}]*\}|\{[^}]*\}|<[^>]*>|X))$")


def new_shell(command: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """`command` in a new login-less bash with a plain PATH (no .venv/bin), as a user's new terminal has it."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=NEW_SHELL, capture_output=True, text=True,
                          timeout=timeout)


def suggested(text: str) -> list[str]:
    return [m.group(1).strip() for m in COMMAND.finditer(text)]


def concrete(command: str) -> list[str] | None:
    """The command's words with its placeholders (DIR, VARIANT_DIR, {variant}, <variant>, ${item}) made concrete and
    its optional parts ([...]) left out; None for a schema that names no command (`quantize <subcommand> ...`)."""
    command = re.sub(r"\[[^\]]*\]", "", command.replace("\\|", "|"))
    command = re.sub(r"<[^>]*>", lambda m: m.group(0).replace(" ", "_"), command)
    words = shlex.split(command)
    if len(words) < 2 or "..." in command or PLACEHOLDER.match(words[1]) or words[1].startswith("-"):
        return None if len(words) < 2 or not words[1].startswith("--help") else words
    return [("models/awq-w4a16" if "/" in w or "DIR" in w or "MODEL" in w else "awq-w4a16") if PLACEHOLDER.match(w)
            else w for w in words]


def parses(words: list[str]) -> str | None:
    """None when `quantize ...` parses (the subcommand exists, each option exists and takes its value), else why not.
    Parsing only: the commands' work is run below where a tiny project allows it."""
    import typer

    from pipeline.cli.app import app

    group = typer.main.get_command(app)
    try:
        with group.make_context("quantize", words[1:], resilient_parsing=False) as ctx:
            name, command, rest = group.resolve_command(ctx, words[1:])
            if command.context_settings.get("allow_extra_args"):  # `quantize repro`: dvc's own arguments
                return None
            command.make_context(name, rest, parent=ctx).close()
    except Exception as exc:  # noqa: BLE001 - click's (typer's own copy of click's) exceptions
        if type(exc).__name__ in ("Exit", "MissingParameter"):  # --help; a command named, its arguments not given
            return None
        return exc.format_message() if hasattr(exc, "format_message") else repr(exc)
    return None


def messages() -> dict[str, set[str]]:
    """Every `quantize ...` / `dvc ...` / `make ...` command named in the code's text (messages, help, comments) and
    in the README, by where."""
    found: dict[str, set[str]] = {}
    for path in [*sorted((REPO / "pipeline").rglob("*.py")), REPO / "README.md", REPO / "Makefile"]:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".py":  # "run `quantize "\n f"profile --fix {name}`": the string literals joined
            text = re.sub(r"[\"']\s*\n\s*[rf]*[\"']", "", text)
        for command in suggested(text):
            found.setdefault(command, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_quantize_command_the_code_and_readme_name_parses():
    wrong = []
    checked = 0
    for command, where in sorted(messages().items()):
        if not command.startswith("quantize"):
            continue
        words = concrete(command)
        if words is None:
            continue
        checked += 1
        alternatives = words[1].split("|")  # `quantize awq|fp8 --plan`
        why = next(filter(None, (parses([words[0], one, *words[2:]]) for one in alternatives)), None)
        if why and why == f"Option '{words[-1]}' requires an argument.":  # an option named: `quantize awq --calib`
            why = None
        if why:
            wrong.append(f"`{command}` ({', '.join(sorted(where))}): {why}")
    assert checked > 60 and not wrong, "\n".join(wrong)


def test_every_dvc_and_make_command_named_exists():
    from dvc.cli import parse_args

    targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(encoding="utf-8"), flags=re.M))
    for command, where in sorted(messages().items()):
        words = shlex.split(re.sub(r"\[[^\]]*\]", "", command))
        if words[0] == "dvc" and len(words) > 1 and "..." not in command:
            parse_args(words[1:])  # an unknown subcommand or option: SystemExit, and the test fails
        elif words[0] == "make" and len(words) == 2 and not words[1].endswith(":"):
            assert words[1] in targets, f"`{command}` ({', '.join(where)}): no such Makefile target"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"^make (\w+)", readme, flags=re.M):
        assert target in targets, target


def test_the_demos_closing_lines_name_commands_that_run_in_a_new_shell(tmp_path):
    """After `make demo` a new shell has neither `quantize` nor `dvc` (make uses .venv/bin without activating it):
    the closing lines (show-verdict, run by path as the Makefile runs it) say the one activation line, and with it
    each command they name runs as written, in a copy of the project (`dvc repro` as a dry run of every stage: the
    whole demo otherwise; `quantize eval` and `quantize report` found and their arguments taken, stopping with a
    message on this copy's missing models and results)."""
    repo = copy_repo(tmp_path / "repo")
    (repo / "reports").mkdir(exist_ok=True)
    (repo / "reports" / "verdict.json").write_bytes((REPO / "reports" / "example" / "verdict.json").read_bytes())
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=repo, check=True, capture_output=True)
    assert new_shell("command -v quantize dvc", repo).stdout == ""  # the newcomer's shell
    shown = new_shell(f"{BIN}/quantize show-verdict", repo)
    assert shown.returncode == 0, shown.stderr
    commands = suggested(shown.stdout)
    assert "quantize profile --fix awq-w4a16" in commands and "dvc repro" in commands, shown.stdout
    activation = re.search(r"in a new shell, first `(source [^`]+)`", shown.stdout)
    assert activation and Path(activation.group(1).split()[1]).resolve() == (BIN / "activate").resolve()
    for command in dict.fromkeys(commands):
        if command.startswith("source"):
            continue
        run = command + (" --dry --force" if command == "dvc repro" else "")  # its plan: every stage, none run
        done = new_shell(f"{activation.group(1)} && {run}", repo)
        said = done.stdout + done.stderr
        assert "command not found" not in said and "Traceback" not in said and "Usage:" not in said, f"{run}:\n{said}"
        if command.startswith(("quantize eval", "quantize report")):  # found and its arguments taken; this copy
            assert done.returncode in (0, 2) and "error: " in said, f"{run}:\n{said}"  # has no models, no results
        else:
            assert done.returncode == 0, f"{run}:\n{said}"
    assert "awq-w4a16" in (repo / "dvc.yaml").read_text(encoding="utf-8")  # the fix was added, as it said
    # as `make demo` runs it: .venv/bin on make's PATH, the user's shell's PATH (without it) in QUANTIZE_SHELL_PATH
    made = subprocess.run([str(BIN / "quantize"), "show-verdict"], cwd=repo, capture_output=True, text=True,
                          env={**NEW_SHELL, "PATH": f"{BIN}:{NEW_SHELL['PATH']}", "QUANTIZE_SHELL_PATH": NEW_SHELL["PATH"]})
    assert activation.group(0) in made.stdout
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert "QUANTIZE_SHELL_PATH='$(SHELL_PATH)' $(BIN)/quantize show-verdict" in makefile
    # with .venv/bin on the shell's PATH (activated), no activation line
    activated = subprocess.run([str(BIN / "quantize"), "show-verdict"], cwd=repo, capture_output=True, text=True,
                               env={**NEW_SHELL, "PATH": f"{BIN}:{NEW_SHELL['PATH']}"})
    assert "dvc repro" in activated.stdout and "activate" not in activated.stdout


def test_quantize_repro_runs_its_stages_without_an_activated_environment(tmp_path):
    """`.venv/bin/quantize repro` in a new shell: its stages' `quantize ...` commands are found (before, every stage
    failed with `quantize: command not found`)."""
    repo = copy_repo(tmp_path / "repo")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    done = new_shell(f"{BIN}/quantize repro code", repo)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "code: " in done.stdout and (repo / ".cache" / "code" / "eval.txt").is_file()


def test_an_error_naming_a_command_says_how_to_reach_it(tmp_path):
    done = new_shell(f"{BIN}/quantize show-verdict nothing.json", tmp_path)
    assert done.returncode == 2 and "run `dvc repro` or `quantize report`" in done.stderr
    assert f"source {BIN}/activate" in done.stderr or "source .venv/bin/activate" in done.stderr, done.stderr


# ---------------------------------------------------------------- the environment, locked

def test_the_environment_is_the_locked_one():
    """constraints.txt pins every package `make install` puts in .venv at the version installed (pip freeze of this
    environment, the project left out), numbers' packages among them; the Makefile installs with it."""
    from importlib import metadata

    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", (REPO / "constraints.txt").read_text(encoding="utf-8"),
                           flags=re.M))
    norm = {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in pins.items()}
    for package in ("torch", "transformers", "compressed-tensors", "llmcompressor", "numpy", "scipy", "safetensors",
                    "tokenizers", "accelerate", "lm-eval", "dvc"):
        assert package in norm, f"{package} is not locked"
    installed = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version for d in metadata.distributions()}
    installed.pop("glm-quant-pipeline", None)
    for name in ("pip", "setuptools", "wheel"):
        installed.pop(name, None)
    unlocked = {name: v for name, v in installed.items() if norm.get(name) != v}
    assert not unlocked, f"installed but not at the locked version (make constraints writes it again): {unlocked}"
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert makefile.count("install -q $(LOCK) -e") == 2 and "LOCK := -c constraints.txt" in makefile


# ---------------------------------------------------------------- a stage piped to a file still speaks

def test_a_stage_whose_output_is_not_a_terminal_says_it_works(tmp_path, tiny_llama):
    """Issue 69: piped to a file, `quantize eval` said nothing for 3-5 minutes. A line comes at least every
    QUANTIZE_HEARTBEAT_S (25 s by default; 0.3 here), with the bar's description and count while one runs."""
    source = tmp_path / "logs.jsonl"
    source.write_text((REPO / "calib_data" / "support_logs.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    env = {**os.environ, "QUANTIZE_HEARTBEAT_S": "0.3", "QUANTIZE_FORKSERVER": "0"}
    args = [str(BIN / "quantize"), "calib", str(source), "--model", str(tiny_llama), "--holdout", "4"]
    piped = subprocess.run([*args, "--out", str(tmp_path / "a")], env=env, capture_output=True, text=True,
                           timeout=300)
    assert piped.returncode == 0, piped.stderr
    beats = [l for l in piped.stderr.splitlines() if l.endswith("so far)")]
    assert beats and any(re.match(r"calib: \w[\w ]*: [\d,]+( of [\d,]+)? \w+ \(\d+ s so far\)", l) for l in beats), \
        piped.stderr
    quiet = subprocess.run([str(BIN / "quantize"), "--quiet", *args[1:], "--out", str(tmp_path / "b")], env=env,
                           capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "so far)" not in quiet.stderr


# ---------------------------------------------------------------- help that reads as help

def test_help_shows_no_bool_type_and_cites_no_source_file():
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    import typer

    runner = CliRunner()
    names = [None, *typer.main.get_command(app).commands]
    for name in names:
        result = runner.invoke(app, [*([name] if name else []), "--help"], env={"COLUMNS": "300"})
        assert result.exit_code == 0, result.output
        assert "<bool>" not in result.output, name
        cited = re.findall(r"\b(?:pipeline|tests|tools|benchmarks)/[\w/]*(?:\.py)?|\b\w+\.py\b", result.output)
        assert not cited, f"quantize {name or ''} --help cites {cited}"
    top = runner.invoke(app, ["--help"], env={"COLUMNS": "300"}).output
    assert re.search(r"--quiet\s+-q\s+Warnings", top)  # the flag, then its help: no type between


def test_compare_verdicts_help_and_its_tolerance(tmp_path):
    script = REPO / "benchmarks" / "compare_verdicts.py"
    helped = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "usage:" in helped.stdout and "--abs-tol" in helped.stdout
    bare = subprocess.run([sys.executable, script], capture_output=True, text=True)
    assert bare.returncode == 2 and "usage:" in bare.stderr
    before = {"perplexity": {"ppl-chat": {"change": 0.0272, "ci_low": 0.019}}, "decision": "GO", "seconds": 3.0}
    after = {"perplexity": {"ppl-chat": {"change": 0.0326, "ci_low": 0.0190000001}}, "decision": "GO", "seconds": 9.0}
    (tmp_path / "a.json").write_text(json.dumps(before))
    (tmp_path / "b.json").write_text(json.dumps(after))
    strict = subprocess.run([sys.executable, script, tmp_path / "a.json", tmp_path / "b.json"], capture_output=True,
                            text=True)
    assert strict.returncode == 1 and ".perplexity.ppl-chat.change: 0.0272 -> 0.0326" in strict.stdout
    assert "2 numeric keys differ beyond rel-tol 1e-09 / abs-tol 0" in strict.stdout
    loose = subprocess.run([sys.executable, script, tmp_path / "a.json", tmp_path / "b.json", "--abs-tol", "0.0005"],
                           capture_output=True, text=True)
    assert loose.returncode == 1 and "ci_low" not in loose.stdout and "1 numeric keys differ" in loose.stdout
    missing = subprocess.run([sys.executable, script, tmp_path / "a.json", tmp_path / "nothing.json"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "nothing.json: cannot read a verdict" in missing.stderr


@pytest.mark.parametrize("requested, conversations, held", [(32, 30, 15), (32, 64, 32), (32, 1, 1), (0, 5, 0)])
def test_the_holdout_leaves_calibration_data(requested, conversations, held):
    from pipeline.stages.calib import holdout_size

    assert holdout_size(requested, conversations)[0] == held


# ---------------------------------------------------------------- AWQ's generation on the CPU

def test_a_w4a16_variant_runs_plain_linears_on_the_cpu_with_the_same_numbers(tiny_variants):
    """compressed-tensors reads every weight of a loaded variant through a CPU-to-CPU offload cache and wraps every
    Linear's forward; for W4A16 (no activation to quantize, weights already on their grid) both do nothing but cost
    time on each call (each decoding step calls every Linear): the loaded variant's Linears are plain, and its
    logits and greedy tokens are bit for bit those of the wrapped model. FP8 keeps its activations' quantization."""
    import torch

    from pipeline.checkpoints import loading

    ids = torch.tensor([[1, 15, 27, 99, 4, 8, 61, 3], [2, 44, 9, 13, 70, 5, 33, 12]])
    for name, plain_expected in (("awq-w4a16", True), ("fp8-w8a8", False)):
        model = loading.load_for_inference(tiny_variants[name], torch.float32)
        linears = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
        assert linears and all(type(m._parameters) is dict for m in model.modules())  # no offload cache
        assert all(("forward" not in vars(m)) == plain_expected for m in linears), name
        with torch.inference_mode():
            plain_logits = model(ids).logits
            plain_tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        original = loading.plain_forwards
        try:
            loading.plain_forwards = lambda model: 0  # compressed-tensors' wrappers left as they load (the real ones)
            wrapped = loading.load_for_inference(tiny_variants[name], torch.float32)
        finally:
            loading.plain_forwards = original
        assert any("forward" in vars(m) for m in wrapped.modules())
        with torch.inference_mode():
            assert torch.equal(plain_logits, wrapped(ids).logits), name
            assert torch.equal(plain_tokens, wrapped.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))
