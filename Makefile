# Two entry points: `make demo` (build, evaluate, report on the demo model) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: demo test install system-deps clean-demo

$(BIN)/quantize: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/quantize

demo: install
	$(BIN)/quantize fetch-demo
	@start=$$(date +%s); $(BIN)/dvc repro && echo "dvc repro: $$(( $$(date +%s) - start )) s"
	$(BIN)/quantize show-verdict

test: install system-deps
	$(BIN)/pytest -q --timeout 900

# Debian packages the tests use: chromium for the report's browser test (playwright's own
# download needs a hub), bubblewrap for the code suite's sandbox.
system-deps:
	@command -v chromium >/dev/null && command -v bwrap >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium bubblewrap >/dev/null) || \
	  { echo "make test needs Debian's chromium and bubblewrap: sudo apt-get install chromium bubblewrap"; exit 1; }

clean-demo:
	rm -rf models results calib_data/build reports/index.html reports/verdict.json
