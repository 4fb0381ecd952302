"""Pack a torch state dict as int8 (groups of 64 along the input axis) and back.

Only for carrying the target off the training machine, whose return channel is too
small for 80 MB of bfloat16. Group-wise int8 rounds to 1/254 of each group's range,
far finer than the 5-bit storage the shipped model uses.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

GROUP = 64


def pack(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float arrays -> {name.q: int8, name.s: float16 scales} for 2-D weights, float32 otherwise."""
    out: dict[str, np.ndarray] = {}
    for name, w in state.items():
        w = np.asarray(w, dtype=np.float32)
        if w.ndim == 2 and w.shape[1] % GROUP == 0:
            g = w.reshape(w.shape[0], -1, GROUP)
            scale = np.abs(g).max(axis=-1, keepdims=True) / 127.0
            scale = np.where(scale == 0, 1.0, scale).astype(np.float16)
            q = np.clip(np.rint(g / scale.astype(np.float32)), -127, 127).astype(np.int8)
            out[name + ".q"] = q.reshape(w.shape)
            out[name + ".s"] = scale[..., 0]
        else:
            out[name] = w
    return out


def unpack(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack`, as float32."""
    out: dict[str, np.ndarray] = {}
    for name, arr in packed.items():
        if name.endswith(".s"):
            continue
        if name.endswith(".q"):
            base = name[:-2]
            scale = packed[base + ".s"].astype(np.float32)[..., None]
            g = arr.astype(np.float32).reshape(arr.shape[0], -1, GROUP)
            out[base] = (g * scale).reshape(arr.shape)
        else:
            out[name] = arr.astype(np.float32)
    return out


def save_packed(state: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(pack(state), str(path))


def load_packed(*paths: Path) -> dict[str, np.ndarray]:
    """float32 weights from one packed file or from its shards, in any order."""
    from safetensors.numpy import load_file

    packed: dict[str, np.ndarray] = {}
    for path in paths:
        packed.update(load_file(str(path)))
    return unpack(packed)
