# One command each for a new user (see README.md). Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

# The extras (pyproject.toml): test, cuda (numba-cuda: its simulator runs the GPU tests here),
# trainer (scikit-learn's digits, SciPy), plot (matplotlib). PTX=1 adds ptx, CUDA 13's NVVM and
# NVRTC, so that a machine without a GPU compiles every kernel for a device
# (tests/kernels/test_kernels_ptx.py; without them it skips, saying why, and with PTX=1 it must
# run). PTX defaults to 1 where nvidia-smi reports a driver for CUDA 13 or later, else to nothing:
# an older driver cannot load CUDA 13's PTX.
CUDA_DRIVER := $(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n 1)
PTX    ?= $(shell [ -n "$(CUDA_DRIVER)" ] && [ "$(CUDA_DRIVER)" -ge 13 ] && echo 1)
comma  := ,
EXTRAS := test,cuda,trainer,plot$(if $(filter 1,$(PTX)),$(comma)ptx)
STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: demo test bench venv clean slurm mpi

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	$(BIN)/python -m pip install -e ".[$(EXTRAS)]"
	touch $(STAMP)

# The main job: 4 ranks train the default model on digits through the launcher.
demo: $(STAMP)
	$(BIN)/python -m runtime.launch -n 4 -m trainer

# The whole test suite (what CI runs, with PTX=1): lint (pyproject.toml [tool.ruff]), then every test.
test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(if $(filter 1,$(PTX)),RINGWEAVE_REQUIRE_PTX=1 )$(BIN)/python -m pytest -q -p no:cacheprovider

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
