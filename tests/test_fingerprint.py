"""system_fingerprint: it names what can change a seeded answer's bytes, and only that."""

from __future__ import annotations

import shutil
from pathlib import Path

from seatd.fingerprint import beside, fingerprint, model_digest, rows_round_apart
from shared.builtin import resolve_model

BASE = dict(model="m" * 64, compute_dtype="float32", kv="fp16", device="cpu",
            rule="gumbel-v1", grid=512)


def test_each_input_that_can_change_bytes_changes_it() -> None:
    """Weights, dtype, lane, device, sampling rule and prefill grid each move it."""
    base = fingerprint(**BASE)  # type: ignore[arg-type]
    assert base.startswith("fp_") and len(base) == 19
    assert base == fingerprint(**BASE)  # type: ignore[arg-type]
    for key, other in [("model", "n" * 64), ("compute_dtype", "bfloat16"), ("kv", "q8"),
                       ("device", "gpu"), ("rule", "gumbel-v2"), ("grid", 256)]:
        assert fingerprint(**{**BASE, key: other}) != base, key  # type: ignore[arg-type]


def test_model_digest_follows_file_contents(tmp_path: Path) -> None:
    """A copy digests the same; a changed weight byte or config changes the digest;
    files that are not weights, config or tokenizer do not count."""
    demo = resolve_model("builtin:demo")
    copy = tmp_path / "copy"
    shutil.copytree(demo, copy)
    digest = model_digest(demo)
    assert model_digest(copy) == digest
    (copy / "README.md").write_text("notes")
    assert model_digest(copy) == digest
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert model_digest(copy) != digest


def test_the_device_part_names_cudas_attention_rule() -> None:
    """The CPU and Metal keep their names (their answers' bytes did not change); a CUDA
    seat's names the attention rule that decides how its verified tokens round."""
    from seatd.fingerprint import fingerprint_device
    from seatd.rows_attention import CUDA_RULE

    assert fingerprint_device("cpu") == "cpu"
    assert fingerprint_device("metal") == "gpu"
    assert fingerprint_device("cuda") == f"cuda/{CUDA_RULE}"
    assert len({fingerprint("m", "bfloat16", "fp16", fingerprint_device(b), "r", 512)
                for b in ("cpu", "metal", "cuda")}) == 3


def test_an_answer_beside_other_rows_is_named_apart_where_they_can_round_it() -> None:
    """CUDA's forwards round a row by the rows beside it (measured); the CPU's do not, and
    Metal's keep the CPU's promise until measured otherwise."""
    assert [rows_round_apart(b) for b in ("cpu", "metal", "cuda")] == [False, False, True]
    fp = fingerprint("d" * 64, "bfloat16", "fp16", "cuda/x", "gumbel-v1", 512)
    named = beside(fp)
    assert named.startswith("fp_") and len(named) == len(fp) and named != fp
    assert beside(fp) == named  # the same seat's batched answers share one name
    assert beside(fingerprint("d" * 64, "bfloat16", "q8", "cuda/x", "gumbel-v1", 512)) != named
