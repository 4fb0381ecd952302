"""The real seat worker, with a decode thread that hangs mid-request.

    SANCTUM_WORKER_MODULE=tests.fakes.stalling_worker   (read by seatd)

Decode steps come at most every `STEP_S`; once a request has decoded for
`STALL_AFTER_S`, the batch engine's thread blocks forever.  The event loop keeps
answering pings, so liveness stays green and only the token count shows the seat is
hung.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from seatd import batch, worker

STEP_S = 0.01
STALL_AFTER_S = 1.5
_real_decode = batch.Engine._decode
_began: list[float] = []


def _stalling_decode(self: batch.Engine, lane: Any) -> None:
    if not _began:
        _began.append(time.monotonic())
    time.sleep(STEP_S)
    if time.monotonic() - _began[0] > STALL_AFTER_S:
        threading.Event().wait()
    _real_decode(self, lane)



if __name__ == "__main__":  # as the worker (seatd runs it so); a test that imports this
    # module for its constants must not patch the engine of its own process
    batch.Engine._decode = _stalling_decode  # type: ignore[method-assign]
    raise SystemExit(worker.main())
