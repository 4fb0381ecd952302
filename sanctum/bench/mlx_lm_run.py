"""mlx_lm.server with MLX's freed-buffer cache bounded as a seat's own is.

The batching bench puts two seats, two mlx_lm.server processes and the bound's loop on
one device at once.  On a card that processes share (CUDA), each process's MLX keeps
the buffers it freed up to 95% of the card, so the first to grow takes what the others
need: with an 8B-shape target the card filled within four client levels and requests
failed with out of memory.  A seat bounds its cache there (`seatd.memory.cache_limit`,
even without a memory budget); the bench's other MLX processes take the same bound, so
every arm keeps the same (`bound_cache`), and elsewhere nothing changes.

    python -m sanctum.bench.mlx_lm_run [mlx_lm.server's arguments]
"""

from __future__ import annotations

import sys


def bound_cache() -> int | None:
    """MLX's cache limit in this process as a seat without a memory budget sets it;
    the limit set, or None where MLX keeps its own."""
    import mlx.core as mx

    from seatd.backend import backend
    from seatd.memory import Room, cache_limit

    limit = cache_limit(Room(0, 0, False), backend())
    if limit is not None:
        mx.set_cache_limit(limit)
    return limit


def main() -> None:
    bound_cache()
    from mlx_lm.server import main as serve

    sys.argv = ["mlx_lm.server", *sys.argv[1:]]
    serve()  # type: ignore[no-untyped-call]  # mlx-lm ships it unannotated


if __name__ == "__main__":
    main()
