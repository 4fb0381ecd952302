"""A seat's `system_fingerprint`: one name for everything that can change the bytes of
a seeded answer, and for nothing that cannot.

In it: the weights and tokenizer (file contents), the compute dtype, the KV lane, the
versions of MLX, mlx-lm and llguidance (its masks decide a constrained answer's
tokens), the platform and device, the keyed sampling rule and the
prefill grid (both fix float reduction orders or draws).  Not in it: the drafter, the
draft depth, the prompt cache, the seat's name or its restarts, since none of them
changes a seeded answer (`seatd.sampling`).

On a backend whose forwards round a row by the number of rows beside it (CUDA:
`rows_round_apart`), a batch neighbour can change a seeded answer's bytes; an answer
that shared any forward with another request's rows there carries `beside(fp)`, its
seat's fingerprint named apart, so that equal fingerprints still mean equal bytes.
"""

from __future__ import annotations

import hashlib
import platform
from importlib import metadata
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".json", ".jinja", ".txt", ".model")
BLOCK = 1 << 20


def model_digest(model_dir: Path) -> str:
    """sha256 over the model directory's weight, config and tokenizer files, by name."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if not path.is_file() or path.suffix not in WEIGHT_SUFFIXES:
            continue
        h.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while block := f.read(BLOCK):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def fingerprint_device(backend: str) -> str:
    """A fingerprint's device: "cpu"; "gpu" for Metal (its name before CUDA ran); CUDA's
    with the attention rule that decides its verified tokens' rounding there
    (`seatd.rows_attention.CUDA_RULE`)."""
    from seatd.rows_attention import CUDA_RULE

    return {"cpu": "cpu", "metal": "gpu"}.get(backend, f"{backend}/{CUDA_RULE}")


def rows_round_apart(backend: str) -> bool:
    """Whether a batch neighbour can change a row's rounding on this backend: measured on
    CUDA (MLX 0.32, an H200: a batched row's logits up to 0.063 from the same row alone,
    bfloat16), not on the CPU; Metal's kernels were not measured here and keep the CPU's
    promise.  Pure."""
    return backend == "cuda"


def beside(fp: str) -> str:
    """The fingerprint of an answer decoded beside other rows, on a backend where that
    can change its bytes: `fp_` and 16 hex digits, apart from its seat's.  Pure."""
    return "fp_" + hashlib.sha256(f"{fp}/beside-rows".encode()).hexdigest()[:16]


def fingerprint(model: str, compute_dtype: str, kv: str, device: str, rule: str,
                grid: int | str) -> str:
    """`fp_` and 16 hex digits naming (model digest, dtype, lane, stack, platform, rule)."""
    parts = [model, compute_dtype, kv, device, rule, str(grid),
             _version("mlx"), _version("mlx-lm"), _version("llguidance"), platform.system(),
             platform.machine()]
    return "fp_" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
