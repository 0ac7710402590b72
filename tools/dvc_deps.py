"""`python -m tools.dvc_deps [--write]`: whether every `quantize` stage of dvc.yaml and the profiles depends on its
command's code file (and, with --write, make it so). The code stage: pipeline/cli/code_deps.py; the derivation: code_reach.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.cli.code_deps import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
