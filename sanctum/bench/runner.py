"""Run a schedule against arms.  The clock and the load average are injected.

An arm is a callable `measure(workload) -> figures`.  An exception in an arm is
recorded on its sample (and the sample left out of every figure); the run goes on,
so one bad request does not throw away the minutes already measured.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

from sanctum.bench.results import Sample
from sanctum.bench.schedule import Slot

Measure = Callable[[str], dict[str, float]]


def load1() -> float:
    return os.getloadavg()[0]


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def run_schedule(slots: Sequence[Slot], arms: Mapping[str, Measure], *, run_id: str,
                 clock: Callable[[], float] = time.monotonic,
                 loadavg: Callable[[], float] = load1,
                 progress: Callable[[Sample], None] | None = None) -> list[Sample]:
    missing = {s.arm for s in slots} - set(arms)
    if missing:
        raise ValueError(f"schedule names arms that were not given: {sorted(missing)}")
    samples: list[Sample] = []
    for slot in slots:
        load_before = loadavg()
        started = clock()
        error = None
        figures: dict[str, float] = {}
        try:
            figures = dict(arms[slot.arm](slot.workload))
        except Exception as exc:  # recorded, not fatal: see the module docstring
            error = f"{type(exc).__name__}: {exc}"
        ended = clock()
        sample = Sample(run_id, slot.seq, slot.round, slot.workload, slot.arm, slot.warmup,
                        started, ended, load_before, loadavg(), figures, error)
        samples.append(sample)
        if progress is not None:
            progress(sample)
    return samples
