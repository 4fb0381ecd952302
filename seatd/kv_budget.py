"""The seat's KV memory: rows in flight and the prompt cache share one byte budget.

Pure arithmetic, no MLX:

    row_bytes(per_token, prompt, max_new, context)   what a row may grow to
    KVBudget.admit(nbytes, alone)   room for a new row? (the prompt cache gives way)
    KVBudget.release(nbytes)        a row left

A row is charged for the longest cache it can reach (its prompt plus its answer
budget, in the batch's allocation steps) from the moment it joins, so traffic can
never grow the batch past the budget mid-answer.  Rows sit in shared columns, so a
batch also pays for the padding of rows shorter than the longest: every row is charged
as the longest admitted alongside it, plus one allocation step of holes
(`seatd.rows_cache`).  The prompt cache keeps `cache_budget` of the total for its
entries; rows that need more take it back (`spill(nbytes)`: the prompt cache holds that
much of its own budget for rows and evicts to fit).  A request that does not fit
waits in the queue; a request alone is always admitted (the context length bounds it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

STEP = 256


def row_bytes(per_token: int, prompt: int, max_new: int, context: int) -> int:
    """Bytes of KV a row may reach: prompt plus answer, rounded up to the allocation
    step, plus one step of holes."""
    tokens = min(context, prompt + max_new)
    return per_token * (-(-tokens // STEP) * STEP + STEP)


@dataclass
class KVBudget:
    budget: int  # bytes for rows in flight and the prompt cache together
    cache_budget: int = 0  # of which the prompt cache's entries may use this much
    spill: Callable[[int], None] = lambda nbytes: None
    rows: list[int] = field(default_factory=list)  # charge of each row in flight

    @property
    def in_flight(self) -> int:
        """Rows in flight, each charged as the longest of them (shared columns)."""
        return len(self.rows) * max(self.rows, default=0)

    def need(self, nbytes: int) -> int:
        rows = [*self.rows, nbytes]
        return len(rows) * max(rows)

    def admit(self, nbytes: int, alone: bool = False) -> bool:
        if self.need(nbytes) > self.budget and not alone:
            return False
        self.rows.append(nbytes)
        self._spill()
        return True

    def release(self, nbytes: int) -> None:
        if nbytes in self.rows:
            self.rows.remove(nbytes)
        self._spill()

    def _spill(self) -> None:
        self.spill(max(0, self.in_flight - (self.budget - self.cache_budget)))
