"""The chat template rendered directly (shared/prompt.chat_text, admission's bound) gives
the text transformers' `apply_chat_template` gives, byte for byte, for every chat the
proxy renders: the bound must never fall below the seat's count."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import prompt
from shared.builtin import resolve_model
from shared.prompt import chat_text, conversation, load_tokenizer, prompt_bound, prompt_ids
from shared.protocol import ChatMessage
from tests.test_tool_prompt import QWEN_STYLE, ROLE_BRANCHES, STRICT_ROLES, TOOLS_JSON

# A template that reads the special tokens, a date and a variable of its own.
VARIABLES = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}|{{ m.name | default('-') }}]"
    "{{ m.content | trim }}{{ eos_token }}{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% if enable_thinking is defined %}<think={{ enable_thinking }}>{% endif %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@cache
def tokenizer(model: str, template: str | None = None) -> Any:
    tok = load_tokenizer(resolve_model(model))
    if template is not None:
        tok.chat_template = template
    return tok


def full(tok: Any, messages: tuple[ChatMessage, ...], tools_json: str | None) -> str:
    rendered, kwargs = conversation(tok, messages, tools_json)
    return str(tok.apply_chat_template(rendered, add_generation_prompt=True,
                                       tokenize=False, **kwargs))


def direct(tok: Any, messages: tuple[ChatMessage, ...], tools_json: str | None) -> str:
    rendered, kwargs = conversation(tok, messages, tools_json)
    return chat_text(tok, rendered, kwargs.get("tools"))


CASES = [("builtin:demo", None), ("builtin:demo-hybrid", None),
         ("builtin:demo", QWEN_STYLE), ("builtin:demo", ROLE_BRANCHES),
         ("builtin:demo", VARIABLES)]
TEXT = st.text(st.characters(codec="utf-8"), max_size=60)
ROLES = st.sampled_from(["system", "user", "assistant", "developer", "tool"])


@pytest.mark.parametrize(("model", "template"), CASES)
@settings(max_examples=30, deadline=None)
@given(turns=st.lists(st.tuples(ROLES, TEXT, st.none() | st.just("bob")), min_size=1,
                      max_size=5),
       tools=st.booleans(), calls=st.booleans())
def test_the_direct_render_is_the_template_s_text(model: str, template: str | None,
                                                  turns: list[tuple[str, str, str | None]],
                                                  tools: bool, calls: bool) -> None:
    tok = tokenizer(model, template)
    assert prompt._direct(tok) is not None  # these templates take the direct path
    messages = tuple(
        ChatMessage(role, content, name=name,
                    tool_calls_json=json.dumps([{"id": "c", "type": "function", "function": {
                        "name": "get_weather", "arguments": json.dumps({"city": content})}}])
                    if calls and role == "assistant" else None,
                    tool_call_id="c" if role == "tool" else None)
        for role, content, name in turns)
    tools_json = TOOLS_JSON if tools else None
    assert direct(tok, messages, tools_json) == full(tok, messages, tools_json)
    assert len(prompt_ids(tok, messages, tools_json=tools_json)) <= \
        prompt_bound(tok, messages, tools_json=tools_json)


def test_a_refusing_template_refuses_on_both_paths() -> None:
    tok = tokenizer("builtin:demo", STRICT_ROLES)
    messages = (ChatMessage("user", "hi"), ChatMessage("tool", "r", tool_call_id="c"))
    rendered = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "r"}]
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    with pytest.raises(Exception, match="unknown role"):
        chat_text(tok, rendered, None)
    assert full(tok, messages, None) == direct(tok, messages, None)  # tool -> user turn


def test_a_template_rendered_otherwise_takes_the_full_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where transformers would render a probe otherwise than the direct path (another
    version's conversions), every chat takes the full path; a changed template is
    looked at again."""
    tok = load_tokenizer(resolve_model("builtin:demo"))
    inner = tok._tokenizer
    real = type(inner).apply_chat_template

    def other(self: Any, *args: Any, **kwargs: Any) -> Any:
        return str(real(self, *args, **kwargs)) + "!"

    monkeypatch.setattr(type(inner), "apply_chat_template", other)
    assert prompt._direct(tok) is None
    rendered = [{"role": "user", "content": "hi"}]
    assert chat_text(tok, rendered, None).endswith("assistant\n!")
    monkeypatch.undo()
    assert prompt._direct(tok) is None  # found once per template
    tok.chat_template = str(tok.chat_template) + " "
    assert prompt._direct(tok) is not None


def test_mlx_lm_s_own_renderers_take_the_full_path() -> None:
    class Coded:
        _chat_template = staticmethod(lambda *a, **k: "text")
        _tokenizer = None

    assert prompt._direct(Coded()) is None
