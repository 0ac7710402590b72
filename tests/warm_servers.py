"""A warm interpreter for the test servers: tests/openai_server.py, run as a script (as the pipeline starts `vllm
serve`), hands its command line to it and runs in a child forked from it, with torch, transformers and the server's
modules imported once per test worker instead of once per server (~4.5 s of a 2-core CPU each, ~60 starts a run).

The fork server is the pipeline's own (pipeline/cli/forkserver.py, serving a different program): the started process
stays what the pipeline started, relays its signals to the child and exits with the child's status; killed, it takes
the child with it. Where no warm interpreter answers (none started, not up yet, another PYTHONPATH: the access
recorder's), the server runs in the started process itself, as before: the result is the same, only slower.

conftest.py starts one per test process (`start`); `python tests/warm_servers.py SOCKET OWNER_PID` is that process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

SOCKET_ENV = "TEST_SERVER_WARM_SOCKET"  # the warm interpreter's socket, for the servers the tests start
PYTHONPATH_ENV = "TEST_SERVER_WARM_PYTHONPATH"  # the PYTHONPATH it imported its modules under
PRELOAD = ("torch", "numpy", "transformers", "transformers.generation.utils", "transformers.models.auto.modeling_auto",
           "transformers.models.llama.modeling_llama", "transformers.models.glm4v.modeling_glm4v",
           "transformers.models.glm4v_moe.modeling_glm4v_moe", "safetensors", "pipeline.checkpoints.loading",
           "openai_server")
_STARTED: list[subprocess.Popen] = []  # held, not waited for: each ends with its owner


def start(owner_pid: int) -> None:
    """Starts the warm interpreter in the background (it listens once its imports are done) and names its socket
    in os.environ, so the servers this process starts find it; it ends with its owner."""
    path = Path(tempfile.mkdtemp(prefix="warm-servers-")) / "s.sock"
    os.environ[SOCKET_ENV] = str(path)
    os.environ[PYTHONPATH_ENV] = os.environ.get("PYTHONPATH", "")
    log = open(path.with_name("log"), "ab")  # noqa: SIM115 - the child holds it
    with log:
        _STARTED.append(subprocess.Popen([sys.executable, __file__, str(path), str(owner_pid)], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, start_new_session=True, close_fds=True))


def run_there() -> int | None:
    """This server's exit status, run in a child of the warm interpreter; None when none answers (run it here)."""
    path = os.environ.get(SOCKET_ENV)
    if not path or _import_path(os.environ.get("PYTHONPATH")) != _import_path(os.environ.get(PYTHONPATH_ENV)):
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return None
    from pipeline.cli.launcher import hand_over

    return hand_over(conn, dict(os.environ))


def _import_path(pythonpath: str | None) -> list[str]:
    """PYTHONPATH's folders but the project's own (installed in place: importable anyway; shared servers' supervisor
    adds it)."""
    project = str(Path(__file__).resolve().parent.parent)
    return [p for p in (pythonpath or "").split(os.pathsep) if p and str(Path(p).resolve()) != project]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pipeline.cli.forkserver import Program, serve
    from pipeline.runs import start_time

    socket_path, owner = Path(sys.argv[1]), int(sys.argv[2])

    def server_main() -> None:
        import openai_server

        openai_server.main()

    sys.exit(serve(socket_path, owner, start_time(owner), Program("openai_server.py", PRELOAD, server_main)))
