"""The error that ends a request no rung answered, as a pure function.

    conclude(attempts, plan, route) -> Conclusion(error, counter)

Every allowed rung failed or was skipped, and nothing was sent.  The first rule
that applies names the error:

    1. a rung refused the prompt as longer than its real context     that refusal (4xx)
       (`context_length_exceeded`), and no later rung took it
    2. every rung was skipped as over the proxy's cap                 413 prompt_too_long,
                                                                      naming the largest
    3. some rung was busy (queue full, or not started in time), and   503 overloaded
       every other was busy or skipped                                 (Retry-After)
    4. off-box rungs were filtered out of this private request        503 no_private_seat
    5. otherwise                                                      503 all_rungs_failed

Rules 1 and 2 are the client's to fix (shorten the prompt); 3 is busy, not broken,
and worth retrying soon; 4 says privacy, not failure, is why no bigger rung was
tried; 5 is a real outage.  `counter` is the proxy counter the conclusion adds to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxyd.ladder import Attempt, Plan, Skipped, attempts_header, context_refusal, is_busy
from shared.caps import Verdict
from shared.errors import (
    AllRungsFailed,
    NoPrivateSeat,
    Overloaded,
    PromptTooLong,
    SanctumError,
    client_error,
)


@dataclass(frozen=True)
class Conclusion:
    error: SanctumError
    counter: str | None = None  # the proxy counter this conclusion counts in
    refused_tokens: int | None = None  # an over-cap prompt's length, for its median


def _over_cap(attempts: Sequence[Attempt]) -> list[tuple[str, Verdict]]:
    return [(seat, o.verdict) for seat, o in attempts
            if isinstance(o, Skipped) and o.reason == "over_cap" and o.verdict is not None]


def conclude(attempts: Sequence[Attempt], plan: Plan, route: str) -> Conclusion:
    """The error for a request whose every allowed rung failed or was skipped."""
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
            isinstance(o, Skipped) or is_busy(o) for _, o in attempts):
        return Conclusion(Overloaded(f"every seat of route {route!r} is busy; retry shortly",
                                     attempts=header), "overloaded")
    if plan.filtered_offbox:
        return Conclusion(NoPrivateSeat(
            "every local seat for this private request failed; off-box seats "
            f"({', '.join(plan.filtered_offbox)}) are not allowed for it",
            attempts=header), "offbox_blocked")
    return Conclusion(AllRungsFailed(f"every seat of route {route!r} failed", attempts=header))
