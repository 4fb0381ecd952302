"""How close a batched row's logits must come to the same row decoded alone, by KV lane.

fp16 KV: batch shapes change only reduction orders, about 1e-5 on the demo model.

q8 KV: a new token's K and V are quantized as they are written (8 bits, a scale per
group of 64 features).  Where a batched projection differs from the single-row one in
its last bits (OpenBLAS's AVX-512 kernels take other paths for other widths; the
reference BLAS does not), an element on the edge between two levels rounds the other
way, and later logits move by up to about 2e-2 on the demo model (measured on an
AVX-512 Xeon).  A structural fault (a wrong column, position or mask) moves them by 2 to
4.5 (one context token dropped), so the q8 bound still tells the two apart by 40x.
"""

from __future__ import annotations

import mlx.core as mx

TOLERANCE = {"fp16": 2e-3, "q8": 5e-2}


def logits_close(a: mx.array, b: mx.array, kv: str) -> bool:
    return float(mx.abs(a - b).max().item()) < TOLERANCE[kv]
