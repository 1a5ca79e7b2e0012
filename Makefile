# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test bench clean

$(BIN)/wbdebug: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet -c constraints.txt torch
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(BIN)/wbdebug

install: $(BIN)/wbdebug

demo: install
	WANDB_SILENT=true $(BIN)/wbdebug demo

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) wandb .pytest_cache
