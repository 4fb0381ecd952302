"""The seat's decode loop: one loop for every lane, speculative or plain.

A lane is (sync | streaming) x (fp16 | q8 KV).  Streaming is this same loop
emitting committed text as it goes; a sync request collects the same pieces, so
streamed output equals sync output byte for byte for the same request and seed.
Both KV modes sit behind mlx-lm's cache protocol (update, offset, trim), and so do
a hybrid model's recurrent layers (`seatd.recurrent` rolls them back), so
speculation reaches every lane of every model it can prove exact.

Tokens come from one of two sources, consumed by the same loop below:
- plain: one target step per token; the next step is scheduled (`async_eval`)
  before the current token is read, so the forward overlaps the host work;
- speculative: a drafter proposes k tokens, the target verifies them in one
  forward, caches roll back to what was kept (`seatd.verify`).  Only verified
  tokens are ever yielded, so a client never sees a draft retracted.

Speculation declines, never fails: a drafter that raises hands the request to
the plain source at the exact point it had reached.

Penalties and logit_bias (`seatd.shaping`) shape the logits here as in the batch
engine, in the plain step, at each verified position and in the drafter's proposal;
grammars and log-probabilities are the engine's alone (the worker decodes there).

Prefill runs in chunks whose boundaries sit at multiples of PREFILL_CHUNK in
absolute position.  A request resumed from a cached prefix on that grid
(`Resume`) therefore computes the rest in exactly the chunks a cold request
would: chunk shapes change float reduction orders, and warm output must equal
cold output byte for byte.

`decode` serves one request and takes no id: the seat never calls it (its requests are
rows of `seatd.batch`, whose lines name them); its lines (`drafter_failed`) name the
request through what its caller bound (`structlog.contextvars`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import structlog
from mlx_lm.models import cache as mlx_cache

from seatd import recurrent
from seatd.adaptive import DepthStats, RoundPolicy, observe, park_tokens
from seatd.answer import Answer
from seatd.drafters import Drafter, LookupDrafter
from seatd.sampling import Draws, draws_for
from seatd.shaping import Shaper
from seatd.spec_costs import SpecCosts
from seatd.verify import judge
from shared.protocol import SamplingParams

log = structlog.get_logger()

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


@dataclass
class Resume:
    """Where prefill starts, and where it hands its cache to the prompt cache.

    `cache` holds the prompt's first `start` tokens (a chunk boundary); None = cold.
    When prefill reaches `keep_at` (a chunk boundary), it calls `keep(cache)`.
    Chunk boundaries are the multiples of PREFILL_CHUNK and, for caches that resume
    only at an exact length, the `cuts` (turn boundaries, `seatd.turns`).
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


def _plain(model: Any, cache: list[Any], y: int, params: SamplingParams, draws: Draws,
           budget: int, position: int, shaper: Shaper | None = None) -> Iterator[int]:
    """Target-only decoding from the unfed token `y`, pipelined one step ahead; the first
    token yielded is answer position `position`."""

    def step(tokens: mx.array, at: int) -> mx.array:
        logits = model(tokens[None], cache=cache)[:, -1, :]
        if shaper is None:
            return draws.token(logits, params, at)
        token = draws.token(shaper.shape(logits), params, at)
        shaper.advance(token)
        return token

    nxt = step(mx.array([y], dtype=mx.uint32), position)
    mx.async_eval(nxt)  # type: ignore[no-untyped-call]  # MLX ships it unannotated
    for i in range(budget):
        cur = nxt
        if i + 1 < budget:
            nxt = step(cur, position + i + 1)
            mx.async_eval(nxt)  # type: ignore[no-untyped-call]  # MLX ships it unannotated
        yield scalar(cur)


def _speculative(model: Any, cache: list[Any], y: int, spec: Speculation,
                 params: SamplingParams, draws: Draws, budget: int, context_room: int,
                 report: SpecReport, shaper: Shaper | None = None) -> Iterator[int]:
    """Speculative rounds; `produced` is also the answer position of the next token."""
    drafter = spec.drafter
    assert drafter is not None
    produced = 0
    parks = 0  # bursts in a row whose probe did not bring the policy back to drafting
    policy = spec.policy
    while produced < budget:
        wanted = spec.depth if policy is None else min(spec.depth, policy.best())
        if wanted > 0:
            parks = 0
        if policy is not None and wanted == 0:
            # Parked: a burst of pipelined plain tokens, then a probe round.
            n = min(park_tokens(parks, policy.seconds), budget - produced)
            parks += 1
            burst = _plain(model, cache, y, params, draws, n, produced, shaper)
            spent = 0.0  # decoding time only, not the consumer's between tokens
            for _ in range(n):
                started = time.perf_counter()
                token = next(burst)
                spent += time.perf_counter() - started
                drafter.plain(token)
                produced += 1
                y = token
                yield token
            observe(spec.stats, 0, 0, spent / n)
            if produced >= budget:
                return
            wanted = min(spec.depth, policy.best(lowest=1))
        # Room for k drafts plus the token after them, in the answer and the context.
        k = max(0, min(wanted, budget - produced - 1, context_room - produced - 1))
        started = time.perf_counter()
        draft = None
        if k > 0:
            try:
                if shaper is not None:
                    draft = drafter.propose(k, params, draws, produced, shaper=shaper)
                else:
                    draft = drafter.propose(k, params, draws, produced)
            except Exception as exc:  # a drafter's fault is a decline, never a failure
                log.warning("drafter_failed", error=repr(exc))
                report.state = "declined:drafter_error"
                yield from _plain(model, cache, y, params, draws, budget - produced, produced,
                                  shaper)
                return
        if draft is None or draft.k == 0:
            logits = model(mx.array([[y]], dtype=mx.uint32), cache=cache)[:, -1, :]
            if shaper is not None:
                logits = shaper.shape(logits)
            picked = draws.token(logits, params, produced)
            if shaper is not None:
                shaper.advance(picked)
            token = scalar(picked)
            observe(spec.stats, 0, 0, time.perf_counter() - started)
            drafter.plain(token)
            produced += 1
            y = token
            yield token
            continue
        block = mx.concatenate([mx.array([y], dtype=mx.uint32), draft.tokens])
        with recurrent.recording():  # recurrent layers keep what rolling back needs
            logits = model(block[None], cache=cache)  # (1, k+1, V)
        if shaper is not None:
            logits = shaper.shape_block(logits, draft.tokens, None)
        n_arr, t_arr = judge(logits, draft.tokens, draft.probs, params, draws, produced)
        mx.eval(n_arr, t_arr, draft.tokens)
        kept, token = scalar(n_arr), scalar(t_arr)
        drafted = draft.k
        tokens: list[int] = draft.tokens.tolist()  # type: ignore[assignment]  # (k,) ints
        trimmed: Any = mlx_cache.trim_prompt_cache(cache, drafted - kept)  # a count
        if trimmed != drafted - kept:
            # Rejected drafts would stay in the cache: never answer from a wrong state.
            raise RuntimeError(f"rollback of {drafted - kept} tokens failed")
        drafter.settle(kept, drafted, token, tokens)
        if shaper is not None:
            shaper.advance(mx.array([*tokens[:kept], token], dtype=mx.uint32))
        observe(spec.stats, drafted, kept, time.perf_counter() - started)
        if policy is not None:
            policy.observe(drafted, kept)
        report.verified(drafted, kept, getattr(drafter, "name", "model"))
        for t in [*tokens[:kept], token]:
            produced += 1
            yield t
        y = token


def decode(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    kv: str,
    context_length: int,
    emit: Emit | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    on_token: Callable[[int], None] | None = None,
    spec: Speculation | None = None,
    resume: Resume | None = None,
    width: int | None = None,
) -> DecodeResult:
    """Generate for one request.  `emit(text, completion_tokens)` gets committed text.
    `width` is the model's logits width (`output_width`), measured once per seat."""
    if resume is not None and resume.cache is not None and resume.start > 0:
        cache = resume.cache
    else:
        cache = make_cache(model, kv)
        resume = (Resume(None, 0, resume.keep_at, resume.keep, resume.cuts)
                  if resume is not None else None)
    cached = resume.start if resume is not None else 0
    prompt = mx.array(list(prompt_ids), dtype=mx.uint32)
    n_prompt = len(prompt_ids)
    budget = min(params.max_tokens, max(context_length - n_prompt, 0))
    width = width if width is not None else output_width(model)
    draws = draws_for(params, width)
    shaper = Shaper.for_row(params, width, prompt_ids)
    report = SpecReport()

    def send(text: str, count: int) -> None:
        if emit is not None:
            emit(text, count, report.state)

    answer = Answer(tokenizer, params, budget, send)
    if budget == 0:
        return DecodeResult("", "length", n_prompt, 0, report)

    prefill(model, cache, prompt, n_prompt - 1, cancelled, resume)
    y = int(prompt_ids[-1])
    source: Iterator[int]
    if spec is None or (spec.drafter is None and spec.decline is None):
        source = _plain(model, cache, y, params, draws, budget, 0, shaper)
    elif spec.decline is not None or spec.drafter is None or spec.depth == 0:
        report.state = f"declined:{spec.decline or 'not_profitable'}"
        source = _plain(model, cache, y, params, draws, budget, 0, shaper)
    elif shaper is not None and not getattr(spec.drafter, "shapes", False):
        report.state = "declined:constrained"  # a drafter that cannot shape
        source = _plain(model, cache, y, params, draws, budget, 0, shaper)
    else:
        # Until a round verifies a draft (a lookup drafter may find nothing to copy).
        report.state = "declined:no_proposal"
        try:
            spec.drafter.start(prompt_ids)
            if cancelled():
                raise DecodeCancelled
            source = _speculative(model, cache, y, spec, params, draws, budget,
                                  context_length - n_prompt, report, shaper)
        except DecodeCancelled:
            raise
        except Exception as exc:
            log.warning("drafter_failed", error=repr(exc))
            report.state = "declined:drafter_error"
            source = _plain(model, cache, y, params, draws, budget, 0, shaper)

    started = time.perf_counter()
    for token in source:
        if answer.take(token):
            if on_token is not None and token not in answer.eos:
                on_token(answer.produced)
            break
        if on_token is not None:
            on_token(answer.produced)
        if cancelled():
            raise DecodeCancelled
    answer.close()
    produced = answer.produced
    if spec is not None and report.state == "declined:not_profitable" and produced:
        # Plain decoding's own speed is what speculation has to beat.
        observe(spec.stats, 0, 0, (time.perf_counter() - started) / produced)
    return DecodeResult(answer.text, answer.finish, n_prompt, produced, report, cached,
                        answer.ids)
