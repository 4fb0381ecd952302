"""`sanctum bench` end to end on a real model: a tiny run, its report, nothing left running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sanctum.bench.results import load_run
from sanctum.bench.stats import check_interleaved


def bench_model() -> str:
    for spec in (os.environ.get("SANCTUM_TEST_MODEL", ""), "builtin:demo"):
        if not spec:
            continue
        from shared.builtin import resolve_model

        try:
            if (resolve_model(spec) / "config.json").exists():
                return spec
        except ValueError:
            continue
    pytest.skip("no model for a bench smoke test (set SANCTUM_TEST_MODEL)")


@pytest.mark.slow
def test_stack_comparison_runs_interleaved_and_reports(tmp_path: Path) -> None:
    """Two rounds of the stack comparison give interleaved samples and a report with a ratio."""
    model = bench_model()
    out, doc = tmp_path / "results", tmp_path / "docs" / "BENCHMARKS.md"
    run = subprocess.run(
        [sys.executable, "-m", "sanctum.cli", "bench", "run", "stack", "--model", model,
         "--rounds", "2", "--tokens", "32", "--workloads", "code-short,doc2body",
         "--out", str(out), "--doc", str(doc), "--report"],
        capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    result = load_run(out / "stack.json")
    check_interleaved(result.samples)
    assert {s.arm for s in result.samples} == {"sanctum", "in-process"}
    assert not [s.error for s in result.samples if s.error]
    assert result.machine["blas"] in ("openblas", "accelerate")
    # A zero exit also means every server it started was proven stopped (servers.Proc.stop).
    assert "end-to-end speed, all workloads | **" in doc.read_text()
