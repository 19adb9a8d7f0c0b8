# The whole set-up: `make run` (main job) and `make test` (test suite). Both are idempotent.
# `make help` lists every target with its one line (the `## ` comment after the target's name).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed
TEST_WORKERS ?= 2  # pytest-xdist workers: the CI machine has 2 cores

.PHONY: help setup run test lint goldens accuracy error-bands docs docs-check clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  make \1\t\2/' | expand -t 24

setup: $(STAMP)  ## create .venv if missing and install (idempotent)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install megatron-core==0.16.1
	$(PIP) install pytest pytest-xdist hypothesis pyyaml numpy import-linter tensorboard
	$(PIP) install --no-build-isolation -e .
	touch $(STAMP)

run: setup  ## the main job: estimate Qwen3 8B in bf16 on 64 H100
	$(VENV)/bin/vtrain estimate examples/plans/qwen3_8b_64gpu_h100.yaml

test: setup  ## the test suite (import layering included), on TEST_WORKERS processes
	@# bytecode written once: where PYTHONDONTWRITEBYTECODE is set, each CLI subprocess would compile vtrain again
	$(PY) -m compileall -q -j 0 vtrain_plugin megatron_adapters profiler benchmarks >/dev/null
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist worksteal

lint: setup  ## pyflakes and the import-linter layer contract, where installed
	@if $(PY) -m pyflakes --version >/dev/null 2>&1; then $(PY) -m pyflakes vtrain_plugin megatron_adapters profiler tests benchmarks; \
	else echo "pyflakes not installed: skipped ($(PIP) install pyflakes)"; fi
	@if test -x $(VENV)/bin/lint-imports; then $(VENV)/bin/lint-imports; else echo "import-linter not installed: skipped"; fi

goldens: setup  ## the headline numbers pinned in tests/golden
	$(PY) -m pytest tests/golden

accuracy: setup  ## every published run against its measured time, then the joint fit's held-out report
	$(PY) -m benchmarks.accuracy.published_runs
	$(PY) -m benchmarks.accuracy.calibrate --dry-run

error-bands: setup  ## rewrite the error-band file from every published run (after any calibration change)
	$(PY) -m benchmarks.accuracy.error_bands

docs: setup  ## rewrite the generated tables of README.md, docs/inputs.md and docs/layout.md
	$(PY) -m vtrain_plugin.cli.support_table --write

docs-check: setup  ## run every example of README.md and docs/, and check the generated tables
	$(PY) -m pytest tests/docs

clean:  ## remove the virtual environment
	rm -rf $(VENV) *.egg-info
