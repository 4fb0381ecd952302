"""Speculation gates on the real demo pair: distribution, rollback, declines.

The fidelity gate (stream equals sync on every lane) runs through real
processes in tests/test_spec_fidelity.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from seatd.adaptive import DepthStats
from seatd.decode import decode
from seatd.drafters import ModelDrafter
from seatd.engine_types import Speculation, make_cache
from seatd.model_load import load_for_compute
from seatd.speculation import SeatSpeculation, kill_switch
from seatd.verify import draft_probs, verify_sampled
from shared.builtin import resolve_model
from shared.config import parse_config
from shared.protocol import Generate, SamplingParams
from tests.chi2 import chi2_critical, chi_square
from tests.lanes import logits_close
from tests.spec_models import (
    drafter_dir,
    greedy_consistent,
    lookup_plan_declines,
    snippet,
    target_dir,
)

pytestmark = pytest.mark.slow

TRIALS = 20_000
BATCH = 5_000  # trials per verify call, to bound memory (B x 2 x vocab floats)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Any, Any, Any, list[int]]]:
    target = load_for_compute(target_dir())
    drafter = load_for_compute(drafter_dir())
    ids = target.tokenizer.encode(snippet())
    yield target.model, drafter.model, target.tokenizer, ids


def _logits(model: Any, ids: list[int]) -> mx.array:
    cache = make_cache(model, "fp16")
    return model(mx.array(ids, dtype=mx.uint32)[None], cache=cache)[0]  # (T, V)


def _emitted(p1: mx.array, q1: mx.array | None, seed: int,
             fixed_draft: int | None = None) -> np.ndarray:
    """First token emitted by one verify round of depth 1, over many trials.

    p1, q1: filtered target and draft probabilities over one set of tokens (a vocabulary
    cut to where either is non-zero: the verifier never looks at zero columns, and the
    trials run an order of magnitude faster)."""
    vocab = p1.shape[-1]
    counts = np.zeros(vocab, dtype=np.int64)
    target = mx.broadcast_to(p1[None, None], (BATCH, 2, vocab))
    for i in range(TRIALS // BATCH):
        key_d, key_v = mx.random.split(mx.random.key(seed * 1000 + i))
        if q1 is None:
            drafts = mx.full((BATCH, 1), fixed_draft, dtype=mx.uint32)
            q = None
        else:
            drafts = mx.random.categorical(mx.log(q1), num_samples=BATCH, key=key_d)[:, None]
            q = mx.broadcast_to(q1[None, None], (BATCH, 1, vocab))
        n, token = verify_sampled(target, drafts, q, key_v)
        first = mx.where(n > 0, drafts[:, 0], token)
        counts += np.bincount(np.array(first), minlength=vocab)
    return counts


def _spread_positions(p_all: mx.array, params: SamplingParams) -> tuple[int, int]:
    """The position whose filtered target distribution is widest (a test with many bins),
    and another whose most likely token differs (for the sabotage)."""
    probs = draft_probs(p_all, params)
    entropy = -(probs * mx.log(mx.maximum(probs, 1e-30))).sum(axis=-1)
    a = int(mx.argmax(entropy).item())
    best = mx.argmax(p_all, axis=-1)
    others = [i for i in range(p_all.shape[0]) if int(best[i].item()) != int(best[a].item())]
    return a, others[len(others) // 2]


@pytest.fixture(scope="module")
def hybrid_pair() -> Iterator[tuple[Any, Any, Any, list[int]]]:
    """The hybrid demo target (gated-delta + attention) with the same drafter."""
    target = load_for_compute(resolve_model("builtin:demo-hybrid"))
    drafter = load_for_compute(drafter_dir())
    ids = target.tokenizer.encode(snippet())
    yield target.model, drafter.model, target.tokenizer, ids


@pytest.mark.parametrize("temperature", [0.4, 0.7, 1.0])
def test_rejection_sampler_follows_target_distribution(pair, temperature: float) -> None:
    """Emitted tokens follow p (chi-square at alpha 0.001); the sabotaged pairing fails."""
    _distribution_gate(*pair, temperature)


@pytest.mark.parametrize("temperature", [0.4, 0.7, 1.0])
def test_rejection_sampler_follows_hybrid_target_distribution(hybrid_pair,
                                                              temperature: float) -> None:
    """The same gate on the hybrid target's logits."""
    _distribution_gate(*hybrid_pair, temperature)


def _distribution_gate(target: Any, drafter: Any, _tok: Any, ids: list[int],
                       temperature: float) -> None:
    params = SamplingParams(temperature=temperature, top_p=0.95)
    p_all, q_all = _logits(target, ids), _logits(drafter, ids)
    pos_a, pos_b = _spread_positions(p_all, params)
    p_a, p_b, q_a = (draft_probs(row[None], params)[0]
                     for row in (p_all[pos_a], p_all[pos_b], q_all[pos_a]))
    support = np.nonzero(np.array((p_a + p_b + q_a) > 0))[0]
    cut = mx.array(support)
    p_a, p_b, q_a = p_a[cut], p_b[cut], q_a[cut]
    probs_a = np.array(p_a, dtype=np.float64)

    counts = _emitted(p_a, q_a, seed=11)
    stat, df = chi_square(counts, probs_a, TRIALS)
    crit = chi2_critical(df)
    print(f"T={temperature}: chi2={stat:.1f} df={df} critical(0.001)={crit:.1f}"
          f" ({len(support)} tokens with p or q above 0)")
    assert stat < crit

    # Lookup drafter: one-hot proposal of q's favourite token.
    onehot = _emitted(p_a, None, seed=12, fixed_draft=int(mx.argmax(q_a).item()))
    stat1, df1 = chi_square(onehot, probs_a, TRIALS)
    print(f"T={temperature} one-hot: chi2={stat1:.1f} df={df1} critical={chi2_critical(df1):.1f}")
    assert stat1 < chi2_critical(df1)

    # Sabotage: proposals from position A verified against position B's target.
    sabotaged = _emitted(p_b, q_a, seed=13)
    stat2, df2 = chi_square(sabotaged, probs_a, TRIALS)
    print(f"T={temperature} sabotage: chi2={stat2:.1f} df={df2} critical={chi2_critical(df2):.1f}")
    assert stat2 > chi2_critical(df2)


def _state(cache: list[Any]) -> list[np.ndarray]:
    out = []
    for c in cache:
        keys, values = c.state[0], c.state[1]
        for part in (keys, values):
            for arr in (part if isinstance(part, list | tuple) else [part]):
                # float32 holds a bfloat16 exactly (numpy has no bfloat16)
                out.append(np.array(arr[..., : c.offset, :].astype(mx.float32)))
    return out


@pytest.mark.parametrize("kv", ["fp16", "q8"])
def test_rollback_is_exact_at_every_acceptance_length(pair, kv: str) -> None:
    """After a partial accept, the trimmed cache equals, bit for bit, a cache that verified a
    block of the same shape whose rejected tail was different tokens; the next step's
    logits are identical.  Against a cache fed only the kept tokens (another batch
    shape) it agrees to kernel rounding."""
    target, _, _, ids = pair
    prompt, drafts, k = ids[:48], ids[48:52], 4
    other = [(t + 1) % 8000 for t in drafts]

    def verified(block_tail: list[int], trim: int) -> list[Any]:
        c = make_cache(target, kv)
        target(mx.array(prompt[:-1], dtype=mx.uint32)[None], cache=c)
        target(mx.array([prompt[-1], *block_tail], dtype=mx.uint32)[None], cache=c)
        for layer in c:
            layer.trim(trim)
        return c

    nxt = mx.array([[ids[60]]], dtype=mx.uint32)
    for kept in range(k + 1):
        a = verified(drafts, k - kept)
        b = verified(drafts[:kept] + other[kept:], k - kept)
        assert [c.offset for c in a] == [c.offset for c in b] == \
            [len(prompt) + kept] * len(a)
        for x, y in zip(_state(a), _state(b), strict=True):
            assert np.array_equal(x, y), f"kv={kv} kept={kept}: cache differs"
        la, lb = target(nxt, cache=a), target(nxt, cache=b)
        assert np.array_equal(np.array(la.astype(mx.float32)), np.array(lb.astype(mx.float32))), \
            f"kv={kv} kept={kept}: logits differ"
        fed = verified(drafts[:kept], 0)  # only the kept tokens, a narrower forward
        lf = target(nxt, cache=fed)
        if la.dtype in (mx.bfloat16, mx.float16):  # a GPU computes in the stored dtype,
            assert logits_close(la, lf, kv)  # where a narrower forward rounds apart
        else:
            assert np.allclose(np.array(la), np.array(lf), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("kv", ["fp16", "q8"])
def test_hybrid_rollback_is_exact_at_every_acceptance_length(hybrid_pair, kv: str) -> None:
    """The trained hybrid demo, verify blocks of every depth up to the adaptive maximum,
    every number of kept tokens: the rolled-back recurrent state, conv window and KV
    equal, bit for bit, the state mlx-lm's own path reaches for the kept tokens at the
    same batch shape; the next step's logits are identical."""
    from mlx_lm.models import cache as mlx_cache

    from seatd import recurrent
    from seatd.adaptive import MAX_DEPTH

    target, _, _, ids = hybrid_pair
    assert getattr(target, recurrent.ENABLED_ATTR)
    nxt = mx.array([[ids[90]]], dtype=mx.uint32)
    # The 60-token prefix is fed once; every pair below starts from its own copy.
    prefix = make_cache(target, kv)
    target(mx.array(ids[:60], dtype=mx.uint32)[None], cache=prefix)
    mx.eval([c.state for c in prefix])
    for fed in range(2, MAX_DEPTH + 2):
        block = mx.array(ids[60 : 60 + fed], dtype=mx.uint32)[None]
        for keep in range(1, fed + 1):
            live, ref = _copied(target, kv, prefix), _copied(target, kv, prefix)
            with recurrent.recording():
                target(block, cache=live)
            assert mlx_cache.trim_prompt_cache(live, fed - keep) == fed - keep
            recurrent.feed_kept(target, ref, block, keep)
            assert recurrent.same_state(live, ref), f"kv={kv} fed={fed} keep={keep}"
            la, lb = target(nxt, cache=live), target(nxt, cache=ref)
            assert mx.array_equal(la, lb).item(), f"kv={kv} fed={fed} keep={keep}: logits"


def _copied(model: Any, kv: str, cache: list[Any]) -> list[Any]:
    """A fresh cache holding `cache`'s state in arrays of its own (through numpy, so a
    write into one copy's KV buffer can never show in another)."""

    def fresh(x: Any) -> Any:
        if isinstance(x, mx.array):  # numpy has no bfloat16: through float32, exactly
            wide = x.astype(mx.float32) if x.dtype == mx.bfloat16 else x
            return mx.array(np.array(wide)).astype(x.dtype)
        if isinstance(x, list | tuple):
            return type(x)(fresh(y) for y in x)
        assert x is None or isinstance(x, int)  # an empty slot, an offset
        return x

    out = make_cache(model, kv)
    for new, old in zip(out, cache, strict=True):
        assert type(new) is type(old)
        new.state = fresh(old.state)
        if hasattr(old, "meta_state"):  # QuantizedKVCache's offset, group and bits
            new.meta_state = old.meta_state
        assert getattr(new, "offset", None) == getattr(old, "offset", None)
    return out


class RaisingDrafter(ModelDrafter):
    """A drafter whose fault cannot be produced on demand otherwise: it raises on round N."""

    def __init__(self, model: Any, fail_at: int) -> None:
        super().__init__(model)
        self.fail_at = fail_at
        self.rounds = 0

    def propose(self, *args: Any, **kw: Any) -> Any:
        self.rounds += 1
        if self.rounds >= self.fail_at:
            raise RuntimeError("drafter exploded")
        return super().propose(*args, **kw)


@pytest.mark.parametrize("fail_at", [1, 3])
def test_drafter_exception_is_a_decline_not_a_failure(pair, fail_at: int) -> None:
    """A drafter raising mid-request: the answer completes on the plain path, declined."""
    target, drafter, tok, ids = pair
    params = SamplingParams(temperature=0.0, max_tokens=40)
    spec = Speculation(RaisingDrafter(drafter, fail_at), 3, DepthStats())
    result = decode(target, tok, ids[:64], params, kv="fp16", context_length=2048, spec=spec)
    assert result.speculation.state == "declined:drafter_error"
    assert result.completion_tokens == 40 or result.finish_reason == "stop"
    if fail_at == 1:
        plain = decode(target, tok, ids[:64], params, kv="fp16", context_length=2048)
        assert result.text == plain.text


def _seat_config(draft_path: Path, **extra: str) -> Any:
    lines = "\n".join(f"{k} = {v}" for k, v in extra.items())
    return parse_config(f"""
[[seat]]
name = "s"
model = "{target_dir()}"
drafter = {{ kind = "model", path = "{draft_path}" }}
{lines}
[[route]]
model = "s"
ladder = ["s"]
""")


def test_declines_with_reasons(pair, tmp_path: Path, monkeypatch) -> None:
    """Kill switch, a drafter with another tokenizer, a drafter that cannot load."""
    target, _, _, _ = pair
    from shared.builtin import tokenizer_hash

    h = tokenizer_hash(target_dir())
    req = Generate("r", False, SamplingParams())
    config = _seat_config(drafter_dir(), draft_depth="3")
    spec = SeatSpeculation(config, config.seat[0], target, h)
    assert spec.plan(req, "fp16").drafter is not None
    for off in ("0", "off", "OFF", "false"):
        monkeypatch.setenv("SANCTUM_SPECULATION", off)
        assert kill_switch(config.seat[0])
    monkeypatch.setenv("SANCTUM_SPECULATION", "on")
    assert not kill_switch(config.seat[0])
    monkeypatch.setenv("SANCTUM_SPECULATION", "off")
    assert spec.plan(req, "fp16").decline == "kill_switch"
    monkeypatch.delenv("SANCTUM_SPECULATION")

    other = tmp_path / "other-drafter"
    shutil.copytree(drafter_dir(), other)
    tj = other / "tokenizer_config.json"
    tj.write_text(tj.read_text() + "\n")
    config = _seat_config(other)
    assert SeatSpeculation(config, config.seat[0], target, h).plan(req, "fp16").decline \
        == "tokenizer_mismatch"

    config = _seat_config(tmp_path / "missing")
    assert SeatSpeculation(config, config.seat[0], target, h).plan(req, "fp16").decline \
        == "no_drafter"


def test_non_rollbackable_cache_declines() -> None:
    """A recurrent model's cache cannot be trimmed: speculation declines, it does not fail."""
    from mlx_lm.models import mamba

    args = mamba.ModelArgs(model_type="mamba", vocab_size=64, hidden_size=32,
                           intermediate_size=64, state_size=4, num_hidden_layers=2,
                           conv_kernel=3, use_bias=False, use_conv_bias=True, time_step_rank=4)
    assert lookup_plan_declines(mamba.Model(args)) == ["cache_not_rollbackable"] * 2


def _policy() -> Any:
    from seatd.adaptive import RoundPolicy

    # Round times as this CPU measures the demo pair (plain 50 ms, a verify about one
    # step, 8 ms per drafter token), the seat's usual prior.
    return RoundPolicy(tuple([0.050] + [0.055 + 0.008 * k for k in range(1, 7)]), (0.6,) * 6)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_round_policy_parks_a_useless_drafter_and_drafts_deep_with_a_good_one(
        pair, temperature: float) -> None:
    """Inside one request: a drafter that never agrees is parked after a few rounds (plain
    bursts with a probe between), the demo drafter on code drafts deep; streaming takes
    the same path as sync, so the text is identical."""
    from mlx_lm.models import llama

    from seatd.adaptive import MAX_DEPTH, park_tokens

    target, drafter, tok, ids = pair
    mx.random.seed(3)
    useless = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=8192,
        tie_word_embeddings=True))
    params = SamplingParams(temperature=temperature, max_tokens=40, seed=5)  # a few parks

    def run(model: Any, stream: bool) -> Any:
        pieces: list[str] = []
        spec = Speculation(ModelDrafter(model), MAX_DEPTH, DepthStats(), policy=_policy())
        out = decode(target, tok, ids[:200], params, kv="fp16", context_length=2048,
                     spec=spec, emit=(lambda t, n, s: pieces.append(t)) if stream else None)
        assert not stream or "".join(pieces) == out.text
        return out

    bad, bad_stream = run(useless, False), run(useless, True)
    assert bad.text == bad_stream.text
    if temperature == 0:  # the parked bursts and probes fed the target the right context
        assert greedy_consistent(target, ids[:200], bad.token_ids) == []
    bursts, left = 0, bad.completion_tokens  # each burst longer than the last, a probe after
    while left > 0:
        left -= park_tokens(bursts) + 1
        bursts += 1
    assert bad.speculation.drafts <= 3 + bursts
    assert bad.speculation.accepted_tokens <= 2
    good, good_stream = run(drafter, False), run(drafter, True)
    assert good.text == good_stream.text
    if temperature == 0:
        assert greedy_consistent(target, ids[:200], good.token_ids) == []
    assert good.speculation.state == "accelerated"
    # A seeded request above 0 keeps a draft only where it is the target's keyed token,
    # which agrees less often than rejection sampling accepts: it drafts less deep.
    assert good.speculation.draft_tokens / good.speculation.drafts >= (
        3 if temperature == 0 else 2)
