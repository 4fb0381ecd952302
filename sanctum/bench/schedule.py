"""Which arm runs when.  Pure: a seed in, a list of slots out.

A benchmark on a shared machine measures the weather unless its arms take turns
within the same minute.  Every round visits every workload, and for each workload
runs every arm once, back to back (a *group*).  The arm order is drawn once from
the seed and kept, so two arms run A B A B ... across the whole run; the seed
decides who starts.  The first `warmup` rounds run but are never reported.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    seq: int  # position in time order, from 0
    round: int  # from 0; rounds below the warm-up count are warm-up
    workload: str
    arm: str
    warmup: bool


def arm_order(arms: Sequence[str], seed: int) -> list[str]:
    """The arms in the order every group runs them: a seeded shuffle."""
    order = list(arms)
    random.Random(seed).shuffle(order)
    return order


def make_schedule(arms: Sequence[str], workloads: Sequence[str], rounds: int,
                  warmup: int = 1, seed: int = 0) -> list[Slot]:
    """Interleaved slots: `rounds` rounds (the first `warmup` excluded from reports)."""
    if len(arms) < 2:
        raise ValueError("a comparison needs at least two arms")
    if len(set(arms)) != len(arms):
        raise ValueError(f"arm names must be unique: {list(arms)}")
    if not workloads or len(set(workloads)) != len(workloads):
        raise ValueError(f"workloads must be a non-empty list of unique names: {list(workloads)}")
    if warmup < 0 or rounds <= warmup:
        raise ValueError(f"need more rounds ({rounds}) than warm-up rounds ({warmup})")
    order = arm_order(arms, seed)
    slots: list[Slot] = []
    for r in range(rounds):
        for w in workloads:
            for a in order:
                slots.append(Slot(len(slots), r, w, a, r < warmup))
    return slots
