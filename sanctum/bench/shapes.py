"""Random-weight targets of a real deployment's shape, for measuring speed only.

    --model shape:8b     a llama of an 8B model's shape (hidden 4096, 32 layers,
                         intermediate 14336, 32 heads, 8 KV heads), 4-bit, about 4 GB
    --model shape:1b     a llama of a 1B model's shape (hidden 2048, 16 layers,
                         intermediate 8192, 32 heads, 8 KV heads), 4-bit, about 0.6 GB
                         (4 GB once a CPU seat dequantizes it to float32)
    --model shape:tiny   the same recipe at a toy size (tests)

Built on first use with mlx-lm's own model class, `nn.quantize` and
`mx.save_safetensors`, with the demo's tokenizer (so the demo drafter and the bench's
workloads fit it), into SANCTUM_BENCH_MODELS (default ~/.cache/sanctum/bench-models), and
reused after.  Its answers are noise: only how fast it decodes means anything.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

PREFIX = "shape:"
SHAPES: dict[str, dict[str, int]] = {
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
           "num_attention_heads": 32, "num_key_value_heads": 8},
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
             "num_attention_heads": 4, "num_key_value_heads": 2},
}
BITS, GROUP = 4, 64
TOKENIZER = "builtin:demo"


def models_dir() -> Path:
    return Path(os.environ.get("SANCTUM_BENCH_MODELS", "~/.cache/sanctum/bench-models")
                ).expanduser()


def shape_model(name: str, root: Path | None = None, seed: int = 0) -> Path:
    """The directory of shape `name`'s random model, built there first if missing.
    Raises ValueError for a shape not in SHAPES."""
    import mlx.core as mx

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    out = (root or models_dir()) / f"shape-{name}"
    if (out / "config.json").exists():
        return out
    _build(name, out, seed)
    # The built model's buffers, freed, stay in MLX's cache for the process's life unless
    # given back: an 8b build's 4-5 GB through every slot, beside the servers the bench
    # measures (on an H100, nvidia-smi showed a process of 5.7 GB from before the first
    # server started to the run's end).
    mx.clear_cache()
    return out


def _build(name: str, out: Path, seed: int) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from shared.builtin import resolve_model

    source = resolve_model(TOKENIZER)
    vocab = int(json.loads((source / "config.json").read_text())["vocab_size"])
    config = {"model_type": "llama", "vocab_size": vocab, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 4096,
              "tie_word_embeddings": False, **SHAPES[name]}
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))  # type: ignore[no-untyped-call]
    model.set_dtype(mx.bfloat16)  # the stored dtype of a real checkpoint's floats
    # Part by part, each cast, quantized and evaluated before the next: the whole model
    # in float32 (32 GB for 8b) never exists at once, so it builds in a small memory.
    parts = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(len(model.model.layers))),
             "lm_head"]
    for part in parts:
        nn.quantize(model, group_size=GROUP, bits=BITS,  # type: ignore[attr-defined]
                    class_predicate=lambda path, m, part=part: (
                        (path == part or path.startswith(part + "."))
                        and hasattr(m, "to_quantized")))
        flat: Any = tree_flatten(model.parameters())
        mx.eval([v for k, v in flat if k == part or k.startswith(part + ".")])
    mx.eval(model.parameters())
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp / "config.json").write_text(json.dumps(
        {**config, "quantization": {"group_size": GROUP, "bits": BITS}}))
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
