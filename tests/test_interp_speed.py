"""deploy/interp_speed.py: which Python the virtual environment is built on."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "interp_speed.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("interp_speed", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pick_counts_one_binary_once_and_passes_over_what_cannot_make_a_venv(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = os.path.realpath(sys.executable)
    one, two = tmp_path / "a", tmp_path / "b"
    one.mkdir()
    two.mkdir()
    # The same binary under two names and in two folders ...
    (one / "python3").symlink_to(here)
    (two / "python3.11").symlink_to(here)
    # ... a Python too old (it says so the way the check asks), and one that fails.
    old = two / "python3.12"
    old.write_text("#!/bin/sh\necho ''\n")
    old.chmod(0o755)
    broken = two / "python3.13"
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setenv("PATH", f"{one}{os.pathsep}{two}")
    mod = _module()
    assert mod.candidates() == {here: str(one / "python3")}
    assert mod.pick() == str(one / "python3")  # named as the PATH names it


def test_pick_finds_nothing_on_an_empty_path(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert _module().pick() == ""
    out = subprocess.run([sys.executable, str(SCRIPT), "--pick"], capture_output=True,
                         text=True, env={**os.environ, "PATH": str(tmp_path)}, timeout=60)
    assert out.returncode == 1 and out.stdout.strip() == ""


def test_a_timing_is_seconds() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    assert 0 < float(out.stdout) < 60
