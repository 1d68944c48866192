# Every target sets up .venv first when it is missing, so each works on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The pinned releases setup installs, and make wheelhouse downloads.
PINS := "torch==2.14.1" "torchvision==0.29.1"

.PHONY: setup demo test lab bench gpu-check lint clean wheelhouse

setup: $(STAMP)

# PYTHONWARNINGS: setuptools warns that a folder named like the package may shadow it on
# import; here that folder is the package itself (an editable install of this clone).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet $(PINS) \
		-e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -c "import ddpnb, torch, torchvision, papermill, ipywidgets, sklearn"
	$(PY) -m ipykernel install --sys-prefix --name python3 > /dev/null
	touch $(STAMP)

demo: setup
	$(PY) -m ddpnb.demo --out runs/demo

# Two pytest-xdist workers: on 2 cores one's tests compute while the other's wait (sshd,
# Slurm, the browser, pip, hang and rendezvous timeouts). Groups and their order: tests/conftest.py.
TEST_WORKERS ?= 2
test: setup lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=20 tests

lint: setup
	$(PY) -m ruff check ddpnb tests notebooks bench
	$(PY) -m ruff format --check ddpnb tests notebooks bench

# Participants work on copies in $(LAB_DIR)/ (git-ignored): JupyterLab's autosave never
# touches the tracked notebooks/, so `git status` stays clean and `git pull` never conflicts.
# A notebook is copied only when its copy is missing (delete a copy for a fresh one; new
# notebooks arrive after a pull); so is solutions/, the exercises' solutions. The overrides
# turn off JupyterLab's news and update pop-ups (a participant can turn them on again in
# Settings). Loopback only; the URL with its token is printed. As root (containers)
# JupyterLab refuses to start without --allow-root.
# The server runs in $(LAB_DIR) with .venv/bin first on PATH: JupyterLab's terminals open
# there (it asks for a folder relative to the server's own), with `ddpnb` and `python` the
# venv's, so the README's commands typed there find the notebooks' data/ and runs/.
# LAB_ARGS adds JupyterLab options (the browser test passes its port and token).
LAB_DIR ?= workshop
LAB_ARGS ?=
LAB_OVERRIDES = $(VENV)/share/jupyter/lab/settings/overrides.json
lab: setup
	mkdir -p "$(LAB_DIR)" "$(dir $(LAB_OVERRIDES))"
	printf '%s\n' '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}' > "$(LAB_OVERRIDES)"
	for nb in notebooks/*.ipynb; do test -e "$(LAB_DIR)/$${nb##*/}" || cp "$$nb" "$(LAB_DIR)/"; done
	test -e "$(LAB_DIR)/solutions" || cp -R notebooks/solutions "$(LAB_DIR)/"
	cd "$(LAB_DIR)" && exec env PATH="$(abspath $(VENV))/bin:$$PATH" "$(abspath $(VENV))/bin/jupyter" \
		lab --ip=127.0.0.1 --ServerApp.root_dir=. --no-browser \
		--LabApp.news_url=None $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# An offline room: every wheel setup installs (pip itself, the build backend of the editable
# install and the test extra included), for this machine's OS, CPU and Python, downloaded into
# $(WHEELHOUSE)/ (git-ignored; needs only a bare .venv for its pip). Then, with no network:
#   PIP_NO_INDEX=1 PIP_FIND_LINKS=/abs/path/to/wheelhouse make lab
# Wheels only (--only-binary): nothing has to be built offline. The stamp makes a second run a
# no-op until pyproject.toml or this file changes (pip skips wheels it already saved).
WHEELHOUSE ?= wheelhouse
wheelhouse: $(WHEELHOUSE)/.complete

$(WHEELHOUSE)/.complete: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip download --only-binary=:all: --dest "$(WHEELHOUSE)" pip "setuptools>=64" \
		$(PINS) ".[test]"
	touch $@

bench: setup
	$(PY) bench/run.py

# Where a GPU is lent: the worker on nccl/bf16, its speed, and the hang watch on NCCL
# (under 5 min on one H200, and 2 more for the hang).
# Without CUDA it says so and exits 77 (nothing checked). `make gpu-check GPU_CHECK_ARGS=--record`
# appends the figures to bench/results.md. With no network for setup, run
# `python3 bench/gpu_check.py` with the machine's own torch: the repo needs no install.
gpu-check: setup
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf runs .pytest_cache
