"""The drafters a speculation run can put beside its seats (`--drafter`):

    builtin:NAME or a directory   a model drafter (`drafter = { kind = "model", ... }`)
    lookup                        prompt lookup, no weights (`drafter = { kind = "lookup" }`)
    noise:SPEC                    SPEC's shape and tokenizer with random weights: a drafter
                                  that never agrees, for measuring what losing rounds cost
                                  and how soon a seat parks them

`noise_drafter` writes the random copy (seeded, so two runs draft alike); it is made for a
run and thrown away after it.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

LOOKUP = "lookup"
NOISE = "noise:"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


@dataclass(frozen=True)
class Drafter:
    kind: str  # "model" | "lookup"
    path: Path | None  # a model drafter's directory

    def seat_line(self) -> str:
        """The seat's `drafter = ...` config line."""
        if self.kind == LOOKUP:
            return 'drafter = { kind = "lookup" }\n'
        return f'drafter = {{ kind = "model", path = "{self.path}" }}\n'


def stem_part(spec: str) -> str:
    """How a drafter or model names a result file: `lookup`, `noise-NAME`, `NAME`
    (`shape:8b`: `shape-8b`), in letters, digits, '.', '_' and '-' alone."""
    if spec.startswith(NOISE):
        return "noise-" + stem_part(spec.removeprefix(NOISE))
    name = spec.removeprefix("builtin:").rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)


def resolve_drafter(spec: str, workdir: Path) -> Drafter:
    """The drafter `spec` names; a noise drafter is written under `workdir`.  Raises
    ValueError for a model that is not there."""
    from shared.builtin import resolve_model

    if spec == LOOKUP:
        return Drafter(LOOKUP, None)
    if spec.startswith(NOISE):
        source = resolve_model(spec.removeprefix(NOISE))
        return Drafter("model", noise_drafter(source, workdir / "noise-drafter"))
    path = resolve_model(spec)
    if not (path / "config.json").exists():
        raise ValueError(f"no drafter model at {spec}")
    return Drafter("model", path)


def noise_drafter(source: Path, out: Path, seed: int = 0) -> Path:
    """`source`'s architecture and tokenizer with random float weights (normal, 0.02),
    written to `out`: the tokenizer matches the target's, the drafts do not."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import load_model

    if not (source / "config.json").exists():
        raise ValueError(f"no model at {source}")
    config = json.loads((source / "config.json").read_text())
    if "quantization" in config:
        raise ValueError(f"{source} is quantized; a noise drafter needs a float model")
    model, _ = load_model(source, lazy=True)
    mx.random.seed(seed)
    model.update(tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(p.dtype),
                          model.parameters()))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out
