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

Writing (`LineSink`): a line written on a thread that runs an event loop waits for the
loop's next turn, and every line of that turn goes out in one write (a proxy answering a
thousand requests a second writes a line each; one write per line cost 35 us of each
under load).  A line from any other thread, or with no loop running, is written at once,
after those waiting; whatever waits is written at exit.

Where: stderr, unless `SANCTUM_LOG_FILE` names a file (the system LaunchDaemons set it:
`/Library/Logs/Sanctum/seatd.log`); lines are appended to it, and when the file at that
path is no longer the one open (newsyslog renamed it to rotate it) it is opened again,
checked at most once a second (`ReopeningFile`).  A seat worker inherits the variable and
appends to its seatd's file.

Human lines: `18:04:05 [info     ] worker:demo model_loaded      path=... seconds=1.2`
(local time, level, process, event, key=values), coloured only on a terminal and
only when `NO_COLOR` is unset or empty (no-color.org).  Every process of `sanctum up`
shares its terminal, so all of them choose the same way.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

import msgspec
import structlog
from structlog.typing import Processor

FORMAT_ENV = "SANCTUM_LOG_FORMAT"
LOG_FILE_ENV = "SANCTUM_LOG_FILE"
REOPEN_CHECK_S = 1.0
FORMATS = ("json", "human")
LAUNCHD_ENV = "XPC_SERVICE_NAME"


def _json(obj: Any, **_: Any) -> str:
    # msgspec: several times faster than json.dumps on every log line; what it cannot
    # encode is written as its str().
    return msgspec.json.encode(obj, enc_hook=str).decode()


class LineSink:
    """Where a process's log lines go (see the module docstring): gathered per turn of
    the event loop of the thread that writes them, at once from anywhere else."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.waiting: list[str] = []
        # the loop a flush is due on: a loop that closed before running it leaves its
        # lines to the next loop that writes (or to any other thread, or to the exit)
        self.due: asyncio.AbstractEventLoop | None = None

    def line(self, text: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self.lock:
            self.waiting.append(text)
            if loop is None:
                self._write()
            elif self.due is not loop:
                self.due = loop
                loop.call_soon(self.flush)

    def flush(self) -> None:
        with self.lock:
            self.due = None
            self._write()

    def _write(self) -> None:
        if not self.waiting:
            return
        lines, self.waiting = self.waiting, []
        try:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not stop the process
            pass


class ReopeningFile:
    """A log file open for appending, opened again once the file at its path is another
    one (renamed away by a rotation, or removed): looked at, at most, every
    REOPEN_CHECK_S of `clock`."""

    def __init__(self, path: str, clock: Any = time.monotonic) -> None:
        self.path = path
        self.clock = clock
        self.file = self._open()
        self.checked = clock()

    def _open(self) -> TextIO:
        handle = open(self.path, "a", encoding="utf-8", buffering=1 << 16)
        info = os.fstat(handle.fileno())
        self.ident = (info.st_dev, info.st_ino)
        return handle

    def _moved(self) -> bool:
        try:
            info = os.stat(self.path)
        except OSError:
            return True
        return (info.st_dev, info.st_ino) != self.ident

    def write(self, text: str) -> int:
        now = self.clock()
        if now - self.checked >= REOPEN_CHECK_S:
            self.checked = now
            if self._moved():
                self.file.close()
                self.file = self._open()
        return self.file.write(text)

    def flush(self) -> None:
        self.file.flush()

    def isatty(self) -> bool:
        return False


class SinkLogger:
    """structlog's logger: every level is one line to the sink."""

    def __init__(self, sink: LineSink) -> None:
        self.sink = sink

    def msg(self, message: str) -> None:
        self.sink.line(message)

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def _utc_stamp(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> Any:
    # structlog's TimeStamper(fmt="iso", utc=True) as text, the seconds formatted once
    # per second: "2026-12-02T03:12:46.897359Z".
    now = time.time()
    second = int(now)
    if second != _stamp[0]:
        _stamp[0], _stamp[1] = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
    event_dict["timestamp"] = f"{_stamp[1]}.{int((now - second) * 1e6):06d}Z"
    return event_dict


_stamp: list[Any] = [-1, ""]
_sinks: list[LineSink] = []


@atexit.register
def flush_logs() -> None:
    """Write every line still waiting (at exit; before `os._exit`, which skips atexit)."""
    for sink in _sinks:
        sink.flush()


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
            _utc_stamp,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_json)]


def setup_logging(process: str, level: str | None = None) -> None:
    chosen = (level or os.environ.get("SANCTUM_LOG_LEVEL") or "info").upper()
    numeric = getattr(logging, chosen, logging.INFO)
    stream: Any = sys.stderr
    unopened = None
    if os.environ.get(LOG_FILE_ENV):
        try:
            stream = ReopeningFile(os.environ[LOG_FILE_ENV])
        except OSError as exc:  # said on stderr, once set up: the lines go there
            unopened = str(exc)
    try:
        isatty = stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr: not a person
        isatty = False
    fmt = choose_format(os.environ, isatty)
    sink = LineSink(stream)
    _sinks.append(sink)
    structlog.configure(
        processors=processors(fmt, use_colour(os.environ, isatty)),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=lambda *_: SinkLogger(sink),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(process=process, pid=os.getpid())
    # aiohttp and asyncio log through the standard library; keep them quiet.
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)
    if unopened is not None:
        structlog.get_logger().warning("log_file_unusable", error=unopened,
                                       using="stderr")
    asked = os.environ.get(FORMAT_ENV, "").strip().lower()
    if asked and asked not in FORMATS:
        structlog.get_logger().warning("log_format_unknown", asked=asked, using=fmt,
                                       known=list(FORMATS))
