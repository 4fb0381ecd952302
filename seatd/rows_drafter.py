"""The model drafters of a lane's rows, drafting together: one drafter forward per draft
position for every row, where each row's own drafter (`seatd.drafters.ModelDrafter`)
runs one forward per position by itself.  At a few tokens a forward costs mostly its
fixed part, so B rows drafting k tokens cost about k forwards instead of B * k.

    drafter = RowsDrafter.for_model(drafter_model)   None where its cache cannot batch
    drafter.join(request_id, model_drafter)             a drafter with the prompt becomes a row
    drafts = drafter.propose({request_id: (k, params, draws, position)})
    drafter.settle(request_id, kept, drafted, next_token, tokens)
    drafter.keep(request_ids)                           rows that left are dropped

The rows' KV lives in one `RowsCache` of the drafter model: each forward feeds every row
(a row not drafting this round, or already done at this position, is padding, invalid
for it).  A row's pending tokens (the last verified token, and the target's tokens made
without a draft, `ModelDrafter.plain`) stay in its own drafter's list, which the engine
goes on appending to; the first forward of a round feeds them.  After a verify, a row
forgets the drafts the target rejected (their columns become invalid for it), as
`ModelDrafter.settle` trims its own cache.  Draft tokens come from each row's own
sampling rule and answer position, so a seeded row's draws never depend on its
neighbours; and a draft only decides how many tokens a verify keeps, never which
(`seatd.verify`).  A row that shapes its logits (`seatd.shaping`) has them shaped here
as its own drafter would; a row under a grammar drafts alone (its mask needs each
drafted token on the host), never here (`seatd.batch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from seatd.drafters import Draft, ModelDrafter
from seatd.rows_cache import SLACK, RowsCache, Unbatchable
from seatd.sampling import Draws
from seatd.shaping import Cursor, Shaper
from seatd.verify import draft_probs
from shared.protocol import SamplingParams


@dataclass
class _Member:
    key: str
    drafter: ModelDrafter
    fed: list[int]  # columns of this round's fed drafts (d0 .. d[k-2])


@dataclass
class Ask:
    k: int
    params: SamplingParams
    draws: Draws
    position: int  # the answer position of the first draft
    shaper: Shaper | None = None  # the row's shaping (never a grammar's, here)


class RowsDrafter:
    def __init__(self, model: Any, cache: RowsCache) -> None:
        self.model = model
        self.cache = cache
        self.members: list[_Member] = []

    @classmethod
    def for_model(cls, model: Any) -> RowsDrafter | None:
        """None for a drafter whose cache cannot batch, or whose recurrent layers could
        not forget a rejected draft of one row alone."""
        try:
            cache = RowsCache.for_model(model, "fp16")
        except Unbatchable:
            return None
        if cache.recurrent_layers:
            return None
        return cls(model, cache)

    def __contains__(self, key: str) -> bool:
        return any(m.key == key for m in self.members)

    def join(self, key: str, drafter: ModelDrafter) -> bool:
        """The row's drafter, its prompt in, drafts with the others from now on; False
        where its cache is not one this batch holds (it drafts alone, as before)."""
        offsets = [c.offset for c in drafter.cache if hasattr(c, "offset")]
        if not offsets or len(drafter.cache) != len(self.cache.layers):
            return False
        self.cache.join(drafter.cache, int(offsets[0]))
        drafter.cache = []  # the batch holds it now
        self.members.append(_Member(key, drafter, []))
        return True

    def keep(self, keys: Sequence[str]) -> None:
        """Only these rows stay (rows that left the lane, or stopped drafting, go)."""
        wanted = set(keys)
        index = [i for i, m in enumerate(self.members) if m.key in wanted]
        if len(index) == len(self.members):
            return
        self.cache.drop(index)
        self.members = [self.members[i] for i in index]

    def propose(self, asks: dict[str, Ask]) -> dict[str, Draft]:
        """Drafts for the rows asked, k tokens each (lazy arrays, as a drafter's own)."""
        rows = self.members
        ks = [asks[m.key].k if m.key in asks else 0 for m in rows]
        if not any(ks):
            return {}
        pending = [list(m.drafter.pending) if k else [] for m, k in zip(rows, ks, strict=True)]
        width = max(len(p) for p in pending)
        block = mx.array([p + [0] * (width - len(p)) for p in pending], dtype=mx.uint32)
        logits = self._forward(block, [len(p) for p in pending])
        tokens: list[list[mx.array]] = [[] for _ in rows]
        probs: list[list[mx.array]] = [[] for _ in rows]
        walks: list[Cursor | None] = []
        for m in rows:
            m.fed = []
            ask_m = asks.get(m.key)
            walks.append(ask_m.shaper.cursor() if ask_m is not None
                         and ask_m.shaper is not None else None)
        for step in range(max(ks)):
            for b, (m, k) in enumerate(zip(rows, ks, strict=True)):
                if step >= k:
                    continue
                ask = asks[m.key]
                at = len(pending[b]) - 1 if step == 0 else 0
                row_logits = logits[b : b + 1, at, :]
                walk = walks[b]
                if walk is not None:
                    row_logits = walk.shape(row_logits)
                if ask.params.temperature > 0 and not ask.draws.keyed:
                    probs[b].append(draft_probs(row_logits, ask.params))
                tokens[b].append(ask.draws.token(row_logits, ask.params, ask.position + step))
                if walk is not None and step + 1 < k:
                    walk.push(tokens[b][-1])
            feeding = [b for b, k in enumerate(ks) if step + 1 < k]
            if not feeding:
                break
            column = self.cache.layout.idx
            x = mx.concatenate([tokens[b][-1] if b in feeding else mx.zeros((1,), mx.uint32)
                                for b in range(len(rows))]).astype(mx.uint32)[:, None]
            logits = self._forward(x, [1 if b in feeding else 0 for b in range(len(rows))])
            for b in feeding:
                rows[b].fed.append(column)
        for m in rows:
            if m.key in asks:
                m.drafter.pending = []
        out: dict[str, Draft] = {}
        for b, (m, k) in enumerate(zip(rows, ks, strict=True)):
            if k:
                out[m.key] = Draft(mx.concatenate(tokens[b]),
                                   mx.concatenate(probs[b], axis=0) if probs[b] else None, k)
        return out

    def _forward(self, x: mx.array, counts: list[int]) -> mx.array:
        self.cache.begin(counts, x.shape[1])
        logits: mx.array = self.model(x, cache=self.cache.layers)
        self.cache.end()
        return logits

    def settle(self, key: str, kept: int, drafted: int, next_token: int,
               tokens: Sequence[int]) -> None:
        """After the verify: the row keeps its pending tokens and its first `kept`
        drafts, as `ModelDrafter.settle`."""
        b = next(i for i, m in enumerate(self.members) if m.key == key)
        m = self.members[b]
        if kept == drafted:
            m.drafter.pending = [int(tokens[-1]), next_token]
        else:
            self.forget(b, m.fed[kept:])
            m.drafter.pending = [next_token]
        m.fed = []

    def forget(self, b: int, columns: Sequence[int]) -> None:
        """Row b's tokens at these columns were never there."""
        if not columns:
            return
        lay = self.cache.layout
        cols = np.asarray(list(columns), dtype=np.int64)
        live = int(lay.valid[b, cols].sum())
        lay.valid[b, cols] = False
        lay.pos[b] -= live

    def tidy(self) -> None:
        """Squeeze out the holes rejected drafts and padding left, now and then."""
        if self.cache.holes() > SLACK:
            self.cache.compact()
