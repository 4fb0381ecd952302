"""The seat worker: one process, one model, one MLX thread decoding a batch.

    python -m seatd.worker --seat NAME [--config FILE]

The asyncio main thread owns the ZeroMQ ROUTER socket: it answers pings at any
time (also during a long prefill), queues work and sends frames.  A thread of its
own prepares each request in turn (`prepare`: the prompt's tokens, the caps, the
grammar, the KV bytes it holds).  All MLX work runs on one long-lived thread,
because MLX registers compute streams per thread: the batch engine (`seatd.batch`),
which decodes every admitted request as a row of one forward per step.  The worker
hands it prepared requests and reads back one stream of events (`seatd.engine_io`),
which it turns into frames (`Started`, `Chunk`, `Final`).

Every line the process writes names its seat: `main` binds it, and the MLX thread
starts bound as the main thread is (`shared.threads.bound_pool`); a line for one
request names its `request_id` (`prepare` binds it, and the engine as a row is
admitted and ends).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from seatd import blas, device_probe, memory, warm_shapes
from seatd.answer import seam
from seatd.backend import backend, device_name, seat_environment
from seatd.batch import Engine
from seatd.counters import SeatCounters
from seatd.engine_io import Ended, Event, Outbox, RowCancelled, Text, Work
from seatd.engine_io import Started as RowStarted
from seatd.engine_types import PREFILL_CHUNK, DecodeResult, output_width
from seatd.fingerprint import (
    beside,
    fingerprint,
    fingerprint_device,
    model_digest,
    rows_round_apart,
)
from seatd.grammar import GrammarError, GrammarRefusal, SeatGrammar
from seatd.kv_budget import KVBudget, row_bytes
from seatd.memory import MB
from seatd.prompt_cache import SeatPromptCache
from seatd.sampling import KEYED_RULE
from seatd.seating import SeatAdmission
from seatd.speculation import SeatSpeculation, kill_switch
from seatd.tool_calls import Family, ToolSplitter, seat_family, splitter_for, tool_finish
from seatd.turns import turn_marks
from shared import curve, exitcodes, lifecycle, protocol, seat_side
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
from shared.logs import flush_logs, setup_logging
from shared.private_files import make_private_dir
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
    Refused,
    Rejected,
    Shutdown,
    Started,
    Usage,
)
from shared.threads import bound_pool

log = structlog.get_logger()
LAST_WORDS_PINGS = 2  # a worker whose device was lost stops once it answered these (`gone`)


class Refusal(Exception):
    """The seat refuses this request before any work (a client error)."""

    def __init__(self, outcome: Rejected, prompt_tokens: int = 0) -> None:
        super().__init__(outcome.message)
        self.outcome = outcome
        self.prompt_tokens = prompt_tokens


@dataclass
class Job:
    identity: bytes
    request: Generate
    received_at: float = field(default_factory=time.monotonic)
    work: Work | None = None  # the prepared request, once the engine has it
    started_at: float | None = None
    answered: bool = False
    lane: str = ""
    fingerprint: str = ""
    # Tool calls split out of the answer's text (set in `prepare` when the request has
    # tools); fed the answer's text as the engine's events are read.
    calls: ToolSplitter | None = None
    count: int = 0  # completion tokens of the last chunk
    began: bool = False  # a chunk went out
    constrained: bool = False  # decoded under a grammar (response_format, a forced call)


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
    engine: Engine | None = None
    tools: Family | None = None  # the tool-call syntax its model writes (seatd.tool_calls)
    grammar: SeatGrammar | None = None  # constrained decoding (seatd.grammar)


class SeatWorker:
    def __init__(self, config: Config, seat: SeatConfig) -> None:
        self.config = config
        self.seat = seat
        self.state_dir = state_dir(config)
        self.counters = SeatCounters(seat.name, self.state_dir / f"counters-{seat.name}.json")
        self.loaded: Loaded | None = None
        # Requests by id: `waiting` until the batch takes them (at most max_queued;
        # a cancel there gives the place up at once), then `running` as rows.
        self.waiting: dict[str, Job] = {}
        self.running: dict[str, Job] = {}
        self.preparing: asyncio.Queue[Job] = asyncio.Queue()  # until `prepare` took them
        self.draining = False
        self.stopped = asyncio.Event()
        # Bound to the seat itself: its lines name it however the worker was started.
        self.mlx = bound_pool("mlx", seat=seat.name)
        self.prep = bound_pool("prep", seat=seat.name)  # requests prepared (`prepare`)
        self.sock: zmq.asyncio.Socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # Whether a batch neighbour can round a row's bytes here (`seatd.fingerprint`).
        self.rows_round_apart = rows_round_apart(backend())
        # The seat's memory once loaded (`kv_budget`), shown in its pongs.
        self.loaded_bytes = self.kv_budget_bytes = self.memory_budget_bytes = 0
        self.code = exitcodes.OK  # how the worker exits once stopped
        self.device_faulted = False  # an injected device fault came (SANCTUM_FAULT_DEVICE)
        self.pings_since_lost: int | None = None  # pings answered since the device was lost

    @property
    def engine(self) -> Engine | None:
        return self.loaded.engine if self.loaded is not None else None

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
        engine = self.engine
        return Pong(
            seat=self.seat.name,
            pid=os.getpid(),
            incarnation=self.counters.incarnation,
            ready=loaded is not None and not self.draining,
            busy=bool(self.running),
            sent_at=sent_at,
            max_prompt_tokens=loaded.cap if loaded else 0,
            context_length=loaded.context_length if loaded else 0,
            tokenizer_hash=loaded.tokenizer_hash if loaded else "",
            in_flight=tuple(self.running),
            tokens_generated=engine.tokens if engine is not None else 0,
            queued=len(self.waiting),
            rows=len(self.running),
            max_batch=self.seat.max_batch,
            kv_bytes=engine.kv_bytes if engine is not None else 0,
            loaded_bytes=self.loaded_bytes,
            kv_budget_bytes=self.kv_budget_bytes,
            memory_budget_bytes=self.memory_budget_bytes,
            warming=engine is not None and engine.idle is not None,
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
            identity, message = seat_side.read_frames(await self.sock.recv_multipart())
            if isinstance(message, Refused):
                self.refuse(identity, message)
            else:
                self.handle(identity, message)

    def refuse(self, identity: bytes, refused: Refused) -> None:
        """A frame that was not taken: counted and answered (shared/seat_side.py)."""
        self.counters.inc("bad_frames")
        self.counters.inc("bad_frames_by_reason", label=refused.reason)
        named = {"request_id": refused.request_id} if refused.request_id else {}
        log.warning("bad_frame", reason=refused.reason, error=refused.error, **named)
        self.send(identity, seat_side.refusal_reply(refused, self.seat.name,
                                                    self.counters.served,
                                                    self.counters.incarnation))

    def handle(self, identity: bytes, message: protocol.Request) -> None:
        match message:
            case Ping(sent_at=sent_at):
                self.send(identity, self.pong(sent_at))
                if self.pings_since_lost is not None:  # a lost device's last words
                    self.pings_since_lost += 1
                    if self.pings_since_lost >= LAST_WORDS_PINGS:
                        self.stopped.set()
            case Generate():
                job = Job(identity, message)
                rid = message.request_id
                if self.loaded is None or self.engine is None:
                    self.send(identity, self.final(job, Failed("not_ready", "model loading")))
                elif (bad := seat_side.out_of_vocabulary(message, self.loaded.width)) is not None:
                    self.refuse(identity, bad)
                elif self.draining:
                    self.send(identity, self.final(job, Failed("draining", "seat stopping")))
                elif len(self.waiting) >= self.seat.max_queued:
                    self.send(identity, self.final(job, Failed("queue_full", "seat overloaded")))
                elif rid in self.waiting or rid in self.running:
                    self.send(identity, self.final(job, Rejected(
                        400, "duplicate_request_id", f"request {rid} is already in flight")))
                else:
                    kv = message.kv or self.seat.kv
                    job.lane = f"{'stream' if message.stream else 'sync'}/{kv}"
                    job.fingerprint = self.loaded.fingerprints.get(kv, "")
                    self.waiting[rid] = job
                    self.preparing.put_nowait(job)
            case Cancel(request_id=rid):
                queued = self.waiting.pop(rid, None)
                if queued is not None:  # never started: its place goes to the next one
                    if queued.work is not None:
                        queued.work.cancel.set()
                    queued.answered = True
                    self.counters.inc("cancelled")
                    self.send(queued.identity, self.final(queued, Cancelled()))
                elif (running := self.running.get(rid)) is not None and running.work:
                    running.work.cancel.set()
            case GetCounters():
                self.send(identity, CountersReply(self.seat.name, self.counters.snapshot()))
            case Shutdown(drain_s=drain_s):
                self.begin_drain(drain_s)

    # -- work -------------------------------------------------------------

    def load(self) -> Loaded:
        from seatd.model_load import load_for_compute
        from shared.builtin import resolve_model
        from shared.config import resolve_path
        from shared.model_trust import UntrustedCode, trust_refusal

        assert self.seat.model is not None
        path = resolve_model(resolve_path(self.config, self.seat.model))
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        untrusted = trust_refusal(self.config, self.seat)  # the drafter's folder too
        if untrusted:
            raise UntrustedCode(untrusted)
        dtype = None if self.seat.compute_dtype == "auto" else self.seat.compute_dtype
        got = load_for_compute(path, dtype, self.seat.trust_remote_code)
        cap = self.seat.max_prompt_tokens or default_seat_cap(got.context_length)
        spec = SeatSpeculation(self.config, self.seat, got.model, got.tokenizer_hash)
        digest = model_digest(path)
        device = fingerprint_device(backend())
        # the prefill's chunks: the grid, cut at turn boundaries too (seatd.turns)
        prints = {kv: fingerprint(digest, got.compute_dtype, kv, device, KEYED_RULE,
                                  f"{PREFILL_CHUNK}/turns") for kv in ("fp16", "q8")}
        cache = SeatPromptCache(self.seat, got.model)
        width = output_width(got.model)
        budget = self.kv_budget(cache)
        marks = turn_marks(got.tokenizer)
        engine = Engine(got.model, got.tokenizer, got.context_length, width,
                        self.seat.max_batch, budget, SeatAdmission(cache, spec, marks),
                        Outbox(self.ring))
        if spec.kind is not None and spec.unusable is None and spec.rollback.get("fp16") \
                and not kill_switch(self.seat) and warm_shapes.wanted(backend()):
            # in the engine's idle time, the seat serving meanwhile.  A warm-up that
            # fails costs the first requests their compile, never the seat.
            try:
                engine.idle = warm_shapes.Warming(got.model, got.tokenizer,
                                                  got.context_length, width,
                                                  spec.drafter_model,
                                                  on_measured=spec.take_times).step
            except Exception as exc:
                log.warning("warm_up_failed", error=repr(exc))
        return Loaded(got.model, got.tokenizer, got.context_length, got.tokenizer_hash, cap,
                      spec, cache, marks, width, prints, engine,
                      seat_family(got.tokenizer), SeatGrammar(got.tokenizer, width))

    def kv_budget(self, cache: SeatPromptCache) -> KVBudget:
        """The bytes rows and the prompt cache may use: `kv_budget_mb`, or less where
        the seat's memory budget leaves less past its loaded model (`seatd.memory`)."""
        import mlx.core as mx

        mx.clear_cache()  # what a warm-up freed is not the seat's to count
        seat = self.seat
        self.loaded_bytes = memory.in_use(backend())
        budget = seat.memory_budget_mb * MB if seat.memory_budget_mb else None
        room = memory.kv_room(seat.kv_budget_mb * MB, budget, self.loaded_bytes)
        # Freed buffers MLX keeps for reuse count in the process's memory, and on a GPU
        # in every other process's: bounded by the seat's own figures.
        cache_limit = memory.cache_limit(room)
        mx.set_cache_limit(cache_limit)
        self.memory_budget_bytes, self.kv_budget_bytes = budget or 0, room.kv
        log.info("memory_budget", loaded_mb=round(self.loaded_bytes / MB, 1),
                 kv_mb=round(room.kv / MB, 1), headroom_mb=round(room.headroom / MB, 1),
                 cache_limit_mb=round(cache_limit / MB, 1),
                 memory_budget_mb=seat.memory_budget_mb, limited=room.limited)
        return KVBudget(room.kv, min(seat.prompt_cache_mb * MB, room.kv), cache.hold)

    def tokenize(self, request: Generate) -> list[int]:
        assert self.loaded is not None
        if request.prompt_ids is not None:  # a completion's prompt given as ids
            return list(request.prompt_ids)
        return prompt_ids(self.loaded.tokenizer, request.messages, request.prompt,
                          request.tools_json)

    async def prepared(self) -> None:
        """Each request prepared (`prepare`, on a thread of its own: tokenizing a long
        prompt never holds the socket or the batch's steps), then handed to the engine,
        in the order they came.  Requests waiting together are prepared in one call on
        that thread (`prepare_all`): each hand-off between this thread and that one
        waits for the interpreter, which the engine's thread holds for most of a step
        while a batch decodes; one hand-off each way for a burst of requests, not two
        for every one of them, lets a burst reach the engine together."""
        assert self.loop is not None and self.engine is not None
        while True:
            jobs = [await self.preparing.get()]
            while not self.preparing.empty():
                jobs.append(self.preparing.get_nowait())
            jobs = [job for job in jobs if not job.answered]  # cancelled while they waited
            if not jobs:
                continue
            got = await self.loop.run_in_executor(self.prep, self.prepare_all, jobs)
            for job, work in zip(jobs, got, strict=True):
                if isinstance(work, Exception):  # refused (or failed) before any work
                    self.finished(job, Ended(job.request.request_id, None, work,
                                             getattr(work, "prompt_tokens", 0)))
                elif not job.answered:
                    job.work = work
                    self.engine.submit(work)

    def prepare_all(self, jobs: list[Job]) -> list[Work | Exception]:
        """`prepare` for each job in order: its Work, or what refused or failed it."""
        out: list[Work | Exception] = []
        for job in jobs:
            try:
                out.append(self.prepare(job))
            except Exception as exc:
                out.append(exc)
        return out

    def prepare(self, job: Job) -> Work:
        """The request as the engine takes it: its prompt's tokens, checked against the
        seat's caps, its grammar and the KV bytes it holds."""
        with structlog.contextvars.bound_contextvars(request_id=job.request.request_id):
            return self._prepare(job)

    def _prepare(self, job: Job) -> Work:
        assert self.loaded is not None
        loaded = self.loaded
        request = job.request
        try:
            prompt = self.tokenize(request)
        except Exception as exc:  # the chat template refused these messages: the client's
            raise Refusal(Rejected(400, "invalid_messages", f"chat template: {exc}")) from exc
        limit = seat_refusal(len(prompt), loaded.cap, loaded.context_length)
        if limit is not None:
            cap = loaded.cap if limit == "seat_cap" else loaded.context_length - 1
            # Checked before any prefill; the prompt is refused whole, never truncated.
            raise Refusal(Rejected(
                413, "prompt_too_long",
                f"prompt has {len(prompt)} tokens; seat {self.seat.name} takes at "
                f"most {cap} ({limit})",
                {"prompt_tokens": len(prompt), "cap": cap, "seat": self.seat.name,
                 "limit": limit}), len(prompt))
        if not prompt:
            raise Refusal(Rejected(400, "empty_prompt", "the prompt is empty"))
        if loaded.tools is not None:  # tools_json read: the template took it
            job.calls = splitter_for(loaded.tools, request.tools_json, request.tool_choice,
                                     request.request_id, request.parallel_tool_calls)
        if request.prefix is not None or request.prefix_ids is not None:
            request, ids = self._continued(job, request, len(prompt))
            prompt = prompt + ids
        grammar = None
        if loaded.grammar is not None:
            try:  # the matcher starts past a continued answer's tokens
                grammar = loaded.grammar.for_request(request, request.prefix_ids or ())
            except GrammarRefusal as exc:
                raise Refusal(Rejected(400, exc.code, exc.message,
                                       {"param": exc.param})) from exc
            except Exception as exc:  # the request's constraint, not the seat, is at fault:
                # a 400 of its own, never a failure that opens the seat's circuit
                log.error("grammar_build_failed", request_id=request.request_id,
                          error=repr(exc))
                raise Refusal(Rejected(400, "invalid_constraint",
                                       f"the seat could not build this request's grammar: "
                                       f"{exc}")) from exc
            job.constrained = grammar is not None
        kv = request.kv or self.seat.kv
        reserve = row_bytes(loaded.prompt_cache.per_token(kv), len(prompt),
                            request.params.max_tokens, loaded.context_length)
        device_fault = _faulty(request, "SANCTUM_FAULT_DEVICE")
        self.device_faulted |= device_fault
        return Work(request, prompt, kv, reserve, grammar, _faulty(request),
                    device_fault=device_fault)

    def _continued(self, job: Job, request: Generate,
                   n_prompt: int) -> tuple[Generate, list[int]]:
        """A continued answer: the answer so far follows the prompt, and its answer
        positions start after it (the engine reads `prefix_ids`)."""
        assert self.loaded is not None
        loaded = self.loaded
        ids, head = continuation(loaded.tokenizer, request)
        try:
            if job.calls is not None:
                # The client's text lacks the calls it got: the splitter replays the
                # answer so far, and the engine takes all of its text as sent.
                job.calls.resume(head, request.prefix or "")
                request = msgspec.structs.replace(request, prefix=head)
            else:
                seam(head, request.prefix or "")
        except ValueError:
            raise Refusal(Rejected(400, "prefix_mismatch",
                                   "the answer's text does not match its tokens")) from None
        if n_prompt + len(ids) >= loaded.context_length:
            raise Refusal(Rejected(
                413, "prompt_too_long",
                f"prompt and answer so far have {n_prompt + len(ids)} tokens; seat "
                f"{self.seat.name} has a context of {loaded.context_length}",
                {"prompt_tokens": n_prompt + len(ids),
                 "cap": loaded.context_length - 1, "seat": self.seat.name,
                 "limit": "context"}), n_prompt + len(ids))
        return msgspec.structs.replace(request, prefix_ids=tuple(ids)), ids

    # -- the engine's events (`seatd.engine_io`) ---------------------------

    def ring(self) -> None:
        """The engine's outbox has events (called on the MLX thread)."""
        assert self.loop is not None
        try:
            self.loop.call_soon_threadsafe(self.read_events)
        except RuntimeError:  # the loop closed on the way out: nobody reads any more
            pass

    def read_events(self) -> None:
        engine = self.engine
        if engine is None:
            return
        for event in engine.outbox.take():
            self.on_event(event)

    def on_event(self, event: Event) -> None:
        job = self.running.get(event.rid) or self.waiting.get(event.rid)
        if job is None or job.answered:  # cancelled while queued: already answered
            return
        match event:
            case RowStarted():
                job.started_at = event.at
                self.started(job)
            case Text():
                self.on_text(job, event)
            case Ended():
                self.on_ended(job, event)

    def served_if_ok(self, job: Job) -> int:
        ahead = sum(1 for other in self.running.values()
                    if other.started_at is not None and job.started_at is not None
                    and other.started_at < job.started_at)
        return self.counters.served + ahead + 1

    def on_text(self, job: Job, event: Text) -> None:
        text = event.text
        calls: tuple[protocol.ToolCall, ...] = ()
        if job.calls is not None:
            # The chunk goes out even when a call holds all its text: its tokens (and
            # their log-probabilities) are the answer's, and it shows progress.
            text, calls = job.calls.feed(text)
            if job.calls.repeated and job.work is not None:
                job.work.complete.set()  # a call came again: the answer is complete
        first = not job.began
        job.count, job.began = event.count, True
        prompt = cached = 0
        if first and job.work is not None:  # the prompt's size, for the first chunk
            prompt = len(job.work.prompt)
            cached = job.work.resume.start if job.work.resume is not None else 0
        self.send(job.identity, Chunk(event.rid, text, event.count, self.served_if_ok(job),
                                      event.state, job.fingerprint, event.ids,
                                      tool_calls=calls, logprobs=event.logprobs,
                                      prompt_tokens=prompt, cached_tokens=cached))

    def on_ended(self, job: Job, event: Ended) -> None:
        result = event.result
        if result is not None and result.beside and self.rows_round_apart:
            # a batch neighbour may have rounded it: its bytes are named apart
            job.fingerprint = beside(job.fingerprint)
        if result is not None and job.calls is not None:
            # What the splitter still holds (a partial marker, an unclosed call) goes
            # out before the Final, which reports the calls' finish_reason.
            text, calls = job.calls.close(cut=result.finish_reason == "length")
            if text or calls:
                self.send(job.identity, Chunk(event.rid, text, job.count,
                                              self.served_if_ok(job),
                                              result.speculation.state, job.fingerprint,
                                              tool_calls=calls))
        self.finished(job, event)

    def started(self, job: Job) -> None:
        rid = job.request.request_id
        if self.waiting.get(rid) is not job:
            return  # cancelled while queued, and already answered
        del self.waiting[rid]
        self.running[rid] = job
        self.send(job.identity, Started(rid))

    def finished(self, job: Job, ended: Ended) -> None:
        rid = job.request.request_id
        result, error = ended.result, ended.error
        if self.waiting.get(rid) is job:
            del self.waiting[rid]
        if self.running.get(rid) is job:
            del self.running[rid]
        if job.answered:
            return
        job.answered = True
        n_prompt = ended.prompt_tokens
        outcome: Outcome
        match error:
            case None:
                outcome = Ok()
            case RowCancelled():
                outcome = Cancelled()
            case Refusal():
                outcome, n_prompt = error.outcome, error.prompt_tokens
            case GrammarError():  # llguidance stopped mid-answer: never go on unconstrained
                log.error("grammar_failed", request_id=rid, seat=self.seat.name,
                          error=str(error))
                outcome = Failed("grammar_error", str(error) or type(error).__name__)
            case _:
                log.error("generate_failed", request_id=rid, seat=self.seat.name,
                          error=repr(error))
                outcome = Failed("internal_error", str(error) or type(error).__name__)
        with structlog.contextvars.bound_contextvars(request_id=rid, seat=self.seat.name):
            frame = self.account(job, outcome, result, n_prompt, ended.first_token_at)
        self.send(job.identity, frame)

    def account(self, job: Job, outcome: Outcome, result: DecodeResult | None,
                n_prompt: int, first: float | None) -> Final:
        c = self.counters
        lane = job.lane
        started = job.started_at or time.monotonic()
        ttft = (first if first is not None else time.monotonic()) - started
        if self.loaded is not None:
            c.prompt_cache(self.loaded.prompt_cache.drain(), lane,
                           self.loaded.prompt_cache.entries, self.loaded.prompt_cache.nbytes)
            c.spec_costs = self.loaded.speculation.cost_snapshot()
        if self.engine is not None:
            c.batch(self.engine.drain(), len(self.running), len(self.waiting),
                    self.engine.kv_bytes)
            c.memory(memory.mlx_memory())
        if job.constrained:
            c.inc("constrained")
        if job.calls is not None:
            c.inc("tool_calls", job.calls.made - job.calls.replayed)  # this seat's own
            c.inc("tool_parse_failures", job.calls.failures)
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
            finish_reason=tool_finish(result.finish_reason,
                                      job.calls.made if job.calls is not None else 0),
            usage=Usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens),
            speculation=result.speculation.state,
            ttft_s=ttft,
            fingerprint=job.fingerprint,
            stop_sequence=result.stop_sequence or "",
        )

    def trimmed(self) -> None:
        """The engine handed MLX's freed buffers back (`seatd.idle_trim`; called on the
        MLX thread): the seat's MLX gauges say so now, not at the next request's end."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.memory_now)

    def device_lost(self, error: BaseException) -> None:
        """The engine's device no longer computes (`seatd.device_probe`; called on the
        MLX thread, its rows already ended): the worker stops and exits DEVICE_LOST, for
        seatd to start a fresh process (`gone`)."""
        assert self.loop is not None
        self.code = exitcodes.DEVICE_LOST
        exitcodes.record_reason(f"the device stopped computing: {error!r}")
        try:
            self.loop.call_soon_threadsafe(self.gone, error)
        except RuntimeError:  # the loop closed on the way out: nobody reads any more
            pass

    def gone(self, error: BaseException) -> None:
        """(the loop) The device lost: new requests are refused as a stopping seat's
        (its pongs say it is not ready), the rows' own ends are sent, every request still
        held (queued, being prepared, or handed to the engine but not yet a row) ends with
        the error, and the worker stops once the proxy has read them."""
        self.draining = True
        self.read_events()
        for job in [*self.running.values(), *self.waiting.values()]:
            self.finished(job, Ended(job.request.request_id, None, error, 0))
        # The proxy takes what arrived from its seat whenever it pings it (one pipe, in
        # order): a ping sent after these answers arrived finds them read.  The second
        # ping to come after them was sent a heartbeat after the first, so the worker
        # stops once it has answered that one, or after the proxy's own clock for a
        # silent seat where no ping comes.
        self.pings_since_lost = 0
        proxy = self.config.proxy
        assert self.loop is not None
        self.loop.call_later(proxy.heartbeat_s * (proxy.liveness + 1), self.stopped.set)

    def probe(self) -> None:
        """`seatd.device_probe.probe`, which fails once an injected device fault came
        (SANCTUM_FAULT_DEVICE, as tests set it)."""
        if self.device_faulted:
            raise RuntimeError("injected device fault (SANCTUM_FAULT_DEVICE): the device "
                               "is lost")
        device_probe.probe()

    def memory_now(self) -> None:
        self.counters.memory(memory.mlx_memory())
        try:
            self.counters.persist()
        except OSError as exc:
            log.error("counters_not_saved", error=str(exc))

    # -- lifecycle --------------------------------------------------------

    def begin_drain(self, drain_s: float) -> None:
        if self.draining:
            return
        self.draining = True
        log.info("draining", drain_s=drain_s, queued=len(self.waiting), rows=len(self.running))
        assert self.loop is not None
        self.loop.create_task(self._drain(drain_s))

    async def _drain(self, drain_s: float) -> None:
        deadline = time.monotonic() + drain_s
        while (self.running or self.waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.stopped.set()

    async def loaded_or_stopped(self) -> Loaded | None:
        """The model, or None when the worker is told to stop while it loads: a large
        model loads for longer than a drain, and waiting would end in a kill, which
        leaves the socket file behind.  The load's thread is left to the exit."""
        assert self.loop is not None
        load = self.loop.run_in_executor(self.mlx, self.load)
        stop = self.loop.create_task(self.stopped.wait())
        await asyncio.wait((load, stop), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if load.done():
            return load.result()
        log.info("stopped_while_loading")
        return None

    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        make_private_dir(self.state_dir)
        ctx = zmq.asyncio.Context()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, seat_side.frame_bound(self.config.proxy))
        gate = curve.bind_seat(ctx, self.sock, worker_endpoint(self.config, self.seat.name),
                               curve.server_keys(self.config, self.seat), self.seat.name,
                               lambda: self.counters.inc("curve_denied"))
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.begin_drain, self.config.seatd.drain_s)
        receiver = self.loop.create_task(self.receive())
        log.info("worker_starting", blas=blas.loaded_blas(), incarnation=self.counters.incarnation)
        try:
            try:
                loaded = await self.loaded_or_stopped()
                if loaded is None:
                    return exitcodes.OK  # stopped while the model loaded: nothing to drain
                self.loaded = loaded
            except Exception as exc:
                log.error("model_load_failed", model=self.seat.model, error=str(exc))
                exitcodes.record_reason(str(exc) or type(exc).__name__)
                return exitcodes.MODEL_LOAD
            self.counters.device = f"{backend()}: {device_name()}"
            self.counters.persist()  # `sanctum status` names the device from here
            log.info("worker_ready", context_length=self.loaded.context_length,
                     tokenizer_hash=self.loaded.tokenizer_hash[:16], backend=backend(),
                     device=device_name())
            assert self.loaded.engine is not None
            engine = self.loaded.engine
            engine.on_trim = self.trimmed
            engine.on_device_lost = self.device_lost
            engine.probe = self.probe
            server = self.loop.run_in_executor(self.mlx, engine.run)
            preparer = self.loop.create_task(self.prepared())
            await self.stopped.wait()
            engine.stop()
            server.cancel()
            preparer.cancel()
        finally:
            receiver.cancel()
            self.counters.persist()
            self.sock.close(linger=0)
            if gate is not None:
                gate.stop()
            ctx.term()
            unlink_endpoint(worker_endpoint(self.config, self.seat.name))
            self.mlx.shutdown(wait=False, cancel_futures=True)
            self.prep.shutdown(wait=False, cancel_futures=True)
        return self.code


def continuation(tokenizer: Any, request: Generate) -> tuple[list[int], str]:
    """The tokens of a continued answer's prefix and their text as the answer's
    detokenizer has it: the tokens the seat that began it sent (`prefix_ids`, from a seat
    with this tokenizer), or the text's own.  The caller checks that text against what
    the client has (`seatd.answer.seam`)."""
    ids = (list(request.prefix_ids) if request.prefix_ids is not None
           else list(tokenizer.encode(request.prefix or "", add_special_tokens=False)))
    detok = tokenizer.detokenizer
    detok.reset()
    for token in ids:
        detok.add_token(token)
    head = str(detok.last_segment)
    detok.reset()
    return ids, head


def _faulty(request: Generate, name: str = "SANCTUM_FAULT_ROW") -> bool:
    """Fault injection for tests of a failing row: SANCTUM_FAULT_ROW=MARKER makes the
    prefill of any request whose prompt holds MARKER raise (the row fails, the batch and
    the worker go on); SANCTUM_FAULT_DEVICE=MARKER makes it raise and the device probe
    fail from then on (`SeatWorker.probe`: the worker exits DEVICE_LOST and seatd starts
    it again).  Unset, as in any real deployment, they do nothing."""
    marker = os.environ.get(name)
    if not marker:
        return False
    texts = [request.prompt or ""] + [m.content for m in request.messages or ()]
    return any(marker in t for t in texts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sanctum-worker")
    parser.add_argument("--seat", required=True)
    parser.add_argument("--config", default=None)
    args = parser.parse_args(argv)
    seat_environment()  # before the MLX thread's first step
    setup_logging(f"worker:{args.seat}")
    structlog.contextvars.bind_contextvars(seat=args.seat)  # before any thread starts
    lifecycle.die_with_parent()
    try:
        config = load_config(args.config)
        seat = config.seat_by_name(args.seat)
        curve.server_keys(config, seat)  # a key file that cannot be used: say so, once
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
    flush_logs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
