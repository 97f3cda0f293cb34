# `make test` and `make install` create .venv when it is missing. torch is installed first and
# pinned: an unpinned torch would pull the multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test clean

$(STAMP): setup.py requirements.txt requirements-test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt -r requirements-test.txt
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) *.egg-info
