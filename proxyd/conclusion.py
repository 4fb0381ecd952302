"""The error that ends a request no rung answered, as a pure function.

    conclude(attempts, plan, route, loading) -> Conclusion(error, counter)

Every allowed rung failed or was skipped, and nothing was sent.  The first rule
that applies names the error:

    1. a rung refused the prompt as longer than its real context     that refusal (4xx)
       (`context_length_exceeded`), and no later rung took it
    2. some rung cannot honour a field of the request (skipped, or    400 unsupported_field,
       a hosted rung that refused it unsent), and every other could    naming the field
       not take the request either (that, or over its cap)
    3. every rung was skipped as over the proxy's cap                 413 context_length_exceeded,
                                                                      naming the largest
    4. some rung was busy (queue full, or not started in time), and   503 overloaded
       every other was busy, loading or skipped                        (Retry-After)
    5. some rung was loading (`not_ready`, and in `loading`, the      503 loading
       rungs still loading now), and every other loading or skipped    (Retry-After)
    5b. some on-demand seat could not load for lack of room (skipped 503 no_room, seatd's
       `no_room`), and every other was skipped, busy or loading      message (Retry-After)
    6. off-box rungs were filtered out of this private request        503 no_private_seat
    7. otherwise                                                      503 all_rungs_failed

Rules 1 to 3 are the client's to fix (shorten the prompt, drop the field): no
retry and no other rung would answer it as it is; 4 is busy, not broken, and
worth retrying soon; 5 is a model still loading, which nothing failed (a request
normally waits for it first: proxyd/load_wait.py); 6 says privacy, not failure, is
why no bigger rung was tried; 7 is a real outage.  A rung that could have honoured
the field but failed, was busy or loading, or had its circuit open makes it one of
those, not a 400: the same request may be answered later.  A seat that says not
ready after it was ready is not in `loading` (proxyd/seat_state.py): its failure is real.
`counter` is the proxy counter the conclusion adds to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxyd.ladder import (
    UNSUPPORTED,
    Attempt,
    Plan,
    Skipped,
    attempts_header,
    context_refusal,
    is_busy,
)
from shared.caps import Verdict
from shared.errors import (
    AllRungsFailed,
    BadRequest,
    Loading,
    NoPrivateSeat,
    NoRoom,
    Overloaded,
    PromptTooLong,
    SanctumError,
    client_error,
)
from shared.protocol import Failed, Outcome


@dataclass(frozen=True)
class Conclusion:
    error: SanctumError
    counter: str | None = None  # the proxy counter this conclusion counts in
    refused_tokens: int | None = None  # an over-cap prompt's length, for its median


def _over_cap(attempts: Sequence[Attempt]) -> list[tuple[str, Verdict]]:
    return [(seat, o.verdict) for seat, o in attempts
            if isinstance(o, Skipped) and o.reason == "over_cap" and o.verdict is not None]


def _unsupported(outcome: Outcome | Skipped) -> str | None:
    """The field a rung could not honour: skipped for it, or (a hosted rung asked
    anyway) failed for it without sending anything."""
    if isinstance(outcome, Skipped) and outcome.reason == UNSUPPORTED:
        return outcome.field or "?"
    if isinstance(outcome, Failed) and outcome.reason == UNSUPPORTED:
        return outcome.message.partition(":")[0] or "?"  # "FIELD: why" (proxyd/hosted.py)
    return None


def _unable(outcome: Outcome | Skipped) -> bool:
    """A rung that could not take this request as it is, whenever it was asked."""
    return _unsupported(outcome) is not None or (
        isinstance(outcome, Skipped) and outcome.reason == "over_cap")


def _passed_over(outcome: Outcome | Skipped) -> bool:
    """Skipped, or as good as: a hosted rung that refused a field without sending."""
    return isinstance(outcome, Skipped) or _unsupported(outcome) is not None


def _loading(seat: str, outcome: Outcome | Skipped, loading: frozenset[str]) -> bool:
    return (seat in loading and isinstance(outcome, Failed)
            and outcome.reason == "not_ready")


def conclude(attempts: Sequence[Attempt], plan: Plan, route: str,
             loading: frozenset[str] = frozenset()) -> Conclusion:
    """The error for a request whose every allowed rung failed or was skipped;
    `loading`: the rungs loading now."""
    header = attempts_header(attempts)
    refused = context_refusal(attempts)
    if refused is not None:
        return Conclusion(client_error(refused.status, refused.code, refused.message,
                                       attempts=header, **refused.extra))
    fields = [(seat, f) for seat, o in attempts if (f := _unsupported(o)) is not None]
    if fields and all(_unable(o) for _, o in attempts):
        names = ", ".join(f"{seat} takes no {field}" for seat, field in fields)
        field = fields[0][1]
        return Conclusion(BadRequest(
            f"no seat of route {route!r} can honour the request's {field!r} ({names}); "
            f"send it without {field!r}, or to a route whose seats take it",
            code=UNSUPPORTED, param=field, attempts=header))
    over_cap = _over_cap(attempts)
    if over_cap and len(over_cap) == len(attempts):
        name, v = max(over_cap, key=lambda nv: nv[1].cap or 0)
        return Conclusion(PromptTooLong(
            f"prompt has {v.tokens} tokens; the largest allowed seat ({name}) admits "
            f"at most {v.cap} (its cap {v.seat_cap} less a margin of {v.margin})",
            prompt_tokens=v.tokens, cap=v.cap, margin=v.margin, seat=name,
            limit="proxy_cap", attempts=header), "over_cap", v.tokens or 0)
    if any(is_busy(o) for _, o in attempts) and all(
            _passed_over(o) or is_busy(o) or _loading(s, o, loading)
            for s, o in attempts):
        return Conclusion(Overloaded(f"every seat of route {route!r} is busy; retry shortly",
                                     attempts=header), "overloaded")
    rooms = [o.detail for _, o in attempts if isinstance(o, Skipped) and o.reason == "no_room"]
    if rooms and all(_passed_over(o) or is_busy(o) or _loading(s, o, loading)
                     for s, o in attempts):
        return Conclusion(NoRoom(f"route {route!r}: {rooms[0]}", attempts=header))
    waiting = [s for s, o in attempts if _loading(s, o, loading)]
    if waiting and all(_passed_over(o) or _loading(s, o, loading)
                       for s, o in attempts):
        return Conclusion(Loading(f"route {route!r} is still loading "
                                  f"({', '.join(waiting)} loading); retry shortly",
                                  attempts=header, loading=waiting))
    if plan.filtered_offbox:
        return Conclusion(NoPrivateSeat(
            "every local seat for this private request failed; off-box seats "
            f"({', '.join(plan.filtered_offbox)}) are not allowed for it",
            attempts=header), "offbox_blocked")
    return Conclusion(AllRungsFailed(f"every seat of route {route!r} failed", attempts=header))
