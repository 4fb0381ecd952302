"""Run proxyd in the foreground until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import signal

import structlog
from aiohttp import web

from proxyd.app import make_app
from shared.config import Config, listen_address

log = structlog.get_logger()


async def run_proxy(config: Config) -> int:
    host, port = listen_address(config)
    # In-flight answers get as long as the seats' drain; launchd's ExitTimeOut is longer.
    runner = web.AppRunner(make_app(config), handle_signals=False, access_log=None,
                           shutdown_timeout=config.seatd.drain_s)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        log.error("listen_failed", host=host, port=port, error=str(exc))
        await runner.cleanup()
        return 1
    log.info("proxyd_listening", host=host, port=port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("proxyd_stopping")
    await runner.cleanup()
    return 0
