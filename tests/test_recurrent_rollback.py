"""Rollback of hybrid (gated-delta + attention) caches, on small random qwen3_next models.

Random weights are enough for exactness: the claim is about state, not quality.  The
reference is mlx-lm's own padding path at the same batch shape (`recurrent.feed_kept`);
against a forward of a different width the projections may round differently.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as mlx_nn
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import qwen3_next
from mlx_lm.utils import load_tokenizer

from seatd import dtype_check, recurrent
from seatd.adaptive import MAX_DEPTH, DepthStats
from seatd.decode import decode
from seatd.drafters import ModelDrafter
from seatd.engine_types import Speculation, make_cache
from seatd.prompt_cache import trimmable
from shared.builtin import resolve_model
from shared.protocol import SamplingParams
from tests.spec_models import greedy_consistent, lookup_plan_declines

VOCAB = 8192  # the demo tokenizer's, so decode() can run on these models


def hybrid(dtype: mx.Dtype = mx.float32, seed: int = 0, interval: int = 2) -> Any:
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
        num_attention_heads=4, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        num_experts=0, num_experts_per_tok=0, decoder_sparse_step=1,
        shared_expert_intermediate_size=0, mlp_only_layers=[], moe_intermediate_size=0,
        rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=2, rope_theta=10000.0,
        partial_rotary_factor=0.25, max_position_embeddings=2048, head_dim=32,
        tie_word_embeddings=True, full_attention_interval=interval)
    mx.random.seed(seed)
    model = qwen3_next.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def model() -> Any:
    m = hybrid()
    assert recurrent.enable(m)
    return m


def _tokens(n: int, seed: int) -> mx.array:
    return mx.random.randint(0, VOCAB, (1, n), key=mx.random.key(seed)).astype(mx.uint32)


def _rolled_back(model: Any, kv: str, fed: int, keep: int, seed: int) -> tuple[list, list]:
    prompt, block = _tokens(37, seed), _tokens(fed, seed + 1)
    live, ref = make_cache(model, kv), make_cache(model, kv)
    for cache in (live, ref):
        model(prompt, cache=cache)
    with recurrent.recording():
        model(block, cache=live)
    assert mlx_cache.trim_prompt_cache(live, fed - keep) == fed - keep
    recurrent.feed_kept(model, ref, block, keep)
    return live, ref


@pytest.mark.parametrize("kv", ["fp16", "q8"])
def test_rollback_is_exact_at_every_acceptance_length(model, kv: str) -> None:
    """Every draft depth up to the adaptive maximum, every number of kept tokens: the
    restored recurrent state, conv window and KV equal mlx-lm's own state for the kept
    tokens bit for bit, and the next step's logits are identical."""
    checked = 0
    for fed in range(2, MAX_DEPTH + 2):
        for keep in range(1, fed):
            live, ref = _rolled_back(model, kv, fed, keep, seed=100 * fed + keep)
            assert recurrent.same_state(live, ref), (fed, keep)
            step = _tokens(1, 7)
            a, b = model(step, cache=live), model(step, cache=ref)
            assert mx.array_equal(a, b).item(), (fed, keep)
            checked += 1
    assert checked == sum(range(1, MAX_DEPTH + 1))


def test_a_wrong_rollback_is_caught(model, monkeypatch) -> None:
    """The comparison has teeth: restoring the state one token late differs."""

    def off_by_one(self: recurrent.RollbackArraysCache, n: int) -> int:
        conv, states = self.trail  # type: ignore[misc]
        self.trail = None
        keep = len(states) - 1 - n + 1
        window = conv.shape[1] - (len(states) - 1)
        self.cache[0] = conv[:, keep : keep + window, :]
        self.cache[1] = states[keep]
        return n

    monkeypatch.setattr(recurrent.RollbackArraysCache, "trim", off_by_one)
    live, ref = _rolled_back(model, "fp16", 4, 2, seed=5)
    assert not recurrent.same_state(live, ref)


def test_cache_trims_only_right_after_a_recorded_forward(model) -> None:
    """Outside a verify the recurrent cache is exact-length state: not trimmable, and
    the prompt cache keeps its entries at their exact length only."""
    cache = make_cache(model, "fp16")
    assert any(isinstance(c, recurrent.RollbackArraysCache) for c in cache)
    model(_tokens(9, 1), cache=cache)
    assert not mlx_cache.can_trim_prompt_cache(cache)
    assert not trimmable(cache)
    with recurrent.recording():
        model(_tokens(3, 2), cache=cache)
    assert mlx_cache.can_trim_prompt_cache(cache)
    model(_tokens(1, 3), cache=cache)  # an unrecorded step drops the record
    assert not mlx_cache.can_trim_prompt_cache(cache)
    assert recurrent.can_roll_back(make_cache(model, "q8"))


def test_models_it_cannot_prove_stay_declined(monkeypatch) -> None:
    """A model whose layers record nothing is not enabled, so speculation declines."""
    from mlx_lm.models import mamba

    args = mamba.ModelArgs(model_type="mamba", vocab_size=64, hidden_size=32,
                           intermediate_size=64, state_size=4, num_hidden_layers=2,
                           conv_kernel=3, use_bias=False, use_conv_bias=True, time_step_rank=4)
    assert not recurrent.enable(mamba.Model(args))

    # A layer layout whose convolution records nothing (as an unknown design would).
    monkeypatch.setattr(recurrent.RecordingConv1d, "__call__",
                        lambda self, x: mlx_nn.Conv1d.__call__(self, x))
    sabotaged = hybrid(seed=3)
    assert not recurrent.enable(sabotaged)
    assert not any(isinstance(c, recurrent.RollbackArraysCache)
                   for c in make_cache(sabotaged, "fp16"))
    assert lookup_plan_declines(sabotaged) == ["cache_not_rollbackable"] * 2


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_residual_stream_keeps_its_dtype(dtype: mx.Dtype) -> None:
    m = hybrid(dtype)
    assert recurrent.enable(m)
    for kv in ("fp16", "q8"):
        assert dtype_check.leaks(m, make_cache(m, kv), list(range(40))) == []
        cache = make_cache(m, kv)
        m(_tokens(20, 4), cache=cache)
        with recurrent.recording():  # the verify path too
            assert dtype_check.leaks(m, cache, [1, 2, 3, 4]) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_demo_keeps_its_dtypes(dtype: str) -> None:
    """The trained hybrid as a seat loads it, in each compute dtype, on both lanes."""
    from seatd.model_load import load_for_compute

    m = load_for_compute(resolve_model("builtin:demo-hybrid"), dtype).model
    for kv in ("fp16", "q8"):
        assert dtype_check.leaks(m, make_cache(m, kv), list(range(3, 40))) == []


def test_dtype_leaks_are_caught(monkeypatch) -> None:
    """A kernel returning float32 into a bfloat16 stream, and a bfloat16 state, are named."""
    m = hybrid(mx.bfloat16)
    real = qwen3_next.gated_delta_update

    def leaky(*args: Any, **kwargs: Any) -> tuple[mx.array, mx.array]:
        y, state = real(*args, **kwargs)
        return y.astype(mx.float32), state

    monkeypatch.setattr(qwen3_next, "gated_delta_update", leaky)
    found = dtype_check.leaks(m, make_cache(m, "fp16"), list(range(12)))
    assert any("bfloat16 in, mlx.core.float32 out" in f for f in found), found

    def narrow(*args: Any, **kwargs: Any) -> tuple[mx.array, mx.array]:
        y, state = real(*args, **kwargs)
        return y, state.astype(mx.bfloat16)

    monkeypatch.setattr(qwen3_next, "gated_delta_update", narrow)
    found = dtype_check.leaks(m, make_cache(m, "fp16"), list(range(12)))
    assert any("recurrent state" in f for f in found), found


@pytest.mark.parametrize("kv", ["fp16", "q8"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_speculative_decode_on_a_hybrid_streams_what_it_syncs(model, kv: str,
                                                               temperature: float) -> None:
    """The one decode loop serves the hybrid with speculation (a small random llama
    drafting): it verifies drafts, and emitted pieces join to exactly the sync text."""
    tok = load_tokenizer(resolve_model("builtin:demo"))
    from mlx_lm.models import llama

    mx.random.seed(1)
    drafter = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=VOCAB,
        tie_word_embeddings=True))
    text = "alpha beta gamma delta " * 12
    ids = tok.encode(text)
    params = SamplingParams(temperature=temperature, max_tokens=48, seed=9)

    def run(stream: bool) -> Any:
        pieces: list[str] = []
        emit = (lambda t, n, s: pieces.append(t)) if stream else None
        spec = Speculation(ModelDrafter(drafter), 4, DepthStats())
        out = decode(model, tok, ids, params, kv=kv, context_length=2048, emit=emit,
                     spec=spec)
        return out, "".join(pieces)

    sync, _ = run(False)
    streamed, joined = run(True)
    assert sync.speculation.state == "accelerated"
    assert sync.speculation.drafts > 0
    assert joined == streamed.text == sync.text
    if temperature == 0:  # every rollback left the target the right context
        assert greedy_consistent(model, ids, sync.token_ids) == []
    assert streamed.speculation.accepted_per_position == sync.speculation.accepted_per_position
