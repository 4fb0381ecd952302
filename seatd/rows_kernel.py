"""One-query attention on CUDA, a batch's rows under their mask or a row alone.

A plain decode step of a batch whose rows are of different lengths hands attention a
boolean mask: each row sees its own columns, from the first that holds one of its
tokens to the step's.  MLX 0.32's CUDA one-query kernel (`sdpa_vector`) takes no mask,
so such a step attends through MLX's composed fallback (a matmul, the mask, a softmax, a
matmul and their copies).  And a step with no mask whose keys are a view of a cache
buffer of a multiple of 256 columns (every seat's and mlx-lm's cache, from 256 keys on)
goes to cuDNN, which (by MLX's source) builds a graph the first time it meets each
buffer size and batch.
Measured on an H100 (host time to dispatch one layer's attention, one query a row, the
demo's heads): at 16 rows and 300 keys the masked fallback took 53 us, this module's
kernel 28 (MLX's own unmasked kernel 30); at 1,024 keys cuDNN's unmasked path 96 us,
this kernel 43.  A decode step there is host-bound: in-process, 16 rows of different
lengths stepped in 2.1-2.4 ms with the kernel against 2.2-3.5 ms (median 3.0) without,
8 rows in 1.6-1.8 ms against 2.1-3.1.

So one query a row attends here with one kernel of this module's: MLX's one-pass
`sdpa_vector` (32 warps a query head, a warp a key at a time, lanes across the head's
features, an online softmax, the warps combined at the end), which skips the keys a
row's mask leaves out as that kernel skips the keys a causal mask leaves out.  Without a
mask it computes, bit for bit, what MLX's one-query kernel computes (checked on an H100
with a mask that keeps every key; the form without a mask drops only that test).  It is
compiled at run time (`mx.fast.cuda_kernel`, NVRTC) once per dtype, head size, grouping
and scale, and reads every array through its own strides (the keys are views of a
cache's buffers).

    attention(queries, keys, values, scale, mask) -> (B, H, 1, D)   mask: boolean or None
    usable(queries, keys, values, mask) -> bool      where it applies.  Pure

Keys past MAX_KEYS go MLX's way, as MLX's own kernel hands them to its two-pass variant:
one pass keeps a warp on a key at a time, and its device time grows with the keys (16
rows at 4,096 keys: 275 us a layer against the fallback's 173 with the demo's heads).
Where a step is device-bound it can cost: 16 rows of an 8B model's heads at 1,024 keys
took 148 us a layer against cuDNN's 105 unmasked (135 against the fallback's 143 masked).
"""

from __future__ import annotations

import struct
from typing import Any

import mlx.core as mx

MAX_KEYS = 1024  # MLX's one-pass kernel's own limit; more keys go MLX's way
HEAD_SIZES = (64, 96, 128)  # the head sizes MLX's one-query kernel is built for
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
WARPS = 32  # warps a query head; each lane holds D / 32 of its features

HEADER = "#include <cooperative_groups/reduce.h>\n"

# The body of MLX 0.32's `kernel_sdpav_1pass` (mlx/backend/cuda/scaled_dot_product_
# attention.cu), every array read through its own strides; masked, a key is used where
# the row's mask says so (its causal test's place).  Template: T (dtype), D (head size),
# GQA (query heads a key head), SCALE_BITS (the float scale's bits).  Grid: (heads x
# 1024, 1, rows).
SOURCE = """
  constexpr int BN = 32;
  constexpr int BD = 32;
  constexpr int v_per_thread = D / BD;
  typedef float U;

  U qv[v_per_thread];
  U kv[v_per_thread];
  U o[v_per_thread];

  __shared__ U outputs[BN][BD + 1];
  __shared__ U max_scores[BN];
  __shared__ U sum_exp_scores[BN];

  const U scale_log2 = (U)((double)__int_as_float(SCALE_BITS) * 1.4426950408889634074);

  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const int lane_idx = warp.thread_rank();
  const int warp_idx = warp.meta_group_rank();

  const int batch_idx = blockIdx.z;
  const int head_idx = blockIdx.x;
  const int heads = gridDim.x;
  const int kv_head_idx = head_idx / GQA;
  const int kL = int(k_shape[2]);

  const T* Q = q + batch_idx * q_strides[0] + head_idx * q_strides[1];
  const T* K = k + batch_idx * k_strides[0] + kv_head_idx * k_strides[1]
      + (int64_t)warp_idx * k_strides[2];
  const T* V = v + batch_idx * v_strides[0] + kv_head_idx * v_strides[1]
      + (int64_t)warp_idx * v_strides[2];
  MASK_ROW
  T* O = out + ((int64_t)batch_idx * heads + head_idx) * D;
  const int64_t k_step = BN * k_strides[2];
  const int64_t v_step = BN * v_strides[2];

  #pragma unroll
  for (int i = 0; i < v_per_thread; i++) {
    qv[i] = scale_log2 * static_cast<U>(Q[(v_per_thread * lane_idx + i) * q_strides[3]]);
  }
  #pragma unroll
  for (int i = 0; i < v_per_thread; i++) {
    o[i] = 0.f;
  }

  U max_score = Limits<U>::finite_min();
  U sum_exp_score = 0.f;

  for (int i = warp_idx; i < kL; i += BN) {
    if (MASK_USES) {
      #pragma unroll
      for (int j = 0; j < v_per_thread; j++) {
        kv[j] = static_cast<U>(K[(v_per_thread * lane_idx + j) * k_strides[3]]);
      }
      U score = 0.f;
      #pragma unroll
      for (int j = 0; j < v_per_thread; j++) {
        score += qv[j] * kv[j];
      }
      score = cg::reduce(warp, score, cg::plus<U>());

      U new_max = max(max_score, score);
      U factor = exp2f(max_score - new_max);
      U exp_score = exp2f(score - new_max);
      max_score = new_max;
      sum_exp_score = sum_exp_score * factor + exp_score;

      #pragma unroll
      for (int j = 0; j < v_per_thread; j++) {
        o[j] = o[j] * factor
            + exp_score * static_cast<U>(V[(v_per_thread * lane_idx + j) * v_strides[3]]);
      }
    }
    K += k_step;
    V += v_step;
  }

  if (lane_idx == 0) {
    max_scores[warp_idx] = max_score;
    sum_exp_scores[warp_idx] = sum_exp_score;
  }
  block.sync();

  max_score = max_scores[lane_idx];
  U new_max = cg::reduce(warp, max_score, cg::greater<U>());
  U factor = exp2f(max_score - new_max);
  sum_exp_score = cg::reduce(warp, sum_exp_scores[lane_idx] * factor, cg::plus<U>());
  sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);

  #pragma unroll
  for (int i = 0; i < v_per_thread; i++) {
    outputs[lane_idx][warp_idx] = o[i];
    block.sync();
    U ot = outputs[warp_idx][lane_idx] * factor;
    o[i] = cg::reduce(warp, ot, cg::plus<U>()) * sum_exp_score;
    block.sync();
  }

  if (lane_idx == 0) {
    #pragma unroll
    for (int i = 0; i < v_per_thread; i++) {
      O[v_per_thread * warp_idx + i] = static_cast<T>(o[i]);
    }
  }
"""

MASKED = {"MASK_ROW": "const bool* M = mask + (mask_shape[0] == 1 ? 0 "
                      ": batch_idx * mask_strides[0]);",
          "MASK_USES": "M[i * mask_strides[3]]"}
UNMASKED = {"MASK_ROW": "", "MASK_USES": "true"}

_kernels: dict[bool, Any] = {}  # by whether it takes a mask


def source(masked: bool) -> str:
    """The kernel's body, with or without a mask.  Pure."""
    out = SOURCE
    for name, text in (MASKED if masked else UNMASKED).items():
        out = out.replace(name, text)
    return out


def _compiled(masked: bool) -> Any:
    if masked not in _kernels:
        _kernels[masked] = mx.fast.cuda_kernel(
            name="sanctum_sdpav_masked" if masked else "sanctum_sdpav",
            input_names=["q", "k", "v", "mask"] if masked else ["q", "k", "v"],
            output_names=["out"], source=source(masked), header=HEADER,
            ensure_row_contiguous=False)
    return _kernels[masked]


def scale_bits(scale: float) -> int:
    """The float32 scale's bits as a signed int (a template argument).  Pure."""
    return int(struct.unpack("<i", struct.pack("<f", scale))[0])


def usable(queries: Any, keys: Any, values: Any, mask: Any) -> bool:
    """Whether `attention` takes this step: one query a row, a head size and dtype MLX's
    one-query kernel has, key heads that group the query heads evenly, no mask or a
    boolean one of one row of columns a row (or one for all), and at most MAX_KEYS
    keys.  Pure."""
    if not all(getattr(x, "ndim", 0) == 4 for x in (queries, keys, values)):
        return False
    B, H, n, D = queries.shape
    S = keys.shape[2]
    if mask is not None and not (getattr(mask, "ndim", 0) == 4 and mask.dtype == mx.bool_
                                 and mask.shape[0] in (1, B) and mask.shape[1:3] == (1, 1)
                                 and mask.shape[3] == S):
        return False
    return (n == 1 and D in HEAD_SIZES and keys.shape[-1] == D and values.shape[-1] == D
            and queries.dtype in DTYPES and keys.dtype == queries.dtype
            and values.dtype == queries.dtype and keys.shape[0] == B
            and values.shape[:3] == keys.shape[:3] and keys.shape[1] > 0
            and H % keys.shape[1] == 0 and 0 < S <= MAX_KEYS)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
              mask: mx.array | None) -> mx.array:
    """Attention of one query a row over its keys, those its mask (B or 1, 1, 1, keys)
    keeps where one is given (every row must keep at least one)."""
    B, H, _, D = queries.shape
    masked = mask is not None
    out: list[mx.array] = _compiled(masked)(
        inputs=[queries, keys, values, mask] if masked else [queries, keys, values],
        template=[("T", queries.dtype), ("D", D), ("GQA", H // keys.shape[1]),
                  ("SCALE_BITS", scale_bits(scale))],
        grid=(H * WARPS * 32, 1, B), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(B, H, 1, D)], output_dtypes=[queries.dtype])
    return out[0]
