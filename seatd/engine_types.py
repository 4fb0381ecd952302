"""What the seat's batch engine (`seatd.batch`) and the one-request reference loop
(`seatd.decode`) share: a request's speculation plan (`Speculation`) and report
(`SpecReport`), its result (`DecodeResult`), where a cached prompt resumes (`Resume`),
the KV cache of a lane (`make_cache`), chunked prefill and the output width.

Prefill runs in chunks whose boundaries sit at multiples of PREFILL_CHUNK in
absolute position.  A request resumed from a cached prefix on that grid
(`Resume`) therefore computes the rest in exactly the chunks a cold request
would: chunk shapes change float reduction orders, and warm output must equal
cold output byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from seatd import recurrent
from seatd.adaptive import DepthStats, RoundPolicy
from seatd.drafters import Drafter, LookupDrafter
from seatd.spec_costs import SpecCosts

PREFILL_CHUNK = 512
# Beside decoding rows a batch prefills smaller pieces, sized to a time per step
# (`seatd.batch`); a request alone always prefills whole chunks.

Emit = Callable[[str, int, str], None]  # text, completion tokens, speculation state


class DecodeCancelled(Exception):
    """The request was cancelled; the loop stopped between two steps."""


@dataclass
class SpecReport:
    """What speculation did for one request: the header value and the counters."""

    state: str = "off"  # "accelerated" | "declined:<reason>" | "off"
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # by drafter ("model", "lookup"): [rounds, draft tokens, accepted tokens]
    by_drafter: dict[str, list[int]] = field(default_factory=dict)

    def verified(self, drafted: int, kept: int, drafter: str = "model") -> None:
        """A round verified `drafted` drafts and kept the first `kept` of them."""
        self.state = "accelerated"
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += kept
        tally = self.by_drafter.setdefault(drafter, [0, 0, 0])
        tally[0] += 1
        tally[1] += drafted
        tally[2] += kept
        while len(self.accepted_per_position) < drafted:
            self.accepted_per_position.append(0)
        for i in range(kept):
            self.accepted_per_position[i] += 1


@dataclass
class Speculation:
    """How a request may speculate, decided by the worker before it starts."""

    drafter: Drafter | None
    depth: int  # draft length for this request (the most, with a policy); 0 = plain
    stats: DepthStats
    decline: str | None = None  # set: serve plain and report this reason
    policy: RoundPolicy | None = None  # set: the depth is chosen round by round
    # With a policy, a model drafter's row may also draft by prompt lookup, round by
    # round (`seatd.drafter_choice`; the batch engine's rows only).
    # By the class of how far a lookup's match reaches back (`seatd.drafters.match_key`:
    # its drafts are kept more often the further it is): the seat's lookup figures, and
    # the request's policies.  In the batch engine, a lookup drafting alone (a parked
    # model seat's) uses them too; a request decoded alone here keeps `stats`/`policy`.
    lookup: LookupDrafter | None = None
    lookup_stats: dict[int, DepthStats] | None = None
    lookup_policies: dict[int, RoundPolicy] | None = None
    # the seat's lookup rounds of every class, for their times (`lookup_policy`)
    lookup_rounds: DepthStats | None = None
    costs: SpecCosts | None = None  # the seat's cost model (`seatd.spec_costs`)
    # match classes whose first match drafts at once (`seatd.speculation.TRUSTED_ROUNDS`)
    lookup_trusted: frozenset[int] = frozenset()


@dataclass
class DecodeResult:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    speculation: SpecReport = field(default_factory=SpecReport)
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # the completion's tokens, in order
    beside: bool = False  # some forward of it held another request's rows (batch engine)
    stop_sequence: str | None = None  # the stop string that ended it


@dataclass
class Resume:
    """Where prefill starts, and where it hands its cache to the prompt cache.

    `cache` holds the prompt's first `start` tokens (a chunk boundary); None = cold.
    When prefill reaches `keep_at` (a chunk boundary), it calls `keep(cache)`.
    Chunk boundaries are the multiples of PREFILL_CHUNK and the `cuts` (turn
    boundaries, `seatd.turns`).
    """

    cache: list[Any] | None = None
    start: int = 0
    keep_at: int = 0
    keep: Callable[[list[Any]], None] | None = None
    cuts: tuple[int, ...] = ()


def _kv_group_size(model: Any) -> int:
    """The largest MLX quantization group that divides the head dimension."""
    args = getattr(model, "args", None)
    head_dim = getattr(args, "head_dim", None) or (
        args.hidden_size // args.num_attention_heads if args is not None else 64)
    for group in (64, 32):
        if head_dim % group == 0:
            return group
    raise ValueError(f"head dimension {head_dim} cannot hold a q8 KV cache")


def make_cache(model: Any, kv: str) -> list[Any]:
    """A fresh prompt cache for the lane's KV mode (`fp16` or `q8`).

    q8 quantizes the attention layers' KV; a hybrid model's recurrent layers keep their
    own state either way, made rollbackable where `seatd.recurrent` proved it exact."""
    base = mlx_cache.make_prompt_cache(model)
    if kv == "q8":
        group = _kv_group_size(model)
        base = [mlx_cache.QuantizedKVCache(group_size=group, bits=8)
                if type(c) is mlx_cache.KVCache else c for c in base]
    return recurrent.make_cache(model, base)


def prefill(model: Any, cache: list[Any], prompt: mx.array, upto: int,
            cancelled: Callable[[], bool], resume: Resume | None = None) -> None:
    """Feed prompt[start:upto] in chunks ending on the grid or a cut; between chunks the
    worker can see a cancel."""
    done = resume.start if resume is not None else 0
    cuts = resume.cuts if resume is not None else ()
    while done < upto:
        n = min(PREFILL_CHUNK - done % PREFILL_CHUNK, upto - done,
                *(c - done for c in cuts if c > done))
        model(prompt[None, done : done + n], cache=cache)
        mx.eval([c.state for c in cache])
        done += n
        if resume is not None and resume.keep is not None and done == resume.keep_at:
            resume.keep(cache)
        if cancelled():
            raise DecodeCancelled


def scalar(a: mx.array) -> int:
    """A one-element integer array's value on the host."""
    value: Any = a.item()
    return int(value)


def output_width(model: Any) -> int:
    """The width of the model's logits, read off a forward's shape (built, never run)."""
    return int(model(mx.array([[0]], dtype=mx.uint32), cache=make_cache(model, "fp16")).shape[-1])
