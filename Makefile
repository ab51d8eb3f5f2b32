# One command each for a new user (see README.md). Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

# The extras (pyproject.toml): test, cuda (numba-cuda: its simulator runs the GPU tests here),
# trainer (scikit-learn's digits, SciPy), plot (matplotlib), ptx (CUDA 13's NVVM and NVRTC, so
# that a machine without a GPU compiles every kernel for a device: tests/kernels/test_kernels_ptx.py).
# `make test` installs ptx unless PTX=0; `make demo` / `make venv` only with PTX=1, which is the
# default where nvidia-smi reports a driver for CUDA 13 or later (an older one cannot load its PTX).
CUDA_DRIVER := $(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n 1)
PTX    ?= $(shell [ -n "$(CUDA_DRIVER)" ] && [ "$(CUDA_DRIVER)" -ge 13 ] && echo 1)
comma  := ,
EXTRAS := test,cuda,trainer,plot$(if $(filter 1,$(PTX)),$(comma)ptx)
STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
TEST_EXTRAS := test,cuda,trainer,plot$(if $(filter 0,$(PTX)),,$(comma)ptx)
TEST_STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(TEST_EXTRAS))

.PHONY: demo test bench venv clean slurm mpi

venv: $(STAMP)

$(VENV)/.installed-%: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	$(BIN)/python -m pip install -e ".[$(subst -,$(comma),$*)]"
	touch $@

# The main job: 4 ranks train the default model on digits through the launcher.
demo: $(STAMP)
	$(BIN)/python -m runtime.launch -n 4 -m trainer

# The whole test suite (what CI runs): the system packages (sysdeps), lint (pyproject.toml
# [tool.ruff]), the library's bytecode compiled once (where PYTHONDONTWRITEBYTECODE is set, each of
# the suite's hundreds of launched ranks would otherwise compile it again), then every test, in three
# parts (tests/conftest.py): the tests not marked serial on TEST_WORKERS cores at once (pytest-xdist;
# each file, and the simulator's wrappers together, on one worker); then the serial ones that are not
# alone, two at a time: they run jobs with deadlines that hold with one other test beside them (SERIAL);
# then the alone ones, one at a time: they assert wall-clock bounds or detect a fault within a tight
# deadline (ALONE). Every part runs; any failing fails `make test`. The tests install the ptx extra
# too (PTX=0 leaves it out) and then require it: the PTX test compiles every kernel for a device on a
# machine without one.
TEST_WORKERS ?= 2
PYTEST := $(if $(filter 0,$(PTX)),,RINGWEAVE_REQUIRE_PTX=1 )$(BIN)/python -m pytest -q -p no:cacheprovider
test: $(TEST_STAMP) sysdeps
	$(BIN)/python -m ruff check .
	$(BIN)/python -m compileall -q runtime collectives trainer tools bench ringweave_torch >/dev/null
	@status=0; \
	echo '$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not serial"'; \
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not serial" || status=$$?; \
	echo '$(PYTEST) -n 2 --dist loadfile -m "serial and not alone"'; \
	$(PYTEST) -n 2 --dist loadfile -m "serial and not alone" || status=$$?; \
	echo '$(PYTEST) -m alone'; \
	$(PYTEST) -m alone || status=$$?; \
	exit $$status

# SLURM (slurmctld, slurmd, munge, the client commands) and Open MPI's mpirun, from Debian's
# packages: the tests in tests/scheduler/ then run a private SLURM and real mpirun jobs
# (they skip, saying why, where these are missing). Needs root (or SUDO=sudo).
SUDO ?=
SCHEDULER_PACKAGES := slurmctld slurmd slurm-client munge openmpi-bin
slurm mpi:
	$(SUDO) apt-get update
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y --no-install-recommends $(SCHEDULER_PACKAGES)

# What the SLURM, Open MPI and emulated-host tests need from the system (tests/scheduler,
# tests/multinode, tests/bench/test_netem_smoke.py): SLURM with munge, Open MPI, iproute2, util-linux,
# iptables (the emulated hosts' delay line where the kernel has no netem qdisc).
# `make test` runs this first, so CI runs those tests. It looks for each command and, as root (or
# with SUDO=sudo) where apt-get is, installs the packages of the missing ones through `make slurm`
# (an install that fails stops `make test`); elsewhere it names them and goes on, and those tests
# skip saying why. With everything there it returns at once.
SYSDEPS := munged:munge slurmctld:slurmctld slurmd:slurmd srun:slurm-client sbatch:slurm-client \
	scontrol:slurm-client mpirun:openmpi-bin ip:iproute2 tc:iproute2 unshare:util-linux iptables:iptables
.PHONY: sysdeps
sysdeps:
	@export PATH="$$PATH:/usr/sbin:/sbin"; \
	missing=$$(for dep in $(SYSDEPS); do command -v $${dep%%:*} >/dev/null 2>&1 || echo $${dep#*:}; done \
		| sort -u | xargs); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if { [ "$$(id -u)" = 0 ] || [ -n "$(SUDO)" ]; } && command -v apt-get >/dev/null 2>&1; then \
		echo "sysdeps: installing $$missing"; \
		$(MAKE) --no-print-directory slurm SCHEDULER_PACKAGES="$$missing"; \
	else \
		echo "sysdeps: $$missing not installed (needs root and apt-get: \`make sysdeps\` as root, or install" \
			"them); the SLURM, Open MPI and emulated-host tests skip"; \
	fi

bench: $(STAMP)
	$(BIN)/python bench/p2p.py --out-dir bench/out
	$(BIN)/python bench/collectives.py --out-dir bench/out

clean:
	rm -rf $(VENV) bench/out .pytest_cache .hypothesis
