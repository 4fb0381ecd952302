"""Models packaged with Sanctum, named `builtin:NAME` in a config.

They live in `shared/models/NAME/` (package data), so a non-editable install carries
them. `sanctum models` lists them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
MODELS_DIR = Path(__file__).resolve().parent / "models"
TOKENIZER_FILES = (
    "added_tokens.json",
    "chat_template.jinja",
    "merges.txt",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
)


def builtin_names() -> list[str]:
    """The packaged model names, without the prefix, sorted."""
    if not MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model(spec: str) -> Path:
    """`builtin:NAME` -> its packaged directory; anything else is a path, with ~ expanded."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX) :]
        path = MODELS_DIR / name
        if not name or "/" in name or not (path / "config.json").is_file():
            known = ", ".join(BUILTIN_PREFIX + n for n in builtin_names()) or "none"
            raise ValueError(f"unknown builtin model {spec!r} (known: {known})")
        return path
    return Path(spec).expanduser()


def tokenizer_hash(model_dir: Path) -> str:
    """sha256 over the tokenizer files that exist, by name: equal hashes, equal tokenizers."""
    h = hashlib.sha256()
    for name in sorted(TOKENIZER_FILES):
        p = Path(model_dir) / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()
