"""Log context reaches the thread that does a request's work."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import structlog

from shared.threads import run_in_thread


async def test_bound_request_id_and_seat_reach_the_executor_thread() -> None:
    """What a request bound is bound in its MLX thread too; the bare executor call
    (the behaviour run_in_thread replaces) loses it."""
    pool = ThreadPoolExecutor(1)
    try:
        with structlog.contextvars.bound_contextvars(request_id="r1", seat="brain"):
            carried = await run_in_thread(pool, structlog.contextvars.get_contextvars)
            bare = await asyncio.get_running_loop().run_in_executor(
                pool, structlog.contextvars.get_contextvars)
        assert carried["request_id"] == "r1" and carried["seat"] == "brain"
        assert "request_id" not in bare
    finally:
        pool.shutdown()


async def test_log_lines_written_in_the_thread_name_the_request() -> None:
    pool = ThreadPoolExecutor(1)
    log = structlog.get_logger()
    try:
        with structlog.testing.capture_logs(
                processors=[structlog.contextvars.merge_contextvars]) as logs:
            with structlog.contextvars.bound_contextvars(request_id="r2"):
                await run_in_thread(pool, log.info, "prefill_chunk")
        assert logs == [{"event": "prefill_chunk", "log_level": "info", "request_id": "r2"}]
    finally:
        pool.shutdown()
