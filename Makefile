# Every target sets up .venv first when it is missing, so each works on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lab bench gpu-check lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1" -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -c "import ddpnb, torch, torchvision, papermill, ipywidgets, sklearn"
	$(PY) -m ipykernel install --sys-prefix --name python3 > /dev/null
	touch $(STAMP)

demo: setup
	$(PY) -m ddpnb.demo --out runs/demo

test: setup lint
	$(PY) -m pytest -q tests

lint: setup
	$(PY) -m ruff check ddpnb tests notebooks bench
	$(PY) -m ruff format --check ddpnb tests notebooks bench

# Loopback only; the URL with its token is printed. As root (containers) JupyterLab
# refuses to start without --allow-root.
lab: setup
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --notebook-dir=notebooks --no-browser \
		$(if $(filter 0,$(shell id -u)),--allow-root)

bench: setup
	$(PY) bench/run.py

# Where a GPU is lent: the worker on nccl/bf16 and its speed (under 5 min on one H200).
# Without CUDA it says so and exits 77 (nothing checked). `make gpu-check GPU_CHECK_ARGS=--record`
# appends the figures to bench/results.md. With no network for setup, run
# `python3 bench/gpu_check.py` with the machine's own torch: the repo needs no install.
gpu-check: setup
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf runs .pytest_cache
