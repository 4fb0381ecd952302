"""Caps agree across layers at the boundary, with the demo model's real tokenizer.

The proxy side is proxyd's `Admission.judge` (the tokenizer loaded alone); the seat
side is the worker's own check (`prompt_ids` with the tokenizer mlx-lm loads with
the model, then `seat_refusal`).  For prompts within a few tokens of `cap - margin`:
the proxy never admits what the seat refuses, and never refuses what is at least
`margin` under the seat's cap.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxyd.admission import Admission
from shared.builtin import resolve_model
from shared.caps import model_context, seat_refusal
from shared.config import parse_config
from shared.prompt import prompt_ids
from shared.protocol import ChatMessage, Generate, SamplingParams

MODEL = os.environ.get("SANCTUM_TEST_MODEL", "builtin:demo")
MARGIN = 8

TEXT = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs")),
        st.sampled_from(list("é漢字😀\n\t    def return ()[]{}:")),
    ),
    min_size=0, max_size=200)
MESSAGES = st.lists(
    st.tuples(st.sampled_from(["system", "user", "assistant"]), TEXT), min_size=1, max_size=4)
TOOLS = st.one_of(st.none(), st.lists(st.fixed_dictionaries({
    "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
                                       "description": TEXT})}), min_size=1, max_size=2))


@pytest.fixture(scope="module")
def layers() -> Iterator[tuple[Admission, Any, int, asyncio.AbstractEventLoop]]:
    from mlx_lm import load

    path = resolve_model(MODEL)
    config = parse_config(f"""
[proxy]
tokenizer_margin = {MARGIN}
[[seat]]
name = "s"
model = "{path}"
[[route]]
model = "s"
ladder = ["s"]
""")
    admission = Admission(config)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(admission.start())
    _, seat_tokenizer = load(str(path))  # what the worker decodes with
    yield admission, seat_tokenizer, model_context(path), loop
    loop.run_until_complete(admission.stop())
    loop.close()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=MESSAGES, tools=TOOLS, delta=st.integers(-3, 3))
def test_proxy_and_seat_agree_at_the_boundary(layers, messages, tools, delta: int) -> None:
    """Never admitted-then-refused; never refused while `margin` under the seat's cap."""
    admission, seat_tokenizer, context, loop = layers
    msgs = tuple(ChatMessage(role, content) for role, content in messages)
    tools_json = json.dumps(tools, ensure_ascii=False) if tools else None
    gen = Generate("r", False, SamplingParams(), messages=msgs, tools_json=tools_json)
    n_seat = len(prompt_ids(seat_tokenizer, msgs, None, tools_json))
    seat_cap = max(1, n_seat + MARGIN + delta)
    if seat_cap >= context:
        return
    verdict = loop.run_until_complete(admission.judge(
        admission.config.seat[0], gen, {}, reported_cap=seat_cap))
    refused_by_seat = seat_refusal(n_seat, seat_cap, context) is not None
    assert verdict.tokens == n_seat  # both layers count the same tokens
    assert not (verdict.admitted and refused_by_seat)
    if n_seat <= seat_cap - MARGIN:
        assert verdict.admitted


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=TEXT.filter(bool), delta=st.integers(-3, 3))
def test_completion_prompts_agree_too(layers, prompt: str, delta: int) -> None:
    """Raw completion prompts (no template) agree the same way."""
    admission, seat_tokenizer, _context, loop = layers
    n_seat = len(prompt_ids(seat_tokenizer, None, prompt))
    seat_cap = max(1, n_seat + MARGIN + delta)
    verdict = loop.run_until_complete(admission.judge(
        admission.config.seat[0], Generate("r", False, SamplingParams(), prompt=prompt), {},
        reported_cap=seat_cap))
    assert verdict.tokens == n_seat
    assert verdict.admitted == (n_seat <= seat_cap - MARGIN)
