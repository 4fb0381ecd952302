"""The one-query kernel of a CUDA seat (`seatd.rows_kernel`): where it applies (pure, on
every backend), which calls of the CUDA rule take it (on every backend, the kernel
stood in for), that a kernel which cannot build or agree leaves mlx-lm's function in its
place (on every backend), and on CUDA that it computes the masked attention the composed
path computes and, every key kept, MLX's own one-query kernel's bytes (run on the GPU;
skipped elsewhere)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest

from seatd import rows_attention, rows_kernel
from seatd.backend import backend
from seatd.rows_attention import _LIBRARY, SPLIT_QUERIES, composed, library
from seatd.rows_kernel import MAX_KEYS, attention, scale_bits, usable

on_cuda = pytest.mark.skipif(backend() != "cuda", reason="the kernel runs on CUDA only")


@pytest.fixture(autouse=True)
def fresh_check() -> Iterator[None]:
    """Each test decides the kernel's check anew, and leaves it undecided."""
    rows_attention._kernel_state.clear()
    yield
    rows_attention._kernel_state.clear()


def arrays(B: int, H: int, kv: int, S: int, D: int, dtype: Any = mx.bfloat16,
           seed: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((B, H, 1, D), key=k1).astype(dtype),
            mx.random.normal((B, kv, S, D), key=k2).astype(dtype),
            mx.random.normal((B, kv, S, D), key=k3).astype(dtype))


def rows_mask(B: int, S: int, holes: tuple[int, ...] = ()) -> mx.array:
    """(B, 1, 1, S): row b from column 3b on (rows joined at different lengths), less
    `holes` for every row but the step's own last column."""
    cols = mx.arange(S)[None, :]
    allowed = cols >= (3 * mx.arange(B))[:, None]
    for h in holes:
        allowed = allowed & (cols != h)
    return allowed[:, None, None, :]


def shape(*dims: int, dtype: Any = mx.bfloat16) -> mx.array:
    return mx.zeros(dims, dtype=dtype)


@pytest.mark.parametrize("q,k,v,mask,want", [
    (shape(4, 8, 1, 64), shape(4, 2, 30, 64), shape(4, 2, 30, 64),
     shape(4, 1, 1, 30, dtype=mx.bool_), True),
    (shape(4, 9, 1, 64), shape(4, 3, 30, 64), shape(4, 3, 30, 64),
     shape(1, 1, 1, 30, dtype=mx.bool_), True),  # one mask for every row
    (shape(2, 32, 1, 128), shape(2, 8, MAX_KEYS, 128), shape(2, 8, MAX_KEYS, 128),
     shape(2, 1, 1, MAX_KEYS, dtype=mx.bool_), True),
    (shape(2, 32, 1, 128), shape(2, 8, MAX_KEYS + 1, 128), shape(2, 8, MAX_KEYS + 1, 128),
     shape(2, 1, 1, MAX_KEYS + 1, dtype=mx.bool_), False),  # past one pass
    (shape(4, 8, 2, 64), shape(4, 2, 30, 64), shape(4, 2, 30, 64),
     shape(4, 1, 2, 30, dtype=mx.bool_), False),  # two queries a row
    (shape(4, 8, 1, 80), shape(4, 2, 30, 80), shape(4, 2, 30, 80),
     shape(4, 1, 1, 30, dtype=mx.bool_), False),  # a head size MLX's kernel lacks
    (shape(4, 8, 1, 64), shape(4, 3, 30, 64), shape(4, 3, 30, 64),
     shape(4, 1, 1, 30, dtype=mx.bool_), False),  # heads that do not group evenly
    (shape(4, 8, 1, 64), shape(4, 2, 30, 64), shape(4, 2, 30, 64),
     shape(4, 1, 1, 30), False),  # an additive mask
    (shape(4, 8, 1, 64), shape(4, 2, 30, 64), shape(4, 2, 30, 64),
     shape(4, 8, 1, 30, dtype=mx.bool_), False),  # a mask per head
    (shape(4, 8, 1, 64), shape(4, 2, 30, 64), shape(4, 2, 30, 64),
     shape(4, 1, 1, 29, dtype=mx.bool_), False),  # columns that are not the keys'
    (shape(4, 8, 1, 64), shape(4, 2, 30, 64), shape(4, 2, 30, 64), None, True),  # alone
    (shape(4, 8, 1, 64), shape(4, 2, 30, 64), shape(4, 2, 30, 64), "causal", False),
    (shape(4, 8, 1, 64), shape(4, 2, 30, 64, dtype=mx.float32),
     shape(4, 2, 30, 64), shape(4, 1, 1, 30, dtype=mx.bool_), False),  # mixed dtypes
    (shape(4, 8, 1, 64, dtype=mx.int32), shape(4, 2, 30, 64, dtype=mx.int32),
     shape(4, 2, 30, 64, dtype=mx.int32), shape(4, 1, 1, 30, dtype=mx.bool_), False),
])
def test_where_the_kernel_applies(q: Any, k: Any, v: Any, mask: Any, want: bool) -> None:
    assert usable(q, k, v, mask) is want


def test_the_scale_travels_as_its_bits() -> None:
    assert scale_bits(0.125) == 0x3E000000
    assert scale_bits(64 ** -0.5) == 0x3E000000
    assert scale_bits(1.0) == 0x3F800000


def test_a_kernel_that_cannot_build_leaves_mlx_lms_function(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CUDA rule, a plain step under a boolean mask whose kernel raises (no NVRTC,
    a refused build; here, on any backend, a kernel that raises) attends through
    mlx-lm's function, and the kernel is not tried again in this process."""
    calls: list[int] = []

    def broken(*a: Any, **kw: Any) -> mx.array:
        calls.append(1)
        raise RuntimeError("no NVRTC here")

    monkeypatch.setattr(rows_kernel, "attention", broken)
    q, k, v = arrays(3, 8, 2, 20, 64, mx.float32)
    m = rows_mask(3, 20, holes=(7,))
    for _ in range(2):
        got = library(q, k, v, None, 0.125, m, on="cuda")
        want = _LIBRARY(q, k, v, cache=None, scale=0.125, mask=m)
        assert mx.array_equal(got, want).item()
    assert calls == [1]
    assert rows_attention._kernel_state == {"ready": False}


def test_a_kernel_that_disagrees_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that builds but computes something else (zeros) fails the check against
    the composed path, and the step takes mlx-lm's function."""
    monkeypatch.setattr(rows_kernel, "attention",
                        lambda q, k, v, scale, mask: mx.zeros(q.shape, q.dtype))
    q, k, v = arrays(3, 8, 2, 20, 64, mx.float32, seed=1)
    m = rows_mask(3, 20)
    got = library(q, k, v, None, 0.125, m, on="cuda")
    assert mx.array_equal(got, _LIBRARY(q, k, v, cache=None, scale=0.125, mask=m)).item()
    assert rows_attention._kernel_state == {"ready": False}


def test_the_cuda_rule_routes_one_query_a_row_to_the_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernel ready (stood in for by the composed path, recording its calls): a
    plain step, masked or alone, and each query of a split block take it, the block's
    queries at their own key lengths; keys past MAX_KEYS and a wide block do not."""
    calls: list[tuple[int, int, bool]] = []

    def stand_in(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any) -> mx.array:
        calls.append((q.shape[0], k.shape[2], mask is not None))
        return composed(q, k, v, scale, mask)

    monkeypatch.setattr(rows_kernel, "attention", stand_in)
    rows_attention._kernel_state["ready"] = True
    q, k, v = arrays(3, 8, 2, 20, 64, mx.float32, seed=2)
    m = rows_mask(3, 20)
    library(q, k, v, None, 0.125, m, on="cuda")
    library(q, k, v, None, 0.125, None, on="cuda")
    assert calls == [(3, 20, True), (3, 20, False)]
    calls.clear()
    k1, k2 = mx.random.split(mx.random.key(5), 2)
    block = mx.random.normal((3, 8, 4, 64), key=k1)
    got = library(block, k, v, None, 0.125, "causal", on="cuda")
    assert calls == [(3, 17, False), (3, 18, False), (3, 19, False), (3, 20, False)]
    assert mx.allclose(got, _LIBRARY(block, k, v, cache=None, scale=0.125, mask="causal"),
                       atol=1e-5).item()
    calls.clear()
    _, long_k, long_v = arrays(3, 8, 2, MAX_KEYS + 1, 64, mx.float32, seed=6)
    library(q, long_k, long_v, None, 0.125, None, on="cuda")
    wide = mx.random.normal((3, 8, SPLIT_QUERIES + 1, 64), key=k2)
    library(wide, k, v, None, 0.125, "causal", on="cuda")
    assert calls == []


def test_other_backends_never_ask_for_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's and Metal's attention never build or check the kernel."""
    monkeypatch.setattr(rows_attention, "_check_kernel", lambda: pytest.fail("checked"))
    q, k, v = arrays(3, 8, 2, 20, 64, mx.float32, seed=2)
    for on in ("cpu", "metal"):
        for m in (rows_mask(3, 20), None):
            library(q, k, v, None, 0.125, m, on=on)
    assert rows_attention._kernel_state == {}


@on_cuda
@pytest.mark.parametrize("B,H,kv,S,D,dtype", [
    (16, 9, 3, 300, 64, mx.bfloat16),  # the demo's heads, 16 rows
    (1, 9, 3, 37, 64, mx.bfloat16),
    (5, 32, 8, 700, 128, mx.bfloat16),  # an 8B model's heads
    (4, 8, 8, MAX_KEYS, 96, mx.float16),
    (3, 4, 2, 65, 64, mx.float32),
])
def test_the_kernel_computes_the_masked_attention(B: int, H: int, kv: int, S: int, D: int,
                                                   dtype: Any) -> None:
    """Rows of different lengths with holes, keys as views of a wider buffer (the batch's
    columns): the composed path's attention, to 16-bit rounding."""
    q, k, v = arrays(B, H, kv, S + 64, D, dtype, seed=S)
    k, v = k[:, :, :S], v[:, :, :S]  # views: the buffer runs on past the step's column
    m = rows_mask(B, S, holes=(1, S // 2))
    got = attention(q, k, v, D ** -0.5, m).astype(mx.float32)
    want = composed(q, k, v, D ** -0.5, m).astype(mx.float32)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert mx.allclose(got, want, atol=tol, rtol=tol).item()
    one = attention(q, k, v, D ** -0.5, m[:1]).astype(mx.float32)  # one for all
    assert mx.allclose(one, composed(q, k, v, D ** -0.5, m[:1]).astype(mx.float32),
                       atol=tol, rtol=tol).item()


@on_cuda
@pytest.mark.parametrize("masked", [False, True])
def test_every_key_kept_is_mlxs_own_kernel_bytes(masked: bool) -> None:
    """Without a mask, or with one that keeps every key, the kernel is MLX's one-pass
    one-query kernel: the same output, bit for bit (keys under 256, where MLX takes
    that kernel rather than cuDNN)."""
    q, k, v = arrays(6, 9, 3, 200, 64, seed=3)
    m = mx.ones((6, 1, 1, 200), dtype=mx.bool_) if masked else None
    got = attention(q, k, v, 0.125, m)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    assert mx.array_equal(got, want).item()


@on_cuda
def test_the_cuda_rule_takes_the_kernel_for_a_masked_plain_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a masked one-query step goes to the kernel (mlx-lm's function is not
    called for it) once the check passed on the device itself."""
    q, k, v = arrays(4, 9, 3, 50, 64, seed=4)
    m = rows_mask(4, 50)
    want = composed(q, k, v, 0.125, m).astype(mx.float32)
    assert rows_attention.kernel_ready()
    monkeypatch.setattr(rows_attention, "_LIBRARY", lambda *a, **kw: pytest.fail("library"))
    got = library(q, k, v, None, 0.125, m).astype(mx.float32)
    assert mx.allclose(got, want, atol=2e-2, rtol=2e-2).item()
