"""The error that ends a request no rung answered, as a pure function.

    conclude(attempts, plan, route, loading) -> Conclusion(error, counter)

Every allowed rung failed or was skipped, and nothing was sent.  The first rule
that applies names the error:

    1. a rung refused the prompt as longer than its real context     that refusal (4xx)
       (`context_length_exceeded`), and no later rung took it
    2. every rung was skipped as over the proxy's cap                 413 prompt_too_long,
                                                                      naming the largest
    3. some rung was busy (queue full, or not started in time), and   503 overloaded
       every other was busy, loading or skipped                        (Retry-After)
    4. some rung was loading (`not_ready`, and in `loading`, the      503 loading
       rungs still loading now), and every other loading or skipped    (Retry-After)
    5. off-box rungs were filtered out of this private request        503 no_private_seat
    6. otherwise                                                      503 all_rungs_failed

Rules 1 and 2 are the client's to fix (shorten the prompt); 3 is busy, not broken,
and worth retrying soon; 4 is a model still loading, which nothing failed (a request
normally waits for it first: proxyd/load_wait.py); 5 says privacy, not failure, is
why no bigger rung was tried; 6 is a real outage.  A seat that says not ready after
it was ready is not in `loading` (proxyd/seat_state.py): its failure is real.
`counter` is the proxy counter the conclusion adds to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxyd.ladder import Attempt, Plan, Skipped, attempts_header, context_refusal, is_busy
from shared.caps import Verdict
from shared.errors import (
    AllRungsFailed,
    Loading,
    NoPrivateSeat,
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
    over_cap = _over_cap(attempts)
    if over_cap and len(over_cap) == len(attempts):
        name, v = max(over_cap, key=lambda nv: nv[1].cap or 0)
        return Conclusion(PromptTooLong(
            f"prompt has {v.tokens} tokens; the largest allowed seat ({name}) admits "
            f"at most {v.cap} (its cap {v.seat_cap} less a margin of {v.margin})",
            prompt_tokens=v.tokens, cap=v.cap, margin=v.margin, seat=name,
            limit="proxy_cap", attempts=header), "over_cap", v.tokens or 0)
    if any(is_busy(o) for _, o in attempts) and all(
            isinstance(o, Skipped) or is_busy(o) or _loading(s, o, loading)
            for s, o in attempts):
        return Conclusion(Overloaded(f"every seat of route {route!r} is busy; retry shortly",
                                     attempts=header), "overloaded")
    waiting = [s for s, o in attempts if _loading(s, o, loading)]
    if waiting and all(isinstance(o, Skipped) or _loading(s, o, loading)
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
