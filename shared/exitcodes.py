"""Worker exit codes that tell seatd why a seat stopped, and the words behind them.

A config or model that cannot load is FATAL at once: restarting cannot fix it.
An exit code alone says *that*; the worker also leaves one line saying *what*
(`/models/brain does not exist`) in the file named by `SANCTUM_EXIT_REASON_FILE`,
which seatd sets for each worker, reads after the exit and shows in `sanctum status`.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from shared.private_files import write_private

OK = 0
CRASH = 1
CONFIG = 78  # sysexits EX_CONFIG
MODEL_LOAD = 79
PARENT_GONE = 80
DEVICE_LOST = 81  # the device stopped computing: a fresh process gets a fresh context

FATAL_AT_ONCE = {CONFIG: "config_error", MODEL_LOAD: "model_load_failed"}
REASON_ENV = "SANCTUM_EXIT_REASON_FILE"
REASON_MAX = 500


def describe(returncode: int, detail: str | None = None) -> str:
    """A short exit reason.

    `model_load_failed: /m does not exist (exit:79)` when the worker said why,
    else `exit:79 (model_load_failed)`, `exit:1` or `signal:SIGKILL`.
    """
    if returncode < 0:
        try:
            base = f"signal:{signal.Signals(-returncode).name}"
        except ValueError:
            base = f"signal:{-returncode}"
        return f"{base}: {detail}" if detail else base
    named = FATAL_AT_ONCE.get(returncode) or {PARENT_GONE: "parent_gone",
                                              DEVICE_LOST: "device_lost"}.get(returncode)
    if detail:
        return f"{named or 'error'}: {detail} (exit:{returncode})"
    return f"exit:{returncode} ({named})" if named else f"exit:{returncode}"


def record_reason(text: str) -> None:
    """Leave one line for seatd saying why this process is about to exit.

    Best effort and atomic (write, then rename): a reason must never be the
    thing that fails, and seatd must never read half of one.
    """
    target = os.environ.get(REASON_ENV)
    if not target:
        return
    line = " ".join(text.split())[:REASON_MAX]
    try:
        write_private(Path(target), line + "\n")
    except OSError:
        pass


def take_reason(path: Path) -> str | None:
    """Read and remove the reason a worker left; None when it left none."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        path.unlink()
    except OSError:
        pass
    return text or None
