"""Turn train_sc2.py's output into the StarCoder2 pair's MLX model folders, and check them.

  python deploy/demo_models/convert_sc2.py --work DIR --out shared/models [--reference DIR]

Writes OUT/demo-sc2 (the target: its int8 transport shards rebuilt as bfloat16, then
quantized by mlx-lm to ``--bits`` bits, group 64) and OUT/demo-sc2-drafter (bfloat16),
each with config.json (model_type ``starcoder2``) and the trained tokenizer files,
byte-identical in both. ``--reference`` also keeps the unquantized bfloat16 target.
WORK is the training run's folder, or what its ``--return-dir`` wrote (sc2_small.tar
beside the weights).

Before writing, the unquantized MLX target and the drafter are run in float32 on the
held-out tokens the training machine saved, and compared with float32 torch logits of the
same bfloat16 weights: computed here when torch and transformers are importable, else the
ones train_sc2.py computed with torch on the training machine (``sc2_*_reference.npz``);
without either the check is skipped. The conversion fails when the relative error is over
MAX_RELATIVE_ERROR or the greedy tokens differ in more than 2% of positions. The 4-bit
target's distance from the same logits is printed, not checked.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import transport
from convert import _load_bf16, mlx_convert, write_hf_dir

TARGET_NAME = "demo-sc2"
DRAFTER_NAME = "demo-sc2-drafter"
MAX_RELATIVE_ERROR = 2e-3
SMALL_TAR = "sc2_small.tar"  # train_sc2.SMALL_TAR (that module needs torch)


def unpack_work(work: Path, tmp: Path) -> Path:
    """WORK itself, or, where train_sc2.py's --return-dir packed its small files in
    sc2_small.tar, a folder at TMP with them unpacked beside links to the big ones."""
    if (work / "sc2_manifest.json").exists() or not (work / SMALL_TAR).exists():
        return work
    tmp.mkdir(parents=True)
    with tarfile.open(work / SMALL_TAR) as tar:
        for member in tar.getmembers():  # flat, regular files only
            src = tar.extractfile(member) if member.isfile() else None
            if src is not None and "/" not in member.name:
                (tmp / member.name).write_bytes(src.read())
    for p in work.iterdir():
        if p.name != SMALL_TAR and not (tmp / p.name).exists():
            (tmp / p.name).symlink_to(p.resolve())
    return tmp


def torch_logits(cfg: dict[str, Any], hf_dir: Path, ids: np.ndarray) -> np.ndarray | None:
    """float32 torch logits of HF_DIR's bfloat16 weights, or None without torch here."""
    try:
        import torch
        import train_sc2
    except ImportError:
        return None
    weights = _load_bf16(hf_dir / "model.safetensors")
    model = train_sc2.load_weights(train_sc2.build_model(cfg), weights).float().eval()
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64))[None]).logits[0]
    return np.asarray(out.float().numpy())


def mlx_logits(model_dir: Path, ids: np.ndarray) -> np.ndarray:
    from mlx_lm import load

    model, _ = load(str(model_dir))
    model.set_dtype(mx.float32)
    return np.array(model(mx.array(ids.astype(np.int32))[None])[0].astype(mx.float32))


def compare(got: np.ndarray, want: np.ndarray) -> dict[str, float]:
    return {
        "relative_error": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
        "argmax_agreement": float((got.argmax(-1) == want.argmax(-1)).mean()),
    }


def check(
    name: str,
    cfg: dict[str, Any],
    hf_dir: Path,
    model_dir: Path,
    ref_npz: Path,
    quantized: Path | None = None,
) -> dict[str, Any]:
    """Compare the MLX model at MODEL_DIR with float32 torch logits; exit on a mismatch."""
    if not ref_npz.exists():
        print(f"{name}: no {ref_npz.name}, check skipped", flush=True)
        return {"skipped": True}
    ref = np.load(ref_npz)
    ids = ref["ids"]
    want = torch_logits(cfg, hf_dir, ids)
    source = "torch here"
    if want is None:
        want, source = ref["logits"], "torch on the training machine"
    got = mlx_logits(model_dir, ids)
    result: dict[str, Any] = {"tokens": len(ids), "reference": source, **compare(got, want)}
    if source == "torch here":
        result["training_machine"] = compare(got, ref["logits"])
    if quantized is not None:
        result["quantized"] = compare(mlx_logits(quantized, ids), want)
    print(json.dumps({f"{name}_mlx_vs_torch_float32": result}), flush=True)
    if result["relative_error"] > MAX_RELATIVE_ERROR or result["argmax_agreement"] < 0.98:
        raise SystemExit(f"{name}: the converted model disagrees with torch: {result}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--work", required=True, type=Path, help="train_sc2.py's output folder")
    ap.add_argument("--out", required=True, type=Path, help="parent of the two model folders")
    ap.add_argument(
        "--reference",
        type=Path,
        default=None,
        help="also keep the unquantized bfloat16 MLX target here",
    )
    ap.add_argument("--bits", type=int, default=4)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = unpack_work(args.work, Path(tmp) / "work")
        manifest = json.loads((work / "sc2_manifest.json").read_text())
        if "drafter" not in manifest:
            raise SystemExit(f"{args.work}: the training run did not finish (no drafter)")
        t_cfg = json.loads((work / "sc2_target_config.json").read_text())
        d_cfg = json.loads((work / "sc2_drafter_config.json").read_text())
        hf_t, hf_d = Path(tmp) / "target", Path(tmp) / "drafter"
        shards = [work / n for n in manifest["target"]["shards"]]
        write_hf_dir(hf_t, t_cfg, transport.load_packed(*shards), work)
        write_hf_dir(hf_d, d_cfg, _load_bf16(work / "sc2_drafter.safetensors"), work)
        full = args.reference or Path(tmp) / "target-bf16"
        mlx_convert(hf_t, full, None, work)
        mlx_convert(hf_t, args.out / TARGET_NAME, args.bits, work)
        mlx_convert(hf_d, args.out / DRAFTER_NAME, None, work)
        check(
            "target",
            t_cfg,
            hf_t,
            full,
            work / "sc2_target_reference.npz",
            quantized=args.out / TARGET_NAME,
        )
        check("drafter", d_cfg, hf_d, args.out / DRAFTER_NAME, work / "sc2_drafter_reference.npz")
    for name in (TARGET_NAME, DRAFTER_NAME):
        size = sum(p.stat().st_size for p in (args.out / name).iterdir())
        print(f"{args.out / name}: {size / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
