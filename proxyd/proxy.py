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
from shared.protocol import GetCounters, Outcome, control_reply_decoder, encode
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
            client.start()
            self.clients[seat.name] = client
        for seat in hosted_seats(self.config):
            self.clients[seat.name] = HostedClient(seat)

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
        await self.admission.stop()
        await asyncio.gather(*(c.close() for c in self.clients.values()))
        if self.ctx is not None:
            self.ctx.term()

    async def supervisor_totals(self) -> dict[str, dict[str, Any]]:
        """Restart totals that seatd owns (restarts, memory_restarts); {} if it is away."""
        assert self.ctx is not None
        endpoint = control_endpoint(self.config)
        if endpoint.startswith("ipc://") and not Path(endpoint[6:]).exists():
            return {}  # seatd is not running: no need to wait a second to learn it
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            await sock.send_multipart([b"", encode(GetCounters())])
            frames = await asyncio.wait_for(sock.recv_multipart(), 1.0)
            reply = control_reply_decoder.decode(frames[-1])
        except (TimeoutError, zmq.ZMQError, ValueError):
            return {}
        finally:
            sock.close(linger=0)
        if not isinstance(reply, SeatCountersReply):
            return {}
        return {name: {k: v for k, v in c.items() if k in ("restarts", "memory_restarts")}
                for name, c in reply.seats.items()}

    async def seat_counters(self) -> dict[str, dict[str, Any] | None]:
        local = {n: c for n, c in self.clients.items() if isinstance(c, SeatClient)}
        names = list(local)
        got = await asyncio.gather(*(local[n].counters() for n in names))
        return dict(zip(names, got, strict=True))


def hosted_seats(config: Config) -> list[SeatConfig]:
    return [s for s in config.seat if s.kind == "openai"]


PROXY = web.AppKey("proxy", Proxy)
