VENV ?= .venv
PY := $(VENV)/bin/python
# MLX's Linux CPU wheel links the reference BLAS; tests that run models in-process
# preload OpenBLAS like seatd does for its workers (empty, and harmless, elsewhere).
OPENBLAS := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/libopenblas.so.0 /usr/lib/aarch64-linux-gnu/libopenblas.so.0))

.PHONY: setup up test lint bench lock

# The tested versions of every dependency, with the hash of every file, for Linux and
# macOS and every Python the project supports: `make setup` installs exactly these.
# lock.txt holds MLX's CPU backend for Linux (and Metal for macOS); lock-cuda.txt the same
# set with MLX's CUDA 13 backend instead, for Linux with an NVIDIA GPU.
LOCK := requirements/lock.txt
LOCK_CUDA := requirements/lock-cuda.txt
UV_VERSION := 0.13.9
LOCK_ARGS ?= --upgrade

setup:
	@sh deploy/setup.sh $(VENV)

# Re-resolve the lock from pyproject.toml: by default the newest releases it allows
# (LOCK_ARGS= keeps the locked versions that still fit).  Then `make test`, and commit.
lock: setup
	$(PY) -m pip install -q 'uv==$(UV_VERSION)'
	$(VENV)/bin/uv pip compile pyproject.toml --extra test --extra cpu --universal \
		--python-version 3.11 --generate-hashes --no-config --custom-compile-command 'make lock' \
		-o $(LOCK) $(LOCK_ARGS)
	cp $(LOCK) $(LOCK_CUDA)  # the same versions, where both hold them
	$(VENV)/bin/uv pip compile pyproject.toml --extra test --extra cuda --universal \
		--python-version 3.11 --generate-hashes --no-config --custom-compile-command 'make lock' \
		-o $(LOCK_CUDA)

up: setup
	$(VENV)/bin/sanctum up

# The lint first, then the suite: CI runs `make test`, so it keeps both clean.
test: lint
	LD_PRELOAD=$(OPENBLAS) $(PY) -m pytest

# mypy --strict (pyproject.toml) on all four packages.
MYPY_PATHS := shared proxyd sanctum seatd

lint: setup
	$(VENV)/bin/ruff check shared seatd proxyd sanctum tests
	$(VENV)/bin/mypy $(MYPY_PATHS)

# Every comparison, interleaved, then docs/BENCHMARKS.md and its plots.
# Pass options through, e.g. make bench BENCH_ARGS="--rounds 8 --model DIR".
BENCH_ARGS ?=
bench:
	@sh deploy/setup.sh $(VENV) bench
	$(PY) -m pip install -q -e '.[bench]'
	$(VENV)/bin/sanctum bench run all --report $(BENCH_ARGS)
