"""A seat process's MLX settings: set before its first step, an operator's own kept."""

from pathlib import Path

import mlx.core as mx

from seatd.backend import CUDA_GRAPH_CACHE, seat_environment


def test_a_seat_gives_cuda_graphs_room_unless_the_operator_chose() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    seat_environment(env, gpu="")
    assert env == {"PATH": "/bin", "MLX_CUDA_GRAPH_CACHE_SIZE": str(CUDA_GRAPH_CACHE)}
    chosen = {"MLX_CUDA_GRAPH_CACHE_SIZE": "64"}
    seat_environment(chosen, gpu="metal")
    assert chosen == {"MLX_CUDA_GRAPH_CACHE_SIZE": "64"}


def test_on_cuda_a_seat_keeps_compiled_kernels_in_the_users_cache_by_mlx_and_device(
        tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    seat_environment(env, gpu="cuda", device="NVIDIA H100 80GB HBM3")
    want = tmp_path / "sanctum" / "mlx-ptx" / str(getattr(mx, "__version__", "unknown")) \
        / "NVIDIA-H100-80GB-HBM3"
    assert env["MLX_PTX_CACHE_DIR"] == str(want)
    other = {"XDG_CACHE_HOME": str(tmp_path)}
    seat_environment(other, gpu="cuda", device="NVIDIA H200")
    assert other["MLX_PTX_CACHE_DIR"] != env["MLX_PTX_CACHE_DIR"]  # one folder per device
    chosen = {"MLX_PTX_CACHE_DIR": "/srv/ptx"}
    seat_environment(chosen, gpu="cuda", device="NVIDIA H200")
    assert chosen["MLX_PTX_CACHE_DIR"] == "/srv/ptx"  # the operator's own
    assert not any(tmp_path.iterdir())  # a setting only: MLX makes the folder when it compiles
