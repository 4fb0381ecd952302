"""Medians, spreads and per-pair ratios.  Pure functions over samples.

Ratios are taken per *pair*: the two arms' samples from the same group (same
round, same workload), which ran back to back.  A ratio of medians would let a
slow minute for one arm pass as a slow arm; a per-pair ratio cancels the minute.

Every ratio is a speed ratio: above 1 means the arm was faster than the baseline,
whichever way its figure points (tokens/s up, seconds down).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sanctum.bench.results import Sample

# A relative spread (IQR / median) above this gets a warning in the report.
WIDE_SPREAD = 0.10

# name -> (unit, higher is better)
FIGURES: dict[str, tuple[str, bool]] = {
    "decode_tps": ("tok/s", True),
    "ttft_s": ("s", False),
    "e2e_s": ("s", False),
    "accept_len": ("tok", True),
    "latency_s": ("s", False),
    "per_token_s": ("s", False),
    "rps": ("req/s", True),
    "latency_p50_s": ("s", False),
    "latency_p99_s": ("s", False),
    "per_token_p50_s": ("s", False),
    "per_token_p99_s": ("s", False),
    "round_s": ("s", False),
    "rollback_s": ("s", False),
    "agg_tps": ("tok/s", True),
    "ttft_p50_s": ("s", False),
    "ttft_p99_s": ("s", False),
    "itl_p50_s": ("s", False),
    "itl_p99_s": ("s", False),
    "slowest_s": ("s", False),
}


class NotInterleaved(ValueError):
    """The samples were not taken in one interleaved run: no comparison is reported."""


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), q in [0, 1]."""
    if not xs:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within [0, 1], got {q}")
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(xs: Sequence[float]) -> float:
    return quantile(xs, 0.5)


@dataclass(frozen=True)
class Summary:
    n: int
    median: float
    q1: float
    q3: float
    lo: float
    hi: float

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def rel_spread(self) -> float:
        """IQR over the median: how wide the middle half is, relative to its centre."""
        return self.iqr / abs(self.median) if self.median else math.inf

    @property
    def wide(self) -> bool:
        return self.n > 1 and self.rel_spread > WIDE_SPREAD


def summarize(xs: Sequence[float]) -> Summary:
    return Summary(len(xs), median(xs), quantile(xs, 0.25), quantile(xs, 0.75), min(xs), max(xs))


def measured(samples: Iterable[Sample]) -> list[Sample]:
    """Samples that count: not warm-up, no error."""
    return [s for s in samples if not s.warmup and s.error is None]


def check_interleaved(samples: Sequence[Sample]) -> None:
    """Raise NotInterleaved unless the samples come from one interleaved run.

    One run id; slots in time order without overlap; every group (round, workload)
    holds each arm exactly once, in consecutive slots; every group has the same arms.
    """
    if not samples:
        raise NotInterleaved("no samples")
    runs = {s.run_id for s in samples}
    if len(runs) != 1:
        raise NotInterleaved(f"samples come from {len(runs)} runs ({sorted(runs)}); "
                             "arms measured in separate runs are not compared")
    by_seq = sorted(samples, key=lambda s: s.seq)
    if len({s.seq for s in samples}) != len(samples):
        raise NotInterleaved("two samples share one slot")
    for prev, cur in itertools.pairwise(by_seq):
        if cur.started < prev.ended:
            raise NotInterleaved(f"slots {prev.seq} and {cur.seq} overlap in time")
    groups: dict[tuple[int, str], list[Sample]] = defaultdict(list)
    for s in by_seq:
        groups[(s.round, s.workload)].append(s)
    arm_sets = {frozenset(s.arm for s in g) for g in groups.values()}
    if len(arm_sets) != 1:
        raise NotInterleaved("groups hold different sets of arms")
    (arms,) = arm_sets
    if len(arms) < 2:
        raise NotInterleaved(f"only one arm ({next(iter(arms))}): nothing to compare")
    for (rnd, wl), g in groups.items():
        if len(g) != len(arms):
            raise NotInterleaved(f"round {rnd}, workload {wl}: an arm ran more than once")
        seqs = [s.seq for s in g]
        if max(seqs) - min(seqs) != len(g) - 1:
            raise NotInterleaved(f"round {rnd}, workload {wl}: the arms did not run back to "
                                 f"back (slots {seqs})")


def pair_ratios(samples: Sequence[Sample], figure: str, arm: str, baseline: str,
                workload: str | None = None) -> list[float]:
    """Speed ratios of `arm` over `baseline`, one per group where both measured `figure`."""
    check_interleaved(samples)
    higher_better = FIGURES[figure][1]
    groups: dict[tuple[int, str], dict[str, float]] = defaultdict(dict)
    for s in measured(samples):
        if (workload is None or s.workload == workload) and figure in s.figures:
            groups[(s.round, s.workload)][s.arm] = s.figures[figure]
    ratios = []
    for values in groups.values():
        if arm in values and baseline in values:
            a, b = values[arm], values[baseline]
            num, den = (a, b) if higher_better else (b, a)
            if den > 0:
                ratios.append(num / den)
    return ratios


def figure_values(samples: Iterable[Sample], figure: str, arm: str,
                  workload: str | None = None) -> list[float]:
    return [s.figures[figure] for s in measured(samples)
            if s.arm == arm and figure in s.figures
            and (workload is None or s.workload == workload)]


def load_range(samples: Iterable[Sample]) -> tuple[float, float]:
    """Lowest and highest 1-minute load average seen during the measured slots."""
    loads = [x for s in measured(samples) for x in (s.load_before, s.load_after)]
    return (min(loads), max(loads)) if loads else (0.0, 0.0)


def geometric_mean(xs: Sequence[float]) -> float:
    if not xs or any(x <= 0 for x in xs):
        raise ValueError("geometric mean needs positive values")
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def pair_differences(samples: Sequence[Sample], figure: str, arm: str, baseline: str,
                     workload: str | None = None) -> list[float]:
    """`arm - baseline` for `figure`, one per group where both measured it."""
    check_interleaved(samples)
    groups: dict[tuple[int, str], dict[str, float]] = defaultdict(dict)
    for s in measured(samples):
        if (workload is None or s.workload == workload) and figure in s.figures:
            groups[(s.round, s.workload)][s.arm] = s.figures[figure]
    return [v[arm] - v[baseline] for v in groups.values() if arm in v and baseline in v]
