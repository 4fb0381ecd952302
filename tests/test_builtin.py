"""Tests for shared.builtin: naming and locating packaged models."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.builtin import BUILTIN_PREFIX, builtin_names, resolve_model, tokenizer_hash


def test_demo_pair_is_listed() -> None:
    """Both demo models are packaged and listed by name."""
    names = builtin_names()
    assert "demo" in names and "demo-drafter" in names


def test_resolve_builtin_points_at_a_model_directory() -> None:
    """builtin:demo resolves to a directory holding config.json and weights."""
    path = resolve_model(BUILTIN_PREFIX + "demo")
    assert (path / "config.json").is_file()
    assert (path / "model.safetensors").is_file()


def test_unknown_builtin_is_a_clear_error() -> None:
    """An unknown builtin raises ValueError naming it and the known ones."""
    with pytest.raises(ValueError, match=r"builtin:nope.*builtin:demo"):
        resolve_model("builtin:nope")


@pytest.mark.parametrize("spec", ["builtin:", "builtin:../demo"])
def test_malformed_builtin_is_rejected(spec: str) -> None:
    """An empty or path-like builtin name never escapes the models folder."""
    with pytest.raises(ValueError):
        resolve_model(spec)


def test_plain_paths_expand_home() -> None:
    """A plain spec is a path with ~ expanded."""
    assert resolve_model("~/models/x") == Path.home() / "models" / "x"
    assert resolve_model("/m/x") == Path("/m/x")


def test_tokenizer_hash_follows_file_bytes(tmp_path: Path) -> None:
    """The hash changes with any tokenizer file's bytes and ignores weight files."""
    (tmp_path / "tokenizer.json").write_text("{}")
    first = tokenizer_hash(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    assert tokenizer_hash(tmp_path) == first
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert tokenizer_hash(tmp_path) != first
