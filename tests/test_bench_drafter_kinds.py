"""`sanctum bench run spec --drafter`: a model, prompt lookup, or a noise drafter that never
agrees (the demo drafter's shape and tokenizer, random weights)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from sanctum.bench.cli import spec_stem
from sanctum.bench.drafter_kinds import resolve_drafter, stem_part
from sanctum.bench.options import Options


@pytest.mark.parametrize(("spec", "part"), [
    ("builtin:demo-drafter-weak", "demo-drafter-weak"),
    ("lookup", "lookup"),
    ("noise:builtin:demo-drafter", "noise-demo-drafter"),
    ("/models/Small-Drafter/", "Small-Drafter"),
    ("shape:8b", "shape-8b"),  # a file name the results folder takes everywhere
])
def test_a_drafter_names_its_results(spec: str, part: str) -> None:
    """Each kind of drafter names the result file of its run, beside the depth."""
    assert stem_part(spec) == part
    assert spec_stem(Options(drafter=spec, draft_depth=None)) == f"spec-{part}-adaptive"


def test_lookup_needs_no_model(tmp_path: Path) -> None:
    """`lookup` is the seat's prompt lookup: no weights, no directory."""
    got = resolve_drafter("lookup", tmp_path)
    assert got.kind == "lookup" and got.path is None
    assert got.seat_line() == 'drafter = { kind = "lookup" }\n'
    with pytest.raises(ValueError):
        resolve_drafter("builtin:no-such-model", tmp_path)


def test_a_noise_drafter_has_the_shape_and_tokenizer_but_not_the_weights(
        tmp_path: Path) -> None:
    """The demo drafter's architecture and tokenizer (the seat takes it: same tokenizer
    hash), random weights: its greedy proposals are not the demo drafter's."""
    from seatd.model_load import load_for_compute
    from shared.builtin import resolve_model

    got = resolve_drafter("noise:builtin:demo-drafter", tmp_path)
    assert got.kind == "model" and got.path is not None and got.path.is_relative_to(tmp_path)
    assert got.seat_line() == f'drafter = {{ kind = "model", path = "{got.path}" }}\n'
    noise = load_for_compute(got.path, None)
    real = load_for_compute(resolve_model("builtin:demo-drafter"), None)
    assert noise.tokenizer_hash == real.tokenizer_hash
    ids = mx.array([real.tokenizer.encode("def fibonacci(n):\n    if n < 2:")])
    a = mx.argmax(noise.model(ids)[0], axis=-1)
    b = mx.argmax(real.model(ids)[0], axis=-1)
    assert (a != b).sum().item() > ids.shape[1] // 2
    again = resolve_drafter("noise:builtin:demo-drafter", tmp_path / "again")
    assert again.path is not None
    assert (again.path / "model.safetensors").read_bytes() == \
        (got.path / "model.safetensors").read_bytes()  # seeded: two runs draft alike
