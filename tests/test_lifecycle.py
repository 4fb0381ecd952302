"""Children bound to their parent: they die with it, even when it is SIGKILLed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from shared import exitcodes
from tests.procs import assert_gone

# A child that would sleep for a minute: the stdlib's timeit, run as __main__.
CHILD = [sys.executable, "-m", "shared.lifecycle", "timeit", "-n", "1", "-r", "1",
         "import time; time.sleep(60)"]
PARENT = (
    "import os, subprocess, sys, time\n"
    "env = dict(os.environ, SANCTUM_PARENT_PID=str(os.getpid()))\n"
    "child = subprocess.Popen(sys.argv[1:], env=env)\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def test_bound_child_dies_with_a_sigkilled_parent() -> None:
    """`python -m shared.lifecycle MODULE` runs MODULE and dies when its parent is killed."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, *CHILD], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(0.5)
        assert psutil.Process(child).status() != psutil.STATUS_ZOMBIE
        parent.kill()
        parent.wait(timeout=10)
        assert_gone({child}, timeout=5)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_child_of_a_parent_already_gone_exits_at_once() -> None:
    """A child whose expected parent is not its parent exits PARENT_GONE before running."""
    env = dict(os.environ, SANCTUM_PARENT_PID="1" if os.getppid() != 1 else "2")
    done = subprocess.run(CHILD, env=env, timeout=30)
    assert done.returncode == exitcodes.PARENT_GONE


def test_unbound_child_just_runs_its_module() -> None:
    """Without SANCTUM_PARENT_PID the module runs normally with its arguments."""
    env = {k: v for k, v in os.environ.items() if k != "SANCTUM_PARENT_PID"}
    done = subprocess.run([sys.executable, "-m", "shared.lifecycle", "timeit", "-n", "1",
                           "-r", "1", "pass"], env=env, timeout=30, capture_output=True,
                          text=True)
    assert done.returncode == 0 and "loop" in done.stdout
