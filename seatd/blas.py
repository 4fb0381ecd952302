"""An optimized BLAS for MLX's CPU backend on Linux.

The `mlx[cpu]` wheel links the reference BLAS (about 5 GFLOP/s on a 64x512x1536
matmul); preloading OpenBLAS into the worker gives about 25x that.  seatd looks
for it and preloads it when present; the worker reports which one it runs on.
On macOS MLX uses Accelerate and the GPU, and nothing here applies.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def find_openblas(candidates: tuple[str, ...] = OPENBLAS_CANDIDATES) -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    override = os.environ.get("SANCTUM_OPENBLAS")
    if override is not None:
        return override if override and Path(override).exists() else None
    for path in candidates:
        if Path(path).exists():
            return path
    return None


def worker_env(base: dict[str, str]) -> dict[str, str]:
    """The environment for a worker: OpenBLAS preloaded where it exists."""
    env = dict(base)
    blas = find_openblas()
    if blas is not None:
        preload = env.get("LD_PRELOAD", "")
        if blas not in preload.split(":"):
            env["LD_PRELOAD"] = f"{blas}:{preload}" if preload else blas
    return env


def loaded_blas() -> str:
    """Which BLAS this process has mapped: `openblas`, `reference` or `accelerate`."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    if "openblas" in maps:
        return "openblas"
    if "libblas" in maps:
        return "reference"
    return "unknown"
