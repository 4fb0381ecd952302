"""The seat worker: one process, one model, one decode thread.

    python -m seatd.worker --seat NAME [--config FILE]

The asyncio main thread owns the ZeroMQ ROUTER socket: it answers pings at any
time (also during a long prefill), queues work and sends frames.  All MLX work
runs on one long-lived thread, because MLX registers compute streams per thread.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from seatd import blas
from seatd.counters import SeatCounters
from seatd.decode import PREFILL_CHUNK, DecodeCancelled, DecodeResult, decode, output_width
from seatd.fingerprint import fingerprint, model_digest
from seatd.prompt_cache import SeatPromptCache
from seatd.sampling import KEYED_RULE
from seatd.speculation import SeatSpeculation
from seatd.turns import turn_cuts, turn_marks
from shared import exitcodes, lifecycle, protocol
from shared.caps import default_seat_cap, seat_refusal
from shared.config import (
    Config,
    ConfigError,
    SeatConfig,
    load_config,
    state_dir,
    unlink_endpoint,
    worker_endpoint,
)
from shared.logs import setup_logging
from shared.prompt import prompt_ids
from shared.protocol import (
    Cancel,
    Cancelled,
    Chunk,
    CountersReply,
    Failed,
    Final,
    Generate,
    GetCounters,
    Ok,
    Outcome,
    Ping,
    Pong,
    Rejected,
    Shutdown,
    Started,
    Usage,
)

log = structlog.get_logger()



@dataclass
class Job:
    identity: bytes
    request: Generate
    received_at: float = field(default_factory=time.monotonic)


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    context_length: int
    tokenizer_hash: str
    cap: int
    speculation: SeatSpeculation
    prompt_cache: SeatPromptCache
    turn_marks: frozenset[int] = frozenset()
    width: int = 0  # the model's logits width: keyed noise is made at it
    fingerprints: dict[str, str] = field(default_factory=dict)  # by KV lane


class SeatWorker:
    def __init__(self, config: Config, seat: SeatConfig) -> None:
        self.config = config
        self.seat = seat
        self.state_dir = state_dir(config)
        self.counters = SeatCounters(seat.name, self.state_dir / f"counters-{seat.name}.json")
        self.loaded: Loaded | None = None
        # Jobs in arrival order; `waiting` holds the live ones by id (at most
        # max_queued), so a job cancelled while queued gives its place up at once.
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.waiting: dict[str, Job] = {}
        self.cancelled: set[str] = set()  # only ever the request in flight
        self.current: str | None = None
        self.tokens_generated = 0
        self.draining = False
        self.stopped = asyncio.Event()
        self.mlx = ThreadPoolExecutor(1, thread_name_prefix="mlx")
        self.sock: zmq.asyncio.Socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- I/O --------------------------------------------------------------

    def send(self, identity: bytes, message: msgspec.Struct) -> None:
        assert self.sock is not None
        # ROUTER sends never block: an unroutable peer's frame is dropped.
        self.sock.send_multipart([identity, protocol.encode(message)])

    def send_threadsafe(self, identity: bytes, message: msgspec.Struct) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.send, identity, message)

    def pong(self, sent_at: float) -> Pong:
        loaded = self.loaded
        return Pong(
            seat=self.seat.name,
            pid=os.getpid(),
            incarnation=self.counters.incarnation,
            ready=loaded is not None and not self.draining,
            busy=self.current is not None,
            sent_at=sent_at,
            max_prompt_tokens=loaded.cap if loaded else 0,
            context_length=loaded.context_length if loaded else 0,
            tokenizer_hash=loaded.tokenizer_hash if loaded else "",
            in_flight=(self.current,) if self.current else (),
            tokens_generated=self.tokens_generated,
            queued=len(self.waiting),
        )

    def final(self, job: Job, outcome: Outcome, **fields: Any) -> Final:
        return Final(
            request_id=job.request.request_id,
            outcome=outcome,
            seat=self.seat.name,
            served=self.counters.served,
            incarnation=self.counters.incarnation,
            **fields,
        )

    async def receive(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart()
            identity, payload = frames[0], frames[-1]
            try:
                message = protocol.request_decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.counters.inc("bad_frames")
                log.warning("bad_frame", error=str(exc))
                self.send(identity, protocol.BadFrame(error=str(exc)))
                continue
            self.handle(identity, message)

    def handle(self, identity: bytes, message: protocol.Request) -> None:
        match message:
            case Ping(sent_at=sent_at):
                self.send(identity, self.pong(sent_at))
            case Generate():
                job = Job(identity, message)
                if self.loaded is None:
                    self.send(identity, self.final(job, Failed("not_ready", "model loading")))
                elif self.draining:
                    self.send(identity, self.final(job, Failed("draining", "seat stopping")))
                elif len(self.waiting) >= self.seat.max_queued:
                    self.send(identity, self.final(job, Failed("queue_full", "seat overloaded")))
                else:
                    self.waiting[message.request_id] = job
                    self.queue.put_nowait(job)
            case Cancel(request_id=rid):
                queued = self.waiting.pop(rid, None)
                if queued is not None:  # never started: its place goes to the next one
                    self.counters.inc("cancelled")
                    self.send(queued.identity, self.final(queued, Cancelled()))
                elif rid == self.current:
                    self.cancelled.add(rid)
            case GetCounters():
                self.send(identity, CountersReply(self.seat.name, self.counters.snapshot()))
            case Shutdown(drain_s=drain_s):
                self.begin_drain(drain_s)

    # -- work -------------------------------------------------------------

    def load(self) -> Loaded:
        from seatd.model_load import load_for_compute, on_cpu
        from shared.builtin import resolve_model
        from shared.config import resolve_path

        assert self.seat.model is not None
        path = resolve_model(resolve_path(self.config, self.seat.model))
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        dtype = None if self.seat.compute_dtype == "auto" else self.seat.compute_dtype
        got = load_for_compute(path, dtype)
        cap = self.seat.max_prompt_tokens or default_seat_cap(got.context_length)
        spec = SeatSpeculation(self.config, self.seat, got.model, got.tokenizer_hash)
        digest = model_digest(path)
        device = "cpu" if on_cpu() else "gpu"
        prints = {kv: fingerprint(digest, got.compute_dtype, kv, device, KEYED_RULE,
                                  PREFILL_CHUNK) for kv in ("fp16", "q8")}
        return Loaded(got.model, got.tokenizer, got.context_length, got.tokenizer_hash, cap,
                      spec, SeatPromptCache(self.seat, got.model), turn_marks(got.tokenizer),
                      output_width(got.model), prints)

    def tokenize(self, request: Generate) -> list[int]:
        assert self.loaded is not None
        return prompt_ids(self.loaded.tokenizer, request.messages, request.prompt,
                          request.tools_json)

    def generate(self, job: Job, emit: Callable[[str, int, str], None]
                 ) -> tuple[Outcome, DecodeResult | None, int]:
        """Runs on the MLX thread.  Returns the outcome, the result and the prompt size."""
        assert self.loaded is not None
        request = job.request
        try:
            prompt = self.tokenize(request)
        except Exception as exc:  # the chat template refused these messages: the client's
            return Rejected(400, "invalid_messages", f"chat template: {exc}"), None, 0
        loaded = self.loaded
        limit = seat_refusal(len(prompt), loaded.cap, loaded.context_length)
        if limit is not None:
            cap = loaded.cap if limit == "seat_cap" else loaded.context_length - 1
            # Checked before any prefill; the prompt is refused whole, never truncated.
            return (
                Rejected(413, "prompt_too_long",
                         f"prompt has {len(prompt)} tokens; seat {self.seat.name} takes at "
                         f"most {cap} ({limit})",
                         {"prompt_tokens": len(prompt), "cap": cap, "seat": self.seat.name,
                          "limit": limit}),
                None, len(prompt))
        if not prompt:
            return Rejected(400, "empty_prompt", "the prompt is empty"), None, 0

        def progress(n: int) -> None:
            self.tokens_generated += 1

        kv = request.kv or self.seat.kv
        plan = loaded.prompt_cache.begin(request, kv, prompt, request.params.max_tokens,
                                         turn_cuts(prompt, loaded.turn_marks))
        try:
            result = decode(
                self.loaded.model, self.loaded.tokenizer, prompt, request.params,
                kv=kv,
                context_length=self.loaded.context_length,
                emit=emit,
                cancelled=lambda: request.request_id in self.cancelled,
                on_token=progress,
                spec=self.loaded.speculation.plan(request, kv),
                resume=plan.resume,
                width=loaded.width,
            )
        except DecodeCancelled:
            loaded.prompt_cache.finish(plan, ok=True)
            raise
        except Exception:
            # An error during generation: drop the entry it resumed from.
            loaded.prompt_cache.finish(plan, ok=False)
            raise
        loaded.prompt_cache.finish(plan, ok=True)
        return Ok(), result, len(prompt)

    async def serve(self) -> None:
        assert self.loop is not None
        while True:
            job = await self.queue.get()
            request = job.request
            rid = request.request_id
            if self.waiting.get(rid) is not job:
                continue  # cancelled while queued, and already answered
            del self.waiting[rid]
            kv = request.kv or self.seat.kv
            lane = f"{'stream' if request.stream else 'sync'}/{kv}"
            print_ = self.loaded.fingerprints.get(kv, "") if self.loaded else ""
            self.current = rid
            self.send(job.identity, Started(rid))
            started = time.monotonic()
            first: list[float] = []

            def emit(text: str, count: int, state: str, job: Job = job,
                     first: list[float] = first, print_: str = print_) -> None:
                if not first:
                    first.append(time.monotonic())
                self.send_threadsafe(job.identity, Chunk(job.request.request_id, text, count,
                                                         self.counters.served + 1, state,
                                                         print_))

            with structlog.contextvars.bound_contextvars(request_id=rid, seat=self.seat.name):
                try:
                    outcome, result, n_prompt = await self.loop.run_in_executor(
                        self.mlx, self.generate, job, emit)
                except DecodeCancelled:
                    outcome, result, n_prompt = Cancelled(), None, 0
                except Exception as exc:  # the seat answers; it does not die
                    log.exception("generate_failed")
                    outcome, result, n_prompt = Failed("internal_error", str(exc)), None, 0
                self.current = None
                self.cancelled.discard(rid)
                frame = self.account(job, lane, outcome, result, n_prompt, started, first,
                                     print_)
            self.send(job.identity, frame)

    def account(self, job: Job, lane: str, outcome: Outcome, result: DecodeResult | None,
                n_prompt: int, started: float, first: list[float], print_: str) -> Final:
        c = self.counters
        ttft = (first[0] if first else time.monotonic()) - started
        if self.loaded is not None:
            c.prompt_cache(self.loaded.prompt_cache.drain(), lane,
                           self.loaded.prompt_cache.entries, self.loaded.prompt_cache.nbytes)
        match outcome:
            case Ok():
                assert result is not None
                c.inc("served", lane=lane)
                c.inc("prompt_tokens", result.prompt_tokens, lane=lane)
                c.inc("completion_tokens", result.completion_tokens, lane=lane)
                c.speculation(result.speculation, lane)
            case Rejected(status=status):
                c.inc("rejected", label=str(status))
                if status == 413:
                    c.refused(n_prompt)
            case Failed():
                c.inc("failed")
            case Cancelled():
                c.inc("cancelled")
        try:
            c.persist()
        except OSError as exc:
            log.error("counters_not_saved", error=str(exc))
        elapsed = time.monotonic() - started
        log.info(
            "request_done", outcome=type(outcome).__name__.lower(), lane=lane,
            prompt_tokens=result.prompt_tokens if result else n_prompt,
            completion_tokens=result.completion_tokens if result else 0,
            ttft_s=round(ttft, 4), elapsed_s=round(elapsed, 4),
        )
        if result is None:
            return self.final(job, outcome, usage=Usage(prompt_tokens=n_prompt))
        return self.final(
            job, outcome,
            finish_reason=result.finish_reason,
            usage=Usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens),
            speculation=result.speculation.state,
            ttft_s=ttft,
            fingerprint=print_,
        )

    # -- lifecycle --------------------------------------------------------

    def begin_drain(self, drain_s: float) -> None:
        if self.draining:
            return
        self.draining = True
        log.info("draining", drain_s=drain_s, queued=len(self.waiting), busy=self.current)
        assert self.loop is not None
        self.loop.create_task(self._drain(drain_s))

    async def _drain(self, drain_s: float) -> None:
        deadline = time.monotonic() + drain_s
        while (self.current is not None or self.waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.stopped.set()

    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        ctx = zmq.asyncio.Context()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(worker_endpoint(self.config, self.seat.name))
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.begin_drain, self.config.seatd.drain_s)
        receiver = self.loop.create_task(self.receive())
        log.info("worker_starting", blas=blas.loaded_blas(), incarnation=self.counters.incarnation)
        code = exitcodes.OK
        try:
            try:
                self.loaded = await self.loop.run_in_executor(self.mlx, self.load)
            except Exception as exc:
                log.error("model_load_failed", model=self.seat.model, error=str(exc))
                exitcodes.record_reason(str(exc) or type(exc).__name__)
                return exitcodes.MODEL_LOAD
            log.info("worker_ready", context_length=self.loaded.context_length,
                     tokenizer_hash=self.loaded.tokenizer_hash[:16])
            server = self.loop.create_task(self.serve())
            await self.stopped.wait()
            server.cancel()
        finally:
            receiver.cancel()
            self.counters.persist()
            self.sock.close(linger=0)
            ctx.term()
            unlink_endpoint(worker_endpoint(self.config, self.seat.name))
            self.mlx.shutdown(wait=False, cancel_futures=True)
        return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sanctum-worker")
    parser.add_argument("--seat", required=True)
    parser.add_argument("--config", default=None)
    args = parser.parse_args(argv)
    setup_logging(f"worker:{args.seat}")
    lifecycle.die_with_parent()
    try:
        config = load_config(args.config)
        seat = config.seat_by_name(args.seat)
    except (ConfigError, KeyError) as exc:
        log.error("config_error", error=str(exc))
        exitcodes.record_reason(str(exc))
        return exitcodes.CONFIG
    if seat.kind != "mlx":
        log.error("config_error", error=f"seat {seat.name} is not a local seat")
        exitcodes.record_reason(f"seat {seat.name} is not a local seat")
        return exitcodes.CONFIG
    code = asyncio.run(SeatWorker(config, seat).run())
    # The MLX thread may still be inside a step; do not wait for it on the way out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
