"""structlog set-up, one call per process: lines for people on a terminal, JSON for machines.

structlog's configuration is process-global; this is the one place that sets it.

Which format (`choose_format`, pure): `SANCTUM_LOG_FORMAT=json|human` decides when
set.  Otherwise a person is reading when stderr is a terminal and the process is not
a launchd job: human lines then, JSON lines in every other case (piped, redirected
to a file, under launchd).  launchd sets `XPC_SERVICE_NAME` to the job's label
(`com.sanctum.seatd`); an interactive macOS shell has it too, set to `0`, and a
terminal app started from the Dock may carry `application.<bundle id>...`, so only
other values count as launchd.  Our plists send stderr to a file anyway, so this
only decides for a job whose stderr is a terminal.

Human lines: `18:04:05 [info     ] worker:demo model_loaded      path=... seconds=1.2`
(local time, level, process, event, key=values), coloured only on a terminal and
only when `NO_COLOR` is unset or empty (no-color.org).  Every process of `sanctum up`
shares its terminal, so all of them choose the same way.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import msgspec
import structlog
from structlog.typing import Processor

FORMAT_ENV = "SANCTUM_LOG_FORMAT"
FORMATS = ("json", "human")
LAUNCHD_ENV = "XPC_SERVICE_NAME"


def _json(obj: Any, **_: Any) -> str:
    # msgspec: several times faster than json.dumps on every log line; what it cannot
    # encode is written as its str().
    return msgspec.json.encode(obj, enc_hook=str).decode()


def under_launchd(env: Mapping[str, str]) -> bool:
    """Whether this process is a launchd job (its label in XPC_SERVICE_NAME)."""
    name = env.get(LAUNCHD_ENV, "")
    return name not in ("", "0") and not name.startswith("application.")


def choose_format(env: Mapping[str, str], isatty: bool) -> str:
    """`json` or `human` for this process's stderr."""
    forced = env.get(FORMAT_ENV, "").strip().lower()
    if forced in FORMATS:
        return forced
    return "human" if isatty and not under_launchd(env) else "json"


def use_colour(env: Mapping[str, str], isatty: bool) -> bool:
    return isatty and not env.get("NO_COLOR")


def _process_first(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> Any:
    # Human lines read "time level process event k=v": the process goes before the
    # event; the pid is for machines (and `sanctum status`).
    process = event_dict.pop("process", None)
    event_dict.pop("pid", None)
    if process:
        event_dict["event"] = f"{process} {event_dict.get('event', '')}"
    return event_dict


def processors(fmt: str, colours: bool) -> list[Processor]:
    """The processor chain of one format, its renderer last."""
    common: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
    ]
    if fmt == "human":
        return [*common,
                structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
                _process_first,
                structlog.dev.ConsoleRenderer(
                    colors=colours, pad_event_to=40,
                    exception_formatter=structlog.dev.plain_traceback)]
    return [*common,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_json)]


def setup_logging(process: str, level: str | None = None) -> None:
    chosen = (level or os.environ.get("SANCTUM_LOG_LEVEL") or "info").upper()
    numeric = getattr(logging, chosen, logging.INFO)
    try:
        isatty = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr: not a person
        isatty = False
    fmt = choose_format(os.environ, isatty)
    structlog.configure(
        processors=processors(fmt, use_colour(os.environ, isatty)),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(process=process, pid=os.getpid())
    # aiohttp and asyncio log through the standard library; keep them quiet.
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)
    asked = os.environ.get(FORMAT_ENV, "").strip().lower()
    if asked and asked not in FORMATS:
        structlog.get_logger().warning("log_format_unknown", asked=asked, using=fmt,
                                       known=list(FORMATS))
