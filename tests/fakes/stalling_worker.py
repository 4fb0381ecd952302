"""The real seat worker, with a decode thread that hangs mid-request.

    SANCTUM_WORKER_MODULE=tests.fakes.stalling_worker   (read by seatd)

Tokens come at most every `STEP_S`; once a request has run `STALL_AFTER_S`, its
decode thread blocks forever.  The event loop keeps answering pings, so liveness
stays green and only the token count shows the seat is hung.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from seatd import worker

STEP_S = 0.01
STALL_AFTER_S = 1.5
_real_decode = worker.decode


def _stalling_decode(*args: Any, on_token: Any = None, **kwargs: Any) -> Any:
    started = time.monotonic()

    def step(n: int) -> None:
        if on_token is not None:
            on_token(n)
        time.sleep(STEP_S)
        if time.monotonic() - started > STALL_AFTER_S:
            threading.Event().wait()

    return _real_decode(*args, on_token=step, **kwargs)


worker.decode = _stalling_decode  # type: ignore[assignment]

if __name__ == "__main__":
    raise SystemExit(worker.main())
