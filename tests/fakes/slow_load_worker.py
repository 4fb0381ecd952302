"""The real seat worker, whose model load waits until the test opens a gate.

    SANCTUM_WORKER_MODULE=tests.fakes.slow_load_worker   (read by seatd)
    SANCTUM_TEST_LOAD_GATE=PATH     the load begins once PATH exists
    SANCTUM_TEST_LOAD_FAIL=SEAT     that seat's load fails at once (it goes FATAL)

The worker binds its socket and answers pings (ready=false) as the real one does
while its model loads; the load itself waits for the gate file, so a test decides
when the seat becomes ready and can prove what happened before.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from seatd import worker

GATE_ENV = "SANCTUM_TEST_LOAD_GATE"
FAIL_ENV = "SANCTUM_TEST_LOAD_FAIL"
LOOK_S = 0.05
_real_load = worker.SeatWorker.load


def _gated_load(self: worker.SeatWorker) -> worker.Loaded:
    if os.environ.get(FAIL_ENV) == self.seat.name:
        raise RuntimeError("the test made this model fail to load")
    gate = Path(os.environ[GATE_ENV])
    while not gate.exists():  # on the worker's MLX thread; its loop answers pings
        time.sleep(LOOK_S)
    return _real_load(self)



if __name__ == "__main__":  # as the worker (seatd runs it so); a test that imports this
    # module for its constants must not patch the engine of its own process
    worker.SeatWorker.load = _gated_load  # type: ignore[method-assign]
    raise SystemExit(worker.main())
