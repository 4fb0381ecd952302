"""The pieces of the report's text that the comparisons' own sections use too: how a
figure, a spread and a ratio are written, the goals, and a headline row per temperature.
Its own module so that `sanctum.bench.report` imports the comparisons' sections (rules,
batching, ...) and they import this, not the report.
"""

from __future__ import annotations

from sanctum.bench.results import Run
from sanctum.bench.stats import Summary, pair_ratios, summarize

# Goals of the headline ratios (arm over baseline), by comparison (and temperature).
GOALS = {"stack": 0.95, "mlx-server t=0": 1.0, "mlx-server t=0.7": 1.3, "spec t=0": 1.4,
         "spec t=0.7": 1.3}


def fmt(x: float, unit: str) -> str:
    if unit == "s":
        return f"{x * 1000:.3g} ms" if x < 1 else f"{x:.3g} s"
    return f"{x:.3g} {unit}"


def fmt_summary(s: Summary, unit: str) -> str:
    return f"{fmt(s.median, unit)} [{fmt(s.q1, unit)}–{fmt(s.q3, unit)}]"


def fmt_ratio(s: Summary) -> str:
    return f"**{s.median:.2f}x** [{s.q1:.2f}–{s.q3:.2f}], n={s.n}"


def per_temperature(run: Run, fig: str, arm: str, other: str, what: str,
                     goals: str | None = None, temperatures: tuple[str, ...] = ("0", "0.7"),
                     ) -> list[tuple[str, Summary, float | None]]:
    """One headline row per temperature (workloads named '... t=T'), all its pairs pooled."""
    out: list[tuple[str, Summary, float | None]] = []
    for t in temperatures:
        r = [x for w in run.workloads if w.endswith(f"t={t}")
             for x in pair_ratios(run.samples, fig, arm, other, w)]
        if r:
            out.append((what.format(t=t), summarize(r),
                        GOALS.get(f"{goals} t={t}") if goals else None))
    return out
