"""The event loop: uvloop where it is installed, asyncio's own otherwise.

uvloop (libuv) makes every socket read, write and timer of the proxy cheaper; it
is a locked dependency on Linux and macOS, but nothing depends on it being there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the best loop available."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
