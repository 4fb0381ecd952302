"""Verification of a drafted block: which drafts to keep, and the next token.

At temperature 0 a draft is kept while it equals the target's argmax.  A seeded
request above 0 uses the same rule on perturbed scores (`seatd.sampling.Keyed`):
a draft is kept while it equals the target's keyed token, and the target's keyed
token follows, so the answer is the plain path's whatever the drafter proposed.
An unseeded request above 0 uses the rejection rule of Leviathan et al. / Chen
et al.: keep draft x with probability min(1, p(x)/q(x)); at the first rejection
draw from the normalised residual max(0, p - q); when every draft is kept draw a
bonus token from p.  p and q are both taken after the same temperature, top-k and
top-p.  A drafter with no distribution (lookup) has a one-hot q: keep x with
probability p(x), and on rejection draw from p with x removed.

`judge` picks the rule for a request and is the one place both decode loops (the batch
engine's verify round and the one-request reference loop) ask for a verdict.

Everything stays on the device and lazy: the caller evaluates `(n, token)` once.
Shapes carry a leading batch axis B so that the distribution test can run many
trials at once; the decode loop uses B = 1.
"""

from __future__ import annotations

import mlx.core as mx

from seatd.sampling import Draws, Keyed, filter_logits
from shared.protocol import SamplingParams


def draft_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The distribution a token is drawn from, after temperature, top-k and top-p."""
    return mx.softmax(filter_logits(logits, params), axis=-1)


def _first_rejection(accept: mx.array) -> mx.array:
    """Number of leading Trues along the last axis: (B, k) -> (B,)."""
    return mx.cumprod(accept.astype(mx.int32), axis=-1).sum(axis=-1)


def verify_greedy(target_logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """target_logits (B, k+1, V), drafts (B, k) -> (accepted (B,), next token (B,))."""
    best = mx.argmax(target_logits, axis=-1)  # (B, k+1)
    k = drafts.shape[-1]
    n = _first_rejection(drafts == best[:, :k])
    token = mx.take_along_axis(best, n[:, None], axis=-1)[:, 0]
    return n, token


def verify_sampled(p: mx.array, drafts: mx.array, q: mx.array | None,
                   key: mx.array) -> tuple[mx.array, mx.array]:
    """Rejection sampling.  p (B, k+1, V) are the target's probabilities (`draft_probs`
    of its logits), q (B, k, V) the drafter's, None for a one-hot drafter.

    Returns (accepted (B,), next token (B,)): the residual draw at the first
    rejection, or the bonus draw from p after the last draft.
    """
    b, k = drafts.shape
    p_head = p[:, :k, :]
    p_x = mx.take_along_axis(p_head, drafts[..., None], axis=-1)[..., 0]  # (B, k)
    onehot = mx.zeros_like(p_head)
    onehot = mx.put_along_axis(onehot, drafts[..., None], mx.array(1.0, p.dtype), axis=-1)
    if q is None:
        q_full = onehot
        q_x = mx.ones_like(p_x)
    else:
        q_full = q
        q_x = mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    k_u, k_draw = mx.random.split(key)
    u = mx.random.uniform(shape=(b, k), key=k_u)
    n = _first_rejection(u * q_x < p_x)  # u < p/q without dividing by a zero q
    residual = mx.maximum(p_head - q_full, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    # Where p and q agree exactly the residual is empty; rejection there has
    # probability zero, but guard the arithmetic with p itself.
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p_head)
    choices = mx.concatenate([residual, p[:, k:, :]], axis=1)  # (B, k+1, V)
    row = mx.take_along_axis(choices, n[:, None, None], axis=1)[:, 0, :]  # (B, V)
    token = mx.random.categorical(mx.log(row), axis=-1, key=k_draw)
    return n, token


def judge(logits: mx.array, drafts: mx.array, probs: mx.array | None,
          params: SamplingParams, draws: Draws, position: int) -> tuple[mx.array, mx.array]:
    """One request's verdict on its drafted block, by its rule: greedy at temperature 0;
    keyed for a seeded request (drafts kept while they are the target's own keyed tokens,
    then the target's token at the first mismatch or after the last draft); rejection
    sampling otherwise.  `logits` (1, k+1, V), already shaped; `drafts` (k,); `probs`
    the drafter's (k, V), None for a one-hot drafter; `position` the answer's position
    of the block's first token (the keyed rule's key).  Returns (kept (1,), next (1,))."""
    if params.temperature == 0:
        return verify_greedy(logits, drafts[None])
    if isinstance(draws, Keyed):
        return verify_greedy(draws.scores(logits, params, position), drafts[None])
    return verify_sampled(draft_probs(logits, params), drafts[None],
                          probs[None] if probs is not None else None, draws.next_key())
