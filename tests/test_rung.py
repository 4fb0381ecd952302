"""Both kinds of rung answer the journey's questions through `proxyd.rung.Rung`:
a local seat and a hosted model, told apart by `local`, not by their class."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from proxyd.hosted import HostedClient
from proxyd.rung import Rung
from proxyd.seat_client import SeatClient
from proxyd.seat_state import SeatState
from shared.config import SeatConfig


def test_a_hosted_rung_is_off_the_box_ready_and_without_a_seat_state() -> None:
    rung: Rung = HostedClient(SeatConfig(name="gpt", kind="openai",
                                         base_url="http://127.0.0.1:9/v1"))
    assert (rung.name, rung.local, rung.ready, rung.state, rung.pong) == \
        ("gpt", False, True, None, None)
    asyncio.run(rung.close())


def test_a_local_rung_not_heard_from_is_loading_and_not_ready() -> None:
    ctx = zmq.asyncio.Context()
    try:
        client = SeatClient("demo", "ipc:///nonexistent/sanctum-test.sock", ctx,
                            clock=lambda: 0.0)
        rung: Rung = client
        assert (rung.name, rung.local, rung.ready, rung.pong) == ("demo", True, False, None)
        assert rung.state is SeatState.LOADING  # within its spawn grace
        client.sock.close(linger=0)
    finally:
        ctx.term()
