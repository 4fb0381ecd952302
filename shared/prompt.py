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


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer alone, without the model's weights.  A folder whose tokenizer
    names code of its own is refused unless trusted (shared/model_trust.py)."""
    from mlx_lm.tokenizer_utils import load

    return load(Path(model_dir), tokenizer_config_extra={"trust_remote_code": trust_remote_code})


# Tokens a tokenizer may add that stand for no byte of the text: BOS/EOS, a
# SentencePiece dummy prefix.  Every other token covers at least one byte.
BOUND_SLACK = 8


def _rendered(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def prompt_bound(tokenizer: Any, messages: Sequence[ChatMessage] | None = None,
                 prompt: str | None = None, tools_json: str | None = None) -> int:
    """An upper bound on `len(prompt_ids(...))`, without tokenizing: the UTF-8 bytes of
    the text the tokenizer would see (the chat template rendered), plus BOUND_SLACK.
    A token covers at least one byte of its text, so the count can never exceed it;
    it costs a template render (tens of microseconds) instead of an encode."""
    if messages is None:
        return len((prompt or "").encode("utf-8")) + BOUND_SLACK
    kwargs: dict[str, Any] = {}
    if tools_json:
        kwargs["tools"] = json.loads(tools_json)
    text = tokenizer.apply_chat_template(_rendered(messages), add_generation_prompt=True,
                                         tokenize=False, **kwargs)
    return len(str(text).encode("utf-8")) + BOUND_SLACK


def prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage] | None = None,
               prompt: str | None = None, tools_json: str | None = None) -> list[int]:
    """Token ids of a chat (template, system prompt and tools included) or of a raw prompt."""
    if messages is not None:
        rendered = _rendered(messages)
        kwargs: dict[str, Any] = {}
        if tools_json:
            kwargs["tools"] = json.loads(tools_json)
        ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True,
                                            tokenize=True, **kwargs)
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer.encode(prompt or ""))
