"""Load a model directory for compute on this device.

The seat decides how weights are held for compute. Per-device default ("auto"):
- CPU: dequantize quantized layers and compute in float32. MLX's quantized matmul on
  CPU is slow and grows with the number of tokens per call (57 ms at width 1, 427 ms at
  width 8 for a 58M model), which would make speculative verification pointless;
  float32 also beat bfloat16 and float16 on CPU (76, 35 and 13 tok/s for a 27M model).
- GPU: keep quantized weights as stored and the stored dtype (bfloat16 for the demo).
An explicit dtype casts the floating weights to it; on CPU quantized layers are still
dequantized first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import structlog
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import cache as mlx_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model, load

from seatd import dtype_check, recurrent
from shared.builtin import tokenizer_hash

log = structlog.get_logger()

COMPUTE_DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
}
ALLOWED = ("auto", *COMPUTE_DTYPES)


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # an mlx-lm nn.Module
    tokenizer: TokenizerWrapper
    compute_dtype: str
    was_quantized: bool
    tokenizer_hash: str
    context_length: int


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def choose_dtype(requested: str | None, cpu: bool, stored: str) -> tuple[str, bool]:
    """(compute dtype, dequantize?) for a request, the device and the stored float dtype."""
    if requested is None or requested == "auto":
        return ("float32", True) if cpu else (stored, False)
    if requested not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {', '.join(ALLOWED)}, not {requested!r}")
    return requested, cpu


def _is_quantized(model: Any) -> bool:
    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding)  # type: ignore[attr-defined]
    return any(isinstance(m, quantized) for _, m in model.named_modules())


def _stored_dtype(model: Any) -> str:
    flat: Any = tree_flatten(model.parameters())
    for _, a in flat:
        if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating):
            name = str(a.dtype).removeprefix("mlx.core.")
            if name in COMPUTE_DTYPES:
                return name
    return "float32"


def _cast(model: Any, dtype: mx.Dtype) -> None:
    def cast(a: Any) -> Any:
        if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating):
            return a.astype(dtype)
        return a

    model.update(tree_map(cast, model.parameters()))


def load_for_compute(model_dir: Path, compute_dtype: str | None = None) -> LoadedModel:
    """Load an mlx-lm model directory and hold its weights as this device computes best."""
    if compute_dtype is not None and compute_dtype not in ALLOWED:
        raise ValueError(
            f"compute_dtype must be one of {', '.join(ALLOWED)}, not {compute_dtype!r}"
        )
    model, tokenizer, config = load(str(model_dir), return_config=True)  # type: ignore[misc]
    quantized = _is_quantized(model)
    cpu = on_cpu()
    chosen, dequantize = choose_dtype(compute_dtype, cpu, _stored_dtype(model))
    if quantized and dequantize:
        model = dequantize_model(model)
    _cast(model, COMPUTE_DTYPES[chosen])
    mx.eval(model.parameters())
    rollback = recurrent.enable(model)
    try:
        leaks = dtype_check.leaks(model, mlx_cache.make_prompt_cache(model), range(8))
    except Exception as exc:  # a layout the check does not know: say so, load anyway
        leaks = [f"not checked: {exc!r}"]
    if leaks:
        log.warning("dtype_leak", path=str(model_dir), leaks=leaks)
    context = int(config.get("max_position_embeddings") or 2048)
    tok_hash = tokenizer_hash(Path(model_dir))
    log.info(
        "model_loaded",
        path=str(model_dir),
        device="cpu" if cpu else "gpu",
        compute_dtype=chosen,
        requested=compute_dtype or "auto",
        was_quantized=quantized,
        dequantized=quantized and dequantize,
        context_length=context,
        tokenizer_hash=tok_hash[:12],
        recurrent_rollback=rollback,
    )
    return LoadedModel(model, tokenizer, chosen, quantized, tok_hash, context)
