"""The sampling-rules comparison: what each arm sends, and how its run is reported."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from sanctum.bench import rules as R
from sanctum.bench.report import render
from sanctum.bench.results import ArmInfo, Run
from sanctum.bench.runner import run_schedule
from sanctum.bench.schedule import make_schedule
from sanctum.bench.workloads import Workload
from tests.fakes.fake_upstream import FakeUpstream


@pytest.fixture
def upstream() -> Iterator[FakeUpstream]:
    up = FakeUpstream(answer="def f(x): return x")
    yield up
    up.stop()


def _arm(url: str, seed: int | None, sanctum: dict[str, Any]) -> R.RuleArm:
    w = Workload("w t=0.7", "a prompt", "completion", prompt="def f(x):", temperature=0.7)
    arm = R.RuleArm(url, "rules", 0.0, 8, {w.name: w}, seed, sanctum)
    arm._counters = lambda: {}  # type: ignore[method-assign]  # the fake has no /counters
    return arm


def test_seeded_arm_sends_seed_per_request_and_its_sanctum_options(upstream) -> None:
    """The k-th request of a workload is seeded seed + k; the pin travels in `sanctum`."""
    arm = _arm(f"http://127.0.0.1:{upstream.port}", 1, {"draft_depth": 3})
    first, second = arm("w t=0.7"), arm("w t=0.7")
    assert [r["seed"] for r in upstream.requests] == [2, 3]
    assert all(r["sanctum"] == {"draft_depth": 3} for r in upstream.requests)
    assert upstream.requests[0]["temperature"] == 0.7
    assert first["answer_crc"] == second["answer_crc"]  # the same answer, the same checksum


def test_unseeded_arm_sends_no_seed(upstream) -> None:
    """An unseeded request carries no `seed` at all (the SDK would send null for None)."""
    arm = _arm(f"http://127.0.0.1:{upstream.port}", None, {})
    arm("w t=0.7")
    assert "seed" not in upstream.requests[0]
    assert "sanctum" not in upstream.requests[0]


def _samples_run(crc: dict[str, float] | None = None) -> Run:
    """An interleaved run of the five arms at two temperatures, with fixed figures."""
    arms = [R.KEYED, R.REJECTION, R.PLAIN, R.KEYED_ADAPTIVE, R.REJECTION_ADAPTIVE]
    workloads = ["code-short t=0.7", "code-short t=1"]
    tps = {R.PLAIN: 20.0, R.KEYED: 30.0, R.REJECTION: 36.0, R.KEYED_ADAPTIVE: 25.0,
           R.REJECTION_ADAPTIVE: 40.0}
    accept = {R.KEYED: 1.0, R.REJECTION: 1.5, R.KEYED_ADAPTIVE: 0.8, R.REJECTION_ADAPTIVE: 2.0}
    crc = crc or {}

    def measure(arm: str) -> Any:
        def figures(workload: str) -> dict[str, float]:
            out = {"decode_tps": tps[arm], "e2e_s": 1.0,
                   "answer_crc": crc.get(arm, 7.0 if arm in (R.KEYED, R.PLAIN) else 1.0)}
            if arm in accept:
                out |= {"accept_len": accept[arm], "accept_p1": 0.5, "accept_p2": 0.25}
            return out
        return figures

    clock = itertools.count(0.0)
    samples = run_schedule(make_schedule(arms, workloads, 4, 1, seed=3),
                           {a: measure(a) for a in arms}, run_id="r1",
                           clock=lambda: next(clock), loadavg=lambda: 0.5)
    return Run("r1", "rules", "Sampling rules", R.PLAIN, [ArmInfo(a, a) for a in arms],
               {w: w for w in workloads}, 4, 1, 3, {"date": "d", "cores": "2",
                                                    "model": "builtin:demo"}, samples)


def test_same_answers_counts_byte_equal_pairs() -> None:
    run = _samples_run()
    assert R.same_answers(run.samples, R.KEYED, R.PLAIN) == (6, 6)  # 3 rounds x 2 workloads
    assert R.same_answers(run.samples, R.REJECTION, R.PLAIN) == (0, 6)


def test_rules_headline_per_arm_and_temperature() -> None:
    """Each speculating arm over plain per temperature; rejection over keyed at the pinned
    depth, in decode rate and in accepted drafts per verify."""
    heads = {what: s.median for what, s, _ in R.headline(_samples_run())}
    assert heads["decode tokens/s, keyed d3 over plain, t=0.7"] == pytest.approx(1.5)
    assert heads["decode tokens/s, rejection adaptive over plain, t=1"] == pytest.approx(2.0)
    assert heads["decode tokens/s, rejection d3 over keyed d3, t=1"] == pytest.approx(1.2)
    assert heads["accepted drafts per verify, rejection d3 over keyed d3, t=0.7"] == \
        pytest.approx(1.5)
    assert len(heads) == 4 * 2 + 2 + 2


def test_rules_section_in_the_report() -> None:
    """Three arms and more in one table, pooled per temperature and per workload, with the
    keyed/plain byte-equality count."""
    text = render({"rules": _samples_run()}, None, plot=lambda run, path: False)
    assert "## 7. Sampling rules: keyed, rejection and plain" in text
    assert "| all, t=0.7 | keyed d3 | 30 | **1.50x** [1.50–1.50], n=3 | 1 | 0.50 / 0.25 |" in text
    assert "| code-short t=1 | plain | 20 | - | - | - |" in text
    assert "byte-equal in 6 of 6 pairs" in text
    assert "The 40 slots (warm-up included) ran for" in text
    assert ("| 7. Sampling rules: keyed, rejection and plain | accepted drafts per verify, "
            "rejection d3 over keyed d3, t=1 | **1.50x**") in text
    differ = render({"rules": _samples_run({R.KEYED: 8.0})}, None, plot=lambda r, p: False)
    assert "byte-equal in 0 of 6 pairs" in differ
