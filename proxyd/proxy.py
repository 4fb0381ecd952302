"""The proxy's shared state: seats, routes, their clients and breakers, counters.

Built once from the config and handed to every request (proxyd/app.py keeps it
under an AppKey).  The clock decides the breakers' cool-downs and the local
seats' queue, first-token and liveness clocks; tests pass a `ManualClock`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.asyncio
from aiohttp import web

from proxyd import breaker
from proxyd.admission import Admission
from proxyd.breaker import Breaker, BreakerPolicy
from proxyd.counters import ProxyCounters
from proxyd.hosted import HostedClient
from proxyd.keys import KeyRing, load_keys
from proxyd.ladder import Health, breaker_verdict
from proxyd.rung import Rung
from proxyd.seat_client import SeatClient
from shared import clock as clocks
from shared import curve
from shared.clock import Clock
from shared.config import Config, SeatConfig, control_endpoint, worker_endpoint
from shared.protocol import (
    Control,
    ControlReply,
    GetCounters,
    Outcome,
    control_reply_decoder,
    encode,
)
from shared.protocol import SeatCounters as SeatCountersReply

log = structlog.get_logger()

class Proxy:
    """Everything the handlers share, built once from the config."""

    def __init__(self, config: Config, clock: Clock = clocks.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.seats = {s.name: s for s in config.seat}
        self.routes = {r.model: r for r in config.route}
        self.counters = ProxyCounters()
        self.admission = Admission(config)
        self.clients: dict[str, Rung] = {}  # by seat name: local and hosted rungs
        self.breakers: dict[str, Breaker] = {s.name: Breaker() for s in config.seat}
        self.breaker_policy = BreakerPolicy(config.proxy.breaker_threshold,
                                            config.proxy.breaker_cooldown_s,
                                            config.proxy.breaker_cooldown_max_s)
        self.ctx: zmq.asyncio.Context | None = None
        # Client keys (proxyd/keys.py) and, per rate-limited key, its recent requests.
        self.keys: KeyRing = load_keys(config, os.environ)
        self.rate_windows: dict[str, tuple[float, ...]] = {}
        # Hosted rungs that answered an assistant prefill with a 400, until a restart.
        self.prefill_refused: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []

    def takes_prefill(self, name: str) -> bool:
        """Whether a continuation is asked of rung `name` with an assistant prefill (else
        afresh, `proxyd.replay`)."""
        return self.seats[name].prefill and name not in self.prefill_refused

    def refused_prefill(self, name: str) -> None:
        """Rung `name` answered a prefill with a 400: remembered, counted, said once."""
        if name in self.prefill_refused:
            return
        self.prefill_refused.add(name)
        self.counters.inc("prefill_refused", name)
        log.warning("prefill_refused", seat=name,
                    then="continuations are asked afresh and replayed")

    async def start(self) -> None:
        await self.admission.start()
        self.ctx = zmq.asyncio.Context()
        p = self.config.proxy
        for seat in self.config.local_seats:
            client = SeatClient(seat.name, worker_endpoint(self.config, seat.name), self.ctx,
                                p.heartbeat_s, p.liveness, seat.queue_timeout_s, self.clock,
                                curve.client_keys(self.config, seat, proxy=True))
            if seat.on_demand:  # asleep until a request wakes it (proxyd/on_demand.py)
                client.on_demand = client.sleeping = True
            client.start()
            self.clients[seat.name] = client
        for seat in hosted_seats(self.config):
            self.clients[seat.name] = HostedClient(seat)
        if any(s.on_demand for s in self.config.local_seats):
            from proxyd.on_demand import keep_alive_loop

            self._tasks.append(asyncio.create_task(keep_alive_loop(self)))

    def admit(self, name: str) -> tuple[bool, bool]:
        """(may this attempt go to the rung, is it the half-open rung's one probe)."""
        before = self.breakers[name]
        self.breakers[name], ok = breaker.admit(before, self.clock(), self.breaker_policy)
        return ok, ok and breaker.took_probe(before, self.breakers[name])

    def settle(self, name: str, outcome: Outcome, probe: bool) -> None:
        """Feed an attempt's end to its rung's breaker: only real failures count.  An
        attempt that ends without a verdict frees the probe slot only if it held it."""
        health = breaker_verdict(outcome)
        if health is Health.UNKNOWN:
            if probe:
                self.breakers[name] = breaker.release(self.breakers[name])
            return
        self.breakers[name] = breaker.record(self.breakers[name], health is Health.BROKEN,
                                             self.clock(), self.breaker_policy)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.admission.stop()
        await asyncio.gather(*(c.close() for c in self.clients.values()))
        if self.ctx is not None:
            self.ctx.term()

    async def control(self, message: Control, timeout_s: float = 5.0) -> ControlReply | None:
        """One message to seatd's control socket and its answer; None if it is away."""
        assert self.ctx is not None
        endpoint = control_endpoint(self.config)
        if endpoint.startswith("ipc://") and not Path(endpoint[6:]).exists():
            return None  # seatd is not running: no need to wait to learn it
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            await sock.send_multipart([b"", encode(message)])
            frames = await asyncio.wait_for(sock.recv_multipart(), timeout_s)
            reply: ControlReply = control_reply_decoder.decode(frames[-1])
        except (TimeoutError, zmq.ZMQError, ValueError):
            return None
        finally:
            sock.close(linger=0)
        return reply

    async def supervisor_totals(self) -> dict[str, dict[str, Any]]:
        """What seatd owns of each seat's counters (restarts, memory_restarts, loads,
        load_ms, sleeps by reason); {} if it is away."""
        reply = await self.control(GetCounters(), 1.0)
        if not isinstance(reply, SeatCountersReply):
            return {}
        owned = ("restarts", "memory_restarts", "loads", "load_ms", "sleeps")
        return {name: {k: v for k, v in c.items() if k in owned}
                for name, c in reply.seats.items()}

    async def seat_counters(self) -> dict[str, dict[str, Any] | None]:
        """Each local seat's own counters (None: it did not answer), with what seatd
        owns of them; a sleeping seat's are seatd's alone."""
        local = {n: c for n, c in self.clients.items() if isinstance(c, SeatClient)}
        names = list(local)
        got, totals = await asyncio.gather(
            asyncio.gather(*(local[n].counters() for n in names)), self.supervisor_totals())
        seats = dict(zip(names, got, strict=True))
        for name, owned in totals.items():
            seat = seats.get(name)
            if seat is not None:
                seat.update(owned)
            elif name in seats and local[name].sleeping:
                seats[name] = {**owned, "sleeping": True}
        return seats


def hosted_seats(config: Config) -> list[SeatConfig]:
    return [s for s in config.seat if s.kind == "openai"]


PROXY = web.AppKey("proxy", Proxy)
