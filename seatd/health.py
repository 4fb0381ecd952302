"""Health beyond liveness: is the work moving, and is the memory within budget?

Pure decisions; the supervisor feeds them what the worker's pongs and psutil
report.  A worker that answers heartbeats proves its event loop runs, not that
its decode thread does: progress is the token count moving.

    progress(watch, in_flight, tokens, now, limits) -> (watch, stalled reason | None)
    over_budget(rss_bytes, budget_mb) -> reason | None

A request has `first_token_s` to produce its first token (prefill of a long
prompt moves no token) and `stall_s` between tokens after that.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MB = 2**20


@dataclass(frozen=True)
class Limits:
    first_token_s: float
    stall_s: float


@dataclass(frozen=True)
class Watch:
    """What the last pong said: which request, how many tokens, since when unmoved."""

    request: str | None = None
    tokens: int = 0
    moved_at: float = 0.0
    produced: bool = False


def progress(watch: Watch, in_flight: tuple[str, ...], tokens: int, now: float,
             limits: Limits) -> tuple[Watch, str | None]:
    """Update the watch from a fresh pong; a reason when the request has stalled."""
    request = in_flight[0] if in_flight else None
    if request is None:
        return Watch(None, tokens, now), None
    if request != watch.request:
        return Watch(request, tokens, now), None
    if tokens != watch.tokens:
        return replace(watch, tokens=tokens, moved_at=now, produced=True), None
    limit, what = ((limits.stall_s, "no token") if watch.produced
                   else (limits.first_token_s, "no first token"))
    idle = now - watch.moved_at
    if idle > limit:
        return watch, f"stalled: {what} for {idle:.1f}s (limit {limit:g}s)"
    return watch, None


def over_budget(rss_bytes: int | None, budget_mb: int | None) -> str | None:
    """A reason when resident memory is over the seat's budget, else None."""
    if rss_bytes is None or budget_mb is None or rss_bytes <= budget_mb * MB:
        return None
    return f"memory: rss {rss_bytes / MB:.0f} MB over budget {budget_mb} MB"
