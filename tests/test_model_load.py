"""Tests for seatd.model_load: the per-device compute-dtype policy, the loader, its
progress lines, and trust of a folder's own code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from structlog.testing import capture_logs

from seatd import model_load
from seatd.model_load import choose_dtype, load_for_compute, progress_due
from shared.builtin import resolve_model, tokenizer_hash
from shared.model_trust import UntrustedCode


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


@pytest.mark.parametrize(("last", "now", "total", "due"), [
    (0.0, 5.0, 2 << 30, True),
    (0.0, 4.9, 2 << 30, False),  # not yet: every few seconds, not every piece
    (10.0, 15.0, 1 << 30, True),  # at the threshold
    (0.0, 60.0, (1 << 30) - 1, False),  # small weights load quietly
])
def test_progress_is_due_for_large_weights_every_few_seconds(
        last: float, now: float, total: int, due: bool) -> None:
    """Progress lines: only for weights over 1 GiB, at most one every 5 s."""
    assert progress_due(last, now, total, 1 << 30, 5.0) is due


@pytest.mark.slow
def test_loading_in_pieces_reports_progress_and_loads_the_same_weights(
        cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small pieces with the threshold at 0: start, progress and done lines, same weights."""
    path = resolve_model("builtin:demo")
    whole = load_for_compute(path).model
    monkeypatch.setattr(model_load, "EVAL_PIECE_BYTES", 4 << 20)
    monkeypatch.setattr(model_load, "PROGRESS_OVER_BYTES", 0)
    monkeypatch.setattr(model_load, "PROGRESS_EVERY_S", 0.0)
    with capture_logs() as logs:
        pieces = load_for_compute(path).model
    events = [e["event"] for e in logs]
    assert events[0] == "model_loading" and "model_loaded" in events
    progress = [e for e in logs if e["event"] == "model_loading_progress"]
    assert len(progress) >= 2, events
    done = [e["percent"] for e in progress]
    assert done == sorted(done) and 0 <= done[0] and done[-1] < 100
    loaded = next(e for e in logs if e["event"] == "model_loaded")
    assert loaded["seconds"] > 0 and loaded["compute_gb"] > loaded["weights_gb"] > 0
    a, b = dict(tree_flatten(whole.parameters())), dict(tree_flatten(pieces.parameters()))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


EVIL = """\
from pathlib import Path

Path(__file__).with_name("ran").write_text("executed")
from mlx_lm.models.llama import Model, ModelArgs  # noqa: E402,F401
"""


@pytest.fixture
def with_model_file(tmp_path: Path) -> Path:
    """The demo model (weights linked) whose config.json names `arch.py`, which marks
    its folder when it runs and then gives mlx-lm the llama classes."""
    demo = resolve_model("builtin:demo")
    folder = tmp_path / "custom"
    folder.mkdir()
    for f in demo.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((demo / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_file": "arch.py"}))
    (folder / "arch.py").write_text(EVIL)
    return folder


def test_untrusted_model_file_is_refused_before_anything_runs(with_model_file: Path) -> None:
    """trust_remote_code off: UntrustedCode naming the key; the file never ran."""
    with pytest.raises(UntrustedCode, match=r'config.json model_file = "arch.py"'):
        load_for_compute(with_model_file)
    assert not (with_model_file / "ran").exists()


@pytest.mark.slow
def test_trusted_model_file_is_what_mlx_lm_builds_the_model_from(
        cpu: None, with_model_file: Path) -> None:
    """trust_remote_code on: mlx-lm imports the folder's model_file (it ran) and loads."""
    with capture_logs() as logs:
        loaded = load_for_compute(with_model_file, trust_remote_code=True)
    assert (with_model_file / "ran").read_text() == "executed"
    assert loaded.context_length == 2048
    start = next(e for e in logs if e["event"] == "model_loading")
    assert start["trusted_code"] == ['config.json model_file = "arch.py"']


TOKENIZER_CODE = """\
from pathlib import Path

from transformers import PreTrainedTokenizerFast

Path(__file__).resolve().with_name("ran").write_text("executed")


class MarkedTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.fixture
def with_tokenizer_code(tmp_path: Path) -> Path:
    """The demo model whose tokenizer_config.json maps AutoTokenizer to `tok_x.py`."""
    demo = resolve_model("builtin:demo")
    folder = tmp_path / "tok"
    folder.mkdir()
    for f in demo.iterdir():
        if f.name != "tokenizer_config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((demo / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tok_x.MarkedTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tok_x.py").write_text(TOKENIZER_CODE)
    return folder


def test_untrusted_tokenizer_code_is_refused(with_tokenizer_code: Path) -> None:
    """A tokenizer auto_map is refused like a model_file when trust is off."""
    with pytest.raises(UntrustedCode, match=r"tokenizer_config.json auto_map.AutoTokenizer"):
        load_for_compute(with_tokenizer_code)


@pytest.mark.slow
def test_trusted_tokenizer_code_reaches_the_tokenizer_loader(
        with_tokenizer_code: Path, tmp_path: Path) -> None:
    """Trusted, the folder's tokenizer class is the one loaded (mlx-lm's own `load` does
    not pass trust to the tokenizer; without it transformers ignores this auto_map)."""
    cache = tmp_path / "hf-modules"  # where transformers copies a folder's code to import it
    script = ("import sys; from pathlib import Path; from seatd.model_load import "
              "load_for_compute; t = load_for_compute(Path(sys.argv[1]), "
              "trust_remote_code=True).tokenizer; print(type(t._tokenizer).__name__)")
    done = subprocess.run([sys.executable, "-c", script, str(with_tokenizer_code)],
                          env=dict(os.environ, HF_MODULES_CACHE=str(cache)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "MarkedTokenizer"  # structlog unset: stdout
    assert [p.read_text() for p in cache.rglob("ran")] == ["executed"]
