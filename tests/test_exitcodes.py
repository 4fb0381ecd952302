"""Exit reasons: the code, and the worker's own words about it."""

from pathlib import Path

import pytest

from shared import exitcodes


@pytest.mark.parametrize(("code", "detail", "text"), [
    (0, None, "exit:0"),
    (1, None, "exit:1"),
    (79, None, "exit:79 (model_load_failed)"),
    (78, None, "exit:78 (config_error)"),
    (-9, None, "signal:SIGKILL"),
    (79, "/m does not exist", "model_load_failed: /m does not exist (exit:79)"),
    (78, "seat x: bad kv", "config_error: seat x: bad kv (exit:78)"),
    (1, "boom", "error: boom (exit:1)"),
])
def test_describe(code: int, detail: str | None, text: str) -> None:
    """Each exit code (with or without a recorded reason) reads as documented."""
    assert exitcodes.describe(code, detail) == text


def test_recorded_reason_is_one_line_read_once(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's reason arrives as one line, and taking it removes it."""
    path = tmp_path / "exit.reason"
    monkeypatch.setenv(exitcodes.REASON_ENV, str(path))
    exitcodes.record_reason("cannot load\n  /models/brain:\tdoes not exist")
    assert exitcodes.take_reason(path) == "cannot load /models/brain: does not exist"
    assert exitcodes.take_reason(path) is None
    assert list(tmp_path.iterdir()) == []


def test_no_reason_file_configured_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside seatd (no reason file named) recording a reason does nothing."""
    monkeypatch.delenv(exitcodes.REASON_ENV, raising=False)
    exitcodes.record_reason("ignored")
