"""The seat client's clocks, on a ManualClock: queue, first token, liveness.

The test plays the seat on a ROUTER socket; the client's clock moves only when the
test says, so a 120 s queue timeout takes a tenth of a second of real time (the
client looks at its deadline at least every GONE_POLL_S).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from proxyd.seat_client import SeatClient, is_alive, overdue
from shared import protocol
from shared.clock import ManualClock
from shared.protocol import Failed, Final, Generate, Pong, SamplingParams, Started

GEN = Generate("r1", True, SamplingParams(max_tokens=4), prompt="hi")


class Seat:
    """The far end: answers whatever the test tells it to, records what it got."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.peer = b""

    async def recv(self) -> protocol.Request:
        self.peer, payload = await asyncio.wait_for(self.sock.recv_multipart(), 5)
        return protocol.request_decoder.decode(payload)

    async def expect(self, kind: type) -> protocol.Request:
        while True:
            msg = await self.recv()
            if isinstance(msg, kind):
                return msg

    async def send(self, msg: protocol.Reply) -> None:
        await self.sock.send_multipart([self.peer, protocol.encode(msg)])


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[SeatClient, Seat, ManualClock]]:
    ctx = zmq.asyncio.Context()
    endpoint = f"ipc://{tmp_path / 's.sock'}"
    seat = Seat(ctx, endpoint)
    clock = ManualClock()
    # Pings go every 50 ms of real time, but the liveness window is 5,000 s of the
    # clock: only the test's moves of the clock can make the seat look silent.
    client = SeatClient("brain", endpoint, ctx, heartbeat_s=0.05, liveness=100_000,
                        queue_s=120, clock=clock)
    client.start()
    await seat.expect(protocol.Ping)
    await seat.send(Pong("brain", 1, 1, True))
    for _ in range(100):
        if client.ready:
            break
        await asyncio.sleep(0.01)
    assert client.ready
    yield client, seat, clock
    await client.close()
    seat.sock.close(linger=0)
    ctx.term()


async def outcome_of(client: SeatClient) -> tuple[asyncio.Task[Final], list[object]]:
    got: list[object] = []

    async def run() -> Final:
        async for frame in client.frames(GEN, first_token_s=30, stall_s=10):
            got.append(frame)
        last = got[-1]
        assert isinstance(last, Final)
        return last

    return asyncio.create_task(run()), got


async def test_a_queued_request_times_out_when_the_clock_passes_queue_timeout(pair) -> None:
    """Still queued at queue_s: queue_timeout (busy, not broken), and the seat is told to
    drop it; a moment before, it is still waiting."""
    client, seat, clock = pair
    task, _ = await outcome_of(client)
    await seat.expect(Generate)
    clock.advance(119)
    await asyncio.sleep(0.25)  # two looks at the deadline: not yet
    assert not task.done()
    clock.advance(2)
    final = await asyncio.wait_for(task, 2)
    assert final.outcome == Failed("queue_timeout", "still queued after 120s")
    assert isinstance(await seat.expect(protocol.Cancel), protocol.Cancel)


async def test_started_switches_to_the_first_token_clock(pair) -> None:
    """Once the seat says Started, the queue clock is gone: first_token_s decides."""
    client, seat, clock = pair
    task, _ = await outcome_of(client)
    await seat.expect(Generate)
    clock.advance(100)
    await seat.send(Started("r1"))
    await asyncio.sleep(0.05)
    clock.advance(31)  # past first_token_s (30) since Started, short of queue_s since sent
    final = await asyncio.wait_for(task, 2)
    assert final.outcome.reason == "first_token_timeout"  # type: ignore[union-attr]


async def test_a_silent_seat_past_its_liveness_is_lost_not_busy(pair) -> None:
    """No message for liveness x heartbeat: worker_lost, whether the heartbeat task or
    the attempt's own clock notices first."""
    client, seat, clock = pair
    task, _ = await outcome_of(client)
    await seat.expect(Generate)
    clock.advance(5001)
    assert not client.alive
    final = await asyncio.wait_for(task, 2)
    assert isinstance(final.outcome, Failed) and final.outcome.reason == "worker_lost"


@pytest.mark.parametrize(("now", "heard", "alive"), [
    (10.0, 7.0, True), (10.0, 7.1, True), (10.0, 6.9, False), (10.0, 10.0, True)])
def test_is_alive_within_liveness_heartbeats(now: float, heard: float, alive: bool) -> None:
    assert is_alive(now, heard, 1.0, 3) is alive


@pytest.mark.parametrize(("reason", "alive", "expected"), [
    ("queue_timeout", True, Failed("queue_timeout", "still queued after 5s")),
    ("first_token_timeout", True, Failed("first_token_timeout", "no frame for 5s")),
    ("stall_timeout", True, Failed("stall_timeout", "no frame for 5s")),
    ("queue_timeout", False, Failed("worker_lost", "no heartbeat")),
    ("stall_timeout", False, Failed("worker_lost", "no heartbeat")),
])
def test_overdue_blames_a_silent_seat_as_lost(reason: str, alive: bool,
                                              expected: Failed) -> None:
    assert overdue(reason, 5.0, alive) == expected
