VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup up test lint bench

setup:
	@sh deploy/setup.sh $(VENV)

up: setup
	$(VENV)/bin/sanctum up

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check shared seatd proxyd sanctum tests
	$(VENV)/bin/mypy shared seatd/states.py seatd/stops.py seatd/prefix_cache.py proxyd/ladder.py \
		proxyd/retry.py proxyd/sse.py proxyd/hosted.py

# Every comparison, interleaved, then docs/BENCHMARKS.md and its plots.
# Pass options through, e.g. make bench BENCH_ARGS="--rounds 8 --model DIR".
BENCH_ARGS ?=
bench: setup
	$(PY) -m pip install -q -e '.[bench]'
	$(VENV)/bin/sanctum bench run all --report $(BENCH_ARGS)
