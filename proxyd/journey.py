"""One request's way down its ladder: admission, one attempt at a time, events out.

    Journey(proxy, route, gen, offbox_header, gone).events() -> AsyncIterator[Event]

This is plumbing: every decision is a pure function elsewhere (which rungs may
be tried: `ladder.plan`; whether the rung can honour every field of the request:
`ladder.unsupported`; whether the prompt fits a rung: `Admission.judge` and
`caps`; whether the rung's circuit admits it: `breaker.admit`; what an
attempt's end means before and after commit: `ladder.decide`; what it tells the
circuit: `ladder.breaker_verdict`; what a continuing rung is asked:
`ladder.continued`; which error ends a request no rung answered:
`conclusion.conclude`; whether a rung is ready, loading or down:
`proxyd.seat_state`).  The journey calls them in order, counts, logs, and
yields `proxyd.events` for a front door to render.

Before its commit, a request that reaches a loading local seat with no ready rung
after it waits (proxyd/load_wait.py) for one to be ready, at most
`proxy.load_wait_s` in all, then goes on down the ladder; a request whose wait runs
out gets 503 `loading` with Retry-After.  A loading seat with a ready rung after it
is passed over at once (`failed:not_ready`): the first ready rung answers.

A request no rung answered before commit ends with the conclusion's error, raised;
a stream that began and that no later rung could finish ends with an `Abort`.  A
stream under a constraint (`constraint`: tools the model may call, a response_format)
is continued only where the constraint holds across the seam (`may_continue`): by a
local seat given the answer's exact tokens, whose grammar starts past them and whose
tool-call parser replays them.  A hosted rung, or a seat given only the text (another
tokenizer, a hosted rung's text), is passed over as `skipped:constrained`.

The front door tells the journey when its client went away (`left()`) and then
stops iterating; closing the iterator ends the seat's attempt (its work is
cancelled there).  The journey itself looks at `gone()` where nothing is written:
before the commit, and between a non-stream answer's chunks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, NoReturn

import msgspec
import structlog

from proxyd import on_demand
from proxyd.conclusion import conclude
from proxyd.events import Abort, Answer, Commit, Done, Event, Text
from proxyd.ladder import (
    UNSUPPORTED,
    Attempt,
    Phase,
    Segment,
    Skipped,
    Step,
    attempts_header,
    continued,
    decide,
    fallback_reason,
    offbox_allowed,
    outcome_label,
    plan,
    prefix_ids,
    unsupported,
)
from proxyd.load_wait import Waited, must_wait, wait_for_rung
from proxyd.proxy import Proxy
from proxyd.readiness import rung_states
from proxyd.replay import DIVERGED, Replay
from proxyd.seat_client import SeatClient
from proxyd.seat_state import SeatState
from shared.caps import Verdict
from shared.config import RouteConfig
from shared.errors import CONTEXT_LENGTH, BadRequest, Loading, client_error
from shared.protocol import (
    Chunk,
    Failed,
    Final,
    Generate,
    Outcome,
    Pong,
    Rejected,
    Retry,
    TokenLogprob,
    ToolCall,
)

log = structlog.get_logger()
# The skip of a rung that could not take a begun answer: its chat template refused the
# chat (a 400 before the commit, where it is the request's fault).
TEMPLATE_REFUSED = "template_refused"
# A rung asked afresh whose answer did not replay the text already sent.
DIVERGED_REASON = "replay_diverged"


def may_continue(gen: Generate, hosted: bool) -> bool:
    """Whether a rung may be given `gen`, a begun answer to continue: any rung for free
    text; under a constraint only a local seat given the answer's exact tokens
    (`gen.prefix_ids`).  From the text alone a seat's grammar and tool-call parser could
    not resume where the answer is (the calls the client got are not in its text), and
    a hosted rung takes a prefill without either.  A prompt of token ids has no text for
    a hosted rung to put a prefill after: only a local seat continues it."""
    if hosted and gen.prompt_ids is not None:
        return False
    return constraint(gen) is None or (not hosted and gen.prefix_ids is not None)


def constraint(gen: Generate) -> str | None:
    """What holds a request's answer to a shape, so that after the commit only a rung
    that can resume it exactly may continue it: "response_format", "tools" (tools the
    model may call), or None."""
    if gen.response_format is not None:
        return "response_format"
    if gen.tools_json is not None and gen.tool_choice != "none":
        return "tools"
    return None


@dataclass
class Held:
    """A sync answer's parts from one rung, held until its final frame (a stream sends
    each chunk on as it comes)."""

    texts: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    parts: list[str | ToolCall] = field(default_factory=list)  # in the order they came

    def take(self, frame: Chunk, segment: Segment, answer: Answer) -> None:
        self.texts.append(frame.text)
        self.calls.extend(frame.tool_calls)
        if frame.text:  # a chunk's text comes before the calls it completes
            if self.parts and isinstance(self.parts[-1], str):
                self.parts[-1] += frame.text
            else:
                self.parts.append(frame.text)
        self.parts.extend(frame.tool_calls)
        self.logprobs.extend(frame.logprobs)
        segment.tokens = max(segment.tokens, frame.completion_tokens)
        answer.served = frame.served_if_ok
        answer.speculation = frame.speculation or answer.speculation
        answer.fingerprint = frame.fingerprint or answer.fingerprint


@dataclass
class Try:
    """One rung's try, as `Journey._try` leaves it: whether the journey ends with it
    (answered, stopped, or the client left), and the rung that broke the answer (a
    failure after the commit point), carried to the next try."""

    name: str
    segment: Segment
    broke: tuple[str, Failed | Rejected] | None
    held: Held = field(default_factory=Held)
    ended: bool = False
    # A continuation asked afresh of a rung that takes no prefill: its answer replays
    # the text sent before it goes on (`proxyd.replay`).
    replay: Replay | None = None
    refused_prefill: bool = False  # it answered the prefill with a 400: ask it afresh


class Journey:
    def __init__(self, proxy: Proxy, route: RouteConfig, gen: Generate,
                 offbox_header: str | None, gone: Callable[[], bool]) -> None:
        self.proxy = proxy
        self.route = route
        self.gen = gen
        self.gone = gone
        self.plan = plan(route, proxy.seats, offbox_allowed(route, offbox_header))
        self.attempts: list[Attempt] = []
        self.probes: set[str] = set()  # rungs this request holds the half-open probe of
        self.seat = ""  # the rung being tried now
        self.committed = False
        self.segments: list[Segment] = []  # the rungs that wrote the answer, in order
        self.sent: list[str] = []  # the text the client has, as it went out
        self.created = int(time.time())
        self.started = time.monotonic()
        self.load_deadline: float | None = None  # on the proxy's clock, once it waited

    def record(self, seat: str, outcome: Outcome | Skipped) -> None:
        self.attempts.append((seat, outcome))
        self.proxy.counters.inc("attempts", seat, outcome_label(outcome).split(":")[0])
        if not isinstance(outcome, Skipped):
            self.proxy.settle(seat, outcome, seat in self.probes)

    def left(self) -> None:
        """The client went away: counted, and the attempt ends (the caller stops
        iterating, which cancels the seat's work)."""
        self.proxy.counters.inc("client_disconnects")
        self.record(self.seat, Failed("client_disconnected"))
        log.info("client_disconnected", request_id=self.gen.request_id, seat=self.seat,
                 committed=self.committed)

    def request_for(self, name: str) -> Generate:
        """What rung `name` is asked: the request, or after the commit point the request
        continued from the text already sent (with its exact tokens where they fit)."""
        if not self.committed:
            return self.gen
        client = self.proxy.clients[name]
        hosted = not client.local
        if hosted and not self.proxy.takes_prefill(name):
            return self.gen  # asked afresh: its answer replays the text sent
        pong = client.pong
        ids = prefix_ids(self.segments, pong.tokenizer_hash) if pong is not None else None
        return continued(self.gen, "".join(self.sent), ids,
                         sum(seg.tokens for seg in self.segments), hosted)

    async def events(self) -> AsyncGenerator[Event, None]:
        """The journey down the ladder: each allowed rung tried in turn (`take_rung`
        says whether and how it is asked), its frames taken as one try (`_try`), until
        one answers, a step ends the journey, or no rung is left."""
        rid = self.gen.request_id
        memo: dict[Any, int] = {}
        answer: Answer | None = None
        broke: tuple[str, Failed | Rejected] | None = None  # the last rung that failed
        over_cap: list[dict[str, str | int]] = []  # continuations too long for a rung
        for i, name in enumerate(self.plan.rungs):
            self.seat = name
            taken = await self.take_rung(i, name, memo, over_cap)
            if taken is Waited.GONE:
                return
            if taken is None:  # skipped, and recorded so
                continue
            assert not isinstance(taken, Waited)
            gen, verdict, pong, probe = taken
            if answer is None:
                answer = Answer(rid, name, self.created)
            while True:
                now = Try(name, Segment(name, tokenizer=pong.tokenizer_hash if pong else "",
                                        ids=[] if pong else None), broke,
                          replay=self.replay_for(name))
                # closed with the journey: a client that leaves mid-answer cancels the
                # rung's work at once (`aclosing` closes its frames)
                async with aclosing(self._try(now, answer, gen, verdict, probe)) as attempt:
                    async for event in attempt:
                        yield event
                if not now.refused_prefill:
                    break
                gen, probe = self.request_for(name), False  # the same rung, afresh
            if now.ended:
                return
            broke = now.broke
            if not self.committed:
                self.segments.clear()  # nothing of a failed sync attempt is kept
        if self.committed:
            # The answer began and no rung could finish it: an honest end, naming the
            # rung that broke and listing every try.
            assert answer is not None and broke is not None
            yield self.abort(answer, broke, over_cap)
            return
        self.conclude()  # every allowed rung failed or was skipped; nothing was sent

    async def _try(self, now: Try, answer: Answer, gen: Generate, verdict: Verdict,
                   probe: bool) -> AsyncGenerator[Event, None]:
        """One rung's try: its frames, until its final one says what its end means
        (`end_attempt`).  `now` is left saying whether the journey ends with it and
        which rung broke the answer."""
        name, segment = now.name, now.segment
        seat_cfg, client = self.proxy.seats[name], self.proxy.clients[name]
        # An attempt also ends when the client leaves while it waits (a local seat's
        # queue place, prefill or next chunk; a hosted rung's back-off).  A rung's
        # half-open probe is one try.
        frames = client.frames(gen, seat_cfg.first_token_s, seat_cfg.stall_s,
                               gone=self.gone, tries=1 if probe else None)
        async with aclosing(frames) as it:
            async for frame in it:
                if type(frame) is Chunk and now.replay is not None:
                    taken = now.replay.take(frame)
                    if taken is DIVERGED:
                        self.diverged(name)
                        return
                    if taken is None:
                        continue
                    frame = taken
                if type(frame) is Chunk:
                    if not self.committed and self.gone():  # before anything went out
                        self.left()
                        now.ended = True
                        return
                    if not self.gen.stream:
                        now.held.take(frame, segment, answer)
                        continue
                    if not self.committed:
                        # Committing to this seat: it begins the answer.  Its attempt has
                        # not ended, so the header says so.
                        self.note(answer, name, frame)
                        answer.attempts = attempts_header(self.attempts, streaming=name)
                        self.committed = True
                        yield Commit(answer)
                    else:
                        if segment not in self.segments:
                            # The first text of a continuing rung: the seam.
                            assert now.broke is not None
                            self.seam(now.broke, name)
                        self.note(answer, name, frame)
                    yield self.text(segment, frame)
                    continue
                if isinstance(frame, Retry):
                    # A hosted rung tries again: the failed try is listed, never served.
                    self.attempts.append((name, frame.outcome))
                    self.proxy.counters.inc("attempts", name, "failed")
                    continue
                assert isinstance(frame, Final)
                step, outcome = self.end_attempt(name, frame, segment)
                if step is Step.RETURN_ERROR:
                    assert isinstance(outcome, Rejected)
                    self.refuse(name, outcome, verdict)
                if step is Step.CONTINUE and self.refuses(name, gen, outcome):
                    self.proxy.refused_prefill(name)
                    now.refused_prefill = True
                if step is Step.CONTINUE:
                    assert isinstance(outcome, Failed | Rejected)
                    # A rung that could not continue before sending any of its own
                    # text (it refused the prefill, or failed) did not break the
                    # answer: the error to report stays the one of the rung that did.
                    if segment in self.segments:
                        now.broke = (name, outcome)
                if step is Step.DONE:
                    yield self.done(answer, name, segment, frame, now.held)
                now.ended = step in (Step.DONE, Step.STOP)
                return

    async def take_rung(self, i: int, name: str, memo: dict[Any, int],
                        over_cap: list[dict[str, str | int]]
                        ) -> tuple[Generate, Verdict, Pong | None, bool] | Waited | None:
        """Whether the ladder's i-th rung, `name`, is tried now: (the request it is
        given, admission's verdict, its last pong, whether this try is its circuit's
        half-open probe); None: it is skipped, and recorded so; Waited.GONE: the client
        left while the request waited for a loading seat."""
        proxy, rid = self.proxy, self.gen.request_id
        seat_cfg = proxy.seats[name]
        client = proxy.clients[name]
        gen = self.request_for(name)
        field = unsupported(gen, seat_cfg)
        if field is not None:  # never answered without a field it was given
            self.record(name, Skipped(UNSUPPORTED, field=field))
            return None
        if self.committed:
            if not may_continue(gen, hosted=not client.local):
                self.record(name, Skipped("constrained"))
                return None
            memo.clear()  # a longer prompt: counted again for every rung
        pong = client.pong
        try:
            verdict = await proxy.admission.judge(seat_cfg, gen, memo,
                                                  pong.max_prompt_tokens if pong else 0)
        except BadRequest:
            if not self.committed:
                raise
            # A continuing rung whose chat template refuses the chat (another model
            # family than the rung that began the answer): it cannot continue it.
            self.record(name, Skipped(TEMPLATE_REFUSED))
            return None
        if verdict.admitted and isinstance(client, SeatClient) and client.on_demand:
            woke = await self.wake(name, client)
            if woke is not None:
                return woke if woke is Waited.GONE else None
        if verdict.admitted and not self.committed and client.state is SeatState.LOADING:
            waited = await self.wait_for_load(self.plan.rungs[i:])
            if waited is Waited.GONE:
                return waited
            if waited is not None:  # a seat that loaded meanwhile tells its own cap
                pong = client.pong
                verdict = await proxy.admission.judge(
                    seat_cfg, gen, memo, pong.max_prompt_tokens if pong else 0)
        if not verdict.admitted:
            self.record(name, Skipped("over_cap", verdict))
            if self.committed:
                log.info("continuation_over_cap", request_id=rid, seat=name,
                         prompt_tokens=verdict.tokens, cap=verdict.cap)
                over_cap.append({"seat": name, "prompt_tokens": verdict.tokens or 0,
                                 "cap": verdict.cap or 0})
            return None
        admitted, probe = proxy.admit(name)
        if not admitted:
            self.record(name, Skipped("circuit_open"))
            return None
        if probe:
            self.probes.add(name)
        return gen, verdict, pong, probe

    def text(self, segment: Segment, frame: Chunk) -> Text:
        """A streamed chunk sent on: its rung's segment of the answer grows by it."""
        if segment not in self.segments:
            self.segments.append(segment)
        segment.tokens = max(segment.tokens, frame.completion_tokens)
        if segment.ids is not None:
            segment.ids.extend(frame.ids)
        self.sent.append(frame.text)
        return Text(frame.text, frame.tool_calls, frame.logprobs)

    def end_attempt(self, name: str, frame: Final, segment: Segment) -> tuple[Step, Outcome]:
        """What the end of rung `name`'s attempt means now (`ladder.decide`), recorded,
        counted and logged; a client that left ends the journey (Step.STOP)."""
        outcome = frame.outcome
        if isinstance(outcome, Failed) and outcome.reason == "client_disconnected":
            self.left()
            return Step.STOP, outcome
        self.record(name, outcome)
        segment.served, segment.outcome = frame.served, outcome_label(outcome)
        phase = Phase.AFTER_COMMIT if self.committed else Phase.BEFORE_COMMIT
        step = decide(outcome, phase)
        if step is not Step.DONE:  # an answer is logged once, as `answered`
            log.info("attempt", request_id=self.gen.request_id, seat=name,
                     outcome=outcome_label(outcome), phase=phase.value,
                     step=step.value, sent_tokens=segment.tokens)
        if step is Step.NEXT_RUNG:
            self.proxy.counters.inc("fallbacks", fallback_reason(outcome))
        return step, outcome

    def refuse(self, name: str, outcome: Rejected, verdict: Verdict) -> NoReturn:
        """The rung's refusal goes back to the client as it is (trying another rung
        cannot fix it); a 413 for a prompt the proxy admitted is a cap disagreement."""
        if outcome.status == 413 and verdict.tokens is not None:
            # We admitted what the seat refused: the layers disagree.
            self.proxy.counters.inc("cap_disagreements")
            log.error("cap_disagreement", seat=name, proxy_tokens=verdict.tokens,
                      proxy_count_exact=verdict.exact,
                      proxy_cap=verdict.cap,
                      seat_tokens=outcome.extra.get("prompt_tokens"),
                      seat_cap=outcome.extra.get("cap"))
        raise client_error(outcome.status, outcome.code, outcome.message,
                           attempts=attempts_header(self.attempts),
                           **outcome.extra)

    def done(self, answer: Answer, name: str, segment: Segment, frame: Final,
             held: Held) -> Done:
        """Rung `name` answered: the answer as its own final frame tells it."""
        self.proxy.counters.inc("answered_by", name)
        if segment not in self.segments:
            self.segments.append(segment)  # a sync answer, or one without text
        answer.seat = name
        answer.served = frame.served
        answer.speculation = frame.speculation
        answer.upstream_model = frame.model
        answer.fingerprint = frame.fingerprint or answer.fingerprint
        answer.stop_sequence = frame.stop_sequence
        answer.attempts = attempts_header(self.attempts)
        answer.segments = [seg.body() for seg in self.segments]
        usage = frame.usage
        if answer.continued:  # every rung's own tokens; the last rung's prompt
            usage = msgspec.structs.replace(
                usage, completion_tokens=sum(seg.tokens for seg in self.segments))
        log.info("answered", request_id=self.gen.request_id, seat=name,
                 attempts=answer.attempts, segments=len(self.segments),
                 prompt_tokens=usage.prompt_tokens,
                 completion_tokens=usage.completion_tokens,
                 ttft_s=round(frame.ttft_s, 4),
                 elapsed_s=round(time.monotonic() - self.started, 4))
        return Done(answer, "".join(held.texts), frame.finish_reason, usage,
                    tuple(held.calls), tuple(held.logprobs), tuple(held.parts))

    def abort(self, answer: Answer, broke: tuple[str, Failed | Rejected],
              over_cap: list[dict[str, str | int]]) -> Abort:
        """The end of an answer that began and that no rung could finish."""
        seat, outcome = broke
        self.proxy.counters.inc("midstream_aborts")
        answer.segments = [seg.body() for seg in self.segments]
        bound = constraint(self.gen)
        why = "no rung could finish it" if bound is None else \
            f"no rung could finish it under its {bound} (only a local seat given " \
            "the answer's exact tokens may)"
        return Abort(f"seat {seat} failed after the answer began "
                     f"({outcome_label(outcome)}) and {why}; the answer is incomplete",
                     "midstream_failure", seat, attempts_header(self.attempts),
                     answer.segments, over_cap)

    def conclude(self) -> NoReturn:
        """Every allowed rung failed or was skipped, and nothing was sent: the error."""
        proxy, counters = self.proxy, self.proxy.counters
        states = rung_states(proxy, self.plan.rungs)
        end = conclude(self.attempts, self.plan, self.route.model,
                       frozenset(n for n, s in states.items() if s is SeatState.LOADING))
        if end.counter is not None:
            counters.inc(end.counter)
        if end.refused_tokens is not None:
            counters.refused(end.refused_tokens)
        raise end.error

    async def wake(self, name: str, client: SeatClient) -> Waited | Skipped | None:
        """An on-demand seat (proxyd/on_demand.py): wait out a hold (seatd deciding
        whether it sleeps to make room for another), and wake it if it sleeps; the
        request then waits for it like for a loading seat, whatever rungs come after
        (it asked for this model).  None: go on with it; a Skipped (recorded): no room
        for it, seatd could not wake it, or it sleeps and the answer has begun;
        Waited.GONE: the client left."""
        while client.held is not None:
            await client.held.wait()
        if client.state is not SeatState.SLEEPING:
            return None
        if self.committed:  # a begun answer does not wait for a load
            skip = Skipped("sleeping")
            self.record(name, skip)
            return skip
        why = await on_demand.wake(self.proxy, name)
        if why is not None:
            skip = Skipped(why.reason, detail=why.message)
            self.record(name, skip)
            return skip
        waited = await self.wait_for_load((name,))
        return Waited.GONE if waited is Waited.GONE else None

    async def wait_for_load(self, rungs: tuple[str, ...]) -> Waited | None:
        """Wait, if none of `rungs` (this one and those after it) is ready and some is
        loading, for one to be ready; None: no need.  The request's waits share one
        deadline.  A wait that runs out raises `Loading`."""
        proxy = self.proxy
        if not must_wait(proxy, rungs):
            return None
        rid, wait_s = self.gen.request_id, proxy.config.proxy.load_wait_s
        began = proxy.clock()
        if self.load_deadline is None:
            self.load_deadline = began + wait_s
        log.info("load_wait", request_id=rid, seat=rungs[0], rungs=list(rungs),
                 wait_s=round(self.load_deadline - began, 3))
        waited = await wait_for_rung(proxy, rungs, self.load_deadline, self.gone)
        if waited is Waited.GONE:
            # Nothing was asked of any seat: no attempt to record.
            proxy.counters.inc("client_disconnects")
            log.info("client_disconnected", request_id=rid, seat=rungs[0], committed=False,
                     during="load_wait")
            return waited
        proxy.counters.inc("load_waits", waited.value)
        log.info("load_waited", request_id=rid, outcome=waited.value,
                 waited_s=round(proxy.clock() - began, 3))
        if waited is Waited.TIMEOUT:
            loading = [n for n, s in rung_states(proxy, rungs).items()
                       if s is SeatState.LOADING]
            raise Loading(f"route {self.route.model!r} is still loading: no seat of it "
                          f"was ready within {wait_s:g}s ({', '.join(loading)} loading); "
                          "retry shortly", attempts=attempts_header(self.attempts),
                          loading=loading)
        return waited

    def note(self, answer: Answer, name: str, frame: Chunk) -> None:
        """The answer's facts from the rung sending now: each chunk names its writer."""
        answer.seat = name
        answer.served = frame.served_if_ok
        answer.speculation = frame.speculation or answer.speculation
        answer.fingerprint = frame.fingerprint or answer.fingerprint
        if frame.prompt_tokens and not answer.prompt_tokens:  # the first rung's prompt
            answer.prompt_tokens, answer.cached_tokens = frame.prompt_tokens, \
                frame.cached_tokens

    def replay_for(self, name: str) -> Replay | None:
        """A continuing hosted rung asked afresh replays the text the client has."""
        if self.committed and not self.proxy.clients[name].local \
                and not self.proxy.takes_prefill(name):
            return Replay("".join(self.sent))
        return None

    def refuses(self, name: str, gen: Generate, outcome: Outcome) -> bool:
        """A hosted rung's 400 to a continuation's prefill: it takes none (a context-
        length refusal says the longer prompt did not fit, not that)."""
        return (isinstance(outcome, Rejected) and outcome.code != CONTEXT_LENGTH
                and gen.prefix is not None and not self.proxy.clients[name].local)

    def diverged(self, name: str) -> None:
        """A rung asked afresh answered otherwise than the text sent: its try ends
        before any of it went out, listed, and the ladder goes on.  Not a failure of the
        rung's health: its circuit is not told."""
        self.attempts.append((name, Failed(DIVERGED_REASON)))
        self.proxy.counters.inc("attempts", name, "failed")
        log.info("continuation_diverged", request_id=self.gen.request_id, seat=name,
                 sent_chars=sum(len(t) for t in self.sent))

    def seam(self, broke: tuple[str, Failed | Rejected], name: str) -> None:
        """A continuing rung sends its first text: counted by the failure that made it
        necessary and by the pair of rungs."""
        seat, outcome = broke
        reason = outcome.reason if isinstance(outcome, Failed) else outcome.code
        self.proxy.counters.inc("continuations", reason, seat, name)
        log.info("continued", request_id=self.gen.request_id, broke=seat, reason=reason,
                 seat=name, sent_chars=sum(len(t) for t in self.sent))
