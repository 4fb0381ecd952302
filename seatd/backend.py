"""Which MLX backend computes in this process, and what the seat calls its device.

    backend() -> "cpu" | "metal" | "cuda"     where the default device's work runs
    device_name() -> str                      e.g. "NVIDIA H200", "Apple M4", "cpu (AMD EPYC)"
    seat_environment(environ)                 a seat process's MLX settings, before its
                                              first step (an operator's own win)

A backend decides more than speed here: which fused kernels exist (MLX 0.32's CUDA build
has no 8-bit quantized matmul for attention's batched shapes) and what a multi-query
attention costs the first time it sees a shape (`seatd.rows_attention`).  The answer
follows the default device, so a test that moves it to the CPU is answered for the CPU.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx

# MLX's CUDA backend records a step's kernels as CUDA graphs and keeps this many of them
# instantiated (its own default: 100).  A speculating seat runs many more shapes than a
# plain one (drafter steps, verify blocks of each width, a one-query attention over each
# prefix of a block); on an H200 its own plain steps measured 2.2-2.9 ms with 100
# against 1.5-2.2 ms with this (medians per run and temperature: two runs before, four
# after, not interleaved, with other changes between), the plain seat's being about
# 1.6 ms.  Only the CUDA backend reads it.
CUDA_GRAPH_CACHE = 2048


def seat_environment(environ: MutableMapping[str, str] = os.environ,
                     gpu: str | None = None, device: str | None = None) -> None:
    """MLX settings for a seat process, set before its first step; a value the operator
    set stays.  `gpu`, `device`: this process's GPU backend and device name (default:
    asked of MLX).

    On CUDA, MLX compiles its kernels with NVRTC at their first use and keeps them in
    `MLX_PTX_CACHE_DIR`, by default under the system's temporary directory, which a
    reboot empties: a speculating seat's warm-up (`seatd.warm_shapes`), which compiles
    most of them, took 104 s on a fresh H100.  A seat keeps them in the user's cache
    directory instead, one folder per MLX version and device (kernels built for one
    GPU architecture must not be handed to another)."""
    environ.setdefault("MLX_CUDA_GRAPH_CACHE_SIZE", str(CUDA_GRAPH_CACHE))
    if (gpu if gpu is not None else _gpu_kind()) == "cuda":
        environ.setdefault("MLX_PTX_CACHE_DIR", str(ptx_cache_dir(
            environ, device if device is not None else device_name())))


def ptx_cache_dir(environ: Mapping[str, str], device: str) -> Path:
    """Where a seat keeps MLX's compiled CUDA kernels for this MLX and device: under
    `XDG_CACHE_HOME` (default ~/.cache).  Pure but for the home directory."""
    base = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", device).strip("-") or "gpu"
    return base / "sanctum" / "mlx-ptx" / str(getattr(mx, "__version__", "unknown")) / slug


@cache
def _gpu_kind() -> str:
    """The GPU backend MLX was built with: "cuda", "metal", or "" (none)."""
    cuda: Any = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return ""


def backend() -> str:
    if mx.default_device() == mx.cpu:
        return "cpu"
    return _gpu_kind() or "cpu"


def device_name() -> str:
    """The device as MLX names it (the CPU's model beside "cpu")."""
    try:
        info: dict[str, Any] = dict(mx.device_info())
    except Exception:  # an MLX without device_info: the backend alone
        info = {}
    name = str(info.get("device_name", "")).strip()
    if backend() == "cpu":
        return f"cpu ({name})" if name else "cpu"
    return name or backend()
