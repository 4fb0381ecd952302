"""The seat's attention as each backend computes it (`seatd.rows_attention.library`): the
CUDA rule (a narrow block query by query over its causal prefix, a wide one composed, a q8
cache dequantized) computes what mlx-lm's attention computes, on this CPU."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from seatd import rows_attention
from seatd.backend import backend
from seatd.rows_attention import _LIBRARY, SPLIT_QUERIES, library

B, H, KV, D, S = 2, 6, 2, 64, 40
# Against mlx-lm's own on this process's backend: on a GPU its multi-query kernel (cuDNN on
# CUDA) computes float32 attention at a lower precision than the one-query kernel.
ATOL = 1e-5 if backend() == "cpu" else 2e-3


def qkv(n: int, seed: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    mx.random.seed(seed)
    return (mx.random.normal((B, H, n, D)), mx.random.normal((B, KV, S, D)),
            mx.random.normal((B, KV, S, D)))


def causal_bool(n: int, holes: tuple[int, ...] = ()) -> mx.array:
    """(B, 1, n, S): causal at the end, with columns no row may see (holes, padding)."""
    allowed = mx.arange(S - n, S)[:, None] >= mx.arange(S)[None]
    for h in holes:
        allowed = allowed & (mx.arange(S) != h)[None]
    return mx.broadcast_to(allowed[None, None], (B, 1, n, S))


@pytest.mark.parametrize("n", [2, 4, SPLIT_QUERIES, SPLIT_QUERIES + 1, 33])
@pytest.mark.parametrize("mask", ["causal", "bool"])
def test_cuda_rule_computes_the_librarys_attention(n: int, mask: str) -> None:
    """Query by query (narrow) or composed (wide), with mlx-lm's causal mask or a rows
    cache's boolean one with holes: the same attention as mlx-lm's, to float rounding."""
    q, k, v = qkv(n)
    m: Any = "causal" if mask == "causal" else causal_bool(n, holes=(3, 17))
    want = _LIBRARY(q, k, v, cache=None, scale=D**-0.5, mask=m)
    got = library(q, k, v, None, D**-0.5, m, on="cuda")
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=ATOL).item()


def test_a_verified_query_is_the_plain_steps_own_call() -> None:
    """Query i of a narrow block is, bit for bit, a one-query attention over the keys up to
    its position: what a plain step at that position computes."""
    n = 5
    q, k, v = qkv(n, seed=1)
    block = library(q, k, v, None, 0.125, "causal", on="cuda")
    for i in range(n):
        end = S - n + i + 1
        plain = _LIBRARY(q[:, :, i : i + 1], k[:, :, :end], v[:, :, :end], cache=None,
                         scale=0.125, mask=None)
        assert mx.array_equal(block[:, :, i : i + 1], plain).item(), i


@pytest.mark.parametrize("n", [1, 3, 40])
def test_cuda_rule_dequantizes_a_q8_cache(n: int) -> None:
    """A q8 cache's keys and values are dequantized with its own group size and bits (MLX's
    CUDA build has no 8-bit quantized matmul for attention's shapes): the same attention as
    mlx-lm's quantized path, to the rounding of the two routes."""
    q, k, v = qkv(n, seed=2)
    cache = mlx_cache.QuantizedKVCache(group_size=64, bits=8)
    qk, qv = cache.update_and_fetch(k, v)
    m: Any = "causal" if n > 1 else None
    got = library(mx.array(q), qk, qv, cache, 0.125, m, on="cuda")
    keys, values = (mx.dequantize(*p, group_size=64, bits=8) for p in (qk, qv))
    exact = _LIBRARY(mx.array(q), keys, values, cache=None, scale=0.125, mask=m)
    assert mx.allclose(got, exact, atol=ATOL).item()
    if backend() != "cuda":  # mlx-lm's quantized attention, where it has a kernel
        # (it scales its queries in place: each call gets its own)
        want = _LIBRARY(mx.array(q), qk, qv, cache=cache, scale=0.125, mask=m)
        assert mx.allclose(got, want, atol=1e-3).item()


def test_other_backends_take_mlx_lms_attention_unchanged() -> None:
    """On the CPU and on Metal the library is mlx-lm's function itself, bit for bit."""
    q, k, v = qkv(4, seed=3)
    for on in ("cpu", "metal"):
        got = library(q, k, v, None, 0.125, "causal", on=on)
        assert mx.array_equal(got, _LIBRARY(q, k, v, cache=None, scale=0.125,
                                            mask="causal")).item()


def test_the_backend_decides_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `on`, the process's backend decides: a narrow block attends query by query
    on CUDA (seen through which calls mlx-lm's function gets)."""
    calls: list[int] = []

    def counting(q: mx.array, *a: Any, **kw: Any) -> mx.array:
        calls.append(q.shape[2])
        return _LIBRARY(q, *a, **kw)

    monkeypatch.setattr(rows_attention, "_LIBRARY", counting)
    monkeypatch.setattr(rows_attention, "kernel_ready", lambda: False)  # (tests/test_rows_kernel)
    q, k, v = qkv(3, seed=4)
    monkeypatch.setattr(rows_attention, "backend", lambda: "cuda")
    library(q, k, v, None, 0.125, "causal")
    assert calls == [1, 1, 1]
    calls.clear()
    monkeypatch.setattr(rows_attention, "backend", lambda: "cpu")
    library(q, k, v, None, 0.125, "causal")
    assert calls == [3]


def test_batched_rows_keep_their_bytes_under_the_cuda_rule(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch engine on the demo pair with CUDA's attention rule (here on the CPU):
    every row, greedy or seeded, fp16 or q8 (dequantized), batched with speculation gives
    the bytes it gives batched without, and its stream pieces make its answer."""
    from seatd.model_load import load_for_compute
    from shared.builtin import resolve_model
    from tests.test_batch_engine import run

    target = load_for_compute(resolve_model("builtin:demo"), None)
    drafter = load_for_compute(resolve_model("builtin:demo-drafter"), None)
    pair = (target.model, target.tokenizer, drafter.model)
    split: list[int] = []
    real = rows_attention._LIBRARY

    def seen(q: mx.array, *a: Any, **kw: Any) -> mx.array:
        split.append(q.shape[2])
        return real(q, *a, **kw)

    monkeypatch.setattr(rows_attention, "backend", lambda: "cuda")
    monkeypatch.setattr(rows_attention, "_LIBRARY", seen)
    plain = run(pair)
    fast = run(pair, spec=("model",) * 4, stream=False)
    assert split and all(n == 1 or n > SPLIT_QUERIES for n in split)  # narrow blocks split
    for i in range(4):
        (want, e1), (got, e2) = plain.results[i], fast.results[i]
        assert e1 is None and e2 is None and want is not None and got is not None
        assert "".join(plain.streamed[i]) == want.text
        if backend() != "cuda":  # on a real CUDA device a batch steps plain (batch_policy)
            assert got.speculation.state == "accelerated", i
        assert got.text == want.text, i
