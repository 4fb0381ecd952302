"""Which Python to build the virtual environment on: the fastest 3.11+ on the PATH.

    python3 deploy/interp_speed.py           ->  seconds for a fixed loop, best of 3
    python3 deploy/interp_speed.py --pick    ->  the fastest interpreter, as the PATH names it

The loop is shaped like the Python side of proxyd's work (calls, attribute reads,
dict work, small objects, string building, a generator).  The same CPython version
built with profile-guided optimisation and LTO (a distribution's, python.org's) runs
it 1.3-1.5x as fast as one compiled from source without them, and the first Python on
the PATH is often the slower (a version manager's own build).  proxyd is one event
loop whose CPU per request bounds its requests per second; most of that CPU is in
compiled extensions and the kernel, so there the gain is smaller (about 5%).

`--pick` finds python3.13, python3.12, python3.11 and python3 in every PATH folder,
keeps those of 3.11 or newer that can make a virtual environment (venv and
ensurepip), counts one binary once, and times them in interleaved rounds (a busy
moment then slows one round of every candidate, not all rounds of one); the report
goes to standard error.  Standard library only: it runs before any environment exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

NAMES = ("python3.13", "python3.12", "python3.11", "python3")
ROUNDS = 9
USABLE = ("import os, sys, venv, ensurepip; "
          "print(os.path.realpath(sys.executable) if sys.version_info >= (3, 11) else '')")


class _Item:
    __slots__ = ("key", "value")

    def __init__(self, key: str, value: int) -> None:
        self.key = key
        self.value = value


def _pieces(n: int) -> Iterator[_Item]:
    for i in range(n):
        yield _Item(f"k{i % 50}", i)


def _work() -> int:
    seen: dict[str, int] = {}
    total = 0
    for item in _pieces(60_000):
        seen[item.key] = seen.get(item.key, 0) + item.value
        total += len(item.key)
    parts = [f"{k}={v}" for k, v in seen.items()]
    return total + len(",".join(parts))


def timing() -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        _work()
        best = min(best, time.perf_counter() - t0)
    return best


def candidates() -> dict[str, str]:
    """Real binary -> the path to run it by, for every usable Python on the PATH."""
    found: dict[str, str] = {}
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        for name in NAMES:
            path = os.path.join(folder or ".", name)
            if not os.access(path, os.X_OK) or os.path.isdir(path):
                continue
            try:
                out = subprocess.run([path, "-c", USABLE], capture_output=True, text=True,
                                     timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                continue
            real = out.stdout.strip() if out.returncode == 0 else ""
            if real and real not in found:
                found[real] = path
    return found


def pick() -> str:
    found = candidates()
    best: dict[str, float] = {real: float("inf") for real in found}
    for _ in range(ROUNDS):
        for real in found:
            out = subprocess.run([real, __file__], capture_output=True, text=True, timeout=120)
            if out.returncode == 0:
                best[real] = min(best[real], float(out.stdout))
    ranked = sorted((s, real) for real, s in best.items() if s < float("inf"))
    for s, real in ranked:
        print(f"  {s:.4f} s  {found[real]}", file=sys.stderr)
    # The path it was found by, not the binary's own: a package manager's stable link
    # (Homebrew's bin/python3.12) outlives the versioned folder it points into.
    return found[ranked[0][1]] if ranked else ""


def main(argv: list[str]) -> int:
    if argv[1:] == ["--pick"]:
        chosen = pick()
        print(chosen)
        return 0 if chosen else 1
    print(f"{timing():.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
