"""A seat's memory: its model, the prompt cache and every row's KV under one budget.

On a Mac the weights, the prompt cache and each row's KV share one unified memory, and a
process that asks Metal for more than there is dies.  So a seat with `memory_budget_mb`
counts them together: what the process holds once its model is loaded (`in_use`: its
resident memory on the CPU, and the device's own figure of the memory MLX holds on a
GPU), a headroom for a step's activations and MLX's free-buffer cache, and what is left
for KV.  Rows are admitted within that (`seatd.kv_budget`); the rest queue on today's
queue clock and are answered 503 overloaded past it.  A seat without a memory budget
keeps `kv_budget_mb` alone.

    headroom(room) -> bytes                      activations and cached buffers
    cache_limit(room) -> bytes                   MLX's cache of freed buffers, at most
    kv_room(kv_budget, memory_budget, in_use)    the KV bytes rows and the prompt cache
        -> Room                                  may use, and why

    mlx_memory() -> {name: bytes}               what MLX holds now (the seat's gauges)

Pure; `in_use()` and `mlx_memory()` read the process.
"""

from __future__ import annotations

from dataclasses import dataclass

MB = 1024 * 1024
HEADROOM_MIN = 64 * MB
HEADROOM_MAX = 512 * MB
CACHE_FLOOR = 256 * MB  # freed buffers a seat without a memory budget may always keep


@dataclass(frozen=True)
class Room:
    kv: int  # bytes for rows in flight and the prompt cache
    headroom: int  # bytes kept for activations and MLX's cached buffers (0: no budget)
    limited: bool  # the memory budget, not kv_budget_mb, set `kv`


def headroom(room: int) -> int:
    """An eighth of what the budget leaves past the loaded model, within 64-512 MiB: a
    prefill chunk's activations and the buffers MLX keeps for reuse (a quarter of it:
    the worker sets MLX's cache limit so)."""
    return min(HEADROOM_MAX, max(HEADROOM_MIN, room // 8))


def kv_room(kv_budget: int, memory_budget: int | None, in_use: int) -> Room:
    """The KV bytes of a seat: `kv_budget` alone, or what `memory_budget` leaves past the
    model loaded (`in_use`) and the headroom, whichever is less (never below 0: a
    request alone is still admitted, bounded by the context length)."""
    if memory_budget is None:
        return Room(kv_budget, 0, False)
    spare = max(0, memory_budget - in_use)
    keep = headroom(spare)
    room = max(0, spare - keep)
    return Room(min(kv_budget, room), keep, room < kv_budget)


def cache_limit(room: Room) -> int:
    """The most MLX keeps of the seat's freed buffers for reuse (`mx.set_cache_limit`).

    Under a memory budget, a quarter of the headroom (the rest is for a step's live
    activations).  Without one, the seat's KV bytes, at least CACHE_FLOOR: a step's
    freed buffers (at most a gathered copy of the rows' KV, and activations) are reused
    by the next, while buffers of sizes the rows have grown past are handed back.  MLX's
    own limit is 95% of the device, per process: measured on an H100 with the 8B-shape
    target, each of two seats on one GPU held 15 GB of freed buffers at 8 clients (4.2
    GB live), and at 16 the processes beside them ran out of the GPU's memory.  Pure."""
    if room.headroom:
        return room.headroom // 4
    return max(CACHE_FLOOR, room.kv)


def in_use(backend: str) -> int:
    """What the process holds now: resident memory, plus MLX's device memory on a GPU
    (Metal's unified memory is not in a process's resident set)."""
    import psutil

    total = int(psutil.Process().memory_info().rss)
    if backend != "cpu":
        import mlx.core as mx

        total += int(mx.get_active_memory())
    return total


MLX_GAUGES = ("mlx_active_bytes", "mlx_cache_bytes", "mlx_peak_bytes")


def mlx_memory() -> dict[str, int]:
    """What MLX holds in this process now, by its own accounting: the buffers of live
    arrays (`mlx_active_bytes`), freed buffers it keeps for reuse (`mlx_cache_bytes`),
    and the most live at once since the process began (`mlx_peak_bytes`).  On a GPU a
    process may hold more than these (what the driver and its libraries keep); set
    beside the device's own figure for the process, they say whose memory it is."""
    import mlx.core as mx

    return {"mlx_active_bytes": int(mx.get_active_memory()),
            "mlx_cache_bytes": int(mx.get_cache_memory()),
            "mlx_peak_bytes": int(mx.get_peak_memory())}
