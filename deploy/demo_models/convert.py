"""Turn the training outputs into MLX model directories with mlx-lm's own convert.

  python deploy/demo_models/convert.py --stage1 DIR --stage2 DIR --drafter d192x4 \\
      --out shared/models [--reference DIR]

The target (int8 transport copy, see transport.py) is rebuilt as a bfloat16 Hugging
Face directory and converted to 5-bit MLX quantization with group size 64; the
drafter is converted in bfloat16. ``--reference`` also writes the unquantized bfloat16
target (80 MB, not shipped) for measure.py's before/after comparison. Both shipped
directories get byte-identical tokenizer files.

  python deploy/demo_models/convert.py --stage2 DIR --drafter d192x4 \\
      --drafter-only demo-drafter-weak --out shared/models

converts one more drafter into OUT/NAME, with the tokenizer files of OUT/demo, and
leaves the target alone (the weak benchmark drafter is made so).
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
import transport

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_hf_dir(dst: Path, config: dict, weights: dict[str, np.ndarray], tok_src: Path) -> None:
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(
        str(dst / "model.safetensors"),
        {k: mx.array(v).astype(mx.bfloat16) for k, v in weights.items()},
        metadata={"format": "pt"},
    )
    for name in TOKENIZER_FILES:
        shutil.copy(tok_src / name, dst / name)


def mlx_convert(hf_dir: Path, out: Path, bits: int | None, tok_src: Path) -> None:
    from mlx_lm import convert

    if out.exists():
        shutil.rmtree(out)
    if bits is None:
        convert(str(hf_dir), str(out), dtype="bfloat16")
    else:
        convert(
            str(hf_dir), str(out), quantize=True, q_bits=bits, q_group_size=64, dtype="bfloat16"
        )
    # transformers may re-serialise tokenizer files; ship the trained ones, identically.
    for p in out.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "chat_template")) or p.name.endswith(
            ".jinja"
        ):
            p.unlink()
    # mlx-lm writes a stub model card; the models' card is shared/models/README.md.
    (out / "README.md").unlink(missing_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tok_src / name, out / name)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stage1", type=Path, help="the target's stage (unless --drafter-only)")
    ap.add_argument("--stage2", required=True, type=Path)
    ap.add_argument("--drafter", default="d192x4")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--reference", type=Path, default=None)
    ap.add_argument("--bits", type=int, default=5)
    ap.add_argument(
        "--drafter-only",
        metavar="NAME",
        default=None,
        help="convert only the drafter, into OUT/NAME, with the tokenizer of OUT/demo",
    )
    args = ap.parse_args()
    if args.drafter_only:
        with tempfile.TemporaryDirectory() as tmp:
            convert_drafter(
                args.stage2,
                args.drafter,
                Path(tmp),
                args.out / args.drafter_only,
                args.out / "demo",
            )
        return
    if args.stage1 is None:
        ap.error("--stage1 is required unless --drafter-only")
    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory() as tmp:
        t_cfg = json.loads((args.stage1 / "target_config.json").read_text())
        t_w = transport.load_packed(args.stage1 / "target_int8.safetensors")
        write_hf_dir(Path(tmp) / "target", t_cfg, t_w, args.stage1)
        mlx_convert(Path(tmp) / "target", args.out / "demo", args.bits, args.stage1)
        if args.reference is not None:
            mlx_convert(Path(tmp) / "target", args.reference, None, args.stage1)
        convert_drafter(
            args.stage2, args.drafter, Path(tmp), args.out / "demo-drafter", args.stage1
        )
    del load_file


def convert_drafter(stage2: Path, name: str, tmp: Path, out: Path, tok_src: Path) -> None:
    """One distilled drafter (bfloat16, torch names) -> a bfloat16 MLX directory at OUT."""
    d_cfg = json.loads((stage2 / f"drafter_{name}_config.json").read_text())
    d_w = {
        k: v.astype(np.float32) if v.dtype != np.float32 else v
        for k, v in _load_bf16(stage2 / f"drafter_{name}.safetensors").items()
    }
    write_hf_dir(tmp / "drafter", d_cfg, d_w, tok_src)
    mlx_convert(tmp / "drafter", out, None, tok_src)


def _load_bf16(path: Path) -> dict[str, np.ndarray]:
    """safetensors in bfloat16 (numpy has no bfloat16) via mlx."""
    return {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(path)).items()}


if __name__ == "__main__":
    main()
