# The two entry points of the README. Both install into .venv first (scripts/setup.sh).
SHELL := /bin/bash
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: repro test install

$(STAMP): pyproject.toml constraints.txt scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

install: $(STAMP)

# The whole pipeline on the built-in environment with params.yaml (the stages run
# scripts/python, which finds .venv by itself).
repro: $(STAMP)
	$(VENV)/bin/dvc repro

# The test suite (CPU only).
test: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" python -m pytest
