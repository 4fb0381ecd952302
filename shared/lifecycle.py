"""Children that die with their parent, on both platforms.

Linux: `prctl(PR_SET_PDEATHSIG, SIGKILL)` makes the kernel kill us when the
parent dies, even when the parent was SIGKILLed.  macOS has no such call, so a
thread watches `getppid()` (re-parenting to launchd means the parent is gone)
and exits the process.  Both run on Linux; only the watcher runs on macOS.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from shared import exitcodes

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.5


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
    """
    expected = int(os.environ.get("SANCTUM_PARENT_PID", "0"))
    if not expected:
        return
    _set_pdeathsig()
    if os.getppid() != expected:
        os._exit(exitcodes.PARENT_GONE)

    def watch() -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            if os.getppid() != expected:
                os._exit(exitcodes.PARENT_GONE)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
