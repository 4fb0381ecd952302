"""structlog set-up: JSON lines on stderr, one call per process.

structlog's configuration is process-global; this is the one place that sets it.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def setup_logging(process: str, level: str | None = None) -> None:
    chosen = (level or os.environ.get("SANCTUM_LOG_LEVEL") or "info").upper()
    numeric = getattr(logging, chosen, logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(process=process, pid=os.getpid())
    # aiohttp and asyncio log through the standard library; keep them quiet.
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)
