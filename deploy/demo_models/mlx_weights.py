"""Read an MLX model directory's weights as float32 numpy arrays, with numpy alone.

The GPU machine has no MLX, yet distilling a drafter from the shipped target
(`train.py drafters --teacher shared/models/demo`) needs that target's weights there.
This reads `model.safetensors` itself (bfloat16 and uint32 included, which numpy's
safetensors loader refuses) and undoes MLX's affine quantization: each row of `bits`-bit
codes is one little-endian bit stream packed into uint32 words, and group g of
`group_size` codes decodes as `code * scales[g] + biases[g]`. tests/test_demo_models.py
checks this against `mx.dequantize` on the shipped target.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # widened to float32 below
    "U32": np.uint32,
    "I32": np.int32,
    "U8": np.uint8,
    "I8": np.int8,
}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file; bfloat16 comes back as float32."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        arr = np.frombuffer(raw[base + start : base + end], dtype=_DTYPES[info["dtype"]])
        if info["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.reshape(info["shape"])
    return out


def dequantize(
    packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int, bits: int
) -> np.ndarray:
    """MLX affine dequantization of a (rows, words) uint32 array to (rows, columns) float32."""
    rows = packed.shape[0]
    cols = packed.shape[1] * 32 // bits
    stream = np.unpackbits(packed.astype("<u4").view(np.uint8), axis=1, bitorder="little")
    codes = stream[:, : cols * bits].reshape(rows, cols, bits)
    weights = (1 << np.arange(bits, dtype=np.uint32)).astype(np.uint32)
    q = (codes.astype(np.uint32) * weights).sum(-1).astype(np.float32)
    q = q.reshape(rows, cols // group_size, group_size)
    w = q * scales.astype(np.float32)[..., None] + biases.astype(np.float32)[..., None]
    return w.reshape(rows, cols)


def load_model_weights(model_dir: Path) -> tuple[dict[str, np.ndarray], dict]:
    """(float32 weights by Hugging Face name, config without its quantization keys)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    quant = config.pop("quantization", None)
    config.pop("quantization_config", None)
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(read_safetensors(f))
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        if quant and stem and stem + ".scales" in tensors:
            out[name] = dequantize(
                arr,
                tensors[stem + ".scales"],
                tensors[stem + ".biases"],
                quant["group_size"],
                quant["bits"],
            )
        else:
            out[name] = np.array(arr, dtype=np.float32)  # a writable copy
    return out, config
