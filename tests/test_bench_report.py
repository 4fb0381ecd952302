"""The benchmark report: ratios from interleaved runs only; missing features said plainly."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
import pytest

from sanctum.bench.arms import decode_figures
from sanctum.bench.options import Options
from sanctum.bench.report import render, write_report
from sanctum.bench.results import ArmInfo, Run, load_run, save_run
from sanctum.bench.runner import run_schedule
from sanctum.bench.schedule import make_schedule


def make_run(comparison: str = "stack", a_tps: float = 100.0, b_tps: float = 50.0) -> Run:
    slots = make_schedule(["sanctum", "in-process"], ["code-short"], 4, 1, seed=2)
    clock = itertools.count(0.0)
    arms = {"sanctum": lambda w: {"decode_tps": a_tps, "e2e_s": 1.0, "ttft_s": 0.1},
            "in-process": lambda w: {"decode_tps": b_tps, "e2e_s": 2.0, "ttft_s": 0.1}}
    samples = run_schedule(slots, arms, run_id="abc", clock=lambda: next(clock),
                           loadavg=lambda: 0.5)
    return Run("abc", comparison, "t", "in-process",
               [ArmInfo("sanctum", "ours"), ArmInfo("in-process", "theirs")],
               {"code-short": "short"}, 4, 1, 2, {"date": "d", "cores": "2", "model": "m"},
               samples)


def no_plot(run: Run, path: Path) -> bool:
    return False


def test_interleaved_run_reports_per_pair_ratios() -> None:
    """An interleaved run shows its speed ratio against the goal."""
    text = render({"stack": make_run()}, None, plot=no_plot)
    assert "end-to-end speed, all workloads | **2.00x** [2.00–2.00], n=3 | ≥ 0.95x" in text
    assert "| 4. Speculative against plain decoding | - | not run yet | - |" in text


def test_sequential_run_is_refused_not_reported() -> None:
    """A run whose arms did not alternate is shown as refused, with no ratio."""
    run = make_run()
    order = sorted(run.samples, key=lambda s: (s.arm, s.seq))
    redone = [msgspec.structs.replace(s, seq=i, started=float(2 * i), ended=float(2 * i + 1))
              for i, s in enumerate(order)]
    text = render({"stack": msgspec.structs.replace(run, samples=redone)}, None, plot=no_plot)
    assert "**Refused:** the arms were not interleaved" in text
    assert "refused: not interleaved" in text
    assert "2.00x" not in text


def test_not_measurable_comparisons_say_so() -> None:
    run = Run("x", "cache", "t", "", [], {}, 0, 0, 0, {}, [], not_measurable="no cache yet")
    text = render({"cache": run}, None, plot=no_plot)
    assert "**Not yet measurable:** no cache yet." in text
    assert "| 5. Prompt cache on against off | - | not yet measurable | - |" in text


def test_results_round_trip_and_write_report(tmp_path: Path) -> None:
    """Stored results render to the same report; plots land beside the document."""
    run = make_run()
    save_run(run, tmp_path / "results" / "stack.json")
    assert load_run(tmp_path / "results" / "stack.json") == run
    doc = write_report(tmp_path / "results", tmp_path / "docs" / "BENCHMARKS.md")
    text = doc.read_text()
    assert "**2.00x**" in text
    pytest.importorskip("matplotlib")
    assert (tmp_path / "docs" / "bench" / "stack.png").exists()
    assert "![stack](bench/stack.png)" in text


def test_runs_on_a_gpu_render_as_a_part_of_their_own(tmp_path: Path) -> None:
    """results/gpu/ renders after the page as "On a GPU": its own machine table (the device
    named), its headings marked GPU, only what ran there, and its plots in bench/gpu/."""
    save_run(make_run(a_tps=100.0, b_tps=50.0), tmp_path / "results" / "stack.json")
    gpu = msgspec.structs.replace(make_run(a_tps=300.0, b_tps=100.0),
                                  machine={"date": "d", "device": "cuda: NVIDIA H200"})
    save_run(gpu, tmp_path / "results" / "gpu" / "stack.json")
    text = write_report(tmp_path / "results", tmp_path / "docs" / "BENCHMARKS.md").read_text()
    cpu_part, gpu_part = text.split("\n# On a GPU\n")
    assert "**2.00x**" in cpu_part and "**3.00x**" not in cpu_part
    assert "| device | cuda: NVIDIA H200 |" in gpu_part
    # each run names its device too: the page's table is its first run's
    assert "on cuda: NVIDIA H200, model" in gpu_part and "on cuda" not in cpu_part
    assert "## GPU: Headline ratios" in gpu_part and "## GPU: 1. Our stack" in gpu_part
    assert "**3.00x**" in gpu_part and "not run yet" not in gpu_part
    pytest.importorskip("matplotlib")
    assert "![stack](bench/gpu/stack.png)" in gpu_part


@pytest.mark.parametrize(("times", "tokens", "expected_tps"), [
    ([1.0, 2.0, 3.0], 3, 1.0),    # 2 tokens after the first, in 2 s
    ([1.0, 1.5], 11, 20.0),       # pieces may carry several tokens: usage counts them
    ([1.0], 1, None),             # one token: no decode rate
])
def test_decode_figures(times: list[float], tokens: int, expected_tps: float | None) -> None:
    """TTFT from the first text, decode rate from first to last text, e2e to the end."""
    f = decode_figures(0.5, times, 4.0, tokens, 7)
    assert f["ttft_s"] == pytest.approx(times[0] - 0.5)
    assert f["e2e_s"] == pytest.approx(3.5)
    assert f.get("decode_tps") == (pytest.approx(expected_tps) if expected_tps else None)


def test_an_answer_without_text_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        decode_figures(0.0, [], 1.0, 0, 1)


def test_spec_run_shows_ours_against_mlx_lm_with_acceptance() -> None:
    """Three arms: the table against plain, then ours against mlx-lm with both
    acceptance lengths and per-position acceptance."""
    arms_ = ["speculative", "plain", "mlx-lm speculative"]
    slots = make_schedule(arms_, ["code-short t=0"], 4, 1, seed=2)
    clock = itertools.count(0.0)
    figs = {"speculative": {"decode_tps": 60.0, "e2e_s": 1.0, "accept_len": 2.0,
                            "accept_p1": 0.9, "accept_p2": 0.6},
            "plain": {"decode_tps": 30.0, "e2e_s": 2.0},
            "mlx-lm speculative": {"decode_tps": 40.0, "e2e_s": 1.5, "accept_len": 1.5,
                                   "accept_p1": 0.8, "accept_p2": 0.4}}
    samples = run_schedule(slots, {a: (lambda w, a=a: figs[a]) for a in arms_}, run_id="s",
                           clock=lambda: next(clock), loadavg=lambda: 0.5)
    run = Run("s", "spec", "t", "plain", [ArmInfo(a, a) for a in arms_],
              {"code-short t=0": "short"}, 4, 1, 2, {"date": "d", "cores": "2", "model": "m"},
              samples)
    text = render({"spec-d3": run}, None, plot=no_plot)
    assert "## 4. Speculative against plain decoding (d3)" in text
    assert "decode tokens/s, ours over mlx-lm speculative, t=0 | **1.50x**" in text
    assert "| code-short t=0 | 60.00 | 40.00 | **1.50x** [1.50–1.50], n=3 |" in text
    assert "| 2.00 | 1.50 | 0.90 / 0.60 | 0.80 / 0.40 |" in text


@pytest.mark.parametrize(("model", "depth", "stem"), [
    ("builtin:demo", 4, "spec"),
    ("builtin:demo", 3, "spec-d3"),
    ("builtin:demo", None, "spec-adaptive"),
    ("builtin:demo-hybrid", 4, "spec-demo-hybrid"),
    ("builtin:demo-hybrid", 3, "spec-demo-hybrid-d3"),
    ("/models/Some-Model/", None, "spec-Some-Model-adaptive"),
])
def test_spec_results_are_named_by_model_and_depth(model: str, depth: int | None,
                                                   stem: str) -> None:
    from sanctum.bench.cli import spec_stem

    assert spec_stem(Options(model=model, draft_depth=depth)) == stem


@pytest.mark.parametrize(("model", "temperature", "unseeded", "stem", "drafter"), [
    ("builtin:demo", 0.0, False, "batching", None),
    ("builtin:demo", 0.0, False, "batching-demo-drafter-weak", "builtin:demo-drafter-weak"),
    ("shape:8b", 0.7, False, "batching-shape-8b-demo-drafter-weak-t0.7",
     "builtin:demo-drafter-weak"),
    ("builtin:demo", 0.7, False, "batching-t0.7", None),
    ("builtin:demo", 0.7, True, "batching-t0.7-unseeded", None),
    ("builtin:demo", 0.0, True, "batching", None),  # nothing is seeded at temperature 0
    ("shape:8b", 0.0, False, "batching-shape-8b", None),
    ("shape:8b", 0.7, False, "batching-shape-8b-t0.7", None),
])
def test_batching_results_are_named_by_model_drafter_and_temperature(
        model: str, temperature: float, unseeded: bool, stem: str, drafter: str | None) -> None:
    from sanctum.bench.batching import stem as batching_stem

    extra = {"drafter": drafter} if drafter is not None else {}
    assert batching_stem(Options(model=model, temperature=temperature,
                                 unseeded=unseeded, **extra)) == stem


def test_the_command_line_asks_for_unseeded_requests() -> None:
    """`sanctum bench run batching --unseeded`: our seats' requests go without a seed
    (off by default, where they are seeded above temperature 0)."""
    import argparse

    from sanctum.bench.cli import add_bench

    parser = argparse.ArgumentParser()
    add_bench(parser.add_subparsers())
    asked = parser.parse_args(["bench", "run", "batching", "--temperature", "0.7",
                               "--unseeded"])
    assert asked.unseeded is True and asked.temperature == 0.7
    assert parser.parse_args(["bench", "run", "batching"]).unseeded is False


def test_a_spec_run_with_another_drafter_is_named_by_it() -> None:
    from sanctum.bench.cli import spec_stem

    opts = Options(drafter="builtin:demo-drafter-weak", draft_depth=None)
    assert spec_stem(opts) == "spec-demo-drafter-weak-adaptive"


def test_spec_run_shows_workload_groups_and_the_cost_models_prediction() -> None:
    """Headline rows per workload group (copy-heavy with its 2x goal at t=0), and the
    pinned arm's measured tokens/s beside its predicted, with the adaptive lookup share."""
    arms_ = ["speculative", "plain", "speculative d3"]
    workloads = {"rename t=0": "r", "template t=0": "t", "prose t=0": "p"}
    slots = make_schedule(arms_, list(workloads), 4, 1, seed=2)
    clock = itertools.count(0.0)
    figs = {"speculative": {"decode_tps": 50.0, "e2e_s": 1.0, "lookup_share": 0.5},
            "plain": {"decode_tps": 20.0, "e2e_s": 2.0},
            "speculative d3": {"decode_tps": 36.0, "e2e_s": 1.5, "accept_len": 2.0,
                               "predicted_tps": 40.0, "host_share": 0.03}}
    samples = run_schedule(slots, {a: (lambda w, a=a: figs[a]) for a in arms_}, run_id="s",
                           clock=lambda: next(clock), loadavg=lambda: 0.5)
    run = Run("s", "spec", "t", "plain", [ArmInfo(a, a) for a in arms_], workloads, 4, 1, 2,
              {"date": "d", "cores": "2", "model": "m"}, samples)
    text = render({"spec-adaptive": run}, None, plot=no_plot)
    assert "| decode tokens/s over plain, copy-heavy, t=0 | **2.50x** [2.50–2.50], n=6 | ≥ 2x |" \
        in text
    assert "| decode tokens/s over plain, prose, t=0 | **2.50x**" in text
    assert "| rename t=0 | speculative d3 | 36.0 | 40.0 | 0.90x | 3% | 50% |" in text


@pytest.mark.parametrize(("depths", "stem"), [
    ((), "spec-adaptive"),
    ((3,), "spec-adaptive"),
    ((1, 2, 3, 4, 5, 6), "spec-adaptive-pinned1-2-3-4-5-6"),
])
def test_an_adaptive_run_over_other_pinned_depths_is_named_by_them(
        depths: tuple[int, ...], stem: str) -> None:
    from sanctum.bench.cli import spec_stem

    assert spec_stem(Options(draft_depth=None, pinned_depths=depths)) == stem


def test_a_sweep_of_pinned_depths_gives_each_depth_over_plain_and_its_prediction() -> None:
    """Each pinned depth gets a row over plain per temperature and a row of measured over
    predicted (per request, goal 0.95x); requests the seat made no prediction for are left
    out of it, not counted as zero."""
    arms_ = ["speculative", "plain", "speculative d1", "speculative d10", "speculative d2"]
    workloads = {"code-short t=0": "c", "prose t=0.7": "p"}
    slots = make_schedule(arms_, list(workloads), 3, 1, seed=1)
    clock = itertools.count(0.0)
    figs = {"speculative": {"decode_tps": 50.0, "e2e_s": 1.0},
            "plain": {"decode_tps": 20.0, "e2e_s": 2.0},
            "speculative d1": {"decode_tps": 30.0, "e2e_s": 1.5, "predicted_tps": 40.0},
            "speculative d2": {"decode_tps": 40.0, "e2e_s": 1.5, "predicted_tps": 40.0},
            "speculative d10": {"decode_tps": 10.0, "e2e_s": 3.0}}
    samples = run_schedule(slots, {a: (lambda w, a=a: figs[a]) for a in arms_}, run_id="s",
                           clock=lambda: next(clock), loadavg=lambda: 0.5)
    run = Run("s", "spec", "t", "plain", [ArmInfo(a, a) for a in arms_], workloads, 3, 1, 1,
              {"date": "d", "cores": "2", "model": "m"}, samples)
    text = render({"spec-adaptive-pinned1-2-10": run}, None, plot=no_plot)
    assert "| decode tokens/s, speculative d1 over plain, t=0 | **1.50x**" in text
    assert "| decode tokens/s, speculative d10 over plain, t=0.7 | **0.50x**" in text
    assert ("| decode tokens/s of speculative d1, measured over the cost model's prediction, "
            "every workload | **0.75x** [0.75–0.75], n=4 | ≥ 0.95x |") in text
    assert "| decode tokens/s of speculative d2, measured over the cost model's prediction" \
        in text
    assert "speculative d10, measured over" not in text
    assert text.index("speculative d2 over plain, t=0 ") < text.index(
        "speculative d10 over plain, t=0 ")
    assert "adaptive over speculative d" not in text
