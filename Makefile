# Two commands set everything up from a fresh clone: `make demo` and `make test`.
# torch is pinned here, not in the package metadata: an unpinned torch resolves to a
# multi-GB CUDA build, while users elsewhere may bring any torch >= 2.3.
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
READY := $(VENV)/.ready

.PHONY: demo test lint clean

$(READY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,data,plots]"
	touch $@

demo: $(READY)
	$(VENV)/bin/microsparse train --workers 4 --out runs/demo

test: $(READY)
	$(PY) -m pytest tests src/microsparse

lint: $(READY)
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) runs
