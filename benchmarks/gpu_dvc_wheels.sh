#!/usr/bin/env bash
# DVC for the GPU machine (Python 3.12, x86-64, no network, no pip index), which the device notes' wheels.sh
# leaves out: wheels of dvc 3.67.1 and what it needs that the image and .device/wheels do not already hold,
# into .device/dvc-wheels/ (git-ignored, travels with .device). benchmarks/gpu_dvc_repro.py installs them.
#   usage, from the project root, after the device notes' wheels.sh:  benchmarks/gpu_dvc_wheels.sh [--scipy]
# typer (the `quantize` command DVC's stages call) comes along too. --scipy also writes .device-scipy/ (35 MB,
# the report's Student t; git-ignored): it does not fit in one carry with .device, so it travels in a call of
# its own if the machine lacks scipy (benchmarks/gpu_dvc_repro.py checks before it starts).
# Left out on purpose: hydra-core / omegaconf / antlr4 (only `dvc exp` with Hydra imports them, and lm-eval
# needs another antlr4), and the packages the image or the evaluation stack already provide (fsspec, pydantic,
# requests, pyyaml, packaging, typing-extensions, networkx, setuptools, ...): overriding them could break torch
# or datasets.
set -euo pipefail
dest=.device/dvc-wheels
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT  # uv installed for this run goes too, whatever fails
printf 'dvc==3.67.1\ntyper>=0.15\n' > "$tmp/req.in"
# uv resolves for the GPU machine's Python and platform (pip cannot: it evaluates dependencies' markers such as
# python_version against the Python it runs on, pypa/pip#11010): uv on PATH, or the project's .venv (`make install`:
# the dev extra), or else uv installed for this run only into the temporary folder (pip --target: no venv needed,
# and allowed where the system Python is externally managed), removed at the end
uv=$(command -v uv || true)
[ -n "$uv" ] || { [ -x .venv/bin/uv ] && uv=.venv/bin/uv; } || true
if [ -z "$uv" ]; then
  echo "uv not found: installing it into $tmp/uv for this run" >&2
  python3 -m pip install -q --disable-pip-version-check --target "$tmp/uv" uv \
    || { echo "could not install uv (python3 -m pip install --target $tmp/uv uv failed): install uv, or run make install" >&2; exit 2; }
  uv="$tmp/uv/bin/uv"
fi
# the system's certificates, as pip uses them (uv's own bundle refuses a TLS-inspecting proxy's)
export UV_NATIVE_TLS="${UV_NATIVE_TLS:-1}"
"$uv" pip compile -q "$tmp/req.in" --python-version 3.12 --python-platform x86_64-manylinux_2_28 -o "$tmp/req.txt"
skip='^(hydra-core|omegaconf|antlr4-python3-runtime|setuptools|fsspec|filelock|pyyaml|requests|urllib3|certifi|idna|charset-normalizer|packaging|typing-extensions|pydantic|pydantic-core|annotated-types|typing-inspection|tqdm|six|python-dateutil|networkx|jinja2|markupsafe)=='
grep -v '^ *#' "$tmp/req.txt" | grep -Ev "$skip" | sed 's/ *;.*//' > "$tmp/keep.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" -r "$tmp/keep.txt"
if [ "${1:-}" = "--scipy" ]; then
  mkdir -p .device-scipy
  if [ -d .git ] && ! grep -qxF "/.device-scipy/" .git/info/exclude 2>/dev/null; then echo "/.device-scipy/" >> .git/info/exclude; fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .device-scipy scipy
  du -sh .device-scipy
fi
du -sh "$dest"
# .gpu-carry/wheels (git-ignored): .device/wheels without lmdeploy's server wheels, which a vLLM run does not use, so
# that vLLM's last part, DVC's wheels, these and the checkout travel in one 64 MiB carry (docs/results/h200-run.md)
rm -rf .gpu-carry/wheels && mkdir -p .gpu-carry/wheels && cp .device/wheels/*.whl .gpu-carry/wheels/
(cd .gpu-carry/wheels && rm -f openai_harmony-* apache_tvm_ffi-* xgrammar-* pyzmq-* mmengine_lite-* fire-* yapf-* \
  addict-* shortuuid-* termcolor-*)
du -sh .gpu-carry/wheels
