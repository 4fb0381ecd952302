"""Which MLX backend `make setup` installs here: cpu, cuda or metal.

    python3 deploy/mlx_backend.py        prints the choice (and why, on stderr)

`SANCTUM_MLX=cpu|cuda` forces it.  Otherwise: macOS is Metal; Linux with an NVIDIA driver
that supports CUDA 13 or newer (what `nvidia-smi` says in its header, "CUDA Version: 13.0")
is cuda, since MLX's CUDA build (`mlx[cuda13]`) needs that driver; anything else is the CPU.
`choose` is pure; the shell around it runs `nvidia-smi`.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

CUDA_MAJOR = 13  # mlx-cuda-13 needs a driver for CUDA 13 or newer


def driver_cuda(smi_output: str) -> tuple[int, int] | None:
    """The CUDA version the driver supports, from `nvidia-smi`'s header; None: not said."""
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", smi_output)
    return (int(found.group(1)), int(found.group(2))) if found else None


def choose(forced: str | None, system: str, smi_output: str | None) -> tuple[str, str]:
    """(backend, why).  `forced`: SANCTUM_MLX; `system`: platform.system(); `smi_output`:
    what `nvidia-smi` printed (None: it is not there or failed)."""
    if system == "Darwin":
        return "metal", "macOS: MLX on Metal"
    if forced:
        if forced not in ("cpu", "cuda"):
            raise ValueError(f"SANCTUM_MLX must be cpu or cuda, not {forced!r}")
        return forced, f"SANCTUM_MLX={forced}"
    if smi_output is None:
        return "cpu", "no NVIDIA driver (nvidia-smi): MLX on the CPU"
    version = driver_cuda(smi_output)
    if version is None:
        return "cpu", "nvidia-smi names no CUDA version: MLX on the CPU"
    if version[0] < CUDA_MAJOR:
        return "cpu", (f"the NVIDIA driver supports CUDA {version[0]}.{version[1]}, MLX's "
                       f"CUDA build needs {CUDA_MAJOR}: MLX on the CPU")
    return "cuda", f"an NVIDIA driver for CUDA {version[0]}.{version[1]}: MLX on CUDA"


def _smi() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def main() -> int:
    system = platform.system()
    try:
        backend, why = choose(os.environ.get("SANCTUM_MLX") or None, system,
                              _smi() if system == "Linux" else None)
    except ValueError as exc:
        print(f"setup: {exc}", file=sys.stderr)
        return 2
    print(f"setup: {why}", file=sys.stderr)
    print(backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
