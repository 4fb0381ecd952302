"""Load a model directory for compute on this device.

The seat decides how weights are held for compute. Per-device default ("auto"):
- CPU: dequantize quantized layers and compute in float32. MLX's quantized matmul on
  CPU is slow and grows with the number of tokens per call (57 ms at width 1, 427 ms at
  width 8 for a 58M model), which would make speculative verification pointless;
  float32 also beat bfloat16 and float16 on CPU (76, 35 and 13 tok/s for a 27M model).
- GPU: keep quantized weights as stored and the stored dtype (bfloat16 for the demo).
An explicit dtype casts the floating weights to it; on CPU quantized layers are still
dequantized first.

A folder that names code of its own (shared/model_trust.py) is refused before mlx-lm
reads it, unless the caller trusts it; trust is then passed to mlx-lm's model loader
and to the tokenizer's (mlx-lm's `load` passes it to the model loader only).

Weights are read lazily and evaluated here in pieces, so a large model says how far
it has got (`model_loading_progress`, every few seconds) instead of going quiet.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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

from seatd import dtype_check, recurrent, rows_attention
from seatd.backend import backend, device_name
from shared.builtin import tokenizer_hash
from shared.model_trust import UntrustedCode, own_code

log = structlog.get_logger()

COMPUTE_DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
}
ALLOWED = ("auto", *COMPUTE_DTYPES)

GB = 1e9
PROGRESS_OVER_BYTES = 1 << 30  # weights this large say how far loading has got
PROGRESS_EVERY_S = 5.0
EVAL_PIECE_BYTES = 256 << 20  # evaluated together: few enough calls, a steady progress


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


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors mlx-lm reads (its own glob)."""
    return sorted(Path(model_dir).glob("model*.safetensors"))


def progress_due(last: float, now: float, total_bytes: int, over_bytes: int,
                 every_s: float) -> bool:
    """Whether to log loading progress now: large weights only, every few seconds."""
    return total_bytes >= over_bytes and now - last >= every_s


def _materialize(model: Any, report: Callable[[int, int], None]) -> int:
    """Evaluate the (lazy) parameters in pieces, `report(done, total)` after each;
    the bytes they hold."""
    seen: set[int] = set()
    arrays: list[mx.array] = []
    flat: Any = tree_flatten(model.parameters())
    for _, a in flat:
        if isinstance(a, mx.array) and id(a) not in seen:  # tied weights appear twice
            seen.add(id(a))
            arrays.append(a)
    total = sum(a.nbytes for a in arrays)
    done = 0
    piece: list[mx.array] = []
    size = 0
    for i, a in enumerate(arrays):
        piece.append(a)
        size += a.nbytes
        if size >= EVAL_PIECE_BYTES or i == len(arrays) - 1:
            mx.eval(piece)
            done += size
            piece, size = [], 0
            report(done, total)
    return total


def load_for_compute(model_dir: Path, compute_dtype: str | None = None,
                     trust_remote_code: bool = False) -> LoadedModel:
    """Load an mlx-lm model directory and hold its weights as this device computes best.

    Raises `UntrustedCode` for a folder that names code of its own, unless trusted.
    """
    if compute_dtype is not None and compute_dtype not in ALLOWED:
        raise ValueError(
            f"compute_dtype must be one of {', '.join(ALLOWED)}, not {compute_dtype!r}"
        )
    found = own_code(Path(model_dir))
    if found and not trust_remote_code:
        raise UntrustedCode(f"model folder {model_dir} names its own code "
                            f"({'; '.join(str(f) for f in found)}); trust_remote_code is off")
    files = weight_files(Path(model_dir))
    stored_bytes = sum(f.stat().st_size for f in files)
    started = time.monotonic()
    log.info("model_loading", path=str(model_dir), weights_gb=round(stored_bytes / GB, 2),
             shards=len(files), trusted_code=[str(f) for f in found] or None)
    model, tokenizer, config = load(  # type: ignore[misc]
        str(model_dir), return_config=True, lazy=True, trust_remote_code=trust_remote_code,
        tokenizer_config={"trust_remote_code": trust_remote_code})
    quantized = _is_quantized(model)
    cpu = on_cpu()
    chosen, dequantize = choose_dtype(compute_dtype, cpu, _stored_dtype(model))
    if quantized and dequantize:
        model = dequantize_model(model)
    _cast(model, COMPUTE_DTYPES[chosen])
    last = started

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        due = progress_due(last, now, stored_bytes, PROGRESS_OVER_BYTES, PROGRESS_EVERY_S)
        if done < total and due:
            last = now
            log.info("model_loading_progress", path=str(model_dir),
                     percent=int(100 * done / total), done_gb=round(done / GB, 2),
                     total_gb=round(total / GB, 2), elapsed_s=round(now - started, 1))

    computed_bytes = _materialize(model, report)
    rollback = recurrent.enable(model)
    # Every attention of the model's layers through the seat's, which computes it as the
    # backend can exactly (`seatd.rows_attention.library`), a request alone's included.
    rows_attention.install(model)
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
        backend=backend(),
        device_name=device_name(),
        compute_dtype=chosen,
        requested=compute_dtype or "auto",
        was_quantized=quantized,
        dequantized=quantized and dequantize,
        context_length=context,
        tokenizer_hash=tok_hash[:12],
        recurrent_rollback=rollback,
        seconds=round(time.monotonic() - started, 2),
        weights_gb=round(stored_bytes / GB, 2),
        compute_gb=round(computed_bytes / GB, 2),
    )
    return LoadedModel(model, tokenizer, chosen, quantized, tok_hash, context)
