"""A seat process's MLX settings: set before its first step, an operator's own kept."""

from seatd.backend import CUDA_GRAPH_CACHE, seat_environment


def test_a_seat_gives_cuda_graphs_room_unless_the_operator_chose() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    seat_environment(env)
    assert env == {"PATH": "/bin", "MLX_CUDA_GRAPH_CACHE_SIZE": str(CUDA_GRAPH_CACHE)}
    chosen = {"MLX_CUDA_GRAPH_CACHE_SIZE": "64"}
    seat_environment(chosen)
    assert chosen == {"MLX_CUDA_GRAPH_CACHE_SIZE": "64"}
