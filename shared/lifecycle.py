"""Children that die with their parent, on both platforms.

Linux: `prctl(PR_SET_PDEATHSIG, SIGKILL)` makes the kernel kill us when the
parent dies, even when the parent was SIGKILLed.  macOS has no such call, so a
thread watches `getppid()` (re-parenting to launchd means the parent is gone)
and exits the process.  Both run on Linux; only the watcher runs on macOS.

Arm it before anything slow happens: a child whose parent is killed while the
child still imports MLX would otherwise live on until its imports end.  So seatd starts
workers as

    python -m shared.lifecycle seatd.worker --seat NAME ...

which arms the death signal first, then runs the module as `__main__`.  Setting
the signal and then checking `getppid()` leaves no window: a parent that died
before the call is seen by the check.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import threading
import time

from shared import exitcodes
from shared.logs import flush_logs

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.5
WATCH_THREAD = "parent-watch"


def _set_pdeathsig() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent() -> None:
    """Arrange to exit when the process that started us goes away.

    Only for processes started by another Sanctum process, which sets
    `SANCTUM_PARENT_PID`; a daemon started by launchd or a shell is left alone.
    Calling it again is harmless.
    """
    expected = int(os.environ.get("SANCTUM_PARENT_PID", "0"))
    if not expected:
        return
    _set_pdeathsig()
    if os.getppid() != expected:
        flush_logs()
        os._exit(exitcodes.PARENT_GONE)
    if any(t.name == WATCH_THREAD for t in threading.enumerate()):
        return

    def watch() -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            if os.getppid() != expected:
                flush_logs()
                os._exit(exitcodes.PARENT_GONE)

    threading.Thread(target=watch, name=WATCH_THREAD, daemon=True).start()


def run_bound(argv: list[str]) -> None:
    """Bind to the parent, then run `argv[0]` as a module with `argv[1:]` as its arguments."""
    die_with_parent()
    module = argv[0]
    sys.argv = [module, *argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m shared.lifecycle MODULE [ARGS...]")
    run_bound(sys.argv[1:])
