# Two entry points: `make demo` (build, evaluate, report on the demo model) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: demo test install clean-demo

$(BIN)/quantize: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/quantize

demo: install
	$(BIN)/quantize fetch-demo
	$(BIN)/dvc repro
	$(BIN)/quantize show-verdict

test: install
	$(BIN)/pytest -q -x --timeout 900

clean-demo:
	rm -rf models results calib_data/build reports/index.html reports/verdict.json
