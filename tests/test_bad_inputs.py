"""Generated corpora of bad inputs, each driven through the real CLI (issue 16 item 1, issue 20 items 3, 4, 7):
params.yaml mistakes through every command that reads params, calibration files through `quantize calib`
(and `quantize awq --calib`, which takes the same raw files), result files and stage summaries through
`quantize report`. Every case must exit 2 with one message that names the file (and the line or key) and
the fix, with no traceback, and leave the directory exactly as it was (no output, no temp file)."""

import functools
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from pipeline import methods
from pipeline.verdict.judge import pairwise_figures
from report_fixture import judge_line

# ---------------------------------------------------------------- the driver


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root (hidden temp files included) with its size, mtime and, when small, a digest."""
    listing = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink() or not path.exists():
            listing[name] = "link"
        elif path.is_dir():
            listing[name] = "dir"
        else:
            stat = path.stat()
            small = stat.st_size < (1 << 20)
            listing[name] = f"{stat.st_size}:{stat.st_mtime_ns}:" + (hashlib.sha256(path.read_bytes()).hexdigest()
                                                                      if small else "")
    return listing


@functools.cache
def _command():
    """The CLI as a click command, built once (typer rebuilds it on every CliRunner.invoke)."""
    import typer

    from pipeline.cli.app import app

    return typer.main.get_command(app)


def invoke(args: list) -> object:
    from click.testing import CliRunner

    return CliRunner().invoke(_command(), [str(a) for a in args])


def assert_refused(result, expected: list[str], label: str) -> str:
    """Exit 2, one error message holding every expected piece, no traceback."""
    output = result.output
    assert result.exit_code == 2, f"{label}: exit {result.exit_code}\n{output}\n{result.exception!r}"
    assert isinstance(result.exception, SystemExit), f"{label}: {result.exception!r}"
    assert "Traceback" not in output, f"{label}: {output}"
    assert output.count("error: ") == 1, f"{label}: {output}"
    for piece in expected:
        assert piece in output, f"{label}: {piece!r} not in\n{output}"
    return output


# ---------------------------------------------------------------- params.yaml

BASE_PARAMS = """\
model:
  source: tiny-hf
  base_dir: models/base
calib:
  source: calib_data/support_logs.jsonl
  out: calib_data/build
  seq_len: 64
  num_blocks: 8
  holdout: 4
variants:
  awq-w4a16:
    method: awq
    group_size: 32
  fp8-w8a8:
    method: fp8
suites:
  math:
    task: quant_gsm8k
    limit: 3
    max_new_tokens: 8
judge:
  limit: 2
verdict:
  margins:
    suites: {math: 0.03}
  bootstrap: 2000
engine:
  batch_size: 8
bench:
  input_len: 128
"""


def sub(old: str, new: str) -> str:
    assert old in BASE_PARAMS, old
    return BASE_PARAMS.replace(old, new, 1)


BOMB = """\
    options:
      a: &a [x, x, x, x, x, x, x, x, x]
      b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
      c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
      d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
      e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
      f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
      g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
      h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
      i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""
FAKE_KEY = "sk-test-0123456789abcdefABCDEF0123456789"

# (id, content of params.yaml (text, bytes, or None for a special case), expected pieces of the message)
PARAMS_CASES = [
    ("empty file", "", ["params.yaml: holds no settings (empty, or only comments)", "delete the file"]),
    ("only comments", "# all defaults\n\n", ["params.yaml: holds no settings"]),
    ("a list at the top", "- model\n- calib\n", ["params.yaml:1: the top level is a list", "mapping of sections"]),
    ("text at the top", "hello\n", ["params.yaml:1: the top level is text"]),
    ("invalid YAML", sub("  seq_len: 64", "  seq_len: [64"), ["params.yaml:8:", "not valid YAML", "fix the file there"]),
    ("a tab in the indentation", sub("  seq_len: 64", "\tseq_len: 64"),
     ["params.yaml:7:1: not valid YAML", "indent with spaces, not tabs"]),
    ("bytes that are not UTF-8", sub("  base_dir: models/base", "  base_dir: models/base # caf\udcff").encode(
        "utf-8", "surrogateescape"), ["params.yaml:3: bytes that are not UTF-8 (0xff); save the file as UTF-8"]),
    ("UTF-16", BASE_PARAMS.encode("utf-16"), ["params.yaml:1: the file is UTF-16 encoded; save it as UTF-8"]),
    ("UTF-16 without BOM", BASE_PARAMS.encode("utf-16-le"),
     ["params.yaml:1: the file is UTF-16-LE encoded without a byte-order mark (every other byte is 0); save it as "
      "UTF-8"]),
    ("a NUL byte", sub("  source: tiny-hf", "  source: tiny\x00hf"), ["params.yaml:2: character #x0000", "delete it"]),
    ("a directory", None, ["params.yaml: is a directory; pass a params.yaml"]),
    ("no such file", None, ["nothere.yaml: no such file; pass --params with an existing params.yaml"]),
    ("2 MB", BASE_PARAMS + "#" * (2 << 20) + "\n", ["params.yaml: over 1 MB, too large for a params.yaml"]),
    ("a section twice", BASE_PARAMS + "verdict:\n  seed: 1\n",
     ["params.yaml:31: verdict: this key is given twice (lines 23 and 31); YAML keeps only the last, so delete one"]),
    ("a key twice", sub("  bootstrap: 2000", "  bootstrap: 2000\n  bootstrap: 3000"),
     ["params.yaml:27: verdict.bootstrap: this key is given twice (lines 26 and 27)"]),
    ("alias bomb under a suite's options", sub("    max_new_tokens: 8\n", "    max_new_tokens: 8\n" + BOMB),
     ["params.yaml:26:10: with its aliases (*name) expanded this value holds", "over the limit of 10,000",
      "drop the aliases"]),
    ("a recursive alias", sub("    max_new_tokens: 8\n", "    max_new_tokens: 8\n    options: &a {x: [*a]}\n"),
     ["params.yaml:21:", "the alias *a refers to a node that contains it"]),
    ("nested 100 deep", sub("    max_new_tokens: 8\n", "    max_new_tokens: 8\n    options: {x: " + "[" * 100 + "]" * 100 + "}\n"),
     ["params.yaml:21:", "nested more than 40 levels deep"]),
    ("a number of 5,000 digits", sub("  holdout: 4", "  holdout: " + "9" * 5000),
     ["params.yaml:9:12: '9999", "cannot be read as int (Exceeds the limit (4300 digits) for integer string conversion"]),
    ("an impossible date", sub("  holdout: 4", "  holdout: 4\n  seed: 2024-13-45"),
     ["params.yaml:10:9: '2024-13-45' cannot be read as timestamp (month must be in 1..12); quote it"]),
    ("an unknown section", BASE_PARAMS + "extras:\n  a: 1\n",
     ["params.yaml:31: extras: unknown key; remove it or check its spelling"]),
    ("an unknown key in model", sub("  base_dir:", "  basedir:"), ["params.yaml:3: model.basedir: unknown key"]),
    ("an unknown key in calib", sub("  seq_len: 64", "  seqlen: 64"), ["params.yaml:7: calib.seqlen: unknown key"]),
    ("an unknown key in a variant", sub("    group_size: 32", "    groupsize: 32"),
     ["params.yaml:13: variants.awq-w4a16.groupsize: unknown key"]),
    ("an unknown key in a suite", sub("    limit: 3", "    limt: 3"), ["params.yaml:19: suites.math.limt: unknown key"]),
    ("an unknown key in judge", sub("  limit: 2", "  limits: 2"), ["params.yaml:22: judge.limits: unknown key"]),
    ("an unknown key in verdict", sub("  bootstrap: 2000", "  bootstraps: 2000"),
     ["params.yaml:26: verdict.bootstraps: unknown key"]),
    ("an unknown key in engine", sub("  batch_size: 8", "  batchsize: 8"), ["params.yaml:28: engine.batchsize: unknown key"]),
    ("an unknown key in bench", sub("  input_len: 128", "  input_length: 128"),
     ["params.yaml:30: bench.input_length: unknown key"]),
    ("a null section", sub("judge:\n  limit: 2\n", "judge:\n"),
     ["params.yaml:21: judge: is empty (null); give it settings, or delete the line to take the defaults"]),
    ("null variants", sub("variants:\n  awq-w4a16:\n    method: awq\n    group_size: 32\n  fp8-w8a8:\n    method: fp8\n",
                          "variants:\n"), ["params.yaml:10: variants: is empty (null)"]),
    ("a section that is a list", sub("engine:\n  batch_size: 8\n", "engine: [hf]\n"),
     ["params.yaml:27: engine: must be a mapping of settings (key: value), not a list"]),
    ("a section that is a number", sub("bench:\n  input_len: 128\n", "bench: 5\n"),
     ["params.yaml:29: bench: must be a mapping of settings (key: value), not a number"]),
    ("a variant without a method", sub("    method: awq\n", ""),
     [f"params.yaml:11: variants.awq-w4a16: needs a method: {methods.names()}"]),
    ("an unknown method", sub("    method: awq", "    method: hqq"),
     [f"params.yaml:11: variants.awq-w4a16: method 'hqq' is not one of {methods.names(quote=True)}"]),
    ("a bad engine name", sub("  batch_size: 8", "  batch_size: 8\n  name: tgi"),
     ["params.yaml:29: engine.name: 'tgi' is not allowed; input should be 'hf', 'vllm', 'lmdeploy' or 'openai'"]),
    ("a bad KV scheme", sub("    method: fp8", "    method: fp8\n    kv: per-channel"),
     ["params.yaml:16: variants.fp8-w8a8.kv: 'per-channel' is not allowed"]),
    ("text for a number", sub("  seq_len: 64", "  seq_len: lots"),
     ["params.yaml:7: calib.seq_len: Input should be a valid integer"]),
    ("true for a number", sub("  batch_size: 8", "  batch_size: true"),
     ["params.yaml:28: engine.batch_size: true/false is not allowed here; give a number"]),
    ("a list for a number", sub("  bootstrap: 2000", "  bootstrap: [2000]"),
     ["params.yaml:26: verdict.bootstrap: Input should be a valid integer"]),
    ("a fraction for a count", sub("  num_blocks: 8", "  num_blocks: 2.5"),
     ["params.yaml:8: calib.num_blocks: Input should be a valid integer, got a number with a fractional part"]),
    ("a list for a flag", sub("  holdout: 4", "  holdout: 4\n  redact: [1]"),
     ["params.yaml:10: calib.redact: Input should be a valid boolean"]),
    ("below the minimum", sub("  seq_len: 64", "  seq_len: 8"),
     ["params.yaml:7: calib.seq_len: Input should be greater than or equal to 16 (got 8)"]),
    ("verdict.bootstrap: 1000000000", sub("  bootstrap: 2000", "  bootstrap: 1000000000"),
     ["params.yaml:26: verdict.bootstrap: Input should be less than or equal to 20000 (got 1000000000)"]),
    ("a 31-digit batch budget", sub("  batch_size: 8", "  batch_size: 8\n  max_batch_tokens: 1" + "0" * 30),
     ["params.yaml:29: engine.max_batch_tokens: Input should be less than or equal to 16777216 (got 1000000000000000000000000000000)"]),
    ("max_new_tokens: 1000000000", sub("    max_new_tokens: 8", "    max_new_tokens: 1000000000"),
     ["params.yaml:20: suites.math.max_new_tokens: Input should be less than or equal to 32768"]),
    ("judge.timeout: 1.0e9", sub("  limit: 2", "  limit: 2\n  timeout: 1.0e9"),
     ["params.yaml:23: judge.timeout: Input should be less than or equal to 3600"]),
    ("engine.threads: 100000", sub("  batch_size: 8", "  batch_size: 8\n  threads: 100000"),
     ["params.yaml:29: engine.threads: Input should be less than or equal to 1024"]),
    ("kl.max_tokens: 10000000", sub("engine:\n", "kl:\n  max_tokens: 10000000\nengine:\n"),
     ["params.yaml:28: kl.max_tokens: Input should be less than or equal to 16384"]),
    ("verdict.kl_sequences of an earlier params.yaml", sub("  bootstrap: 2000", "  bootstrap: 2000\n  kl_sequences: 8"),
     ["params.yaml:27: verdict.kl_sequences: this setting moved: write it as kl.sequences (same meaning and value)"]),
    ("judge.margin of an earlier params.yaml", sub("  limit: 2", "  limit: 2\n  margin: 0.05"),
     ["params.yaml:23: judge.margin: this setting moved: write it as verdict.margins.judge"]),
    ("a suite's margin where an earlier params.yaml had it", sub("    suites: {math: 0.03}", "    math: 0.03"),
     ["params.yaml:24: verdict.margins: math: a suite's own margin goes under verdict.margins.suites (e.g. "
      "suites: {math: 0.03})"]),
    ("bench.concurrency: [0, 100000]", sub("  input_len: 128", "  input_len: 128\n  concurrency: [0, 100000]"),
     ["params.yaml:31: bench.concurrency: must be a non-empty list of integers from 1 to 4096"]),
    ("seq_len x num_blocks too large", sub("  seq_len: 64\n  num_blocks: 8", "  seq_len: 32768\n  num_blocks: 16384"),
     ["params.yaml:4: calib: seq_len x num_blocks = 536,870,912 tokens, over the limit of 16,777,216"]),
    ("NaN", sub("  limit: 2", "  limit: 2\n  min_consistency: .nan"),
     ["params.yaml:23: judge.min_consistency: Input should be a finite number"]),
    ("infinity", sub("  batch_size: 8", "  batch_size: 8\n  name: vllm\n  timeout: .inf"),
     ["params.yaml:30: engine.timeout: Input should be a finite number"]),
    ("a key of another engine's section", sub("  batch_size: 8", "  batch_size: 8\n  timeout: 30"),
     ["params.yaml:29: engine.timeout: the vllm and the openai engines' setting; engine.name is hf"]),
    ("a negative margin", sub("    suites: {math: 0.03}", "    suites: {math: -1.5}"),
     ["params.yaml:25: verdict.margins.suites.math: -1.5 is not between 0 and 1; a margin is the largest acceptable "
      "loss"]),
    ("a negative default margin", sub("    suites: {math: 0.03}", "    accuracy: -0.02\n    suites: {math: 0.03}"),
     ["params.yaml:25: verdict.margins.accuracy: Input should be greater than or equal to 0 (got -0.02)"]),
    ("a margin for an unknown suite", sub("    suites: {math: 0.03}", "    suites: {math: 0.03, mth: 0.05}"),
     ["params.yaml:25: verdict.margins.suites.mth: no such suite (defined: math); fix the name or remove it"]),
    ("a negative seed", sub("  bootstrap: 2000", "  bootstrap: 2000\n  seed: -1"),
     ["params.yaml:27: verdict.seed: Input should be greater than or equal to 0 (got -1)"]),
    ("group_size 100", sub("    group_size: 32", "    group_size: 100"),
     ["params.yaml:13: variants.awq-w4a16.group_size: 100 is not one of auto, 16, 32, 64, 128"]),
    ("group_size 1024", sub("    group_size: 32", "    group_size: 1024"),
     ["params.yaml:13: variants.awq-w4a16.group_size: 1024 is not one of auto, 16, 32, 64, 128"]),
    ("a regex that does not compile", sub("  holdout: 4", "  holdout: 4\n  redact_patterns: ['((']"),
     ["params.yaml:10: calib.redact_patterns: '((' is not a valid regex"]),
    ("a variant named true", sub("  fp8-w8a8:", "  true:"),
     ["params.yaml:14: variants.true: YAML reads this key as true/false, not as a name; quote it ('true':) or "
      "rename it"]),
    ("a suite named 1", sub("  math:\n    task", "  1:\n    task"),
     ["params.yaml:17: suites.1: YAML reads this key as a number, not as a name; quote it ('1':)"]),
    ("a suite named base", sub("  math:\n    task", "  base:\n    task"),
     ["params.yaml:16: suites: name 'base' must be letters, digits"]),
    ("a suite without a task", sub("    task: quant_gsm8k\n", ""),
     ["params.yaml:17: suites.math.task: required key missing; add it"]),
    ("long_context lengths of 100 million tokens",
     sub("    max_new_tokens: 8\n", "    max_new_tokens: 8\n  long_context:\n    task: quant_long_context\n"
                                  "    options: {lengths: [100000000]}\n"),
     ["params.yaml:21: suites.long_context: options.lengths: give a list of 1 to 32 token counts"]),
    ("a NUL character in a path", sub("  base_dir: models/base", '  base_dir: "models/\\0base"'),
     ["params.yaml:3: model.base_dir: holds a NUL character; give a plain path"]),
    ("an unpaired surrogate", sub("  source: tiny-hf", '  source: "tiny\\ud800"'),
     ["params.yaml:2:11: model.source: holds an unpaired UTF-16 surrogate", "write the character whole"]),
    ("an empty model source", sub("  source: tiny-hf", '  source: ""'),
     ["params.yaml:2: model.source: String should have at least 1 character"]),
    ("an API key pasted as api_key_env", sub("  limit: 2", f"  limit: 2\n  api_key_env: {FAKE_KEY}"),
     ["params.yaml:23: judge.api_key_env: must be the name of an environment variable"]),
    ("dvc.yaml that is not YAML", None, ["dvc.yaml:3:1: not valid YAML", "fix the file there"]),
    ("dvc.yaml whose matrix is text", None, ["dvc.yaml:4: stages.evaluate.matrix.model: is text; give a list of values"]),
    ("dvc.yaml whose stages are a list", None, ["dvc.yaml:1: stages: is a list; it must map each stage's name"]),
    ("dvc.yaml whose matrix is a list", None, ["dvc.yaml:3: stages.evaluate.matrix: is a list; DVC's matrix maps each "
                                               "name to its list of values"]),
    ("dvc.yaml whose stage is a number", None, ["dvc.yaml:2: stages.evaluate: is a number; a stage is a mapping"]),
    ("dvc.yaml whose foreach is a number", None, ["dvc.yaml:3: stages.quantize.foreach: is a number; give a list"]),
    ("dvc.yaml that is a list", None, ["dvc.yaml:1: the top level is a list; a dvc.yaml is a mapping"]),
]
DVC_FILES = {  # case -> the dvc.yaml beside a good params.yaml
    "dvc.yaml that is not YAML": "stages:\n  evaluate: [\n",
    "dvc.yaml whose matrix is text": "stages:\n  evaluate:\n    matrix:\n      model: base\n",
    "dvc.yaml whose stages are a list": "stages: [1, 2]\n",
    "dvc.yaml whose matrix is a list": "stages:\n  evaluate:\n    matrix: [base, awq-w4a16]\n    cmd: quantize eval\n",
    "dvc.yaml whose stage is a number": "stages:\n  evaluate: 1\n",
    "dvc.yaml whose foreach is a number": "stages:\n  quantize:\n    foreach: 3\n    do:\n      cmd: quantize variant\n",
    "dvc.yaml that is a list": "- stages\n",
}
PARAMS_COMMANDS = {
    "resave": ["resave"], "calib": ["calib"], "awq": ["awq"], "fp8": ["fp8"], "variant": ["variant", "awq-w4a16"],
    "eval": ["eval", "models/base", "--suite", "math"], "bench": ["bench", "models/base"],
    "kl": ["kl", "models/awq-w4a16"], "judge": ["judge", "models/awq-w4a16"], "report": ["report"],
    "card": ["card", "models/awq-w4a16"],
}


def make_params(root: Path, case: str, content) -> Path:
    path = root / "params.yaml"
    if case == "a directory":
        path.mkdir()
    elif case == "no such file":
        return root / "nothere.yaml"
    elif case.startswith("dvc.yaml"):
        path.write_text(BASE_PARAMS)
        (root / "dvc.yaml").write_text(DVC_FILES[case])
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


def test_the_params_corpus_is_as_large_as_promised():
    assert len(PARAMS_CASES) >= 41 and len({case for case, _, _ in PARAMS_CASES}) == len(PARAMS_CASES)


def test_every_command_refuses_every_params_mistake(tmp_path, monkeypatch):
    """Each params.yaml mistake through each command that reads params.yaml (11 commands)."""
    tried = 0
    for number, (case, content, expected) in enumerate(PARAMS_CASES):
        root = tmp_path / f"case{number}"
        root.mkdir()
        params = make_params(root, case, content)
        monkeypatch.chdir(root)
        before = snapshot(root)
        for command, args in PARAMS_COMMANDS.items():
            output = assert_refused(invoke([*args, "--params", params]), expected, f"{case} / {command}")
            assert FAKE_KEY not in output
            assert snapshot(root) == before, f"{case} / {command}: files changed"
            tried += 1
    assert tried == len(PARAMS_CASES) * len(PARAMS_COMMANDS)


def test_repo_params_and_aliases_within_bounds_still_load(tmp_path):
    from pipeline.settings import params

    assert params.load(REPO / "params.yaml").verdict.bootstrap == 2000
    shared = BASE_PARAMS.replace("  math:\n    task: quant_gsm8k\n    limit: 3\n    max_new_tokens: 8\n",
                                 "  math: &suite\n    task: quant_gsm8k\n    limit: 3\n    max_new_tokens: 8\n"
                                 "  math2:\n    <<: *suite\n    limit: 5\n")
    path = tmp_path / "params.yaml"
    path.write_text(shared)
    loaded = params.load(path)
    assert loaded.suites["math2"].task == "quant_gsm8k" and loaded.suites["math2"].limit == 5


def test_the_alias_bomb_is_refused_before_it_grows(tmp_path):
    """The 12-line bomb of issue 20 grew `quantize report` to 7.9 GB; now it is refused while reading."""
    path = tmp_path / "params.yaml"
    path.write_text(sub("    max_new_tokens: 8\n", "    max_new_tokens: 8\n" + BOMB))
    # VmHWM: this process's peak RSS since exec (ru_maxrss would include the forking pytest's)
    code = ("from pipeline.settings import params\nfrom pipeline.errors import UserError\n"
            f"try:\n    params.load({str(path)!r})\nexcept UserError as e:\n    print(e)\n"
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    message, peak_kb = done.stdout.strip().rsplit("\n", 1)
    assert "over the limit of 10,000" in message
    assert int(peak_kb) < 200_000, peak_kb  # kilobytes: the interpreter, PyYAML and pydantic, nothing more


# ---------------------------------------------------------------- calibration files

TURNS = {"turns": [{"role": "User", "content": "Where is my parcel?"}, {"role": "Agent", "content": "Let me check."}]}
LOGS = [json.loads(line) for line in (REPO / "calib_data" / "support_logs.jsonl").read_text(encoding="utf-8").splitlines()]


def lines(*rows) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode("utf-8", "surrogatepass")


def writer(name: str, data):
    """A case maker: writes data (bytes, or a callable of the path) to NAME inside the case dir."""
    def make(root: Path) -> Path:
        path = root / name
        if callable(data):
            data(path)
        else:
            path.write_bytes(data)
        return path
    return make


def fifty_mb_line(path: Path) -> None:
    with open(path, "wb") as handle:
        handle.write(b'{"text": "' + b"x" * (50 << 20) + b'"}\n')


def symlink_loop(path: Path) -> None:
    os.symlink(path.name, path)


def broken_link(path: Path) -> None:
    os.symlink(path.parent / "gone.jsonl", path)


PII_ROLE = "jane.doe@example.com"
LONG_PII_ROLE = "write to me, jane.doe@example.com, or call +91 98765 43210 any day after five please"
# (id, maker, --strict?, expected pieces; "{p}" is the case dir)
CALIB_CASES = [
    ("no such file", lambda root: root / "missing.jsonl", False, ["{p}/missing.jsonl: no such file; pass a .jsonl"]),
    ("a directory", lambda root: (root / "d.jsonl").mkdir() or root / "d.jsonl", False,
     ["{p}/d.jsonl: is a directory; pass a .jsonl, .jsonl.gz or .json file of conversations inside it"]),
    ("a symlink loop", writer("loop.jsonl", symlink_loop), False, ["{p}/loop.jsonl: no such file"]),
    ("a broken symlink", writer("dangling.jsonl", broken_link), False, ["{p}/dangling.jsonl: no such file"]),
    ("an empty file", writer("empty.jsonl", b""), False, ["{p}/empty.jsonl:1: the file is empty"]),
    ("blank lines only", writer("blank.jsonl", b"\n \r\n\t\n"), False,
     ["{p}/blank.jsonl:1: no records (the file holds only blank lines or an empty array)"]),
    ("a byte-order mark only", writer("bom.jsonl", b"\xef\xbb\xbf\n"), False, ["{p}/bom.jsonl:1: no records"]),
    ("whitespace-only .json", writer("ws.json", b"  \n"), False,
     ["{p}/ws.json:1: the file holds only whitespace; a .json file must hold an array of records"]),
    ("an empty JSON array", writer("empty.json", b"[]"), False, ["{p}/empty.json:1: no records"]),
    ("binary garbage", writer("garbage.jsonl", bytes(range(256)) * 64), False,
     ["{p}/garbage.jsonl: ", "records are bad", "calib.max_bad_fraction", "{p}/garbage.jsonl:1: "]),
    ("NUL bytes", writer("nul.jsonl", b"\x00" * 4096 + b"\n" + b"\x00\x00\n"), False,
     ["{p}/nul.jsonl: 2 of 2 records are bad", "{p}/nul.jsonl:1: invalid JSON"]),
    ("UTF-16 LE with BOM", writer("u16le.jsonl", lines(TURNS).decode().encode("utf-16")), False,
     ["{p}/u16le.jsonl:1: the file is UTF-16 encoded; re-export it as UTF-8"]),
    ("UTF-16 BE with BOM", writer("u16be.jsonl", b"\xfe\xff" + lines(TURNS).decode().encode("utf-16-be")), False,
     ["{p}/u16be.jsonl:1: the file is UTF-16 encoded"]),
    ("UTF-16 without BOM", writer("u16.jsonl", lines(TURNS, TURNS).decode().encode("utf-16-le")), False,
     ["{p}/u16.jsonl:1: the file is UTF-16-LE encoded without a byte-order mark (every other byte is 0); re-export it "
      "as UTF-8"]),
    ("UTF-16 BE without BOM, gzipped", writer("u16be.jsonl.gz", gzip.compress(lines(*LOGS[:5]).decode().encode(
        "utf-16-be"))), False, ["{p}/u16be.jsonl.gz:1: the file is UTF-16-BE encoded without a byte-order mark"]),
    ("UTF-16 .json without BOM", writer("u16le.json", json.dumps(LOGS[:3]).encode("utf-16-le")), False,
     ["{p}/u16le.json:1: the file is UTF-16-LE encoded without a byte-order mark"]),
    ("UTF-16 .json", writer("u16.json", json.dumps([TURNS]).encode("utf-16")), False,
     ["{p}/u16.json:1: the file is UTF-16 encoded"]),
    ("Latin-1 bytes", writer("latin1.jsonl", '{"text": "café crème"}\n'.encode("latin-1") * 3), False,
     ["{p}/latin1.jsonl: 3 of 3 records are bad", "{p}/latin1.jsonl:1: bytes at 13 are not UTF-8"]),
    ("Latin-1 .json", writer("latin1.json", '[{"text": "café"}]'.encode("latin-1")), False,
     ["{p}/latin1.json:1: bytes are not UTF-8; re-export the file as UTF-8"]),
    ("a JSON array on one .jsonl line", writer("array.jsonl", lines([TURNS, TURNS])), False,
     ["{p}/array.jsonl:1: a record must be a JSON object, not an array"]),
    ("null, numbers and strings as records", writer("scalars.jsonl", lines("null", "5", '"hi"')), False,
     ["{p}/scalars.jsonl:1: a record must be a JSON object, not null", "{p}/scalars.jsonl:2: a record must be a JSON "
      "object, not a number", "{p}/scalars.jsonl:3: a record must be a JSON object, not text"]),
    ("a .json object, not an array", writer("object.json", json.dumps(TURNS).encode()), False,
     ["{p}/object.json:1:1: the top level is not an array"]),
    ("invalid .json", writer("broken.json", b'[{"text": "a"},\n {"text": }]'), False,
     ["{p}/broken.json:2: invalid JSON (Expecting value at column 11)"]),
    ("a .json with a missing comma", writer("comma.json", b'[{"text": "a"} {"text": "b"}]'), False,
     ["{p}/comma.json:1:16: expected ',' or ']' after a record"]),
    ("text after a .json array", writer("after.json", b'[{"text": "a"}]\n[]'), False,
     ["{p}/after.json:2:1: text after the closing ']'"]),
    ("a .json array of numbers", writer("numbers.json", b"[1, 2, 3]"), False,
     ["{p}/numbers.json:1:2: a record must be a JSON object, not a number"]),
    ("a 50 MB line", writer("long.jsonl", fifty_mb_line), False,
     ["{p}/long.jsonl:1: line is 50 MB, over the 8 MB limit for one record"]),
    ("nesting 100,000 deep", writer("deep.jsonl", lines('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}")), False,
     ["{p}/deep.jsonl:1: JSON that cannot be loaded (maximum recursion depth"]),
    ("nesting 100,000 deep in .json", writer("deep.json", ("[" * 100_000 + "]" * 100_000).encode()), False,
     ["{p}/deep.json:1:2: JSON that cannot be loaded (maximum recursion depth"]),
    ("a number of 5,000 digits", writer("digits.jsonl", lines('{"text": ' + "9" * 5000 + "}")), False,
     ["{p}/digits.jsonl:1: JSON that cannot be loaded (Exceeds the limit (4300 digits)"]),
    ("a truncated gzip", writer("cut.jsonl.gz", gzip.compress(lines(*LOGS[:200]))[:2000]), False,
     ["{p}/cut.jsonl.gz:", "reading failed (Compressed file ended before the end-of-stream marker was reached)",
      "compress it again"]),
    ("a gzip header over garbage", writer("junk.jsonl.gz", b"\x1f\x8b" + bytes(range(256)) * 8), False,
     ["{p}/junk.jsonl.gz:1: reading failed", "a gzip file here is corrupt or truncated"]),
    ("a corrupt .json.gz", writer("cut.json.gz", gzip.compress(json.dumps(LOGS[:50]).encode())[:500]), False,
     ["{p}/cut.json.gz: the gzip data is corrupt or truncated", "compress the file again"]),
    ("every record of an unknown shape", writer("shape.jsonl", lines(*[{"dialog": [], "id": i} for i in range(30)])), False,
     ["{p}/shape.jsonl: 30 of 30 records are bad", "{p}/shape.jsonl:1: unknown record shape (keys: dialog, id)",
      "... and 20 more"]),
    ("every turn empty", writer("empty_turns.jsonl", lines(*[{"turns": [{"role": "user", "content": " "}]}] * 5)), False,
     ["{p}/empty_turns.jsonl:1: turns[0].content is empty; drop the turn or fill it"]),
    ("a bad role, strict", writer("role.jsonl", lines(*LOGS[:30], {"turns": [{"role": "narrator", "content": "x"}]})),
     True, ["{p}/role.jsonl:31: turns[0].role 'narrator' cannot be mapped", "--strict stops at the first bad record"]),
    ("unpaired surrogates in content", writer("surrogate.jsonl", lines(
        *[f'{{"turns": [{{"role": "user", "content": "hi \\ud83d there {i}"}}]}}' for i in range(5)])), False,
     ["{p}/surrogate.jsonl: 5 of 5 records are bad", "{p}/surrogate.jsonl:1: turns[0].content holds an unpaired UTF-16 "
      "surrogate at character 4"]),
    ("an unpaired surrogate, strict", writer("surrogate1.jsonl", lines(
        *LOGS[:30], '{"prompt": "a", "response": "b", "input": "\\udc00"}')), True,
     ["{p}/surrogate1.jsonl:31: input holds an unpaired UTF-16 surrogate at character 1"]),
    ("an unpaired surrogate in a key", writer("surrogate_key.jsonl", lines('{"\\ud800x": 1}') * 3), False,
     ["{p}/surrogate_key.jsonl:1: unknown record shape (keys: '\\ud800x')"]),
    ("an e-mail address as a role", writer("pii_role.jsonl", lines(*[{"turns": [{"role": PII_ROLE, "content": "x"}]}] * 3)),
     False, ["{p}/pii_role.jsonl:1: turns[0].role '[EMAIL]' cannot be mapped"]),
    ("a long role holding personal data", writer("pii_long.jsonl", lines(
        *[{"turns": [{"role": LONG_PII_ROLE, "content": "x"}]}] * 3)), False,
     ["{p}/pii_long.jsonl:1: turns[0].role (text of 84 characters, not shown) cannot be mapped"]),
    ("an e-mail address as a key", writer("pii_key.jsonl", lines({PII_ROLE: "x"}, {PII_ROLE: "y"})), False,
     ["{p}/pii_key.jsonl:1: unknown record shape (keys: [EMAIL])"]),
    ("only system messages", writer("system.jsonl", lines(
        *[{"messages": [{"role": "system", "content": f"Be kind, rule {i}."}]} for i in range(5)])), False,
     ["{p}/system.jsonl: no record has a user or assistant turn: all 5 hold only system messages (from "
      "{p}/system.jsonl:1 on)", "export the conversations' user and assistant turns"]),
    ("system prompts alone past calib.max_bad_fraction", writer("system_mix.jsonl", lines(
        *LOGS[:30], *[{"turns": [{"role": "system", "content": f"Rule {i}"}]} for i in range(3)])), False,
     ["{p}/system_mix.jsonl: 3 of 33 records are bad (9% > calib.max_bad_fraction 5%)",
      "{p}/system_mix.jsonl:31: 'turns' holds only system turns (1), no user or assistant turn"]),
    ("text of control characters only", writer("controls.jsonl", lines(*[{"text": "\x00\x01 \x1b"}] * 4)), False,
     ["{p}/controls.jsonl: 4 of 4 records are bad", "{p}/controls.jsonl:1: text is nothing but control characters"]),
    ("text without a user turn to hold out", writer("text_only.jsonl", lines(
        *[{"text": turn["content"]} for log in LOGS[:40] for turn in log["turns"]])), False,
     ["{p}/text_only.jsonl: no record has a user turn, so none can be held out", "(calib.holdout: 4)",
      "or set calib.holdout: 0"]),
    ("too little text for one block", writer("tiny.jsonl", lines(TURNS)), False,
     ["{p}/tiny.jsonl: calibration set too small", "add conversations or lower calib.num_blocks"]),
]
CALIB_NO_AWQ = {"a bad role, strict", "an unpaired surrogate, strict"}  # awq has no --strict


def test_the_calibration_corpus_is_as_large_as_promised():
    assert len(CALIB_CASES) >= 34 and len({case for case, *_ in CALIB_CASES}) == len(CALIB_CASES)


@pytest.fixture()
def calib_root(tmp_path, tiny_llama, monkeypatch):
    params = tmp_path / "params.yaml"
    params.write_text(BASE_PARAMS.replace("  seq_len: 64\n  num_blocks: 8", "  seq_len: 32\n  num_blocks: 4"))
    monkeypatch.chdir(tmp_path)
    return tmp_path, params


def test_quantize_calib_refuses_every_bad_calibration_file(calib_root, tiny_llama):
    root, params = calib_root
    for number, (case, make, strict, expected) in enumerate(CALIB_CASES):
        case_dir = root / f"case{number}"
        case_dir.mkdir()
        source = make(case_dir)
        before = snapshot(case_dir), sorted(os.listdir(root))
        result = invoke(["calib", source, "--out", case_dir / "out", "--model", tiny_llama, "--params", params,
                         *(["--strict"] if strict else [])])
        output = assert_refused(result, [e.format(p=case_dir) for e in expected], case)
        for secret in ("jane.doe", "+91 98765"):
            assert secret not in output, case
        assert (snapshot(case_dir), sorted(os.listdir(root))) == before, f"{case}: files changed"


def test_quantize_awq_refuses_every_bad_raw_calibration_file(calib_root, tiny_llama):
    """`quantize awq --calib` takes a raw conversation file too: same messages, nothing written."""
    root, params = calib_root
    for number, (case, make, strict, expected) in enumerate(CALIB_CASES):
        if case in CALIB_NO_AWQ:
            continue
        case_dir = root / f"case{number}"
        case_dir.mkdir()
        source = make(case_dir)
        before = snapshot(case_dir), sorted(os.listdir(root))
        result = invoke(["awq", "--calib", source, "--model", tiny_llama, "--out", case_dir / "out",
                         "--params", params])
        assert_refused(result, [e.format(p=case_dir) for e in expected], case)
        assert (snapshot(case_dir), sorted(os.listdir(root))) == before, f"{case}: files changed"


@pytest.mark.parametrize("blocks, expected", [
    ('{"input_ids": [1, 2, 3]}\n{"input_ids": "abc"}\n', "calib.jsonl:2: input_ids must be a non-empty list of token ids"),
    ('{"input_ids": [1, -2]}\n', "calib.jsonl:1: input_ids must be a non-empty list"),
    ('{"input_ids": []}\n', "calib.jsonl:1: input_ids must be a non-empty list"),
    ('{"input_ids": [1, 2]}\n{"text": "hi"}\n', "calib.jsonl:2: not a calibration block"),
])
def test_quantize_awq_refuses_broken_token_blocks(calib_root, tiny_llama, blocks, expected):
    root, params = calib_root
    (root / "calib.jsonl").write_text(blocks)
    before = snapshot(root)
    result = invoke(["awq", "--calib", root / "calib.jsonl", "--model", tiny_llama, "--out", root / "out",
                     "--params", params])
    assert_refused(result, [expected], blocks)
    assert snapshot(root) == before


# ---------------------------------------------------------------- result files and stage summaries

def result_line(i: int, right: bool, **overrides) -> dict:
    return {"id": f"q{i}", "suite": "math", "variant": "v", "prompt": f"question {i}", "target": str(i),
            "output": f"answer {i}", "score": float(right), "correct": right, "n_tokens": 3, "seconds": 0.1,
            **overrides}


def good_lines(n: int = 20) -> list[dict]:
    return [result_line(i, i % 2 == 0) for i in range(n)]


def document_line(i: int, **overrides) -> dict:
    """A perplexity suite's line: one document, its summed log-likelihood and its token count."""
    return {"id": f"book-{i}", "suite": "ppl-book", "variant": "v", "prompt": f"document {i}", "target": "", "output": "",
            "score": 20.0, "correct": None, "loglikelihood": -30.0 - i, "n_tokens": 10, "seconds": None, **overrides}


def good_documents(n: int = 8, **overrides) -> list[dict]:
    return [document_line(i, **overrides) for i in range(n)]


def with_document(number: int, line) -> bytes:
    rows = good_documents()
    rows[number - 1] = line
    return jsonl(rows)


# kl.jsonl's sequences (per-token KL, top-1 agreeing tokens) and the kl.json they give; judge.jsonl's pairs (4 wins,
# 2 ties, one of them the two orders disagreeing, 4 losses, a control run) and the judge.json they give
KL_SEQUENCES = [([0.01 * (i + 1) * (j % 5) for j in range(25)], 20 + i) for i in range(4)]
KL_LINES = [{"sequence": i, "tokens": 25, "top1_agree": agree, "kl": kl} for i, (kl, agree) in enumerate(KL_SEQUENCES)]
KL = {"sequences": 4, "tokens": 100, "kl_mean": 0.05, "kl_p99": 0.16, "kl_max": 0.16, "top1_agreement": 0.86}
JUDGE_LINES = [judge_line(i, outcome, consistent=i != 5, length_diff=i, control="tie")
               for i, outcome in enumerate(["win"] * 4 + ["tie"] * 2 + ["loss"] * 4)]
JUDGE = {"mode": "pairwise", "judge": "j", "weak_judge": False, "confidence": 0.95,
         **pairwise_figures(JUDGE_LINES, True, confidence=0.95)}
LEVEL = {"concurrency": 1, "tpot_ms": 10.0, "ttft_p50_ms": 50.0, "output_tokens_per_s": 100.0, "memory_bytes": 1000}
BENCH = {"engine": "hf", "device": "cpu", "date": "2026-12-01", "input_len": 8, "output_len": 8,
         "workloads": {"fixed": {"levels": [LEVEL]}}, "roofline": {"fraction_of_bound": 0.5, "bound_tokens_per_s": 200.0}}
QUANT = {"scheme": "W4A16", "size_bytes": 100, "quantized_modules": 4, "ignored": {"lm_head": "kept"},
         "calibration": {"blocks": 4, "seq_len": 32, "sha256": "ab" * 32}, "seconds": {"total": 3.0}, "device": "cpu",
         "peak_rss_bytes": 10, "verify": {"reloads": True, "sample": "hi", "vision": {"vision_tensors": 0, "mismatched": []}}}
STATS = {"source": "x.jsonl", "records_in": 10, "records_kept": 9, "dropped": {"duplicate": 1}, "shapes": {"turns": 9},
         "calib_conversations": 8, "holdout": 1, "blocks": 4, "seq_len": 32, "tokens": 128, "redaction": True,
         "redactions": {"email": 2}, "non_latin_share": 0.0}
LONG = {"table": {"by_length_and_depth": {"1024": {"d0": {"n": 2, "score": 0.5}}},
                         "lengths_skipped": [{"length": 8192, "reason": "beyond"}]}}


def jsonl(rows) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode("utf-8")


def with_line(number: int, line) -> bytes:
    rows = good_lines()
    rows[number - 1] = line
    return jsonl(rows)


def encoded_line(number: int, raw: bytes) -> bytes:
    rows = jsonl(good_lines()).split(b"\n")
    rows[number - 1] = raw
    return b"\n".join(rows)


def but(base: dict, **changes) -> bytes:
    data = {k: v for k, v in {**base, **changes}.items() if v != "<missing>"}
    return json.dumps(data).encode()


V_MATH, B_MATH = "results/awq-w4a16/math.jsonl", "results/base/math.jsonl"
V_BOOK, B_BOOK = "results/awq-w4a16/ppl-book.jsonl", "results/base/ppl-book.jsonl"
KL_LINES_PATH, JUDGE_LINES_PATH = "results/awq-w4a16/kl.jsonl", "results/awq-w4a16/judge.jsonl"
KL_FIX, JUDGE_FIX = "run `quantize kl models/awq-w4a16` again", "run `quantize judge models/awq-w4a16` again"
KL_PATH, JUDGE_PATH, BENCH_PATH = "results/awq-w4a16/kl.json", "results/awq-w4a16/judge.json", "results/base/bench.json"
QUANT_PATH, STATS_PATH = "models/awq-w4a16/quant.json", "calib_data/build/stats.json"
RESULT_FIX = "run `quantize eval models/awq-w4a16 --suite math` again to rewrite it"
# Issue 46: values outside their domain, and summaries that disagree with their lines; each was shown as it was
# (exit 0) or ended in a traceback before
DOMAIN_CASES = [
    ("a code item scoring -1 (shown as -10 %)", V_MATH, with_line(3, result_line(2, False, score=-1)),
     [f"{V_MATH}:3: score: expected a number in [0, 1], found -1", RESULT_FIX]),
    ("score 2, correct", V_MATH, with_line(3, result_line(2, True, score=2)),
     [f"{V_MATH}:3: score: expected a number in [0, 1], found 2"]),
    ("score 0.5, correct", V_MATH, with_line(3, result_line(2, True, score=0.5)),
     [f"{V_MATH}:3: correct: true with score 0.5: an item is correct exactly when it scores 1", RESULT_FIX]),
    ("score 1, not correct", B_MATH, with_line(2, result_line(1, False, score=1.0)),
     [f"{B_MATH}:2: correct: false with score 1: an item is correct exactly when it scores 1"]),
    ("a document of 0 tokens (left the pairing)", V_BOOK, with_document(4, document_line(3, n_tokens=0)),
     [f"{V_BOOK}:4: n_tokens: expected a whole number >= 1, found 0", "quantize eval models/awq-w4a16 --suite ppl-book"]),
    ("loglikelihood 1e308 (OverflowError)", B_BOOK, with_document(2, document_line(1, loglikelihood=1e308)),
     [f"{B_BOOK}:2: loglikelihood: 1e+308 is above 0: a log-likelihood is the log of a probability, at most 0"]),
    ("every base document at -1e308 (ValueError: NaN)", B_BOOK, jsonl(good_documents(loglikelihood=-1e308)),
     [f"{B_BOOK}:1: loglikelihood: -1e+308 over 10 tokens is -1e+307 per token, below -700",
      "run `quantize eval models/base --suite ppl-book` again"]),
    ("a log-likelihood of 400 digits", V_BOOK, with_document(2, '{"id": "book-1", "score": 1, "correct": null, '
                                                              '"loglikelihood": -1' + "0" * 400 + ', "n_tokens": 10}'),
     [f"{V_BOOK}:2: loglikelihood: expected a finite number, found a number"]),
    ("2^60 tokens in a document", V_BOOK, with_document(2, document_line(1, n_tokens=2 ** 60)),
     [f"{V_BOOK}:2: n_tokens: 1.15e+18 tokens in one document, more than a float counts exactly"]),
    ("judge.json: 4 wins, 0 losses, an interval of [-3, -2]", JUDGE_PATH, but(JUDGE, ci_low=-3, ci_high=-2),
     [f"{JUDGE_PATH}:1: ci_low: -3 is not a win rate (in [0, 1])", JUDGE_FIX]),
    ("judge.json: an interval its pairs do not give", JUDGE_PATH, but(JUDGE, ci_low=0.1, ci_high=0.2),
     [f"{JUDGE_PATH}:1: ci_low: 0.1 is not what the 10 lines of ", f"{JUDGE_LINES_PATH} give (0.218859)", JUDGE_FIX]),
    ("judge.json: win_rate 7", JUDGE_PATH, but(JUDGE, win_rate=7),
     [f"{JUDGE_PATH}: win_rate: expected a number in [0, 1] or null, found 7"]),
    ("judge.json: more wins than its pairs hold", JUDGE_PATH, but(JUDGE, wins=5),
     [f"{JUDGE_PATH}:1: wins: 5 is not what the 10 lines of ", f"{JUDGE_LINES_PATH} give (4)"]),
    ("judge.json: length bias 1.5", JUDGE_PATH, but(JUDGE, length_bias=1.5),
     [f"{JUDGE_PATH}: length_bias: expected a number in [-1, 1] or null, found 1.5"]),
    ("judge.json without judge.jsonl", JUDGE_LINES_PATH, "<absent>",
     [f"{JUDGE_LINES_PATH}: missing beside judge.json: the report recomputes judge.json's figures from these lines", JUDGE_FIX]),
    ("judge.jsonl: an outcome that is none", JUDGE_LINES_PATH, jsonl([*JUDGE_LINES[:3], {**JUDGE_LINES[3], "outcome": "draw"}]),
     [f"{JUDGE_LINES_PATH}:4: outcome: 'draw' is none of win, tie, loss, unjudged", JUDGE_FIX]),
    ("judge.jsonl: a win whose orders disagree", JUDGE_LINES_PATH, jsonl([{**JUDGE_LINES[0], "consistent": False}]),
     [f"{JUDGE_LINES_PATH}:1: outcome: a win whose two orders disagree"]),
    ("judge.jsonl: a pair judged, consistent null", JUDGE_LINES_PATH, jsonl([{**JUDGE_LINES[0], "consistent": None}]),
     [f"{JUDGE_LINES_PATH}:1: consistent: null with outcome win: null exactly when the pair is unjudged"]),
    ("judge.jsonl: a line without its outcome", JUDGE_LINES_PATH, jsonl([{"id": "p0", "consistent": True}]),
     [f"{JUDGE_LINES_PATH}:1: outcome: expected text, found nothing"]),
    ("kl.json: kl_mean -0.5", KL_PATH, but(KL, kl_mean=-0.5),
     [f"{KL_PATH}:1: kl_mean: -0.5 is negative: a KL divergence is >= 0", KL_FIX]),
    ("kl.json: top1_agreement 1.5", KL_PATH, but(KL, top1_agreement=1.5),
     [f"{KL_PATH}: top1_agreement: expected a number in [0, 1], found 1.5"]),
    ("kl.json: a mean its lines do not give", KL_PATH, but(KL, kl_mean=0.2),
     [f"{KL_PATH}:1: kl_mean: 0.2 is not what the 4 lines of ", f"{KL_LINES_PATH} give (0.05)", KL_FIX]),
    ("kl.json without kl.jsonl", KL_LINES_PATH, "<absent>", [f"{KL_LINES_PATH}: missing beside kl.json"]),
    ("kl.jsonl: a negative KL", KL_LINES_PATH, jsonl([KL_LINES[0], {**KL_LINES[1], "kl": [-0.5] + KL_LINES[1]["kl"][1:]}]),
     [f"{KL_LINES_PATH}:2: kl[0]: -0.5 is negative: a KL divergence is >= 0", KL_FIX]),
    ("kl.jsonl: more agreeing tokens than tokens", KL_LINES_PATH, jsonl([{**KL_LINES[0], "top1_agree": 26}]),
     [f"{KL_LINES_PATH}:1: top1_agree: 26 of 25 tokens: an agreement above 1"]),
    ("kl.jsonl: a value short", KL_LINES_PATH, jsonl([{**KL_LINES[0], "kl": KL_LINES[0]["kl"][1:]}]),
     [f"{KL_LINES_PATH}:1: kl: 24 values for 25 tokens: one value a token"]),
    ("kl.jsonl: a NaN", KL_LINES_PATH, jsonl(['{"sequence": 0, "tokens": 1, "top1_agree": 1, "kl": [NaN]}']),
     [f"{KL_LINES_PATH}:1: kl[0]: expected a finite number, found nan"]),
    ("kl.jsonl empty", KL_LINES_PATH, b"", [f"{KL_LINES_PATH}: no sequence"]),
]
# (id, file under the case dir, its bytes (None: make it a directory; "<absent>": delete it), expected pieces)
RESULT_CASES = [
    ("bytes that are not UTF-8", V_MATH, encoded_line(3, b'{"id": "q2", "output": "caf\xe9", "score": 1.0, "correct": true}'),
     [f"{V_MATH}:3: bytes that are not UTF-8 (0xe9)", RESULT_FIX]),
    ("surrogate bytes (CESU-8)", V_MATH, encoded_line(4, b'{"id": "q3", "output": "\xed\xa0\x80", "score": 1.0, '
                                                      b'"correct": true}'), [f"{V_MATH}:4: bytes that are not UTF-8"]),
    ("a lone surrogate", V_MATH, with_line(5, '{"id": "q4", "output": "x \\ud800 y", "score": 0.0, "correct": false}'),
     [f"{V_MATH}:5: output: holds an unpaired UTF-16 surrogate", RESULT_FIX]),
    ("a lone surrogate in the base's prompt", B_MATH, with_line(2, result_line(1, False, prompt="\udc80")),
     [f"{B_MATH}:2: prompt: holds an unpaired UTF-16 surrogate", "quantize eval models/base --suite math"]),
    ("a missing id", V_MATH, with_line(2, {"score": 1.0, "correct": True}),
     [f"{V_MATH}:2: id: expected a non-empty string or an integer, found nothing (the key is missing)"]),
    ("a missing correct", V_MATH, with_line(2, {"id": "q1", "score": 1.0}),
     [f"{V_MATH}:2: correct: expected true or false, found nothing (the key is missing)"]),
    ("a missing score", B_MATH, with_line(7, {"id": "q6", "correct": True}),
     [f"{B_MATH}:7: score: expected a number in [0, 1], found nothing"]),
    ("a JSON array line", V_MATH, with_line(6, [result_line(5, True)]),
     [f"{V_MATH}:6: a result line must be a JSON object, not an array"]),
    ("a string line", V_MATH, with_line(6, '"q5"'), [f"{V_MATH}:6: a result line must be a JSON object, not text"]),
    ("a null line", V_MATH, with_line(6, "null"), [f"{V_MATH}:6: a result line must be a JSON object, not null"]),
    ("score as text", V_MATH, with_line(8, result_line(7, True, score="1.0")),
     [f"{V_MATH}:8: score: expected a number in [0, 1], found text"]),
    ("score NaN", V_MATH, with_line(8, '{"id": "q7", "score": NaN, "correct": true}'),
     [f"{V_MATH}:8: score: expected a number in [0, 1], found nan"]),
    ("score Infinity", V_MATH, with_line(8, '{"id": "q7", "score": -Infinity, "correct": true}'),
     [f"{V_MATH}:8: score: expected a number in [0, 1], found -inf"]),
    ("correct as text", V_MATH, with_line(9, result_line(8, True, correct="yes")),
     [f"{V_MATH}:9: correct: expected true or false, found text"]),
    ("correct as 1", V_MATH, with_line(9, result_line(8, True, correct=1)),
     [f"{V_MATH}:9: correct: expected true or false, found a number"]),
    ("id null", V_MATH, with_line(1, result_line(0, True, id=None)), [f"{V_MATH}:1: id: expected a non-empty string"]),
    ("id true", V_MATH, with_line(1, result_line(0, True, id=True)), [f"{V_MATH}:1: id: expected a non-empty string"]),
    ("id an object", V_MATH, with_line(1, result_line(0, True, id={"a": 1})), [f"{V_MATH}:1: id: expected"]),
    ("id empty", V_MATH, with_line(1, result_line(0, True, id="")), [f"{V_MATH}:1: id: expected a non-empty string"]),
    ("a duplicate id", V_MATH, with_line(4, result_line(1, True)),
     [f"{V_MATH}:4: id 'q1' is already on line 2; each item must appear once: delete the duplicate line"]),
    ("a duplicate id, int and text", B_MATH, jsonl([result_line(0, True, id=7), result_line(1, True, id="7")]),
     [f"{B_MATH}:2: id '7' is already on line 1"]),
    ("a truncated line", V_MATH, encoded_line(10, b'{"id": "q9", "score'),
     [f"{V_MATH}:10: not valid JSON (Unterminated string starting at column 14)"]),
    ("nesting 100,000 deep", V_MATH, with_line(3, '{"id": "q2", "output": ' + "[" * 100_000 + "]" * 100_000 + "}"),
     [f"{V_MATH}:3: JSON that cannot be loaded (maximum recursion depth"]),
    ("a number of 5,000 digits", V_MATH, with_line(3, '{"id": "q2", "n_tokens": ' + "9" * 5000 + "}"),
     [f"{V_MATH}:3: JSON that cannot be loaded (Exceeds the limit (4300 digits)"]),
    ("a UTF-16 result file", V_MATH, jsonl(good_lines()).decode().encode("utf-16"),
     [f"{V_MATH}:1: the file is UTF-16 encoded, not UTF-8"]),
    ("binary garbage", V_MATH, bytes(range(256)) * 16, [f"{V_MATH}:2: bytes that are not UTF-8 (0x80)"]),
    ("a result file that is a directory", V_MATH, None,
     [f"{V_MATH}: is a directory where a file belongs; move it away"]),
    ("kl.json not JSON", KL_PATH, b'{"tokens": 100, "kl_mean": ', [f"{KL_PATH}:1: not valid JSON",
                                                                   "run `quantize kl models/awq-w4a16` again"]),
    ("kl.json a list", KL_PATH, b"[1, 2]", [f"{KL_PATH}: the top level: expected an object, found an array"]),
    ("kl.json without kl_mean", KL_PATH, but(KL, kl_mean="<missing>"),
     [f"{KL_PATH}: kl_mean: expected a finite number, found nothing (the key is missing)"]),
    ("kl.json kl_mean as text", KL_PATH, but(KL, kl_mean="0.1"), [f"{KL_PATH}: kl_mean: expected a finite number, found text"]),
    ("kl.json not UTF-8", KL_PATH, b'{"tokens": 100, "note": "\xff"}', [f"{KL_PATH}:1: bytes that are not UTF-8 (0xff)"]),
    ("kl.json with a lone surrogate", KL_PATH, but(KL, note="\ud800"),
     [f"{KL_PATH}: note: holds an unpaired UTF-16 surrogate"]),
    ("kl.json empty", KL_PATH, b"", [f"{KL_PATH}:1: not valid JSON (Expecting value at column 1)"]),
    ("judge.json not JSON", JUDGE_PATH, b"{oops}", [f"{JUDGE_PATH}:1: not valid JSON", "quantize judge models/awq-w4a16"]),
    ("judge.json a number", JUDGE_PATH, b"42", [f"{JUDGE_PATH}: the top level: expected an object, found a number"]),
    ("judge.json judged without an interval", JUDGE_PATH, but(JUDGE, ci_low=None),
     [f"{JUDGE_PATH}: ci_low: expected a finite number when n is 10, found null"]),
    ("judge.json consistency as text", JUDGE_PATH, but(JUDGE, consistency="high"),
     [f"{JUDGE_PATH}: consistency: expected a number in [0, 1] or null, found text"]),
    ("bench.json without workloads", BENCH_PATH, but(BENCH, workloads="<missing>"),
     [f"{BENCH_PATH}: workloads: expected an object, found nothing", "quantize bench models/base"]),
    ("bench.json without levels", BENCH_PATH, but(BENCH, workloads={"fixed": {"levels": []}}),
     [f"{BENCH_PATH}: workloads.fixed.levels: expected at least one level, found none"]),
    ("bench.json TTFT as text", BENCH_PATH, but(BENCH, workloads={"fixed": {"levels": [{**LEVEL, "ttft_p50_ms": "50"}]}}),
     [f"{BENCH_PATH}: workloads.fixed.levels[0].ttft_p50_ms: expected a number >= 0, found text"]),
    ("bench.json concurrency 0", BENCH_PATH, but(BENCH, workloads={"fixed": {"levels": [{**LEVEL, "concurrency": 0}]}}),
     [f"{BENCH_PATH}: workloads.fixed.levels[0].concurrency: expected a whole number >= 1, found 0"]),
    ("bench.json percentiles without p99", BENCH_PATH,
     but(BENCH, workloads={"fixed": {"levels": [{**LEVEL, "ttft_ms": {"median": 5.0, "p90": 6.0}}]}}),
     [f"{BENCH_PATH}: workloads.fixed.levels[0].ttft_ms.p99: expected a number >= 0, found nothing"]),
    ("quant.json serving as a list", QUANT_PATH, but(QUANT, serving=["vllm"]),
     [f"{QUANT_PATH}: serving: expected an object or null, found an array"]),
    ("quant.json not JSON", QUANT_PATH, b"{", [f"{QUANT_PATH}:1: not valid JSON", "quantize variant awq-w4a16"]),
    ("quant.json size as text", QUANT_PATH, but(QUANT, size_bytes="100 MB"),
     [f"{QUANT_PATH}: size_bytes: expected a whole number >= 0, found text"]),
    ("quant.json without calibration", QUANT_PATH, but(QUANT, calibration="<missing>"),
     [f"{QUANT_PATH}: calibration: expected an object, found nothing"]),
    ("quant.json a directory", QUANT_PATH, None, [f"{QUANT_PATH}: is a directory where a file belongs"]),
    ("a suite summary not JSON", "results/base/math.json", b"not json",
     ["results/base/math.json:1: not valid JSON", "quantize eval models/base --suite math"]),
    ("a suite summary status as a number", "results/base/math.json", b'{"status": 1}',
     ["results/base/math.json: status: expected text or null, found a number"]),
    ("long_context.json of the wrong shape", "results/base/long_context.json",
     json.dumps({"table": {"by_length_and_depth": [1, 2]}}).encode(),
     ["results/base/long_context.json: table.by_length_and_depth: expected an object, found an array"]),
    ("calib stats.json not JSON", STATS_PATH, b"\x00\x01", [f"{STATS_PATH}:1: not valid JSON", "run `quantize calib` again"]),
    ("calib stats.json share as text", STATS_PATH, but(STATS, non_latin_share="none"),
     [f"{STATS_PATH}: non_latin_share: expected a finite number, found text"]),
    ("a 70 MB kl.json", KL_PATH, b" " * (70 << 20), [f"{KL_PATH}: over 64 MB, not a summary this pipeline writes"]),
    *DOMAIN_CASES,
]


def test_the_result_corpus_is_as_large_as_promised():
    assert len(RESULT_CASES) >= 9 and len({case for case, *_ in RESULT_CASES}) == len(RESULT_CASES)


def build_results(root: Path) -> None:
    """A complete, valid set of report inputs."""
    for model in ("base", "awq-w4a16"):
        (root / "results" / model).mkdir(parents=True)
        (root / "results" / model / "math.jsonl").write_bytes(jsonl(good_lines()))
        (root / "results" / model / "ppl-book.jsonl").write_bytes(jsonl(good_documents()))
    files = {KL_PATH: KL, JUDGE_PATH: JUDGE, BENCH_PATH: BENCH, "results/awq-w4a16/bench.json": BENCH,
             QUANT_PATH: QUANT, STATS_PATH: STATS, "results/base/long_context.json": LONG,
             "results/base/math.json": {"status": "ok"}}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(data))
    (root / KL_LINES_PATH).write_bytes(jsonl(KL_LINES))
    (root / JUDGE_LINES_PATH).write_bytes(jsonl(JUDGE_LINES))
    (root / "params.yaml").write_text(sub("    max_new_tokens: 8\n", "    max_new_tokens: 8\n  ppl-book:\n    task: quant_ppl_book\n"))


def report_args(root: Path) -> list:
    return ["report", "--results", root / "results", "--out", root / "reports", "--models", root / "models",
            "--params", root / "params.yaml"]


def test_quantize_report_refuses_every_bad_result_file_and_keeps_the_last_report(tmp_path, monkeypatch):
    template = tmp_path / "template"
    build_results(template)
    monkeypatch.chdir(template)
    good = invoke(report_args(template))
    assert good.exit_code == 0, good.output
    for number, (case, name, data, expected) in enumerate(RESULT_CASES):
        root = tmp_path / f"case{number}"
        shutil.copytree(template, root, symlinks=True)  # inputs and the report they gave
        monkeypatch.chdir(root)
        previous = snapshot(root / "reports")
        target = root / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        if data is None:
            target.mkdir()
        elif data != "<absent>":
            target.write_bytes(data)
        before = snapshot(root)
        assert_refused(invoke(report_args(root)), expected, case)
        assert snapshot(root) == before, f"{case}: files changed"
        assert snapshot(root / "reports") == previous and {"index.html", "verdict.json"} <= set(previous)


def test_a_result_file_with_a_bom_and_crlf_is_read(tmp_path, monkeypatch):
    build_results(tmp_path)
    path = tmp_path / V_MATH
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes().replace(b"\n", b"\r\n"))
    monkeypatch.chdir(tmp_path)
    assert invoke(report_args(tmp_path)).exit_code == 0


# ---------------------------------------------------------------- verdict.json and index.html together

def test_verdict_and_page_change_together_or_not_at_all(tmp_path, monkeypatch):
    from pipeline.report import publish

    out = tmp_path / "reports"
    publish.write_pair(out, {"index.html": "old page", "verdict.json": "old verdict"}, "report")
    real_replace, calls = os.replace, []

    def swap_fails(src, dst):
        if Path(dst).parent != out:  # inside the new run's own folder
            return real_replace(src, dst)
        calls.append(Path(dst))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(publish.os, "replace", swap_fails)
    from pipeline.errors import UserError

    with pytest.raises(UserError, match="no space left on the device"):  # one message (issue 70.1), not a traceback
        publish.write_pair(out, {"index.html": "new page", "verdict.json": "new verdict"}, "report")
    assert calls == [out / ".report"]  # one rename swaps both files
    assert (out / "index.html").read_text() == "old page" and (out / "verdict.json").read_text() == "old verdict"
    monkeypatch.setattr(publish.os, "replace", real_replace)
    with pytest.raises(UnicodeEncodeError):  # text no file can hold: nothing is even opened
        publish.write_pair(out, {"index.html": "new page", "verdict.json": "broken \ud800"}, "report")
    assert (out / "index.html").read_text() == "old page" and (out / "verdict.json").read_text() == "old verdict"

    publish.write_pair(out, {"index.html": "new page", "verdict.json": "new verdict"}, "report")
    assert (out / "index.html").read_text() == "new page" and (out / "verdict.json").read_text() == "new verdict"
    folders = [p.name for p in out.iterdir() if p.name.startswith(".report-")]
    assert len(folders) == 1 and os.readlink(out / ".report") == folders[0]  # the earlier runs' folders are gone
    assert sorted(p.name for p in out.iterdir()) == sorted([".report", folders[0], "index.html", "verdict.json"])


def test_a_killed_reports_leftovers_are_removed_by_the_next_report(tmp_path, monkeypatch):
    build_results(tmp_path)
    monkeypatch.chdir(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    reports = tmp_path / "reports"
    (reports / f".report-{dead}-abc").mkdir(parents=True)
    (reports / f".report-{dead}-abc" / "index.html").write_text("half")
    os.symlink(f".report-{dead}-abc", reports / f".report.tmp-{dead}")
    (reports / ".report-1-live").mkdir()  # PID 1 is alive: not ours to remove
    (reports / "notes.txt").write_text("the user's")  # another file in --out is left alone
    assert invoke(report_args(tmp_path)).exit_code == 0
    names = sorted(p.name for p in reports.iterdir())
    current = os.readlink(reports / ".report")
    assert names == sorted([".report", ".report-1-live", current, "cards", "index.html", "notes.txt", "verdict.json"])


@pytest.mark.parametrize("where", ["a file", "inside a file", "index.html is a directory"])
def test_a_report_that_cannot_be_written_there_is_refused_and_nothing_changes(tmp_path, monkeypatch, where):
    build_results(tmp_path)
    monkeypatch.chdir(tmp_path)
    args = report_args(tmp_path)
    out = tmp_path / "reports"
    if where == "a file":
        out.write_text("notes")
    elif where == "inside a file":
        out.write_text("notes")
        out = out / "sub"
        args[args.index("--out") + 1] = out
    else:
        (out / "index.html").mkdir(parents=True)
    before = snapshot(tmp_path)
    expected = ([f"{out}: cannot write the report there", "pass --out a writable directory"] if where != "index.html is a directory"
                else [f"{out}: {out / 'index.html'} is not the report link a previous run left", "move them away"])
    assert_refused(invoke(args), expected, where)
    assert snapshot(tmp_path) == before
