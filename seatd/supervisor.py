"""seatd: spawns one worker per local seat, watches it, restarts it, stops it.

This is the shell around `states.transition`: it turns process exits, pongs and
missed heartbeats into events, and the returned actions into spawns and kills.
It also answers the control socket (`sanctum status`, `restart`, `counters`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import msgspec
import psutil
import structlog
import zmq
import zmq.asyncio

from seatd import blas
from seatd.states import (
    Action,
    Event,
    Exited,
    Heard,
    Kill,
    Lost,
    Policy,
    RestartRequested,
    SeatState,
    Spawn,
    Spawned,
    State,
    StopRequested,
    Terminate,
    Tick,
    transition,
)
from shared import exitcodes, protocol
from shared.config import Config, control_endpoint, state_dir, unlink_endpoint, worker_endpoint

log = structlog.get_logger()

# A worker imports MLX and binds its socket before loading the model; until its
# first pong, allow this long before calling it lost.
FIRST_PONG_S = 60.0
LOOP_S = 0.1


@dataclass
class Seat:
    name: str
    state: SeatState = field(default_factory=SeatState)
    proc: subprocess.Popen[bytes] | None = None
    sock: zmq.Socket[bytes] | None = None
    spawned_at: float = 0.0
    heard_at: float | None = None
    pinged_at: float = 0.0
    incarnation: int = 0


class Supervisor:
    def __init__(self, config: Config, config_path: str | None) -> None:
        self.config = config
        self.config_path = config_path
        s = config.seatd
        self.policy = Policy(s.max_crashes, s.crash_window_s, s.backoff_initial_s, s.backoff_max_s)
        self.seats = {seat.name: Seat(seat.name) for seat in config.local_seats}
        self.ctx: zmq.asyncio.Context | None = None
        # Heartbeat sockets are polled without blocking from the watch loop, so
        # they are plain sockets on a context of their own.
        self.beat_ctx = zmq.Context()
        self.stopping = False

    # -- state machine plumbing -------------------------------------------

    def feed(self, seat: Seat, event: Event) -> None:
        before = seat.state.state
        seat.state, actions = transition(seat.state, event, time.monotonic(), self.policy)
        if seat.state.state != before:
            log.info("seat_state", seat=seat.name, state=seat.state.state.value,
                     was=before.value, last_exit=seat.state.last_exit)
        for action in actions:
            self.act(seat, action)

    def act(self, seat: Seat, action: Action) -> None:
        match action:
            case Spawn():
                self.spawn(seat)
            case Kill(reason=reason):
                if seat.proc is not None and seat.proc.poll() is None:
                    log.warning("killing_worker", seat=seat.name, pid=seat.proc.pid, reason=reason)
                    seat.proc.kill()
            case Terminate():
                if seat.proc is not None and seat.proc.poll() is None:
                    seat.proc.send_signal(signal.SIGTERM)

    def spawn(self, seat: Seat) -> None:
        cmd = [sys.executable, "-m", "seatd.worker", "--seat", seat.name]
        if self.config_path is not None:
            cmd += ["--config", self.config_path]
        env = blas.worker_env(dict(os.environ))
        env["SANCTUM_PARENT_PID"] = str(os.getpid())
        # Popen from the main thread: PR_SET_PDEATHSIG follows the spawning thread.
        seat.proc = subprocess.Popen(cmd, env=env)
        seat.spawned_at = time.monotonic()
        seat.heard_at = None
        log.info("worker_spawned", seat=seat.name, pid=seat.proc.pid,
                 blas=env.get("LD_PRELOAD", "default"))
        self.feed(seat, Spawned(seat.proc.pid))

    # -- the watch loop ---------------------------------------------------

    def connect(self, seat: Seat) -> None:
        sock = self.beat_ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(worker_endpoint(self.config, seat.name))
        seat.sock = sock

    def ping(self, seat: Seat, now: float) -> None:
        if seat.sock is None or now - seat.pinged_at < self.config.seatd.heartbeat_s:
            return
        seat.pinged_at = now
        try:
            seat.sock.send(protocol.encode(protocol.Ping(sent_at=now)), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def drain_replies(self, seat: Seat) -> None:
        assert seat.sock is not None
        while True:
            try:
                payload = seat.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = protocol.reply_decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if isinstance(reply, protocol.Pong) and seat.proc is not None \
                    and reply.pid == seat.proc.pid:
                seat.heard_at = time.monotonic()
                seat.incarnation = reply.incarnation
                self.feed(seat, Heard(reply.ready, reply.busy))

    def check(self, seat: Seat, now: float) -> None:
        if seat.proc is not None:
            code = seat.proc.poll()
            if code is not None:
                seat.proc = None
                fatal = code in exitcodes.FATAL_AT_ONCE
                self.feed(seat, Exited(exitcodes.describe(code), fatal))
        if seat.state.state in (State.STARTING, State.READY, State.BUSY) and seat.proc:
            window = self.config.seatd.heartbeat_s * self.config.seatd.liveness
            if seat.heard_at is None:
                if now - seat.spawned_at > FIRST_PONG_S:
                    self.feed(seat, Lost("no first heartbeat"))
            elif now - seat.heard_at > window:
                self.feed(seat, Lost(f"no heartbeat for {now - seat.heard_at:.1f}s"))
        self.feed(seat, Tick())

    async def watch(self) -> None:
        while True:
            now = time.monotonic()
            for seat in self.seats.values():
                try:
                    self.drain_replies(seat)
                    self.check(seat, now)
                    self.ping(seat, now)
                except Exception:  # one seat's trouble must not stop the watch
                    log.exception("watch_failed", seat=seat.name)
            if self.stopping and all(s.proc is None for s in self.seats.values()):
                return
            await asyncio.sleep(LOOP_S)

    # -- control socket ---------------------------------------------------

    def status(self) -> protocol.StatusReply:
        rows = []
        for seat in self.seats.values():
            rss = uptime = None
            pid = seat.proc.pid if seat.proc is not None else None
            if pid is not None:
                try:
                    rss = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    pass
                uptime = time.monotonic() - seat.spawned_at
            rows.append(protocol.SeatStatus(
                name=seat.name, state=seat.state.state.value, pid=pid, rss_bytes=rss,
                uptime_s=uptime, restarts=seat.state.restarts, incarnation=seat.incarnation,
                last_exit=seat.state.last_exit))
        return protocol.StatusReply(tuple(rows))

    def counters(self) -> protocol.SeatCounters:
        out: dict[str, dict[str, object]] = {}
        base = state_dir(self.config)
        for seat in self.seats.values():
            path = base / f"counters-{seat.name}.json"
            try:
                out[seat.name] = json.loads(path.read_text())
            except (OSError, ValueError):
                out[seat.name] = {}
            out[seat.name]["restarts"] = seat.state.restarts
        return protocol.SeatCounters(out)

    async def control(self) -> None:
        assert self.ctx is not None
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(control_endpoint(self.config))
        try:
            while True:
                identity, *_, payload = await sock.recv_multipart()
                reply: protocol.ControlReply
                try:
                    message = protocol.control_decoder.decode(payload)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    reply = protocol.ControlError(f"bad control frame: {exc}")
                else:
                    match message:
                        case protocol.StatusQuery():
                            reply = self.status()
                        case protocol.GetCounters():
                            reply = self.counters()
                        case protocol.RestartSeat(seat=name):
                            if name not in self.seats:
                                reply = protocol.ControlError(f"no local seat named {name!r}")
                            else:
                                self.feed(self.seats[name], RestartRequested())
                                reply = protocol.ControlOk(f"restarting {name}")
                await sock.send_multipart([identity, b"", protocol.encode(reply)])
        finally:
            sock.close(linger=0)

    # -- run --------------------------------------------------------------

    def request_stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        log.info("seatd_stopping", drain_s=self.config.seatd.drain_s)
        for seat in self.seats.values():
            self.feed(seat, StopRequested())

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        state_dir(self.config).mkdir(parents=True, exist_ok=True)
        self.ctx = zmq.asyncio.Context()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        for seat in self.seats.values():
            self.connect(seat)
            self.spawn(seat)
        control = loop.create_task(self.control())
        watcher = loop.create_task(self.watch())
        log.info("seatd_started", seats=list(self.seats), state_dir=str(state_dir(self.config)))
        try:
            while not self.stopping:
                await asyncio.sleep(LOOP_S)
            # Workers drain up to drain_s; after a grace period they are killed.
            deadline = time.monotonic() + self.config.seatd.drain_s + 2.0
            while not watcher.done() and time.monotonic() < deadline:
                await asyncio.sleep(LOOP_S)
        finally:
            for seat in self.seats.values():
                if seat.proc is not None and seat.proc.poll() is None:
                    log.warning("worker_killed_at_deadline", seat=seat.name, pid=seat.proc.pid)
                    seat.proc.kill()
                if seat.proc is not None:
                    seat.proc.wait()
                if seat.sock is not None:
                    seat.sock.close(linger=0)
            watcher.cancel()
            control.cancel()
            await asyncio.gather(watcher, control, return_exceptions=True)
            self.ctx.term()
            self.beat_ctx.term()
            unlink_endpoint(control_endpoint(self.config))
        log.info("seatd_stopped")
        return 0

