"""MLX's freed buffers, handed back when a seat has had nothing to do for a while.

MLX keeps the buffers a step frees for the next step of the same shapes (its cache),
with no limit of its own short of most of the device.  A seat that serves keeps them:
its next step reuses them, where clearing between steps would cost every step its
allocations.  But a seat between requests holds them for nothing: measured through the
batching bench on an H100 (run 0c790d06f10e), each seat kept 3.7-5.3 GB of freed buffers
for the demo's 27 MB of weights (the driver's figure for the process 5.1-8.3 GB, against
mlx_lm.server's 1.4-1.5 GB: mlx-lm clears MLX's cache after each prefill chunk and every
256 or 512 decode steps), and four servers of an 8B-shape model ran an 80 GB card out of
memory, each process 10-13 GiB larger after its first 8-client slot and staying so.  On
a Mac those buffers are the household's memory.  So a seat that has had no work for
`AFTER_S` seconds hands them back, once (`mx.clear_cache`), until it works again.

AFTER_S is a pause no burst of requests leaves between its members (an agent's calls, a
batch of clients started together, a streamed answer's next request) and most people
do between their turns; the request after a trim pays its first step's allocations.

    IdleTrim(after_s).busy()              the engine did work: the pause starts again
    IdleTrim(after_s).idle(now) -> bool   nothing to do at `now`: trim now?
"""

from __future__ import annotations

AFTER_S = 2.0  # seconds without work before a seat hands MLX's freed buffers back


class IdleTrim:
    """When an idle engine hands back MLX's freed buffers: once per pause of at least
    `after_s` seconds (`now` from the caller's clock, so a test drives it)."""

    def __init__(self, after_s: float = AFTER_S) -> None:
        self.after_s = after_s
        self.since: float | None = None  # when the pause began; None: working
        self.trimmed = False  # this pause's trim is done

    def busy(self) -> None:
        self.since, self.trimmed = None, False

    def idle(self, now: float) -> bool:
        if self.since is None:
            self.since = now
        if self.trimmed or now - self.since < self.after_s:
            return False
        self.trimmed = True
        return True
