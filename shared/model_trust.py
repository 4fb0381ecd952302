"""Which model folders name code of their own, and the words of a refusal.

A model folder is data until its config names Python to run.  What the loaders in
this stack would run from a folder (mlx-lm 0.32, transformers 5):

- config.json `model_file`: mlx-lm's `load_model` imports that file from the folder
  and builds the model from its `Model` and `ModelArgs` (it refuses unless
  `trust_remote_code=True` is passed, since CVE-2026-5843).
- config.json `auto_map` (its `AutoConfig` entry): transformers' `AutoConfig`, which
  `AutoTokenizer` calls, imports the module it names from the folder.
- tokenizer_config.json `auto_map` (its `AutoTokenizer` entry, or the older list
  form): `AutoTokenizer` imports the tokenizer module it names.  mlx-lm's `load`
  does not pass `trust_remote_code` to the tokenizer; transformers then asks on
  stdin, or refuses where it cannot ask.  An entry `org/repo--module.Class` names
  code on the Hugging Face Hub, to be downloaded and run.

Every `auto_map` entry is a reason here, not only the ones a loader runs today: a
folder that carries one was made to run code somewhere.  What does not run folder
code, so is not a reason: `model_type` (mlx-lm imports `mlx_lm.models.<type>`, only
its own package), `tokenizer_class` (transformers looks the name up among its own and
registered classes), `chat_template_type` / `tool_parser_type` (mlx-lm's own
packages), a chat template (rendered in Jinja's sandbox), and a `*.py` file that
nothing names.

`own_code` reads two small JSON files and decides; it imports no loader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.builtin import BUILTIN_PREFIX, resolve_model
from shared.config import Config, SeatConfig, resolve_path

CONFIG = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class OwnCode:
    """One place a folder names code: `config.json model_file = "evil.py"`."""

    file: str  # the JSON file that names it
    key: str  # `model_file`, `auto_map.AutoConfig`, `auto_map.AutoTokenizer[1]`
    value: str  # what it says
    code: str  # the Python it points at: `evil.py`, or `hub:org/repo (module.py)`

    def __str__(self) -> str:
        return f"{self.file} {self.key} = {json.dumps(self.value)}"


class UntrustedCode(ValueError):
    """A model folder names code of its own and its seat does not trust it."""


def _read(path: Path) -> dict[str, Any]:
    # The loaders parse these with the stdlib json module too, so a file reads the
    # same here as there (duplicate keys: the last wins in both).  A file that is
    # missing or not JSON names no code; the loader then fails on it in its own words.
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _module_file(ref: str) -> str:
    """`org/repo--pkg.mod.Class` -> `hub:org/repo (pkg/mod.py)`; `mod.Class` -> `mod.py`."""
    repo, _, local = ref.rpartition("--")
    module = local.rpartition(".")[0] or local
    path = module.replace(".", "/") + ".py"
    return f"hub:{repo} ({path})" if repo else path


def _auto_map(file: str, value: Any) -> list[OwnCode]:
    entries: list[tuple[str, Any]]
    if isinstance(value, dict):
        entries = [(f"auto_map.{k}", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        entries = [("auto_map", value)]
    else:
        entries = [("auto_map", value)] if value else []
    found: list[OwnCode] = []
    for key, ref in entries:
        refs = list(ref) if isinstance(ref, (list, tuple)) else [ref]
        for i, one in enumerate(refs):
            if one is None or one == "":
                continue
            name = f"{key}[{i}]" if isinstance(ref, (list, tuple)) else key
            text = one if isinstance(one, str) else json.dumps(one)
            found.append(OwnCode(file, name, text, _module_file(text)))
    return found


def own_code(folder: Path) -> list[OwnCode]:
    """Every place the folder's configs name code of their own; [] for plain data."""
    folder = Path(folder)
    found: list[OwnCode] = []
    config = _read(folder / CONFIG)
    model_file = config.get("model_file")
    if model_file is not None:
        text = model_file if isinstance(model_file, str) else json.dumps(model_file)
        found.append(OwnCode(CONFIG, "model_file", text, text))
    if "auto_map" in config:
        found += _auto_map(CONFIG, config["auto_map"])
    tokenizer = _read(folder / TOKENIZER_CONFIG)
    if "auto_map" in tokenizer:
        found += _auto_map(TOKENIZER_CONFIG, tokenizer["auto_map"])
    return found


def refusal(seat: str, role: str, folder: Path, found: list[OwnCode]) -> str:
    """The one line a refused seat shows, in `sanctum check` and in its state."""
    what = "; ".join(str(f) for f in found)
    return (f"{role} folder {folder} names its own code ({what}); set "
            f"trust_remote_code = true on seat {json.dumps(seat)} to allow it")


def seat_folders(config: Config, seat: SeatConfig) -> list[tuple[str, Path]]:
    """(role, folder) of each model folder a local seat loads: its model, its drafter.

    builtin: models are ours and are left out; so is a spec that names no builtin.
    """
    specs = [("model", seat.model)]
    if seat.drafter is not None and seat.drafter.kind == "model":
        specs.append(("drafter", seat.drafter.path))
    folders: list[tuple[str, Path]] = []
    for role, spec in specs:
        if not spec or spec.startswith(BUILTIN_PREFIX):
            continue
        folders.append((role, resolve_model(resolve_path(config, spec))))
    return folders


def trust_refusal(config: Config, seat: SeatConfig) -> str | None:
    """Why this seat must not load its folders, or None (trusted, or plain data)."""
    if seat.trust_remote_code:
        return None
    for role, folder in seat_folders(config, seat):
        found = own_code(folder)
        if found:
            return refusal(seat.name, role, folder, found)
    return None


__all__ = ["OwnCode", "UntrustedCode", "own_code", "refusal", "seat_folders", "trust_refusal"]
