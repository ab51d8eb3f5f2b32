# One command each for a new user (see README.md). Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench venv clean slurm mpi

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	$(BIN)/python -m pip install -e ".[test,cuda,ptx,plot]"
	touch $(STAMP)

# The main job: 4 ranks train the default model on digits through the launcher.
demo: $(STAMP)
	$(BIN)/python -m runtime.launch -n 4 -m trainer

# The whole test suite (what CI runs): lint (pyproject.toml [tool.ruff]), then every test.
test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider

# SLURM (slurmctld, slurmd, munge, the client commands) and Open MPI's mpirun, from Debian's
# packages: the tests in tests/scheduler/ then run a private SLURM and real mpirun jobs
# (they skip, saying why, where these are missing). Needs root (or SUDO=sudo).
SUDO ?=
SCHEDULER_PACKAGES := slurmctld slurmd slurm-client munge openmpi-bin
slurm mpi:
	$(SUDO) apt-get update
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y --no-install-recommends $(SCHEDULER_PACKAGES)

bench: $(STAMP)
	$(BIN)/python bench/p2p.py --out-dir bench/out
	$(BIN)/python bench/collectives.py --out-dir bench/out

clean:
	rm -rf $(VENV) bench/out .pytest_cache .hypothesis
