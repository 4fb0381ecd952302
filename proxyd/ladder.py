"""Ladder decisions, as pure functions.

    plan(route, seats, offbox_allowed) -> rungs          who may be tried, in order
    decide(outcome, phase) -> Step                        what one attempt's end means

Rules (DESIGN.md): fall back only on real failures and only before the commit
point; a client error is returned as it is; a private request never reaches an
off-box rung, which is filtered out before the first attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shared.config import RouteConfig, SeatConfig
from shared.protocol import Cancelled, Failed, Ok, Outcome, Rejected


class Phase(str, Enum):
    BEFORE_COMMIT = "before_commit"
    AFTER_COMMIT = "after_commit"


class Step(str, Enum):
    DONE = "done"  # answered; finish the response
    RETURN_ERROR = "return_error"  # deterministic client error: to the client, no fallback
    NEXT_RUNG = "next_rung"  # real failure before commit: try the next rung
    ABORT_STREAM = "abort_stream"  # real failure after commit: terminal error event
    STOP = "stop"  # cancelled (client gone): nothing more to do


@dataclass(frozen=True)
class Skipped:
    reason: str


def decide(outcome: Outcome, phase: Phase) -> Step:
    match outcome:
        case Ok():
            return Step.DONE
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


def attempts_header(attempts: list[tuple[str, Outcome | Skipped]]) -> str:
    return "; ".join(f"{seat}={outcome_label(o)}" for seat, o in attempts)
