"""The demo pair for speculation tests (env overrides for development)."""

from __future__ import annotations

import os
from pathlib import Path

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
