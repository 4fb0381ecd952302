"""Work handed to a thread keeps the context of the request it is for.

`loop.run_in_executor` runs its function in the thread's own context, so the
structlog variables a request bound (`request_id`, `seat`) are missing from every
log line written there; `asyncio.to_thread` carries them, but only into the
default pool.  A seat's MLX work must run on its one long-lived thread
(DESIGN.md), so it goes through `run_in_thread`, which carries the caller's
context into any executor.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")


async def run_in_thread(executor: Executor | None, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in `executor`, in a copy of the caller's context (its log bindings)."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    return await loop.run_in_executor(executor, ctx.run, fn, *args)
