"""What a benchmark run records, and how it is stored (JSON, via msgspec).

One file per comparison under `docs/bench/results/`; the report is rendered from
these files alone, so `sanctum bench report` reproduces docs/BENCHMARKS.md without
rerunning anything.
"""

from __future__ import annotations

from pathlib import Path

import msgspec


class Sample(msgspec.Struct, frozen=True):
    """One slot of a schedule, as it ran."""

    run_id: str
    seq: int
    round: int
    workload: str
    arm: str
    warmup: bool
    started: float  # monotonic seconds
    ended: float
    load_before: float  # 1-minute load average
    load_after: float
    figures: dict[str, float] = {}
    error: str | None = None


class ArmInfo(msgspec.Struct, frozen=True):
    name: str
    description: str


class Run(msgspec.Struct, frozen=True):
    """A whole comparison: one run id, one schedule, every sample."""

    run_id: str
    comparison: str
    title: str
    baseline: str  # the arm ratios are taken against
    arms: list[ArmInfo]
    workloads: dict[str, str]  # name -> description
    rounds: int
    warmup: int
    seed: int
    machine: dict[str, str]
    samples: list[Sample]
    notes: list[str] = []
    # Set when the comparison could not be measured (e.g. a feature is missing):
    # the report says so instead of showing numbers.
    not_measurable: str | None = None
    extra: dict[str, object] = {}


def save_run(run: Run, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(run), indent=1) + b"\n")


def load_run(path: Path) -> Run:
    return msgspec.json.decode(path.read_bytes(), type=Run)
