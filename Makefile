# One command each for a new user (see README.md). Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	$(BIN)/python -m pip install -e ".[test,cuda,ptx,plot]"
	touch $(STAMP)

# The main job: 4 ranks train the default model on digits through the launcher.
demo: $(STAMP)
	$(BIN)/python -m runtime.launch -n 4 -m trainer

# The whole test suite (what CI runs).
test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/python bench/p2p.py --out-dir bench/out
	$(BIN)/python bench/collectives.py --out-dir bench/out

clean:
	rm -rf $(VENV) bench/out .pytest_cache .hypothesis
