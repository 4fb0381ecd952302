"""One rung of a ladder as the journey sees it, local or hosted, behind one interface.

    Rung.name      the seat's name in the config
    Rung.local     a seat on this box (`proxyd.seat_client.SeatClient`: a worker process
                   with its own tokenizer, prompt cap and load state), or not
                   (`proxyd.hosted.HostedClient`: an upstream over HTTP)
    Rung.ready     whether it takes a request now (a hosted rung always does; its
                   circuit breaker says otherwise)
    Rung.state     a local seat's ready / loading / down (`proxyd.seat_state`); None for
                   a hosted rung, whose state is its circuit's
    Rung.pong      a local seat's last word about itself (tokenizer, cap, queue); None
                   for a hosted rung, or a seat not heard from yet
    Rung.frames    one attempt at a request: its chunks, retries and Final, ending in a
                   Final whatever happens (`shared.protocol.RungFrame`)
    Rung.close     at shutdown

The journey (`proxyd.journey`) and the readiness answers (`proxyd.readiness`) read rungs
through this, never by asking which class a client is; what only a local seat has (its
load wait, its counters) is asked of `local` rungs, or of the proxy's seat clients.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from proxyd.seat_state import SeatState
from shared.protocol import Generate, Pong, RungFrame


class Rung(Protocol):
    name: str

    @property
    def local(self) -> bool: ...

    @property
    def ready(self) -> bool: ...

    @property
    def state(self) -> SeatState | None: ...

    @property
    def pong(self) -> Pong | None: ...

    def frames(self, gen: Generate, first_token_s: float, stall_s: float, /,
               gone: Callable[[], bool] = ..., tries: int | None = None
               ) -> AsyncGenerator[RungFrame, None]: ...

    async def close(self) -> None: ...
