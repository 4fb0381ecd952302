"""Turning a request into prompt tokens, the same way in every layer.

The seat tokenizes to generate; the proxy tokenizes to admit.  Both call
`prompt_ids` with the tokenizer of the same model directory, loaded the same
way (mlx-lm's TokenizerWrapper, which is what the seat decodes with), so the
counts agree to the token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shared.protocol import ChatMessage


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer alone, without the model's weights."""
    from mlx_lm.tokenizer_utils import load

    return load(Path(model_dir))


def prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage] | None = None,
               prompt: str | None = None, tools_json: str | None = None) -> list[int]:
    """Token ids of a chat (template, system prompt and tools included) or of a raw prompt."""
    if messages is not None:
        rendered = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.name is not None:
                d["name"] = m.name
            rendered.append(d)
        kwargs: dict[str, Any] = {}
        if tools_json:
            kwargs["tools"] = json.loads(tools_json)
        ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True,
                                            tokenize=True, **kwargs)
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer.encode(prompt or ""))
