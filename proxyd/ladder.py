"""Ladder decisions, as pure functions.

    plan(route, seats, offbox_allowed) -> rungs          who may be tried, in order
    decide(outcome, phase) -> Step                        what one attempt's end means
    breaker_verdict(outcome) -> Verdict                   what it tells the rung's circuit
    unsupported(gen, seat) -> field | None                a field this rung cannot honour
    continued(gen, text, ids, tokens, hosted) -> Generate the request a rung continues from
    prefix_ids(segments, tokenizer) -> ids | None         the exact tokens, where they fit
    conclude(attempts, plan, route) -> Conclusion         the error when no rung answered
                                                          (proxyd/conclusion.py)

Rules (DESIGN.md): fall back only on real failures; a client error is returned as
it is; a private request never reaches an off-box rung, which is filtered out
before the first attempt.  One rejection is not the request's last word:
`context_length_exceeded` from a rung whose real context is smaller than
configured moves to the next rung (`NEXT_RUNG`, with the code as the fallback
reason), and reaches the client only if no later rung answers.

After the commit point (the first byte sent) a failure is continued: the next
allowed rung is given the text already sent as the start of its answer and
finishes it (`CONTINUE`).  The same filters apply as before commit (privacy,
caps, circuits), because the continuing rungs are the rest of the same plan.  A
continuing rung that refuses the request (a 400 on a trailing assistant message,
a prompt grown past its cap) is passed over the same way: the error the client
gets, if no rung finishes, is the one of the rung that broke.

A rung that cannot honour a field of the request is skipped, never asked without
it (`skipped:unsupported_field`, naming the field).  A local seat honours every
field (what its decoder cannot do, e.g. a schema it cannot constrain, it refuses
itself with a 400).  A hosted rung, field by field:

    field                          forwarded?                        else
    -----------------------------  --------------------------------  ------------------
    temperature, top_p, max_tokens, stop, seed, presence_penalty,
    frequency_penalty              always (OpenAI's own)
    logprobs                       always: chat `logprobs` +
                                   `top_logprobs`, completions
                                   `logprobs`; read back per token
    tools, tool_choice,            chat: always                      completions: skip
    parallel_tool_calls                                              ("tools")
    response_format                chat: always                      completions: skip
    top_k, min_p,                  where the seat's upstream_fields  skip
    repetition_penalty             lists it (shared/config.py)
    logit_bias                     never: its ids are the local      skip
                                   tokenizer's, not the upstream's

A field at its neutral value (top_k 0, min_p 0, repetition_penalty 1, no bias) is
not set, and needs nothing.  An upstream that refuses a forwarded field answers 400,
which reaches the client as that upstream's rejection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import msgspec

from shared.caps import Verdict
from shared.config import RouteConfig, SeatConfig
from shared.errors import CONTEXT_LENGTH
from shared.protocol import Cancelled, Failed, Generate, Ok, Outcome, Rejected


class Phase(StrEnum):
    BEFORE_COMMIT = "before_commit"
    AFTER_COMMIT = "after_commit"


class Step(StrEnum):
    DONE = "done"  # answered; finish the response
    RETURN_ERROR = "return_error"  # deterministic client error: to the client, no fallback
    NEXT_RUNG = "next_rung"  # real failure before commit: try the next rung
    # a failure after commit: the next allowed rung continues the answer; when none
    # can, the stream ends with a terminal error event
    CONTINUE = "continue"
    STOP = "stop"  # cancelled (client gone): nothing more to do


@dataclass(frozen=True)
class Skipped:
    """A rung passed over without being called (over_cap, circuit_open,
    unsupported_field)."""

    reason: str
    # over_cap: the proxy's count against this rung's cap, for the 413 that names it
    verdict: Verdict | None = None
    # unsupported_field: the request's field this rung cannot honour
    field: str | None = None
    # no_room: why seatd could not load this on-demand seat (the budget, what holds it)
    detail: str = ""


# The skip of a rung that cannot honour a field of the request (`unsupported`).  A
# hosted rung asked anyway ends its attempt as Failed with this reason, sending nothing.
UNSUPPORTED = "unsupported_field"


Attempt = tuple[str, Outcome | Skipped]

# A seat whose queue is full, or that could not start a request in queue_timeout_s,
# is busy: the request goes on down the ladder, and the seat's circuit is untouched.
BUSY = frozenset({"queue_full", "queue_timeout"})
# Failures that say nothing about the seat's health: its circuit neither opens nor closes.
# A seat that says it is not ready (its model loads, or it drains) was not sent the
# request: it told the truth, and its circuit stays as it was.
# A rung that refused a field it cannot honour (UNSUPPORTED) was not sent the request.
# A grammar that gave up mid-answer (GRAMMAR_ERROR: llguidance hit a limit on this
# request's schema) says nothing about the seat: repeating the schema must not open it.
GRAMMAR_ERROR = "grammar_error"
NOT_THE_SEATS_FAULT = frozenset({"client_disconnected", "not_ready", UNSUPPORTED,
                                 GRAMMAR_ERROR, *BUSY})


def is_busy(outcome: Outcome | Skipped) -> bool:
    return isinstance(outcome, Failed) and outcome.reason in BUSY


class Health(StrEnum):
    """What an attempt's end tells its rung's circuit breaker."""

    HEALTHY = "healthy"  # the seat worked (answered, or refused the request itself)
    BROKEN = "broken"  # a real failure: counts toward opening the circuit
    UNKNOWN = "unknown"  # busy or abandoned: the circuit is untouched (a probe is freed)


def breaker_verdict(outcome: Outcome) -> Health:
    if isinstance(outcome, Failed):
        return Health.UNKNOWN if outcome.reason in NOT_THE_SEATS_FAULT else Health.BROKEN
    return Health.HEALTHY


def unsupported(gen: Generate, seat: SeatConfig) -> str | None:
    """The first field of `gen` that rung `seat` cannot honour (the table above);
    None: it can take the request as it is."""
    if seat.kind == "mlx":
        return None
    p, extras = gen.params, seat.upstream_fields
    if p.logit_bias:
        return "logit_bias"
    if p.top_k and "top_k" not in extras:
        return "top_k"
    if p.min_p and "min_p" not in extras:
        return "min_p"
    if p.repetition_penalty != 1.0 and "repetition_penalty" not in extras:
        return "repetition_penalty"
    if gen.messages is None and gen.tools_json is not None:
        return "tools"
    if gen.messages is None and gen.response_format is not None:
        return "response_format"
    return None


def decide(outcome: Outcome, phase: Phase) -> Step:
    match outcome:
        case Ok():
            return Step.DONE
        case Rejected(code=code) if code == CONTEXT_LENGTH:
            # A rung whose real context is smaller than its configured cap (a hosted
            # upstream says so with this code): a later rung may be larger.  If none
            # takes it, the client gets this rejection (`context_refusal`).
            return Step.NEXT_RUNG if phase is Phase.BEFORE_COMMIT else Step.CONTINUE
        case Rejected():
            # Deterministic before commit: another rung would refuse it too.  After
            # commit it is a continuing rung refusing the continuation (its prefill or
            # its longer prompt), which says nothing about the answer: the next may
            # take it.
            return Step.RETURN_ERROR if phase is Phase.BEFORE_COMMIT else Step.CONTINUE
        case Failed():
            return Step.NEXT_RUNG if phase is Phase.BEFORE_COMMIT else Step.CONTINUE
        case Cancelled():
            return Step.STOP
    raise TypeError(f"not an outcome: {outcome!r}")


@dataclass
class Segment:
    """One rung's part of an answer: what it sent, and its own served count."""

    seat: str
    tokens: int = 0  # the rung's own count of what it sent (a hosted rung: events)
    served: int = 0  # the seat's `served` after this request (from its final frame)
    outcome: str = ""  # how the rung's attempt ended, as in X-Sanctum-Attempts
    ids: list[int] | None = None  # the tokens it sent, from a local seat
    tokenizer: str = ""  # the tokenizer hash of a local seat, "" for a hosted rung

    def body(self) -> dict[str, str | int]:
        return {"seat": self.seat, "tokens": self.tokens, "served": self.served,
                "outcome": self.outcome}


def prefix_ids(segments: Sequence[Segment], tokenizer: str) -> tuple[int, ...] | None:
    """The exact tokens of the answer so far, when every segment came from a local seat
    with this tokenizer and sent its tokens; None: the continuing rung encodes the text."""
    if not tokenizer or not segments:
        return None
    out: list[int] = []
    for seg in segments:
        if seg.tokenizer != tokenizer or seg.ids is None or len(seg.ids) < seg.tokens:
            return None
        out.extend(seg.ids)
    return tuple(out)


def continued(gen: Generate, text: str, ids: tuple[int, ...] | None, tokens: int,
              hosted: bool) -> Generate:
    """The request a rung continues a begun answer from: the same request, with the text
    already sent as the start of its answer.  A local seat counts the prefix in its
    budget itself (and takes `ids` when they are known); a hosted rung is asked for what
    is left of `max_tokens` after the `tokens` already sent."""
    if hosted:
        params = msgspec.structs.replace(gen.params,
                                         max_tokens=max(1, gen.params.max_tokens - tokens))
        return msgspec.structs.replace(gen, params=params, prefix=text, prefix_ids=None)
    return msgspec.structs.replace(gen, prefix=text, prefix_ids=ids)


def fallback_reason(outcome: Outcome) -> str:
    """Why the ladder moved on after `outcome` (the `fallbacks{reason}` label)."""
    match outcome:
        case Failed(reason=reason):
            return reason
        case Rejected(code=code):
            return code
    raise TypeError(f"not a fallback: {outcome!r}")


def context_refusal(attempts: Sequence[Attempt]) -> Rejected | None:
    """The context-length rejection to answer with when no later rung answered."""
    for _, outcome in attempts:
        if isinstance(outcome, Rejected) and outcome.code == CONTEXT_LENGTH:
            return outcome
    return None


def offbox_allowed(route: RouteConfig, header: str | None) -> bool:
    """Whether this request may leave the box: route policy, then the opt-in header."""
    if route.offbox == "allow":
        return True
    if route.offbox == "header":
        return (header or "").strip().lower() == "allow"
    return False


@dataclass(frozen=True)
class Plan:
    rungs: tuple[str, ...]  # seats to try, in order
    filtered_offbox: tuple[str, ...]  # off-box rungs removed because the request is private


def plan(route: RouteConfig, seats: dict[str, SeatConfig], may_leave: bool) -> Plan:
    keep: list[str] = []
    removed: list[str] = []
    for name in route.ladder:
        if seats[name].offbox and not may_leave:
            removed.append(name)
        else:
            keep.append(name)
    return Plan(tuple(keep), tuple(removed))


def outcome_label(outcome: Outcome | Skipped) -> str:
    match outcome:
        case Ok():
            return "ok"
        case Rejected(status=status):
            return f"rejected:{status}"
        case Failed(reason=reason):
            return f"failed:{reason}"
        case Cancelled():
            return "cancelled"
        case Skipped(reason=reason):
            return f"skipped:{reason}"
    raise TypeError(outcome)


def attempts_header(attempts: Sequence[Attempt], streaming: str = "") -> str:
    """Every attempt as `seat=outcome`; `streaming` names a rung whose attempt has begun
    an answer and not ended yet (`seat=streaming`): headers leave at the commit point,
    before anyone can know that attempt will end `ok`."""
    done = [f"{seat}={outcome_label(o)}" for seat, o in attempts]
    if streaming:
        done.append(f"{streaming}=streaming")
    return "; ".join(done)
