"""Tests for seatd.model_load: the per-device compute-dtype policy and the loader."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
import pytest
from structlog.testing import capture_logs

from seatd.model_load import choose_dtype, load_for_compute
from shared.builtin import resolve_model, tokenizer_hash


@pytest.fixture
def cpu() -> Iterator[None]:
    """Run on the CPU and put the default device back afterwards."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(before)


@pytest.mark.parametrize(
    ("requested", "cpu", "stored", "expected"),
    [
        (None, True, "bfloat16", ("float32", True)),
        ("auto", True, "bfloat16", ("float32", True)),
        ("auto", False, "bfloat16", ("bfloat16", False)),
        (None, False, "float16", ("float16", False)),
        ("bfloat16", True, "bfloat16", ("bfloat16", True)),
        ("float16", False, "bfloat16", ("float16", False)),
    ],
)
def test_dtype_policy(
    requested: str | None, cpu: bool, stored: str, expected: tuple[str, bool]
) -> None:
    """CPU defaults to dequantized float32; GPU keeps quantized weights and the stored dtype."""
    assert choose_dtype(requested, cpu, stored) == expected


def test_unknown_dtype_is_rejected() -> None:
    """A compute dtype outside auto/float32/bfloat16/float16 is a clear error."""
    with pytest.raises(ValueError, match="compute_dtype"):
        choose_dtype("int8", True, "bfloat16")


@pytest.mark.slow
def test_cpu_load_dequantizes_to_float32(cpu: None) -> None:
    """On CPU the 5-bit target is dequantized to float32, and the choice is logged."""
    path = resolve_model("builtin:demo")
    with capture_logs() as logs:
        loaded = load_for_compute(path)
    assert loaded.was_quantized and loaded.compute_dtype == "float32"
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.model.named_modules())
    assert loaded.model.model.embed_tokens.weight.dtype == mx.float32
    assert loaded.context_length == 2048
    assert loaded.tokenizer_hash == tokenizer_hash(path)
    event = next(e for e in logs if e["event"] == "model_loaded")
    assert event["compute_dtype"] == "float32" and event["dequantized"] is True


@pytest.mark.slow
def test_explicit_dtype_is_honoured(cpu: None) -> None:
    """An explicit bfloat16 casts the bfloat16 drafter's weights to bfloat16 and says so."""
    loaded = load_for_compute(resolve_model("builtin:demo-drafter"), "bfloat16")
    assert not loaded.was_quantized and loaded.compute_dtype == "bfloat16"
    assert loaded.model.model.embed_tokens.weight.dtype == mx.bfloat16
