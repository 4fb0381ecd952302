"""One request decoded alone, speculative or plain: the reference loop.

The seat decodes in its batch engine (`seatd.batch`); tests, the demo models' measure
script and the float-flips benchmark decode here, one request in this process, as the
answer the engine's rows must equal.  The types both share are in `seatd.engine_types`.

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

`decode` serves one request and takes no id: the seat never calls it (its requests are
rows of `seatd.batch`, whose lines name them); its lines (`drafter_failed`) name the
request through what its caller bound (`structlog.contextvars`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import structlog
from mlx_lm.models import cache as mlx_cache

from seatd import recurrent
from seatd.adaptive import observe, park_tokens
from seatd.answer import Answer
from seatd.engine_types import (
    DecodeCancelled,
    DecodeResult,
    Emit,
    Resume,
    SpecReport,
    Speculation,
    make_cache,
    output_width,
    prefill,
    scalar,
)
from seatd.sampling import Draws, draws_for
from seatd.shaping import Shaper
from seatd.verify import judge
from shared.protocol import SamplingParams

log = structlog.get_logger()


log = structlog.get_logger()


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
