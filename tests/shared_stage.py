"""A stage as `quantize eval --engine vllm` holds a shared server, for tests/test_shared_server.py: it
acquires the server for a checkpoint (tests/openai_server.py started through the same command line as
`vllm serve`), prints one JSON line (port, started or attached, server pid), then either holds it until
killed (`--hold`) or sends one request and releases it."""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.engines import shared  # noqa: E402
from pipeline.engines.http import get_ok  # noqa: E402

SERVER = [sys.executable, str(Path(__file__).with_name("openai_server.py"))]

if __name__ == "__main__":
    model, log = sys.argv[1], sys.argv[2]
    idle = float(sys.argv[sys.argv.index("--idle") + 1]) if "--idle" in sys.argv else 300.0
    keep = int(sys.argv[sys.argv.index("--max-servers") + 1]) if "--max-servers" in sys.argv else 1
    # planned memory (engine.kv_cache_memory: fitted): this server's bytes and the budget of the servers together
    memory = {name: int(sys.argv[sys.argv.index(flag) + 1]) for name, flag in (("gpu_bytes", "--gpu-bytes"),
                                                                                ("gpu_budget", "--gpu-budget"))
              if flag in sys.argv}
    lease = shared.acquire([*SERVER, model, "--served-model-name", "model"], "--port", model_dir=Path(model),
                           log_path=Path(log), start_timeout=120, idle_timeout=idle, max_servers=keep, **memory)
    print(json.dumps({"port": lease.port, "started": lease.started, "server_pid": lease.server_pid,
                      "start_seconds": lease.start_seconds, "owner": lease.owner, "key": lease.key,
                      "healthy": get_ok(lease.base_url + "/health")}), flush=True)
    if "--hold" in sys.argv:
        time.sleep(3600)
    lease.release()
