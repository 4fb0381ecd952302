"""The cheap upper bound on a prompt's tokens never falls below the exact count, so a
prompt it admits is one the exact count admits too (caps stay exact)."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.builtin import resolve_model
from shared.prompt import BOUND_SLACK, load_tokenizer, prompt_bound, prompt_ids
from shared.protocol import ChatMessage

MODELS = ["builtin:demo", "builtin:demo-hybrid"]


@cache
def tokenizer(name: str) -> Any:
    return load_tokenizer(resolve_model(name))


TEXT = st.text(st.characters(codec="utf-8"), max_size=200)


@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=60, deadline=None)
@given(prompt=TEXT)
def test_bound_covers_a_raw_prompt(name: str, prompt: str) -> None:
    tok = tokenizer(name)
    assert len(prompt_ids(tok, prompt=prompt)) <= prompt_bound(tok, prompt=prompt)


@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=60, deadline=None)
@given(turns=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), TEXT),
                      min_size=1, max_size=4))
def test_bound_covers_a_chat(name: str, turns: list[tuple[str, str]]) -> None:
    tok = tokenizer(name)
    messages = tuple(ChatMessage(r, c) for r, c in turns)
    assert len(prompt_ids(tok, messages)) <= prompt_bound(tok, messages)


def test_bound_is_bytes_plus_slack_for_a_raw_prompt() -> None:
    """Tight enough to be useful: a short prompt's bound is its bytes and the slack."""
    assert prompt_bound(tokenizer("builtin:demo"), prompt="héllo") == 6 + BOUND_SLACK
