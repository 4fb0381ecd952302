#!/bin/sh
# Set up everything Sanctum needs on this machine: system packages where the
# platform has them, then a virtual environment with Sanctum installed in it.
#   deploy/setup.sh [VENV] [bench]     (default: .venv; `bench` adds what benchmarks need)
set -eu
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
WANT=${2:-}

# MLX's backend: Metal on macOS; on Linux CUDA where an NVIDIA driver supports CUDA 13,
# else the CPU; SANCTUM_MLX=cpu|cuda forces it (deploy/mlx_backend.py says why it chose).
BOOT=""
for cand in python3 python3.13 python3.12 python3.11; do
    if command -v "$cand" >/dev/null 2>&1; then BOOT=$cand; break; fi
done
[ -n "$BOOT" ] || { echo "setup: Python 3.11 or newer is required" >&2; exit 1; }
MLX_BACKEND=$("$BOOT" deploy/mlx_backend.py)

case "$(uname -s)" in
Linux)
    # MLX's CPU wheel links the reference BLAS; OpenBLAS makes it ~25x faster.
    if [ "$MLX_BACKEND" = cpu ] && [ ! -e /usr/lib/x86_64-linux-gnu/libopenblas.so.0 ] && [ ! -e /usr/lib/aarch64-linux-gnu/libopenblas.so.0 ] \
        && command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        [ "$(id -u)" = 0 ] || SUDO="sudo"
        echo "setup: installing OpenBLAS (libopenblas0-pthread)"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null
    fi
    # `sanctum bench run hop` compares the proxy hop with nginx's.
    if [ "$WANT" = bench ] && ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ] \
        && command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        [ "$(id -u)" = 0 ] || SUDO="sudo"
        echo "setup: installing nginx (nginx-light), for the hop benchmark"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nginx-light >/dev/null
    fi
    ;;
Darwin)
    # MLX uses Metal and Accelerate; nothing to install system-wide.
    if [ "$WANT" = bench ] && ! command -v nginx >/dev/null 2>&1 && command -v brew >/dev/null 2>&1; then
        echo "setup: installing nginx (Homebrew), for the hop benchmark"
        brew install nginx
    fi
    ;;
esac

# The virtual environment's Python: SANCTUM_PYTHON where set, else the fastest Python
# 3.11+ on the PATH, timed by deploy/interp_speed.py (why: its docstring).
PY=${SANCTUM_PYTHON:-}
if [ -z "$PY" ] && [ ! -x "$VENV/bin/python" ]; then
    echo "setup: timing the Pythons on the PATH (deploy/interp_speed.py)"
    PY=$("$BOOT" deploy/interp_speed.py --pick) || PY=""
fi
if [ ! -x "$VENV/bin/python" ]; then
    [ -n "$PY" ] || { echo "setup: Python 3.11 or newer (with venv and ensurepip) is required" >&2; exit 1; }
    echo "setup: creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
# Exactly the tested versions, each file checked against its hash (`make lock` writes
# the lock); then Sanctum itself, which adds nothing the lock does not hold.
# lock-cuda.txt is the same set with MLX's CUDA build (and NVIDIA's libraries) in place of
# its CPU one; the two builds install the same files, so the other one leaves first.
LOCK=requirements/lock.txt
OTHER=mlx-cuda-13
if [ "$MLX_BACKEND" = cuda ]; then LOCK=requirements/lock-cuda.txt; OTHER=mlx-cpu; fi
PIP_VERSION=26.3
STAMP="$VENV/.sanctum-installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ "$LOCK" -nt "$STAMP" ] \
        || [ "$(cat "$STAMP")" != "$MLX_BACKEND" ]; then
    echo "setup: installing the locked versions ($LOCK) into $VENV"
    # pip itself at a tested version, as the lock pins the rest (a venv's own pip is
    # as old as its Python's ensurepip)
    "$VENV/bin/python" -m pip install -q "pip==$PIP_VERSION"
    "$VENV/bin/python" -m pip uninstall -q -y "$OTHER" 2>/dev/null || true
    "$VENV/bin/python" -m pip install -q --require-hashes -r "$LOCK"
    "$VENV/bin/python" -m pip install -q --no-deps -e .
    echo "$MLX_BACKEND" > "$STAMP"
fi
