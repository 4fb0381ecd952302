"""structlog set-up: JSON lines on stderr, one call per process.

structlog's configuration is process-global; this is the one place that sets it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import msgspec
import structlog


def _json(obj: Any, **_: Any) -> str:
    # msgspec: several times faster than json.dumps on every log line; what it cannot
    # encode is written as its str().
    return msgspec.json.encode(obj, enc_hook=str).decode()


def setup_logging(process: str, level: str | None = None) -> None:
    chosen = (level or os.environ.get("SANCTUM_LOG_LEVEL") or "info").upper()
    numeric = getattr(logging, chosen, logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_json),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(process=process, pid=os.getpid())
    # aiohttp and asyncio log through the standard library; keep them quiet.
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)
