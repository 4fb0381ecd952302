"""One request's way down its ladder: admission, one attempt at a time, events out.

    Journey(proxy, route, gen, offbox_header, gone).events() -> AsyncIterator[Event]

This is plumbing: every decision is a pure function elsewhere (which rungs may
be tried: `ladder.plan`; whether the prompt fits a rung: `Admission.judge` and
`caps`; whether the rung's circuit admits it: `breaker.admit`; what an
attempt's end means before and after commit: `ladder.decide`; what it tells the
circuit: `ladder.breaker_verdict`; which error ends a request no rung answered:
`conclusion.conclude`).  The journey calls them in order, counts, logs, and
yields `proxyd.events` for a front door to render.  A request no rung answered
before commit ends with the conclusion's error, raised.

The front door tells the journey when its client went away (`left()`) and then
stops iterating; closing the iterator ends the seat's attempt (its work is
cancelled there).  The journey itself looks at `gone()` where nothing is written:
before the commit, and between a non-stream answer's chunks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

import structlog

from proxyd.conclusion import conclude
from proxyd.events import Abort, Answer, Commit, Done, Event, Text
from proxyd.ladder import (
    Attempt,
    Phase,
    Skipped,
    Step,
    attempts_header,
    decide,
    fallback_reason,
    offbox_allowed,
    outcome_label,
    plan,
)
from proxyd.proxy import Proxy
from proxyd.seat_client import SeatClient
from shared.config import RouteConfig
from shared.errors import client_error
from shared.protocol import Chunk, Failed, Final, Generate, Ok, Outcome, Rejected, Retry

log = structlog.get_logger()


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
        self.created = int(time.time())
        self.started = time.monotonic()

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

    async def events(self) -> AsyncGenerator[Event, None]:
        proxy, gen, counters = self.proxy, self.gen, self.proxy.counters
        rid, stream = gen.request_id, gen.stream
        memo: dict[Any, int] = {}
        for name in self.plan.rungs:
            self.seat = name
            seat_cfg = proxy.seats[name]
            client = proxy.clients[name]
            pong = client.pong if isinstance(client, SeatClient) else None
            verdict = await proxy.admission.judge(seat_cfg, gen, memo,
                                                  pong.max_prompt_tokens if pong else 0)
            if not verdict.admitted:
                self.record(name, Skipped("over_cap", verdict))
                continue
            admitted, probe = proxy.admit(name)
            if not admitted:
                self.record(name, Skipped("circuit_open"))
                continue
            if probe:
                self.probes.add(name)
            answer = Answer(rid, name, self.created)
            texts: list[str] = []
            # An attempt also ends when the client leaves while it waits (a local seat's
            # queue place, prefill or next chunk; a hosted rung's back-off).
            frames = client.frames(gen, seat_cfg.first_token_timeout_s,
                                   seat_cfg.stall_timeout_s, gone=self.gone)
            async with aclosing(frames) as it:
                async for frame in it:
                    if type(frame) is Chunk:
                        answer.served = frame.served_if_ok
                        answer.speculation = frame.speculation or answer.speculation
                        answer.fingerprint = frame.fingerprint or answer.fingerprint
                        if not stream:
                            texts.append(frame.text)
                            if self.gone():
                                self.left()
                                return
                            continue
                        if not self.committed:
                            if self.gone():
                                self.left()
                                return
                            # Committing to this seat: it is the answering one.
                            answer.attempts = attempts_header([*self.attempts, (name, Ok())])
                            self.committed = True
                            yield Commit(answer)
                        yield Text(frame.text)
                        continue
                    if isinstance(frame, Retry):
                        # A hosted rung tries again: the failed try is listed, never served.
                        self.attempts.append((name, frame.outcome))
                        counters.inc("attempts", name, "failed")
                        continue
                    assert isinstance(frame, Final)
                    outcome = frame.outcome
                    if isinstance(outcome, Failed) and outcome.reason == "client_disconnected":
                        self.left()
                        return
                    self.record(name, outcome)
                    phase = Phase.AFTER_COMMIT if self.committed else Phase.BEFORE_COMMIT
                    step = decide(outcome, phase)
                    if step is not Step.DONE:  # an answer is logged once, as `answered`
                        log.info("attempt", request_id=rid, seat=name,
                                 outcome=outcome_label(outcome), phase=phase.value,
                                 step=step.value)
                    if step is Step.NEXT_RUNG:
                        counters.inc("fallbacks", fallback_reason(outcome))
                        break
                    if step is Step.RETURN_ERROR:
                        assert isinstance(outcome, Rejected)
                        if outcome.status == 413 and verdict.tokens is not None:
                            # We admitted what the seat refused: the layers disagree.
                            counters.inc("cap_disagreements")
                            log.error("cap_disagreement", seat=name, proxy_tokens=verdict.tokens,
                                      proxy_count_exact=verdict.exact,
                                      proxy_cap=verdict.cap,
                                      seat_tokens=outcome.extra.get("prompt_tokens"),
                                      seat_cap=outcome.extra.get("cap"))
                        raise client_error(outcome.status, outcome.code, outcome.message,
                                           attempts=attempts_header(self.attempts),
                                           **outcome.extra)
                    if step is Step.ABORT_STREAM:
                        counters.inc("midstream_aborts")
                        yield Abort(f"seat {name} failed after the answer began "
                                    f"({outcome_label(outcome)}); the answer is incomplete",
                                    "midstream_failure", name, attempts_header(self.attempts))
                        return
                    if step is Step.STOP:
                        return
                    # DONE
                    counters.inc("answered_by", name)
                    answer.served = frame.served
                    answer.speculation = frame.speculation
                    answer.upstream_model = frame.model
                    answer.fingerprint = frame.fingerprint or answer.fingerprint
                    answer.attempts = attempts_header(self.attempts)
                    log.info("answered", request_id=rid, seat=name, attempts=answer.attempts,
                             prompt_tokens=frame.usage.prompt_tokens,
                             completion_tokens=frame.usage.completion_tokens,
                             ttft_s=round(frame.ttft_s, 4),
                             elapsed_s=round(time.monotonic() - self.started, 4))
                    yield Done(answer, "".join(texts), frame.finish_reason, frame.usage)
                    return
        # Every allowed rung failed or was skipped; nothing was sent.
        end = conclude(self.attempts, self.plan, self.route.model)
        if end.counter is not None:
            counters.inc(end.counter)
        if end.refused_tokens is not None:
            counters.refused(end.refused_tokens)
        raise end.error
