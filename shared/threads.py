"""Work handed to a thread keeps the log context it is for.

structlog's bound variables (`process`, `pid`, `seat`, `request_id`) live in
contextvars, and a thread starts with an empty context: a line written there names
nothing the process bound.  Two ways to carry them:

- `bound_pool`: a pool whose threads start bound as the thread that made it is, plus
  the bindings given (a seat's MLX thread: `seat`).  Everything run there in the
  thread's own context names its process and seat: the model loading, and the
  batch engine's loop, which serves many requests' rows at once and so names each
  row's request itself (`seatd.batch`);
- `run_in_thread`: one call in a copy of the caller's context (`loop.run_in_executor`
  runs its function in the thread's own context; `asyncio.to_thread` carries the
  caller's, but only into the default pool).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TypeVar

import structlog

T = TypeVar("T")


def bound_pool(name: str, workers: int = 1, **bindings: object) -> ThreadPoolExecutor:
    """A pool of `workers` threads named `name`, each bound at its start to the
    creating thread's structlog variables (read now) and `bindings`."""
    bound = {**structlog.contextvars.get_contextvars(), **bindings}
    return ThreadPoolExecutor(
        workers, thread_name_prefix=name,
        initializer=functools.partial(structlog.contextvars.bind_contextvars, **bound))


async def run_in_thread(executor: Executor | None, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in `executor`, in a copy of the caller's context (its log bindings)."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    return await loop.run_in_executor(executor, ctx.run, fn, *args)
