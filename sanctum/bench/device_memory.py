"""What an NVIDIA card's driver says each arm's processes hold, beside MLX's own figure.

MLX counts the buffers it allocates (`seatd.memory.mlx_memory`); a process on a CUDA
card may hold more (what the driver, cuDNN and CUDA graphs keep).  On an H100 the
8B-shape batching bench ran out of memory with its processes at 8-38 GiB by the
driver's figure, and nothing said whose memory that was.  So where `nvidia-smi` is on
the PATH, each slot also records the driver's MiB for the arm's processes (`device_mb`):
a seat's worker (its pid from the proxy's /health), or the process serving a peer's
port and its children.  Elsewhere (the CPU, Metal) there is no such figure, and none
is recorded.

    available() -> bool                            whether this machine has nvidia-smi
    parse_apps(csv) -> {pid: MiB}                  nvidia-smi's per-process lines; pure
    device_mib(pids, query=...) -> MiB | None      their sum now, None without a figure
    listening(port) -> {pid, ...}                  the process serving `port`, and its children
    WithDeviceMemory(arm, pids)                    an arm whose slots add `device_mb`
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterable

import psutil

QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"]
QUERY_TIMEOUT_S = 10.0


def parse_apps(text: str) -> dict[int, float]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader` output
    ("1234, 5678 MiB" a line) as MiB by pid; lines it cannot read ("[N/A]", a process
    the driver cannot measure) are left out.  Pure."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        pid, _, used = line.partition(",")
        value, _, unit = used.strip().partition(" ")
        try:
            mib = float(value) * {"MiB": 1.0, "GiB": 1024.0, "KiB": 1 / 1024}[unit.strip()]
            out[int(pid)] = out.get(int(pid), 0.0) + mib
        except (ValueError, KeyError):
            continue
    return out


def available() -> bool:
    """Whether this machine has the driver's query (an NVIDIA card's)."""
    return shutil.which(QUERY[0]) is not None


def _query() -> str | None:
    if not available():
        return None
    try:
        done = subprocess.run(QUERY, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def device_mib(pids: Iterable[int], query: Callable[[], str | None] = _query) -> float | None:
    """The driver's MiB for `pids` together now; None where there is no such figure (no
    `nvidia-smi`, or it failed) or none of them holds device memory."""
    text = query()
    if text is None:
        return None
    apps = parse_apps(text)
    held = [apps[p] for p in set(pids) if p in apps]
    return sum(held) if held else None


def listening(port: int) -> set[int]:
    """The process that listens on local TCP `port` among this process's children, and
    its own children (a server's worker processes); empty if none is found."""
    for child in psutil.Process().children(recursive=True):
        try:
            if any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                   for c in child.net_connections(kind="tcp")):
                return {child.pid, *(p.pid for p in child.children(recursive=True))}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return set()


class WithDeviceMemory:
    """`arm`, whose every slot's figures add `device_mb`, the driver's MiB for the
    processes `pids()` names as the slot ended, where there is such a figure."""

    def __init__(self, arm: Callable[[str], dict[str, float]],
                 pids: Callable[[], set[int]],
                 mib: Callable[[Iterable[int]], float | None] = device_mib) -> None:
        self.arm, self.pids, self.mib = arm, pids, mib

    def __call__(self, name: str) -> dict[str, float]:
        out = self.arm(name)
        if not out:  # a slot the arm does not measure
            return out
        try:
            held = self.mib(self.pids())
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            held = None
        return out if held is None else out | {"device_mb": held}
