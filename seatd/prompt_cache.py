"""The seat's prompt cache: MLX cache copies under the policy of `prefix_cache`.

Per request, on the MLX thread:

    plan = cache.begin(request, kv, prompt, max_new)   lookup, restore
    decode(..., resume=plan.resume)                     prefill keeps a copy on the grid
    cache.finish(plan, ok)                              insert the copy, or invalidate

What is stored is the KV of the prompt up to its last chunk boundary: a prefill-grid
position (`PREFILL_CHUNK`) or, when later, the prompt's last turn boundary
(`seatd.turns`), where the conversation's next turn will resume.  Prefill cuts its
chunks at every turn boundary, warm or cold, cache or none, so what is stored is
exactly what a cold request computes in the same chunks, and a warm answer equals a
cold one byte for byte: a second turn of a short chat resumes where its first turn's
prompt opened the answer.  State that resumes only at its exact length (a hybrid
model's recurrent layers) is reused only at that length.  Generated tokens are not stored:
they were computed one step (or one verify block) at a time, which a later cold
prefill would not reproduce bit for bit.  The drafter's cache is rebuilt from the
prompt by `ModelDrafter.start`, so it is never wrong.

Entries never alias the live cache that decoding mutates: a copy is sliced to
its length and made contiguous; a restore hands decoding new array objects, and
the first write past a restored length reallocates.

Off: `prompt_cache_mb = 0`, `SANCTUM_PROMPT_CACHE=off`, or a request's
`sanctum.prompt_cache = false` (no lookup, nothing kept).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import structlog
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import cache as mlx_cache

from seatd.engine_types import PREFILL_CHUNK, Resume, make_cache
from seatd.prefix_cache import Entry, PrefixCache, Tally
from shared.config import SeatConfig
from shared.protocol import Generate

log = structlog.get_logger()

OFF_VALUES = ("off", "0", "false", "no")
# KV caches of these types can be cut to any shorter length; anything else
# (recurrent or rotating state) resumes only at its exact stored length.
TRIMMABLE = (mlx_cache.KVCache, mlx_cache.QuantizedKVCache)


def kill_switch() -> bool:
    return os.environ.get("SANCTUM_PROMPT_CACHE", "on").strip().lower() in OFF_VALUES


def trimmable(cache: list[Any]) -> bool:
    return all(type(c) in TRIMMABLE for c in cache)


def _nbytes(state: Any) -> int:
    leaves: Any = tree_flatten(state)
    return sum(int(x.nbytes) for _, x in leaves if isinstance(x, mx.array))


def _layer_copy(layer: Any, n: int | None) -> Any:
    """A copy of one layer's cache with new arrays; KV layers cut to `n` tokens."""
    new = copy.copy(layer)
    if type(layer) in TRIMMABLE:
        if layer.keys is None:
            return new

        def cut(x: mx.array) -> mx.array:
            return mx.contiguous(x[..., :n, :])

        new.keys, new.values = tree_map(cut, (layer.keys, layer.values))
        new.offset = n
        return new
    new.state = tree_map(lambda x: mx.contiguous(x) if isinstance(x, mx.array) else x,
                         layer.state)
    return new


def snapshot(cache: list[Any], n: int) -> list[Any]:
    """A compact, evaluated copy of `cache` holding its first `n` tokens."""
    out = [_layer_copy(c, n) for c in cache]
    mx.eval([c.state for c in out])
    return out


def restore(stored: list[Any], n: int) -> list[Any]:
    """A live cache resuming from a stored one at `n` tokens (cut when trimmable)."""
    return [_layer_copy(c, n) for c in stored]


@dataclass
class Plan:
    resume: Resume | None = None
    entry: Entry | None = None  # the entry resumed from
    namespace: str = ""
    tokens: tuple[int, ...] = ()
    trimmable: bool = True
    kept: list[Any] | None = None
    cuts: tuple[int, ...] = ()  # the prompt's prefill cuts off the grid


class SeatPromptCache:
    def __init__(self, seat: SeatConfig, model: Any) -> None:
        self.seat = seat
        self.model = model
        self.policy = PrefixCache(seat.prompt_cache_mb * 1024 * 1024, align=PREFILL_CHUNK)
        self._per_step: dict[str, tuple[int, bool]] = {}

    def enabled(self, request: Generate) -> bool:
        return (self.policy.budget > 0 and not kill_switch()
                and request.prompt_cache is not False)

    def _measure(self, kv: str) -> tuple[int, bool]:
        """(bytes a fresh cache allocates for one KV step of 256 tokens, trimmable)."""
        if kv not in self._per_step:
            cache = make_cache(self.model, kv)
            self.model(mx.array([[0]], dtype=mx.uint32), cache=cache)
            mx.eval([c.state for c in cache])
            self._per_step[kv] = (_nbytes([c.state for c in cache]), trimmable(cache))
        return self._per_step[kv]

    def begin(self, request: Generate, kv: str, prompt: list[int], max_new: int,
              cuts: tuple[int, ...] = ()) -> Plan:
        """`cuts`: the prompt's turn boundaries (`seatd.turns`): prefill cuts its chunks
        there, and keeps a copy at the last one it reaches when that is past the grid.

        A request that does not use the cache still has its prefill cut there, so its
        answer is the one a warm or cold request with the cache gets."""
        if len(prompt) < 2 or not (cuts or self.enabled(request)):
            return Plan()
        cuts = tuple(c for c in cuts if c <= len(prompt) - 1)
        if not self.enabled(request):
            return Plan(resume=Resume(cuts=cuts) if cuts else None)
        _, can_trim = self._measure(kv)
        tokens = tuple(prompt)
        keep_at = (len(prompt) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
        keep_at = max(keep_at, *cuts) if cuts else keep_at
        plan = Plan(namespace=kv, tokens=tokens[:keep_at], trimmable=can_trim, cuts=cuts)
        hit = self.policy.lookup(kv, tokens, len(prompt) - 1, cuts)
        cache = None
        if hit.entry is not None:
            try:
                cache = restore(hit.entry.value, hit.reuse)
            except Exception as exc:  # a fast path declines: serve cold, drop the entry
                log.warning("prompt_cache_restore_failed", error=repr(exc),
                            request_id=request.request_id)
                self.policy.invalidate(hit.entry)
                hit = type(hit)(None, 0)
        plan.entry = hit.entry

        def keep(live: list[Any]) -> None:
            plan.kept = snapshot(live, keep_at)

        wants = keep_at > hit.reuse
        plan.resume = Resume(cache, hit.reuse if cache is not None else 0,
                             keep_at if wants else 0, keep if wants else None, cuts)
        return plan

    def finish(self, plan: Plan, ok: bool) -> None:
        """After the request: keep its copy, or, after an error, drop what it touched."""
        try:
            if not ok:
                if plan.entry is not None:
                    self.policy.invalidate(plan.entry)
                return
            if plan.kept is not None:
                self.policy.insert(plan.namespace, plan.tokens,
                                   _nbytes([c.state for c in plan.kept]), plan.trimmable,
                                   plan.kept, plan.cuts)
        finally:
            plan.kept = None

    def hold(self, nbytes: int) -> None:
        """Rows in flight need `nbytes` of the cache's budget (`seatd.kv_budget`): the
        least recently used entries make room, and nothing is kept into it."""
        self.policy.reserve(nbytes)

    def per_token(self, kv: str) -> int:
        """Bytes of cache one more token of a row costs in this lane."""
        return -(-self._measure(kv)[0] // 256)

    def drain(self) -> Tally:
        return self.policy.drain()

    @property
    def entries(self) -> int:
        return len(self.policy.entries)

    @property
    def nbytes(self) -> int:
        return self.policy.nbytes
