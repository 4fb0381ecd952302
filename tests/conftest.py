"""Fixtures shared by the batch tests."""

from __future__ import annotations

from typing import Any

import pytest

from seatd import recurrent


@pytest.fixture(scope="module", params=[("builtin:demo", "fp16"), ("builtin:demo", "q8"),
                                        ("builtin:demo-hybrid", "fp16")],
                ids=["fp16", "q8", "hybrid"])
def lane(request: Any) -> tuple[Any, str]:
    """A packaged model and a KV lane: the demo target's fp16 and q8, the hybrid's fp16."""
    from seatd.model_load import load_for_compute
    from shared.builtin import resolve_model

    name, kv = request.param
    model = load_for_compute(resolve_model(name), None).model
    if "hybrid" in name:
        assert recurrent.enable(model)
    return model, kv
