"""The sandbox against a hostile corpus: every sample fails, and the host and this run are untouched.

Each hostile sample exits 0 only if its attack worked, so "not passed" plus a check of the host
state shows the sandbox (not a typo in the sample) stopped it. Hostile code only ever goes
through `run_python`.
"""

import os
import pwd
import resource
import socket
import threading
import time
import uuid

import pytest

from conftest import REPO
from pipeline.scoring import bwrap
from pipeline.scoring import sandbox
from pipeline.errors import UserError
from pipeline.scoring.sandbox import available_method, run_check, run_python

pytestmark = pytest.mark.timeout(60)
NOBODY = 65534

HUMANEVAL_0 = '''
def has_close_elements(numbers, threshold):
{body}

def check(candidate):
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True

check(has_close_elements)
'''
CORRECT = """    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])"""
WRONG = """    return False"""


@pytest.fixture(autouse=True)
def temp_home(tmp_path, monkeypatch):
    """This test process's HOME is a temp dir with a canary, should anything escape."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "canary.txt").write_text("still here")
    monkeypatch.setenv("HOME", str(home))
    return home


def _uid_processes(uid: int) -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as status:
                if any(line.startswith("Uid:") and line.split()[1] == str(uid) for line in status):
                    count += 1
        except OSError:
            pass
    return count


def test_correct_solution_passes_and_wrong_one_fails():
    good = run_python(HUMANEVAL_0.format(body=CORRECT), timeout_s=10)
    bad = run_python(HUMANEVAL_0.format(body=WRONG), timeout_s=10)
    assert good.passed and good.exit_code == 0, good.stderr_tail
    assert not bad.passed and bad.exit_code == 1 and "AssertionError" in bad.stderr_tail
    assert good.method == bad.method == available_method()


def test_sandbox_method_is_bubblewrap_here():
    """Recorded in every result; on this machine bubblewrap works, so the strong method is used."""
    assert available_method() == "bwrap", "bubblewrap missing or unusable: apt-get install -y bubblewrap (make test does it)"
    assert run_python("print('hi')", timeout_s=10).method == "bwrap"


def test_fork_bomb_is_stopped_and_leaves_no_process_behind():
    baseline = _uid_processes(NOBODY)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _uid_processes(NOBODY))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    started = time.monotonic()
    result = run_python(bomb, timeout_s=3, max_processes=32)
    stop.set()
    watcher.join()
    assert not result.passed and time.monotonic() - started < 15
    assert peak[0] <= baseline + 32 + 2, f"{peak[0]} processes of nobody: RLIMIT_NPROC did not hold"
    deadline = time.monotonic() + 5
    while _uid_processes(NOBODY) > baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _uid_processes(NOBODY) == baseline, "fork bomb processes survived the sandbox"


def test_infinite_loop_times_out():
    result = run_python("while True:\n    pass\n", timeout_s=2)
    assert result.timed_out and not result.passed and result.exit_code is None
    assert result.seconds < 5


def test_a_gigabyte_of_output_is_capped():
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run_python("import sys\nfor _ in range(1 << 14):\n    sys.stdout.write('x' * 65536)\n",
                        timeout_s=20, max_output_bytes=1 << 20)
    assert result.output_capped and not result.passed and result.seconds < 10
    assert len(result.stdout_tail) <= 2000
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 100_000  # KiB: no 1 GB buffer


def test_a_gigabyte_file_hits_the_file_size_limit():
    code = "with open('big', 'wb') as f:\n    for _ in range(1 << 10):\n        f.write(b'x' * (1 << 20))\n"
    result = run_python(code, timeout_s=10, max_file_mb=8)
    assert not result.passed and not result.timed_out and result.seconds < 8


def test_rm_rf_home_leaves_the_real_home_alone(temp_home):
    canary = temp_home / "canary.txt"
    code = (f"import os, subprocess\nassert os.path.exists({str(canary)!r}), 'host HOME not visible'\n"
            f"subprocess.run('rm -rf ~ {temp_home}', shell=True)\n"
            f"assert not os.path.exists({str(canary)!r})\n")
    result = run_python(code, timeout_s=10)
    assert not result.passed and "host HOME not visible" in result.stderr_tail
    assert canary.read_text() == "still here"


def test_writes_outside_the_temp_dir_do_not_reach_the_host():
    target = f"/tmp/sandbox-escape-{uuid.uuid4().hex}"
    code = f"open({target!r}, 'w').write('escaped')\nprint('wrote')\n"
    result = run_python(code, timeout_s=10)
    assert not result.passed and "wrote" not in result.stdout_tail
    assert not os.path.exists(target)
    inside = run_python("open('notes.txt', 'w').write('ok')\nprint(open('notes.txt').read())\n", timeout_s=10)
    assert inside.passed and inside.stdout_tail.strip() == "ok"  # its own temp dir is writable


def test_no_connection_reaches_a_host_socket():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(1.0)
    port = server.getsockname()[1]
    code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'stolen')\n")
    try:
        result = run_python(code, timeout_s=10)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert not result.passed and not result.timed_out


def test_secrets_in_the_parent_environment_are_not_visible(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "s3cret-token")
    code = (
        "import glob, os\n"
        "seen = str(dict(os.environ))\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        seen += open(path, 'rb').read().decode(errors='replace')\n"
        "    except OSError:\n"
        "        pass\n"
        "print(seen)\n"
        "assert 's3cret-token' in seen\n"
    )
    result = run_python(code, timeout_s=10)
    assert not result.passed
    assert "s3cret-token" not in result.stdout_tail + result.stderr_tail


def test_fallback_method_still_blocks_the_corpus(temp_home, monkeypatch):
    """Where bubblewrap is unusable: rlimits + audit hook; weaker, but these attacks still fail."""
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "s3cret-token")
    target = f"/tmp/sandbox-escape-{uuid.uuid4().hex}"
    attacks = {
        "fork": "import os\nos.fork()\n",
        "subprocess": f"import subprocess\nsubprocess.run('rm -rf {temp_home}', shell=True, check=True)\n",
        "rmtree": f"import shutil\nshutil.rmtree({str(temp_home)!r})\n",
        "write": f"open({target!r}, 'w').write('escaped')\n",
        "socket": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n",
        "secret": "import os\nassert os.environ.get('SANDBOX_TEST_SECRET')\n",
        "proc": "import os\nassert b's3cret' in open(f'/proc/{os.getppid()}/environ', 'rb').read()\n",
    }
    for name, code in attacks.items():
        result = run_python(code, timeout_s=5, method="rlimits+audit")
        assert not result.passed and result.method == "rlimits+audit", name
    assert (temp_home / "canary.txt").read_text() == "still here" and not os.path.exists(target)
    assert run_python(HUMANEVAL_0.format(body=CORRECT), timeout_s=10, method="rlimits+audit").passed


def test_sandbox_sees_only_the_interpreter_and_a_scratch_dir(temp_home):
    """Files planted in the project, the real HOME, this HOME and /tmp, the calibration data, the venv,
    /etc/shadow and /etc/passwd: none readable; and the whole visible tree is the interpreter's mounts."""
    token = uuid.uuid4().hex
    real_home = pwd.getpwuid(os.getuid()).pw_dir
    planted = [REPO / f".sandbox-canary-{token}", os.path.join(real_home, f".sandbox-canary-{token}"),
               temp_home / f"canary-{token}", f"/tmp/sandbox-canary-{token}"]
    secrets = [*map(str, planted), str(REPO / "calib_data" / "support_logs.jsonl"), str(REPO / "params.yaml"),
               "/etc/shadow", "/etc/passwd", "/etc/hostname", os.path.join(os.path.dirname(os.path.dirname(
                   os.path.abspath(os.sys.executable))), "pyvenv.cfg")]
    mounts = bwrap.interpreter_mounts()
    allowed = [mounts.executable, *mounts.directories, *(target for _, target in mounts.files), "/tmp/work"]
    code = f"""
import os
readable = []
for path in {secrets!r}:
    try:
        readable.append((path, open(path, 'rb').read(100)))
    except OSError:
        pass
outside = []
for root, dirs, files in os.walk('/'):
    if root == '/dev' or root.startswith('/dev/'):
        continue
    for name in files:
        path = os.path.join(root, name)
        if not any(path == a or path.startswith(a + '/') for a in {allowed!r}):
            outside.append(path)
masked = [os.listdir(d) for d in {list(mounts.masked)!r}]
print('READ', readable, 'OUTSIDE', outside[:20], len(outside), 'MASKED', masked)
assert readable or outside or any(masked), 'nothing of the host beyond the interpreter is visible'
"""
    try:
        for path in planted:
            with open(path, "w") as handle:
                handle.write(f"planted secret {token}")
        result = run_python(code, timeout_s=20)
    finally:
        for path in planted:
            os.unlink(path)
    assert result.method == "bwrap"
    assert not result.passed, result.stdout_tail
    assert "nothing of the host beyond the interpreter is visible" in result.stderr_tail, result.stderr_tail
    assert token not in result.stdout_tail + result.stderr_tail
    assert "READ [] OUTSIDE [] 0 MASKED" in result.stdout_tail, result.stdout_tail
    assert mounts.masked, "the interpreter's site-packages should be masked"  # this machine's pyenv has one


def test_sandbox_starts_every_stdlib_extension_module():
    """Only what ldd lists is mounted: every extension module of the stdlib still imports (but the few
    left out on purpose: Tk, curses, readline, NIS, dbm)."""
    code = (
        f"UNMOUNTED = {sorted(bwrap.UNMOUNTED_EXTENSIONS)!r}\n"
        "import os, sys, importlib\n"
        "failed = []\n"
        "for d in sys.path:\n"
        "    for name in (os.listdir(d) if os.path.isdir(d) else []):\n"
        "        if name.endswith('.so') and name.split('.')[0] not in UNMOUNTED:\n"
        "            module = name.split('.')[0]\n"
        "            try:\n"
        "                importlib.import_module(module)\n"
        "            except ImportError as exc:\n"
        "                failed.append((module, str(exc)))\n"
        "print(failed)\n"
        "assert not failed, failed\n"
        "import ssl, sqlite3, decimal, hashlib, lzma, bz2, zlib, json, ctypes, typing, dataclasses\n"
    )
    result = run_python(code, timeout_s=30)
    assert result.passed, result.stdout_tail + result.stderr_tail


def test_without_bubblewrap_it_refuses_unless_allowed(bwrap_missing):
    assert available_method() == "rlimits+audit"
    with pytest.raises(UserError) as refused:
        run_python("print('ran')", timeout_s=10)
    message = str(refused.value)
    assert "apt-get install -y bubblewrap" in message and "allow_unsandboxed: true" in message
    assert "no `bwrap` on PATH" in message
    with pytest.raises(UserError):
        run_check("def f():\n    return 1\n", "f", "assert __sample_function__() == 1\n")
    with sandbox.allow_unsandboxed():
        ran = run_python("print('ran')", timeout_s=10)
        checked = run_check("def f():\n    return 1\n", "f", "assert __sample_function__() == 1\n")
    assert ran.passed and ran.method == "rlimits+audit" and ran.stdout_tail.strip() == "ran"
    assert checked.passed and checked.method == "rlimits+audit"
    with pytest.raises(UserError):  # the permission ends with the block
        run_python("print('ran')", timeout_s=10)


CHECKER = "assert __sample_function__(2, 3) == 5\nassert __sample_function__(-1, 1) == 0\n"


@pytest.mark.parametrize("method", ["bwrap", "rlimits+audit"])
def test_run_check_passes_a_right_function_and_fails_a_wrong_one(method):
    right = run_check("def add(a, b):\n    return a + b\n", "add", CHECKER, method=method)
    wrong = run_check("def add(a, b):\n    return a - b\n", "add", CHECKER, method=method)
    early = run_check("import os\ndef add(a, b):\n    os._exit(0)\n", "add", CHECKER, method=method)
    printed = run_check("def add(a, b):\n    print('check passed')\n    raise SystemExit(0)\n", "add", CHECKER,
                        method=method)
    assert right.passed and right.method == method and right.checker_exit_code == 0, right.checker_stderr_tail
    assert not wrong.passed and "AssertionError" in wrong.checker_stderr_tail
    assert not early.passed and "no complete answer" in early.checker_stderr_tail
    assert not printed.passed and "check passed" in printed.sample_stdout_tail


def test_run_check_carries_plain_values_exactly_and_nothing_else():
    """Types survive the pipe exactly (a tuple stays a tuple, 1.0 stays a float, big ints, nan, bytes);
    an object of the sample's making (an always-equal one) does not cross."""
    values = ("[1, (2, 3.5), {'k': {4, 5}}, frozenset({6}), b'x\\x00', 'é\\ud800', None, True, 2 ** 200, -7, "
              "float('inf'), 1.0, 3j]")
    checker = (f"import math\nv = {values}\ngot = __sample_function__(v)\n"
               "assert got[:-2] == v[:-2] and [type(x) for x in got] == [type(x) for x in v]\n"
               "assert math.isinf(got[10]) and got[11] == 1.0 and type(got[11]) is float and got[12] == 3j\n"
               "assert __sample_function__(x=1) == {'x': 1}\n")
    echo = run_check("def f(v=None, **kw):\n    return v if v is not None else kw\n", "f", checker)
    assert echo.passed, echo.checker_stderr_tail
    always_equal = ("class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
                    "def f(v=None, **kw):\n    return Yes()\n")
    forged = run_check(always_equal, "f", "assert __sample_function__(1) == 2\n")
    assert not forged.passed and "cannot cross the sandbox" in forged.checker_stderr_tail
    subclasses = ("import collections\nclass Same(str):\n    def __eq__(self, other):\n        return True\n"
                  "    __hash__ = str.__hash__\n"
                  "def f(kind):\n    return collections.Counter('aab') if kind == 'counter' else Same('no')\n")
    checker = ("v = __sample_function__('counter')\nassert v == {'a': 2, 'b': 1} and type(v) is dict\n"
               "assert __sample_function__('same') == 'yes'\n")
    crossed = run_check(subclasses, "f", checker)  # a Counter crosses as a dict, the str as its characters
    assert not crossed.passed and 'File "<checker>", line 3' in crossed.checker_stderr_tail  # line 2 held
    assert "AssertionError" in crossed.checker_stderr_tail
    raised = run_check("def f(x):\n    raise ValueError('nope')\n", "f",
                       "try:\n    __sample_function__(1)\nexcept ValueError as e:\n    assert 'nope' in str(e)\n")
    assert raised.passed, raised.checker_stderr_tail  # a builtin exception crosses as itself


def test_checker_refuses_malformed_or_oversized_answers():
    """The sample controls what it writes on the reply pipe; nothing it writes there passes."""
    attacks = {
        "['ok', ['code', '__import__(\\'os\\')._exit(0)']]": "ValueError: malformed value",
        "['ok', 5]": "ValueError: malformed value",  # untagged: not a plain value of ours
        "['raised', 'SystemExit', '0']": "SampleError: raised in the sample: SystemExit",  # never SystemExit itself
        "['exit', 0]": "SampleError: malformed answer",
    }
    for reply, expected in attacks.items():
        sample = ("import json, os\n"
                  "def f(*a):\n"
                  f"    os.write(int(__import__('sys').argv[8]), (json.dumps({reply}) + '\\n').encode())\n"
                  "    os._exit(0)\n")
        result = run_check(sample, "f", "assert __sample_function__(1) == 5\n", timeout_s=5)
        assert not result.passed and expected in result.checker_stderr_tail, (reply, result.checker_stderr_tail)
    # the same pipe with a right answer passes: the channel carries answers, and only answers count
    right = run_check(sample.replace("['exit', 0]", "['ok', ['i', '0x5']]"), "f", "assert __sample_function__(1) == 5\n")
    assert right.passed
    huge = run_check("def f(*a):\n    return 'x' * (20 << 20)\n", "f", "assert __sample_function__() == ''\n",
                     timeout_s=20, memory_mb=1024, max_output_bytes=64 << 20)
    assert not huge.passed and "no complete answer" in huge.checker_stderr_tail
