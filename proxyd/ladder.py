"""Ladder decisions, as pure functions.

    plan(route, seats, offbox_allowed) -> rungs          who may be tried, in order
    decide(outcome, phase) -> Step                        what one attempt's end means
    breaker_verdict(outcome) -> Verdict                   what it tells the rung's circuit
    conclude(attempts, plan, route) -> Conclusion         the error when no rung answered
                                                          (proxyd/conclusion.py)

Rules (DESIGN.md): fall back only on real failures and only before the commit
point; a client error is returned as it is; a private request never reaches an
off-box rung, which is filtered out before the first attempt.  One rejection is
not the request's last word: `context_length_exceeded` from a rung whose real
context is smaller than configured moves to the next rung (`NEXT_RUNG`, with the
code as the fallback reason), and reaches the client only if no later rung answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from shared.caps import Verdict
from shared.config import RouteConfig, SeatConfig
from shared.errors import CONTEXT_LENGTH
from shared.protocol import Cancelled, Failed, Ok, Outcome, Rejected


class Phase(StrEnum):
    BEFORE_COMMIT = "before_commit"
    AFTER_COMMIT = "after_commit"


class Step(StrEnum):
    DONE = "done"  # answered; finish the response
    RETURN_ERROR = "return_error"  # deterministic client error: to the client, no fallback
    NEXT_RUNG = "next_rung"  # real failure before commit: try the next rung
    ABORT_STREAM = "abort_stream"  # real failure after commit: terminal error event
    STOP = "stop"  # cancelled (client gone): nothing more to do


@dataclass(frozen=True)
class Skipped:
    """A rung passed over without being called (over_cap, circuit_open)."""

    reason: str
    # over_cap: the proxy's count against this rung's cap, for the 413 that names it
    verdict: Verdict | None = None


Attempt = tuple[str, Outcome | Skipped]

# A seat whose queue is full, or that could not start a request in queue_timeout_s,
# is busy: the request goes on down the ladder, and the seat's circuit is untouched.
BUSY = frozenset({"queue_full", "queue_timeout"})
# Failures that say nothing about the seat's health: its circuit neither opens nor closes.
NOT_THE_SEATS_FAULT = frozenset({"client_disconnected", *BUSY})


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


def decide(outcome: Outcome, phase: Phase) -> Step:
    match outcome:
        case Ok():
            return Step.DONE
        case Rejected(code=code) if code == CONTEXT_LENGTH:
            # A rung whose real context is smaller than its configured cap (a hosted
            # upstream says so with this code): a later rung may be larger.  If none
            # takes it, the client gets this rejection (`context_refusal`).
            return Step.NEXT_RUNG if phase is Phase.BEFORE_COMMIT else Step.ABORT_STREAM
        case Rejected():
            # Deterministic: another rung would refuse it too.  After commit a
            # rejection cannot happen in our seats, but if it does the stream must
            # still end honestly.
            return Step.RETURN_ERROR if phase is Phase.BEFORE_COMMIT else Step.ABORT_STREAM
        case Failed():
            return Step.NEXT_RUNG if phase is Phase.BEFORE_COMMIT else Step.ABORT_STREAM
        case Cancelled():
            return Step.STOP
    raise TypeError(f"not an outcome: {outcome!r}")


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


def attempts_header(attempts: Sequence[Attempt]) -> str:
    return "; ".join(f"{seat}={outcome_label(o)}" for seat, o in attempts)
