"""Turn train_hybrid.py's output into the shipped MLX model, and check it against torch.

  python deploy/demo_models/convert_hybrid.py --work DIR --out shared/models/demo-hybrid \\
      [--reference DIR] [--bits 4]

Transformers' Qwen3Next keeps its RMSNorm weights centred on zero (it multiplies by
1 + w) and its depthwise convolution as (channels, 1, kernel); mlx-lm's qwen3_next
converts those only for checkpoints with experts, so for this dense model the weights are
put in MLX's layout here (w + 1; (channels, kernel, 1)) before mlx-lm's own convert
quantizes them. The gated norm inside the linear-attention layers multiplies by w itself
and is left alone.

Before writing, the unquantized MLX model's logits on the reference tokens are compared
with the float32 torch logits the training machine saved (same bfloat16 weights): the
conversion fails when the relative error is over 3e-3 or the greedy tokens differ in
more than 2% of positions.  Measured on the shipped model: 1.5e-3 and 100% agreement.
Most of that error is the folded norm weights (1 + w) rounded to bfloat16 (keeping them
in float32 gives 3.4e-4, the rest being torch's chunked gated-delta algorithm against
mlx-lm's step-by-step one); they stay bfloat16, since a float32 weight would promote a
bfloat16 residual stream to float32 on the GPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import TOKENIZER_FILES, mlx_convert

ZERO_CENTRED_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def to_mlx_layout(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    out = {}
    for k, v in weights.items():
        if k.endswith(ZERO_CENTRED_NORMS) and v.ndim == 1:
            v = (v.astype(mx.float32) + 1.0).astype(v.dtype)
        if "conv1d.weight" in k and v.ndim == 3 and v.shape[-1] != 1:
            v = v.moveaxis(2, 1)
        out[k] = v
    return out


def check_against_torch(model_dir: Path, reference: Path) -> dict[str, float]:
    from mlx_lm import load

    ref = np.load(reference)
    model, _ = load(str(model_dir))
    model.set_dtype(mx.float32)
    ids = mx.array(ref["ids"].astype(np.int32))[None]
    logits = np.array(model(ids)[0].astype(mx.float32))
    want = ref["logits"]
    rel = float(np.linalg.norm(logits - want) / np.linalg.norm(want))
    agree = float((logits.argmax(-1) == want.argmax(-1)).mean())
    return {"relative_error": rel, "argmax_agreement": agree}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--tokenizer", default=Path("shared/models/demo"), type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--reference", type=Path, default=None,
                    help="also keep the unquantized bfloat16 MLX model here")
    ap.add_argument("--bits", type=int, default=4)
    args = ap.parse_args()
    manifest = json.loads((args.work / "hybrid_manifest.json").read_text())
    weights: dict[str, mx.array] = {}
    for name in manifest["shards"]:
        weights.update(mx.load(str(args.work / name)))
    weights = to_mlx_layout(weights)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps(manifest["config"], indent=2) + "\n")
        mx.save_safetensors(str(hf / "model.safetensors"),
                            {k: v.astype(mx.bfloat16) for k, v in weights.items()},
                            metadata={"format": "pt"})
        for name in TOKENIZER_FILES:
            shutil.copy(args.tokenizer / name, hf / name)
        full = args.reference or Path(tmp) / "bf16"
        mlx_convert(hf, full, None, args.tokenizer)
        check = check_against_torch(full, args.work / "hybrid_reference.npz")
        print(json.dumps({"mlx_vs_torch_float32": check}))
        if check["relative_error"] > 3e-3 or check["argmax_agreement"] < 0.98:
            raise SystemExit(f"converted model disagrees with torch: {check}")
        mlx_convert(hf, args.out, args.bits, args.tokenizer)
        (args.out / "README.md").unlink(missing_ok=True)  # mlx-lm's generic card


if __name__ == "__main__":
    main()
