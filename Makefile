# Two entry points: `make demo` (build, evaluate, report on the demo model) and `make test`; `make docs` builds the docs site.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# the PATH of the shell that ran make (before .venv/bin joins it): the demo's closing lines name the activation a
# new shell needs for the commands they suggest (pipeline/console.py run_hint)
SHELL_PATH := $(PATH)
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: demo test docs install constraints gpu-install system-deps sandbox-deps clean-demo example-report example-cards example-gpu-report

# torch 2.13.0 is the CPU build these machines take from local disk (pyproject.toml pins no torch, so a
# GPU machine keeps its CUDA build).
CPU_TORCH := torch==2.13.0

# constraints.txt: every package at one version (pip freeze of a working .venv), so a fresh clone installs what the
# committed figures were computed with; `make constraints` writes it again after a change to the dependencies.
LOCK := -c constraints.txt

$(BIN)/quantize: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(LOCK) -e '.[quantize,dev]' '$(CPU_TORCH)'
	touch $@

install: $(BIN)/quantize

# On a GPU machine, in an environment that already has its CUDA torch: `make gpu-install EXTRA=vllm`
# (or lmdeploy, or quantize). The installed torch is named as a requirement, so pip picks the release of
# the extra that pins it (vLLM 0.24-0.26 for torch 2.11, 0.27+ for 2.13) instead of replacing it.
EXTRA ?= vllm
gpu-install:
	$(PY) -m pip install -e '.[$(EXTRA)]' "torch==$$($(PY) -c 'import torch; print(torch.__version__.split("+")[0])')"

# One line per stage (pipeline/cli/repro.py runs dvc repro without DVC's own progress lines; each stage's
# libraries write to .cache/logs/<stage>.log), the verdict, and the demo's wall and CPU time (QUANTIZE_STAGE_LOG:
# what each command cost, pipeline/cli/common.py).
STAGE_TIMES := .cache/demo-commands.jsonl
demo: install sandbox-deps
	@started=$$(date +%s.%N); mkdir -p .cache; rm -f $(STAGE_TIMES); \
	QUANTIZE_STAGE_LOG=$(STAGE_TIMES) $(BIN)/quantize fetch-demo && \
	QUANTIZE_STAGE_LOG=$(STAGE_TIMES) QUANTIZE_SHELL_PATH='$(SHELL_PATH)' $(BIN)/python -m pipeline.cli.repro && \
	QUANTIZE_SHELL_PATH='$(SHELL_PATH)' $(BIN)/quantize show-verdict; status=$$?; \
	$(BIN)/python -m pipeline.cli.repro --times $(STAGE_TIMES) $$started; exit $$status

test: install system-deps docs
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n 2 --dist worksteal --timeout 900 --durations=20  # two workers (pytest-xdist): the two cores

# The docs site (mkdocs.yml): the `docs` extra, then a strict build into site/ (every warning an error: a broken link
# or anchor, a missing include). The reference pages are generated from the code at each build (tools/gen_docs.py).
DOCS_STAMP := $(VENV)/.docs-extra
$(DOCS_STAMP): pyproject.toml constraints.txt $(BIN)/quantize
	$(BIN)/pip install -q $(LOCK) -e '.[docs]' '$(CPU_TORCH)'
	touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site  # not --quiet: it hides the warnings --strict counts

# constraints.txt written again from .venv (its comment lines kept), after a change to pyproject.toml's dependencies
constraints: $(DOCS_STAMP)
	{ grep '^#' constraints.txt; $(BIN)/pip freeze --exclude-editable; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# After `make demo`: its report becomes the committed example (reports/example/: the page, the verdict and the model
# cards), with screenshots of the first screen at 1280 x 800 and at 390 x 844 beside it (Debian's chromium, headless,
# no network).
example-report: install system-deps
	@test -f reports/index.html -a -f reports/verdict.json -a -d reports/cards || { echo "no report yet: run make demo first"; exit 2; }
	mkdir -p reports/example
	cp -L reports/index.html reports/verdict.json reports/example/
	cp dvc.lock reports/example/dvc.lock  # the run's lock: what produced the example (the project keeps none in git)
	rm -rf reports/example/cards && cp -rL reports/cards reports/example/cards
	mkdir -p reports/example/card_inputs  # what the cards were written from, for make example-cards
	cp params.yaml models/base/source.json $$($(BIN)/python -c "from pipeline.settings.params import load; print(load().calib.out)")/stats.json reports/example/card_inputs/
	$(BIN)/python benchmarks/report_screenshots.py reports/example

# The example's model cards written again from the committed verdict and card inputs (no demo run): after a change
# to the cards' code (tests/test_model_card.py checks the committed cards are what this writes).
example-cards: $(BIN)/quantize
	$(BIN)/python benchmarks/example_cards.py reports/example

# The GPU example (reports/example-gpu/) re-rendered on the CPU from the stored copy of what the GPU run's report
# read (benchmarks/report_bundle.py pack, on the GPU machine), with its screenshots.
GPU_RESULTS ?= benchmarks/results/gpu_dvc_repro_full_inputs.tar.xz
# The run of 2026-12-02 predates kl.jsonl (the per-sequence KL lines the report checks kl.json against): its kl.json
# files are left out, and the page says KL was not measured, until the next full run on the GPU machine.
GPU_LEAVE_OUT ?= --leave-out 'results/*/kl.json'
example-gpu-report: install system-deps
	@test -f $(GPU_RESULTS) || { echo "$(GPU_RESULTS): no stored GPU results; on the GPU machine: python3 benchmarks/report_bundle.py pack /tmp/gpu-dvc/project \$$OUT/$$(basename $(GPU_RESULTS))"; exit 2; }
	$(BIN)/python benchmarks/report_bundle.py render $(GPU_RESULTS) reports/example-gpu $(GPU_LEAVE_OUT)
	$(BIN)/python benchmarks/report_screenshots.py reports/example-gpu

# bubblewrap: the code suite runs model-written code only inside it (without it, `quantize eval`
# refuses unless params.yaml says suites.code.allow_unsandboxed: true).
sandbox-deps:
	@command -v bwrap >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null) || \
	  { echo "the code suite runs model-written code in a bubblewrap sandbox: sudo apt-get install bubblewrap"; \
	    echo "(or, to run it without isolation, set suites.code.allow_unsandboxed: true in params.yaml and run: $(BIN)/quantize fetch-demo && $(BIN)/quantize repro)"; exit 1; }

# Debian packages the tests use: chromium for the report's browser test (playwright's own
# download needs a hub), poppler-utils' pdftotext to read the printed report back, bubblewrap for the code suite's sandbox.
system-deps:
	@command -v chromium >/dev/null && command -v bwrap >/dev/null && command -v pdftotext >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium bubblewrap poppler-utils >/dev/null) || \
	  { echo "make test needs Debian's chromium, bubblewrap and poppler-utils: sudo apt-get install chromium bubblewrap poppler-utils"; exit 1; }

clean-demo:
	rm -rf models results calib_data/build reports/index.html reports/verdict.json reports/.report reports/.report-* \
	  .cache/logs $(STAGE_TIMES)
