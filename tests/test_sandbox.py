"""The sandbox against a hostile corpus: every sample fails, and the host and this run are untouched.

Each hostile sample exits 0 only if its attack worked, so "not passed" plus a check of the host
state shows the sandbox (not a typo in the sample) stopped it. Hostile code only ever goes
through `run_python`.
"""

import os
import resource
import socket
import threading
import time
import uuid

import pytest

from pipeline.sandbox import available_method, run_python

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
