"""`--model shape:NAME`: a random-weight, 4-bit llama of a named shape with the demo's
tokenizer, built once and reused, that a seat loads like any model."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from sanctum.bench.shapes import SHAPES, shape_model


def test_a_shape_builds_once_and_loads_as_a_quantized_model(tmp_path: Path) -> None:
    """The tiny shape: the sizes it names, 4-bit layers, the demo's tokenizer (the demo
    drafter fits it), a forward of the vocabulary's width; asked again, the same folder,
    not rebuilt."""
    from seatd.model_load import load_for_compute
    from shared.builtin import resolve_model

    path = shape_model("tiny", tmp_path)
    # what the build freed went back: the bench's process keeps no model it built
    assert mx.get_cache_memory() == 0
    made = (path / "model.safetensors").stat().st_mtime_ns
    loaded = load_for_compute(path, None)
    demo = load_for_compute(resolve_model("builtin:demo"), None)
    assert loaded.was_quantized and loaded.tokenizer_hash == demo.tokenizer_hash
    args = loaded.model.args
    assert (args.hidden_size, args.num_hidden_layers, args.num_key_value_heads) == (
        SHAPES["tiny"]["hidden_size"], SHAPES["tiny"]["num_hidden_layers"],
        SHAPES["tiny"]["num_key_value_heads"])
    logits = loaded.model(mx.array([[1, 2, 3]]))
    assert logits.shape[-1] == demo.model(mx.array([[1]])).shape[-1]
    assert shape_model("tiny", tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == made


def test_an_unknown_shape_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="known: 8b"):
        shape_model("70b", tmp_path)
