# The whole set-up: `make run` (main job) and `make test` (test suite). Both are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

.PHONY: setup run test clean

setup: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install megatron-core==0.16.1
	$(PIP) install pytest hypothesis pyyaml numpy import-linter tensorboard
	$(PIP) install --no-build-isolation -e .
	touch $(STAMP)

run: setup
	$(VENV)/bin/vtrain estimate examples/configs/gpt3_175b_512gpu.json

test: setup
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) *.egg-info
