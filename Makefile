VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup up test lint

setup:
	@sh deploy/setup.sh $(VENV)

up: setup
	$(VENV)/bin/sanctum up

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check shared seatd proxyd sanctum tests
	$(VENV)/bin/mypy shared seatd/states.py seatd/stops.py proxyd/ladder.py
