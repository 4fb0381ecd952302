"""proxyd in a thread of the test process, on a clock the test moves.

The rigs start proxyd as a real process; a test whose subject is time (a breaker's
cool-down) starts it here instead, with a `ManualClock`, and advances the clock
instead of sleeping.  It looks like the process to the rigs: `poll()` is None
while it serves, `stop()` ends it, and its log lines go to `log` as JSON lines.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from proxyd.app import make_app
from shared.clock import ManualClock
from shared.config import listen_address, load_config


class ProxyThread:
    def __init__(self, config: Path, env: dict[str, str], log: Path,
                 clock: ManualClock) -> None:
        self.clock = clock
        self.pid = os.getpid()  # not a child: nothing to prove gone
        self._env = env
        self._saved_env = dict(os.environ)
        os.environ.update(env)  # the state dir and keys, read at start-up
        self._log = open(log, "w", buffering=1)
        self._saved_log = structlog.get_config()
        structlog.configure(
            processors=[structlog.contextvars.merge_contextvars,
                        structlog.processors.add_log_level,
                        structlog.processors.JSONRenderer()],
            logger_factory=structlog.PrintLoggerFactory(file=self._log),
            cache_logger_on_first_use=False)
        self._config = load_config(config)
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise AssertionError(f"proxyd thread did not start: {self._error!r}")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            host, port = listen_address(self._config)
            self._runner = web.AppRunner(make_app(self._config, self.clock),
                                         handle_signals=False, access_log=None,
                                         shutdown_timeout=2.0)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.TCPSite(self._runner, host, port).start())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else 0

    def stop(self) -> None:
        if self._thread.is_alive() and self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(20)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()
        structlog.configure(**self._saved_log)
        self._log.close()
        os.environ.clear()
        os.environ.update(self._saved_env)

    # The rigs treat their proxy like a Popen.
    def send_signal(self, signum: Any) -> None:
        self.stop()

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        return 0

    def kill(self) -> None:
        self.stop()
