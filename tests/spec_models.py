"""The demo pair for speculation tests (env overrides for development)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shared.builtin import resolve_model

HELDOUT = Path(__file__).parent / "data" / "heldout"


def target_dir() -> Path:
    return resolve_model(os.environ.get("SANCTUM_TEST_MODEL", "builtin:demo"))


def drafter_dir() -> Path:
    return resolve_model(os.environ.get("SANCTUM_TEST_DRAFTER", "builtin:demo-drafter"))


def snippet(chars: int = 1200) -> str:
    """Held-out code the models never trained on (or, without it, a fixed snippet)."""
    files = sorted(HELDOUT.glob("*.py")) if HELDOUT.exists() else []
    if files:
        return files[0].read_text()[:chars]
    return ("def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
            "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
            "        else:\n            out.append(b[j])\n            j += 1\n    return out\n") * 4


def greedy_consistent(model: Any, prompt: Sequence[int], out: Sequence[int],
                      tol: float = 1e-3) -> list[int]:
    """Positions of `out` (a t=0 answer to `prompt`) that are not the target's argmax,
    within `tol`, when the whole sequence is scored in one forward: a decode path that
    let the model see a wrong context shows up here, rounding between batch shapes does
    not."""
    import mlx.core as mx

    from seatd.engine_types import make_cache

    ids = [*prompt, *out]
    logits = model(mx.array(ids[:-1], dtype=mx.uint32)[None], cache=make_cache(model, "fp16"))
    rows = logits[0, len(prompt) - 1 :].astype(mx.float32)
    best = rows.max(axis=-1)
    got = mx.take_along_axis(rows, mx.array(list(out))[:, None], axis=-1)[:, 0]
    return [i for i, bad in enumerate((best - got > tol).tolist()) if bad]


def _seat(model: Any, tokenizer_hash: str, drafter: str) -> Any:
    """The speculation set-up of a seat on `model` with this drafter (a TOML table)."""
    from seatd.speculation import SeatSpeculation
    from shared.config import parse_config

    config = parse_config(f"""
[[seat]]
name = "s"
model = "unused"
drafter = {drafter}
[[route]]
model = "s"
ladder = ["s"]
""")
    return SeatSpeculation(config, config.seat[0], model, tokenizer_hash)


def lookup_seat(model: Any, tokenizer_hash: str = "h") -> Any:
    """The speculation set-up of a seat on `model` whose only drafter is prompt lookup."""
    return _seat(model, tokenizer_hash, '{ kind = "lookup" }')


def model_seat(model: Any, tokenizer_hash: str) -> Any:
    """The speculation set-up of a seat on `model` with the demo drafter, its depth
    adaptive (the default seat's)."""
    return _seat(model, tokenizer_hash, f'{{ kind = "model", path = "{drafter_dir()}" }}')


def lookup_plan_declines(model: Any) -> list[str | None]:
    """The decline reasons a lookup-drafter seat on `model` gives on the fp16 and q8 lanes."""
    from shared.protocol import Generate, SamplingParams

    spec = lookup_seat(model)
    return [spec.plan(Generate("r", False, SamplingParams()), kv).decline  # type: ignore[union-attr]
            for kv in ("fp16", "q8")]
