"""How close a batched row's logits must come to the same row decoded alone, by KV lane.

fp16 KV: batch shapes change only reduction orders, about 1e-5 on the demo model.

q8 KV: a new token's K and V are quantized as they are written (8 bits, a scale per
group of 64 features).  Where a batched projection differs from the single-row one in
its last bits (OpenBLAS's AVX-512 kernels take other paths for other widths; the
reference BLAS does not), an element on the edge between two levels rounds the other
way, and later logits move by up to about 2e-2 on the demo model (measured on an
AVX-512 Xeon).  A structural fault (a wrong column, position or mask) moves them by 2 to
4.5 (one context token dropped), so the q8 bound still tells the two apart by 40x.

On a GPU (MLX's CUDA backend, bfloat16 compute) a batched row's matmuls round apart from
the single row's at some widths (a 4-bit linear row was bit for bit the same at 1, 2 and 4
rows, not at 8): the suite's run on an H200 measured differences up to 0.063 on the demo
model, any lane, and 1.2e-3 for a float32 model there.  `HALF` bounds the first, by 30x
under a dropped context token; `CUDA_FLOAT32` the second.  Byte-for-byte answers beside
batch neighbours are not promised there (README, "On an NVIDIA GPU"): tests of them are
marked `rows_round_apart`.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from seatd.backend import backend

TOLERANCE = {"fp16": 2e-3, "q8": 5e-2}
HALF = 0.15
CUDA_FLOAT32 = 1e-2
ON_CUDA = backend() == "cuda"
rows_round_apart = pytest.mark.skipif(
    ON_CUDA, reason="on CUDA a batch neighbour may round a row's logits apart (README)")


def logits_close(a: mx.array, b: mx.array, kv: str) -> bool:
    bound = TOLERANCE[kv]
    if a.dtype in (mx.bfloat16, mx.float16):
        bound = max(bound, HALF)
    elif ON_CUDA:
        bound = max(bound, CUDA_FLOAT32)
    diff = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()
    return float(diff.item()) < bound
