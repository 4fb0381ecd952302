"""A real seat worker driven in process: the demo model loaded on its MLX thread, its
engine running, its ROUTER socket replaced by a `Recorder` of the frames it sends.

    worker = demo_worker(state_dir, "max_prompt_tokens = 64")
    async def scenario():
        async with serving(worker) as served:
            worker.sock = sock
            worker.handle(b"peer", request)
            served.prepare()                # the worker's preparer, from now on
            await sock.finals(1)
    drive(worker, scenario())               # and its threads shut down after
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared import protocol


class Recorder:
    """The worker's ROUTER socket, keeping the frames it is given and each Final."""

    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.final: dict[str, protocol.Final] = {}
        self.changed = asyncio.Event()

    def send_multipart(self, parts: list[bytes]) -> None:
        frame = protocol.reply_decoder.decode(parts[1])
        self.frames.append(frame)
        if isinstance(frame, protocol.Final):
            self.final[frame.request_id] = frame
            self.changed.set()

    async def finals(self, n: int) -> None:
        """Until n requests have their Final."""
        while len(self.final) < n:
            self.changed.clear()
            await self.changed.wait()


def demo_worker(state: Path, seat_lines: str = "max_prompt_tokens = 1536") -> Any:
    """A `SeatWorker` for a seat of the demo model (fp16 KV) with these lines added."""
    from seatd.worker import SeatWorker
    from shared.config import parse_config

    config = parse_config(
        f'[seatd]\nstate_dir = "{state}"\n[[seat]]\nname = "demo"\n'
        f'model = "builtin:demo"\nkv = "fp16"\n{seat_lines}\n'
        '[[route]]\nmodel = "demo"\nladder = ["demo"]\n')
    return SeatWorker(config, config.seat_by_name("demo"))


@dataclass
class Served:
    worker: Any
    engine: Any
    preparer: asyncio.Task[None] | None = field(default=None)

    def prepare(self) -> None:
        """Start the worker's preparer (`SeatWorker.prepared`)."""
        self.preparer = asyncio.get_running_loop().create_task(self.worker.prepared())


@asynccontextmanager
async def serving(worker: Any) -> AsyncIterator[Served]:
    """The worker's model loaded and its engine running, stopped on the way out."""
    loop = asyncio.get_running_loop()
    worker.loop = loop
    worker.loaded = await loop.run_in_executor(worker.mlx, worker.load)
    engine = worker.loaded.engine
    assert engine is not None
    server = loop.run_in_executor(worker.mlx, engine.run)
    served = Served(worker, engine)
    try:
        yield served
    finally:
        if served.preparer is not None:
            served.preparer.cancel()
        engine.stop()
        await server


def drive(worker: Any, scenario: Coroutine[Any, Any, None]) -> None:
    """Run the scenario, then shut the worker's threads down."""
    try:
        asyncio.run(scenario)
    finally:
        worker.mlx.shutdown(wait=True)
        worker.prep.shutdown(wait=True)
