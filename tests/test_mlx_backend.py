"""`make setup`'s choice of MLX backend (deploy/mlx_backend.py): forced, by platform, by
what the NVIDIA driver supports."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "mlx_backend.py"
_spec = importlib.util.spec_from_file_location("mlx_backend", SCRIPT)
assert _spec is not None and _spec.loader is not None
mlx_backend = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mlx_backend)
choose, driver_cuda = mlx_backend.choose, mlx_backend.driver_cuda

SMI_13 = "| NVIDIA-SMI 580.95.05    Driver Version: 580.95.05    CUDA Version: 13.0     |"
SMI_12 = "| NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: 12.4     |"


@pytest.mark.parametrize(("forced", "system", "smi", "backend"), [
    (None, "Darwin", None, "metal"),
    ("cuda", "Darwin", None, "metal"),       # a Mac has Metal, whatever is asked
    (None, "Linux", None, "cpu"),            # no driver
    (None, "Linux", SMI_13, "cuda"),
    (None, "Linux", SMI_13.replace("13.0", "13.2"), "cuda"),
    (None, "Linux", SMI_12, "cpu"),          # a driver too old for mlx-cuda-13
    (None, "Linux", "NVIDIA-SMI has failed", "cpu"),
    ("cpu", "Linux", SMI_13, "cpu"),         # forced
    ("cuda", "Linux", None, "cuda"),         # forced, e.g. to build a venv for later
])
def test_the_backend_follows_the_platform_and_the_driver(
        forced: str | None, system: str, smi: str | None, backend: str) -> None:
    """Metal on macOS; on Linux cuda where the driver supports CUDA 13, else cpu; SANCTUM_MLX
    forces cpu or cuda."""
    assert choose(forced, system, smi)[0] == backend


def test_a_bad_forced_value_is_refused() -> None:
    """SANCTUM_MLX=gpu is an error that names the allowed values."""
    with pytest.raises(ValueError, match="cpu or cuda"):
        choose("gpu", "Linux", None)


def test_the_drivers_cuda_version_is_read_from_the_header() -> None:
    """nvidia-smi's header line names the CUDA version the driver supports."""
    assert driver_cuda(SMI_13) == (13, 0)
    assert driver_cuda("no version here") is None


def test_the_script_prints_its_choice() -> None:
    """Run as `make setup` runs it, forced: the choice on stdout, the reason on stderr."""
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env={"SANCTUM_MLX": "cpu", "PATH": "/usr/bin:/bin"}, check=True)
    assert done.stdout.strip() == "cpu"
    assert "SANCTUM_MLX=cpu" in done.stderr
