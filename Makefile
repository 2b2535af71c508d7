# The two commands: `make demo` and `make test`. Both create .venv when it is missing.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned resolve would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/relayrl demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
