"""seatd: spawns one worker per local seat, watches it, restarts it, stops it.

This is the shell around `states.transition`: it turns process exits, pongs,
missed heartbeats, stalled token counts and memory readings into events, and
the returned actions into spawns, signals and kills.  It also answers the
control socket (`sanctum status`, `restart`, `counters`, and the proxy's `wake` and
`sleep` of on-demand seats).

An on-demand seat (`load = "on_demand"`) starts SLEEPING, with no worker.  The proxy
asks for it with a request (`WakeSeat`, naming the loaded seats it has nothing in
flight or waiting for); seatd loads it where its estimated size fits the memory budget
and `max_loaded`, putting the least recently used of those idle seats to sleep first
(`seatd.room`), or answers `NoRoom` naming the budget and what holds it.  The proxy
puts a seat to sleep after its keep-alive (`SleepSeat`); a sleep is a drain like a
stop, never a crash.

Stopping (SIGTERM or SIGINT) is ordered: each worker gets SIGTERM and drains its
in-flight request for up to `drain_s`; a worker still there `KILL_GRACE_S`
later is killed.  Workers die with seatd even when seatd is SIGKILLed
(`shared.lifecycle`, in the worker).
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
from pathlib import Path

import psutil
import structlog
import zmq
import zmq.asyncio

from seatd import blas, health, ledger, room
from seatd.states import (
    ALIVE,
    KILL_GRACE_S,
    Action,
    Event,
    Exited,
    Heard,
    Kill,
    Lost,
    OverBudget,
    Policy,
    RestartRequested,
    SeatState,
    SleepRequested,
    Spawn,
    Spawned,
    State,
    StopRequested,
    Terminate,
    Tick,
    WakeRequested,
    stop_deadline,
    transition,
)
from shared import curve, exitcodes, protocol
from shared.config import (
    Config,
    SeatConfig,
    control_endpoint,
    resolve_path,
    state_dir,
    unlink_endpoint,
    worker_endpoint,
)
from shared.private_files import make_private_dir

log = structlog.get_logger()

# A worker imports MLX and binds its socket before loading the model; until its
# first pong, allow this long before calling it lost.
FIRST_PONG_S = 60.0
LOOP_S = 0.1
# The worker module to run, for tests that need a worker with an injected fault
# (a decode thread that hangs); unset in production.
WORKER_MODULE_ENV = "SANCTUM_WORKER_MODULE"


@dataclass
class Seat:
    name: str
    config: SeatConfig
    state: SeatState = field(default_factory=SeatState)
    proc: subprocess.Popen[bytes] | None = None
    sock: zmq.Socket[bytes] | None = None
    spawned_at: float = 0.0
    heard_at: float | None = None
    pinged_at: float = 0.0
    measured_at: float = 0.0
    rss: int | None = None
    incarnation: int = 0
    pong: protocol.Pong | None = None
    watch: health.Watch = field(default_factory=health.Watch)
    reason_file: Path | None = None
    totals_file: Path | None = None
    estimated: int = 0  # bytes once loaded and busy (seatd.room.estimate)
    busy_at: float | None = None  # when a pong last showed work (idle since then)
    loads: int = 0  # loads that reached READY, and the seconds they took
    load_seconds: float = 0.0
    sleeps: dict[str, int] = field(default_factory=dict)  # by reason

    @property
    def on_demand(self) -> bool:
        return self.config.on_demand

    @property
    def holds_memory(self) -> bool:
        """Loaded, loading, or coming back: what counts against the memory budget."""
        s = self.state
        return s.state in (*ALIVE, State.BACKOFF) or (s.state is State.STOPPING
                                                      and s.sleep is None)


def policy_for(config: Config) -> Policy:
    s = config.seatd
    # `fatal_cooldown_s` is optional in the config schema: absent means FATAL stays
    # down until `sanctum restart`.
    return Policy(s.max_crashes, s.crash_window_s, s.backoff_initial_s, s.backoff_max_s,
                  getattr(s, "fatal_cooldown_s", None), stop_deadline(s.drain_s))


class Supervisor:
    def __init__(self, config: Config, config_path: str | None) -> None:
        self.config = config
        self.config_path = config_path
        self.policy = policy_for(config)
        self.state_dir = state_dir(config)
        self.seats = {seat.name: Seat(seat.name, seat) for seat in config.supervised_seats}
        for seat in self.seats.values():
            seat.reason_file = self.state_dir / f"exit-{seat.name}.reason"
            seat.totals_file = ledger.path_for(self.state_dir, seat.name)
            saved = ledger.load(seat.totals_file)
            seat.state = SeatState(State.SLEEPING if seat.on_demand else State.STARTING,
                                   restarts=saved.restarts, memory_restarts=saved.memory_restarts)
            seat.estimated = room.estimate(config, seat.config)
        self.memory_budget = room.budget_bytes(config.seatd, room.physical_memory())
        self.ctx: zmq.asyncio.Context | None = None
        # Heartbeat sockets are polled without blocking from the watch loop, so
        # they are plain sockets on a context of their own.
        self.beat_ctx = zmq.Context()
        self.stopping = False
        self.bad_control_frames = 0

    # -- state machine plumbing -------------------------------------------

    def feed(self, seat: Seat, event: Event) -> None:
        before = seat.state
        seat.state, actions = transition(seat.state, event, time.monotonic(), self.policy)
        after = seat.state
        if after.state != before.state:
            log.info("seat_state", seat=seat.name, state=after.state.value,
                     was=before.state.value, last_exit=after.last_exit)
            if before.state is State.STARTING and after.state in (State.READY, State.BUSY):
                seat.loads += 1
                seat.load_seconds += time.monotonic() - seat.spawned_at
                seat.busy_at = time.monotonic()
            if before.sleep is not None and after.state in (State.SLEEPING, State.STARTING):
                seat.sleeps[before.sleep] = seat.sleeps.get(before.sleep, 0) + 1
        if (after.restarts, after.memory_restarts) != (before.restarts, before.memory_restarts):
            self.save_totals(seat)
        for action in actions:
            self.act(seat, action)

    def save_totals(self, seat: Seat) -> None:
        assert seat.totals_file is not None
        try:
            ledger.save(seat.totals_file,
                        ledger.Totals(seat.state.restarts, seat.state.memory_restarts))
        except OSError as exc:
            log.error("totals_not_saved", seat=seat.name, error=str(exc))

    def act(self, seat: Seat, action: Action) -> None:
        match action:
            case Spawn():
                self.spawn(seat)
            case Kill(reason=reason):
                # SIGKILL also ends a stopped (SIGSTOP) process: no SIGCONT needed.
                if seat.proc is not None and seat.proc.poll() is None:
                    log.warning("killing_worker", seat=seat.name, pid=seat.proc.pid, reason=reason)
                    seat.proc.kill()
            case Terminate():
                if seat.proc is not None and seat.proc.poll() is None:
                    log.info("terminating_worker", seat=seat.name, pid=seat.proc.pid,
                             reason=seat.state.recycle or "stop")
                    seat.proc.send_signal(signal.SIGTERM)

    def preflight(self, seat: Seat) -> str | None:
        """Why this seat cannot start, when that is knowable without starting it.

        A worker needs seconds to import MLX before it could say its model path is
        missing, or that a folder names code its seat does not trust; seatd can see
        that at once (the worker refuses it too).  Everything else is the worker's.
        """
        from shared.model_trust import trust_refusal

        untrusted = trust_refusal(self.config, seat.config)
        if untrusted:
            return untrusted
        spec = seat.config.model or ""
        if not spec or spec.startswith("builtin:"):
            return None
        path = Path(resolve_path(self.config, spec))
        if not path.exists():
            return f"{path} does not exist"
        return None

    def spawn(self, seat: Seat) -> None:
        assert seat.reason_file is not None
        missing = self.preflight(seat)
        if missing:
            log.error("model_load_failed", seat=seat.name, error=missing, preflight=True)
            why = f"{exitcodes.FATAL_AT_ONCE[exitcodes.MODEL_LOAD]}: {missing} (not started)"
            self.feed(seat, Exited(why, fatal=True))
            return
        # The worker is bound to us before it imports anything heavy (lifecycle.py).
        module = os.environ.get(WORKER_MODULE_ENV) or "seatd.worker"
        cmd = [sys.executable, "-m", "shared.lifecycle", module, "--seat", seat.name]
        if self.config_path is not None:
            cmd += ["--config", self.config_path]
        env = blas.worker_env(dict(os.environ))
        env["SANCTUM_PARENT_PID"] = str(os.getpid())
        env[exitcodes.REASON_ENV] = str(seat.reason_file)
        exitcodes.take_reason(seat.reason_file)  # a stale reason must not name this exit
        # Popen from the main thread: PR_SET_PDEATHSIG follows the spawning thread.
        seat.proc = subprocess.Popen(cmd, env=env)
        seat.spawned_at = time.monotonic()
        seat.heard_at = None
        seat.pong = None
        seat.rss = None
        seat.watch = health.Watch()
        log.info("worker_spawned", seat=seat.name, pid=seat.proc.pid,
                 blas=env.get("LD_PRELOAD", "default"))
        self.feed(seat, Spawned(seat.proc.pid))

    # -- the watch loop ---------------------------------------------------

    def connect(self, seat: Seat) -> None:
        sock = self.beat_ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        curve.dial(sock, worker_endpoint(self.config, seat.name),
                   curve.client_keys(self.config, seat.config, proxy=False))
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
            reply = protocol.read_reply(payload)  # anything but a Pong is not a heartbeat
            if isinstance(reply, protocol.Pong) and seat.proc is not None \
                    and reply.pid == seat.proc.pid:
                seat.heard_at = time.monotonic()
                seat.incarnation = reply.incarnation
                seat.pong = reply
                if reply.busy or reply.in_flight:
                    seat.busy_at = seat.heard_at
                self.feed(seat, Heard(reply.ready, reply.busy))
                if seat.state.state in (State.READY, State.BUSY):
                    self.check_progress(seat, seat.heard_at)

    def limits(self, seat: Seat) -> health.Limits:
        return health.Limits(seat.config.first_token_s, seat.config.stall_s)

    def check(self, seat: Seat, now: float) -> None:
        if seat.proc is not None:
            code = seat.proc.poll()
            if code is not None:
                seat.proc = None
                assert seat.reason_file is not None
                detail = exitcodes.take_reason(seat.reason_file)
                fatal = code in exitcodes.FATAL_AT_ONCE
                self.feed(seat, Exited(exitcodes.describe(code, detail), fatal))
        if seat.state.state in ALIVE and seat.proc is not None:
            self.check_liveness(seat, now)
        if seat.state.state in (State.READY, State.BUSY) and seat.proc is not None:
            self.check_memory(seat, now)
        self.feed(seat, Tick())

    def check_liveness(self, seat: Seat, now: float) -> None:
        window = self.config.seatd.heartbeat_s * self.config.seatd.liveness
        if seat.heard_at is None:
            if now - seat.spawned_at > FIRST_PONG_S:
                self.feed(seat, Lost("no first heartbeat"))
        elif now - seat.heard_at > window:
            self.feed(seat, Lost(f"no heartbeat for {now - seat.heard_at:.1f}s"))

    def check_progress(self, seat: Seat, now: float) -> None:
        # Judged on each fresh pong only: between pongs the token count is unknown,
        # not unmoved.  A worker that stops ponging is caught by liveness instead.
        if seat.pong is None:
            return
        seat.watch, stalled = health.progress(seat.watch, seat.pong.in_flight,
                                              seat.pong.tokens_generated, now, self.limits(seat))
        if stalled:
            self.feed(seat, Lost(stalled))

    def check_memory(self, seat: Seat, now: float) -> None:
        if now - seat.measured_at < self.config.seatd.heartbeat_s or seat.proc is None:
            return
        seat.measured_at = now
        try:
            seat.rss = psutil.Process(seat.proc.pid).memory_info().rss
        except psutil.Error:
            return
        reason = health.over_budget(seat.rss, seat.config.memory_budget_mb)
        if reason:
            log.warning("memory_over_budget", seat=seat.name, pid=seat.proc.pid, reason=reason)
            self.feed(seat, OverBudget(reason))

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
                last_exit=seat.state.last_exit, device=self.device_of(seat.name),
                load=seat.config.load, estimated_bytes=seat.estimated,
                idle_s=self.idle_s(seat)))
        return protocol.StatusReply(tuple(rows), self.bad_control_frames, self.memory_budget,
                                    self.config.seatd.max_loaded)

    def idle_s(self, seat: Seat) -> float | None:
        """Seconds since a loaded seat last showed work (None: not loaded)."""
        if seat.state.state not in (State.READY, State.BUSY) or seat.busy_at is None:
            return None
        return max(0.0, time.monotonic() - seat.busy_at)

    def saved_counters(self, name: str) -> dict[str, object]:
        """The counters the seat's worker last wrote ({}: none yet, or unreadable)."""
        try:
            got = json.loads((self.state_dir / f"counters-{name}.json").read_text())
        except (OSError, ValueError):
            return {}
        return got if isinstance(got, dict) else {}

    def device_of(self, name: str) -> str:
        """What the seat's worker said computes its model ("": not loaded yet)."""
        return str(self.saved_counters(name).get("device", ""))

    def counters(self) -> protocol.SeatCounters:
        out: dict[str, dict[str, object]] = {}
        for seat in self.seats.values():
            out[seat.name] = self.saved_counters(seat.name)
            out[seat.name]["restarts"] = seat.state.restarts
            out[seat.name]["memory_restarts"] = seat.state.memory_restarts
            out[seat.name]["loads"] = seat.loads
            out[seat.name]["load_ms"] = round(seat.load_seconds * 1000)
            out[seat.name]["sleeps"] = dict(seat.sleeps)
        return protocol.SeatCounters(out)

    def restart(self, name: str) -> protocol.ControlReply:
        if name not in self.seats:
            return protocol.ControlError(f"no local seat named {name!r}")
        if self.stopping:
            return protocol.ControlError("seatd is stopping")
        if self.seats[name].state.state is State.SLEEPING:  # a restart wakes it
            woken = self.wake(name, ())
            if isinstance(woken, protocol.NoRoom):
                return protocol.ControlError(woken.message)
            return protocol.ControlOk(f"waking {name}")
        self.feed(self.seats[name], RestartRequested())
        return protocol.ControlOk(f"restarting {name}")

    def wake(self, name: str, idle: tuple[str, ...]) -> protocol.ControlReply:
        """Load on-demand seat `name`, first putting to sleep what `seatd.room` says of
        `idle` (the proxy's idle seats, least recently used first)."""
        seat = self.seats.get(name)
        if seat is None:
            return protocol.ControlError(f"no local seat named {name!r}")
        if self.stopping:
            return protocol.ControlError("seatd is stopping")
        state = seat.state
        if not (state.state is State.SLEEPING
                or (state.state is State.STOPPING and state.sleep is not None)):
            return protocol.Woken(name)  # loaded, loading, or not ours to wake
        loaded = [n for n, s in self.seats.items() if s.holds_memory and n != name]
        loaded.sort(key=lambda n: self.seats[n].busy_at or 0.0)
        sleepable = [n for n in idle if n in self.seats and self.seats[n].on_demand]
        sizes = {n: s.estimated for n, s in self.seats.items()}
        plan = room.make_room(name, sizes, loaded, sleepable, self.memory_budget,
                              self.config.seatd.max_loaded)
        if not plan.fits:
            held = {n: sizes[n] for n in loaded}
            message = room.no_room_message(name, plan, self.memory_budget,
                                           self.config.seatd.max_loaded, held)
            log.warning("no_room", seat=name, message=message)
            return protocol.NoRoom(message, self.memory_budget, held)
        for victim in plan.victims:
            log.info("seat_sleeping", seat=victim, reason="room", for_seat=name)
            self.feed(self.seats[victim], SleepRequested("room"))
        log.info("seat_waking", seat=name, estimated_mb=seat.estimated // room.MB,
                 slept=list(plan.victims))
        self.feed(seat, WakeRequested())
        if seat.state.state is State.FATAL:  # refused before it started (its model is gone)
            return protocol.ControlError(f"seat {name!r} cannot load: {seat.state.last_exit}")
        return protocol.Woken(name, plan.victims)

    def sleep(self, name: str, reason: str) -> protocol.ControlReply:
        seat = self.seats.get(name)
        if seat is None or not seat.on_demand:
            return protocol.ControlError(f"no on-demand seat named {name!r}")
        log.info("seat_sleeping", seat=name, reason=reason)
        self.feed(seat, SleepRequested(reason))
        return protocol.ControlOk(f"{name} sleeps")

    async def control(self) -> None:
        assert self.ctx is not None
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.CONTROL_MAX_FRAME_BYTES)
        sock.bind(control_endpoint(self.config))
        try:
            while True:
                frames = await sock.recv_multipart()
                message = protocol.read_control_frames(frames)
                reply: protocol.ControlReply
                match message:
                    case protocol.Refused(reason=reason, error=error):
                        self.bad_control_frames += 1
                        log.warning("bad_control_frame", reason=reason, error=error)
                        reply = protocol.control_refusal(message)
                    case protocol.StatusQuery():
                        reply = self.status()
                    case protocol.GetCounters():
                        reply = self.counters()
                    case protocol.RestartSeat(seat=name):
                        reply = self.restart(name)
                    case protocol.WakeSeat(seat=name, idle=idle):
                        reply = self.wake(name, idle)
                    case protocol.SleepSeat(seat=name, reason=reason):
                        reply = self.sleep(name, reason)
                await sock.send_multipart([frames[0], b"", protocol.encode(reply)])
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
        make_private_dir(self.state_dir)
        self.ctx = zmq.asyncio.Context()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        for seat in self.seats.values():
            self.connect(seat)
            if not seat.on_demand:  # an on-demand seat loads on its first request
                self.spawn(seat)
        control = loop.create_task(self.control())
        watcher = loop.create_task(self.watch())
        log.info("seatd_started", seats=list(self.seats), state_dir=str(self.state_dir))
        try:
            while not self.stopping:
                await asyncio.sleep(LOOP_S)
            # The watch loop drains, then kills at each seat's deadline (states.py);
            # this outer deadline only guards against the loop itself being stuck.
            started = time.monotonic()
            deadline = started + self.policy.stop_deadline_s + KILL_GRACE_S
            while not watcher.done() and time.monotonic() < deadline:
                await asyncio.sleep(LOOP_S)
            log.info("seatd_drained", seconds=round(time.monotonic() - started, 2))
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
