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
    kv_room(kv_budget, memory_budget, in_use)    the KV bytes rows and the prompt cache
        -> Room                                  may use, and why
    cache_limit(room, backend) -> bytes | None   the freed buffers MLX may keep

MLX keeps freed buffers for reuse, by default up to its whole memory limit (on CUDA 95%
of the card).  Where one process has the device that is harmless; on a card several
processes share (CUDA: each seat is a process, and each process's MLX takes 95% of the
card for its own) the buffers one process keeps are memory the others cannot have, and
none gives them back until its own allocations fail.  A seat's KV grows by new buffers
of new sizes (a batch's rows joining, its capacity's steps), each kept once freed: through
the batching bench on an H100 (an 8B-shape 4-bit target, two seats and three other
MLX processes on the card) the card filled (81 GB) within four client levels and a
seat's prefill failed with out of memory.  So on such a device a seat keeps at most a
quarter of the largest headroom even without a memory budget.

Pure; `in_use()` reads the process.
"""

from __future__ import annotations

from dataclasses import dataclass

MB = 1024 * 1024
HEADROOM_MIN = 64 * MB
HEADROOM_MAX = 512 * MB


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


SHARED_DEVICES = ("cuda",)  # a card that processes share, each MLX taking most of it


def cache_limit(room: Room, backend: str) -> int | None:
    """The bytes of freed buffers MLX may keep for reuse: a quarter of the headroom
    under a memory budget (the rest is for a step's live activations); without one, a
    quarter of the largest headroom on a device processes share (`SHARED_DEVICES`), and
    None elsewhere (MLX's own limit: the process has its memory to itself, or, on a
    Mac, counts it under a memory budget).  Pure."""
    if room.headroom:
        return room.headroom // 4
    return HEADROOM_MAX // 4 if backend in SHARED_DEVICES else None


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


def in_use(backend: str) -> int:
    """What the process holds now: resident memory, plus MLX's device memory on a GPU
    (Metal's unified memory is not in a process's resident set)."""
    import psutil

    total = int(psutil.Process().memory_info().rss)
    if backend != "cpu":
        import mlx.core as mx

        total += int(mx.get_active_memory())
    return total
