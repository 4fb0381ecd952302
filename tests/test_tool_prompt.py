"""Tools and tool history in the prompt (shared/prompt.py): through the chat template
when it renders tools, in Sanctum's own syntax when it does not; a second turn sees
the calls and their results, and the proxy's bound still covers the seat's count."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seatd.tool_calls import ToolSplitter, seat_family
from shared.builtin import resolve_model
from shared.prompt import (
    TOOLS_HEADER,
    conversation,
    load_tokenizer,
    prompt_bound,
    prompt_ids,
    renders_any_role,
    template_knows_tools,
)
from shared.protocol import ChatMessage

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOLS_JSON = json.dumps(TOOLS)
CALLS_JSON = json.dumps([{"id": "call_1", "type": "function", "function": {
    "name": "get_weather", "arguments": '{"city": "Paris"}'}}])
HISTORY = (
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage("assistant", "", tool_calls_json=CALLS_JSON),
    ChatMessage("tool", "18 C", tool_call_id="call_1"),
)

# A small template in Qwen2.5's manner: tools in the system turn, calls as JSON in
# <tool_call> tags, results as user turns in <tool_response> tags.
QWEN_STYLE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# A template that knows only three roles and says so.
STRICT_ROLES = (
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role') }}{% endif %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@cache
def tokenizer(template: str | None = None) -> Any:
    """The demo tokenizer, or a copy of it with another chat template."""
    tok = load_tokenizer(resolve_model("builtin:demo"))
    if template is not None:
        tok.chat_template = template
    return tok


def text(tok: Any, messages: tuple[ChatMessage, ...], tools_json: str | None = None) -> str:
    rendered, kwargs = conversation(tok, messages, tools_json)
    return str(tok.apply_chat_template(rendered, add_generation_prompt=True,
                                       tokenize=False, **kwargs))


def test_which_templates_know_tools() -> None:
    assert not template_knows_tools(tokenizer())
    assert template_knows_tools(tokenizer(QWEN_STYLE))
    assert renders_any_role(tokenizer()) and not renders_any_role(tokenizer(STRICT_ROLES))


def test_the_demo_gets_the_tools_as_a_system_turn() -> None:
    """Its template drops `tools`: Sanctum lists them, as JSON, and says how to call."""
    got = text(tokenizer(), (ChatMessage("user", "Hi"),), TOOLS_JSON)
    assert got.startswith("<|im_start|>system\n" + TOOLS_HEADER)
    assert json.dumps(TOOLS[0]) in got
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in got
    assert got.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert got != text(tokenizer(), (ChatMessage("user", "Hi"),))


def test_the_tools_join_an_existing_system_turn() -> None:
    got = text(tokenizer(), (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")),
               TOOLS_JSON)
    assert got.startswith("<|im_start|>system\nBe brief.\n\n" + TOOLS_HEADER)
    assert got.count("<|im_start|>system") == 1


def test_the_demo_sees_its_calls_and_their_results() -> None:
    """A second turn: the assistant's call in Sanctum's syntax, the result as a tool turn
    (ChatML renders any role)."""
    got = text(tokenizer(), HISTORY, TOOLS_JSON)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n') in got
    assert "<|im_start|>tool\n<tool_response>\n18 C\n</tool_response><|im_end|>\n" in got


def test_a_call_rendered_in_the_history_parses_back_to_itself() -> None:
    """What the prompt shows the model as a call is what the seat reads as one."""
    rendered, _ = conversation(tokenizer(), HISTORY, TOOLS_JSON)
    assistant = next(m for m in rendered if m["role"] == "assistant")
    splitter = ToolSplitter(seat_family(tokenizer()), TOOLS, "r")
    got = splitter.feed("Let me see. " + assistant["content"])
    rest = splitter.close()
    assert got.text + rest.text == "Let me see. "
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == \
        [("get_weather", {"city": "Paris"})]


def test_content_beside_calls_comes_first() -> None:
    messages = (ChatMessage("user", "?"),
                ChatMessage("assistant", "Checking.", tool_calls_json=CALLS_JSON))
    rendered, _ = conversation(tokenizer(), messages)
    assert rendered[1]["content"].startswith("Checking.\n<tool_call>\n")


def test_a_template_that_knows_tools_gets_the_hf_convention() -> None:
    """Tools as the template's argument; calls with their arguments decoded; results
    with the call they answer."""
    tok = tokenizer(QWEN_STYLE)
    rendered, kwargs = conversation(tok, HISTORY, TOOLS_JSON)
    assert kwargs == {"tools": TOOLS}
    assert rendered[1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert rendered[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    got = text(tok, HISTORY, TOOLS_JSON)
    assert TOOLS_HEADER not in got and '"name": "get_weather"' in got
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>") in got
    assert '<tool_response id="call_1">\n18 C\n</tool_response>' in got


def test_a_template_without_a_tool_role_gets_the_result_as_a_user_turn() -> None:
    got = text(tokenizer(STRICT_ROLES), HISTORY, TOOLS_JSON)
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in got


@pytest.mark.parametrize("bad", ["{}", "[1]", '[{"id": "x"}]', "not json"])
def test_tool_calls_that_are_not_calls_are_refused(bad: str) -> None:
    """The callers answer a template's refusal with a 400 (proxy admission, seat)."""
    for tok in (tokenizer(), tokenizer(QWEN_STYLE)):
        with pytest.raises(ValueError):
            conversation(tok, (ChatMessage("assistant", "", tool_calls_json=bad),))


TEXT = st.text(st.characters(codec="utf-8"), max_size=80)


@pytest.mark.parametrize("template", [None, QWEN_STYLE])
@settings(max_examples=40, deadline=None)
@given(user=TEXT, result=TEXT, city=TEXT, content=TEXT)
def test_the_bound_covers_a_tool_conversation(template: str | None, user: str, result: str,
                                              city: str, content: str) -> None:
    """Admission's cheap bound stays an upper bound of the seat's count with tools."""
    tok = tokenizer(template)
    calls = json.dumps([{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": city})}}])
    messages = (ChatMessage("user", user), ChatMessage("assistant", content,
                                                       tool_calls_json=calls),
                ChatMessage("tool", result, tool_call_id="c"))
    assert len(prompt_ids(tok, messages, tools_json=TOOLS_JSON)) <= \
        prompt_bound(tok, messages, tools_json=TOOLS_JSON)


# ChatML in Qwen's manner: it branches on the roles it knows and drops any other turn.
ROLE_BRANCHES = (
    "{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize(("template", "role"), [
    (None, "developer"),  # the demo's ChatML renders any role as it is
    (ROLE_BRANCHES, "system"),  # would drop a developer turn: it goes as system
    (STRICT_ROLES, "system"),  # would refuse one: it goes as system
])
def test_a_developer_turn_is_never_dropped(template: str | None, role: str) -> None:
    """A `developer` message (Codex sends its permissions as one) reaches the model: as
    itself where the template renders the role, else as a system turn, as OpenAI reads
    it for models with no developer role."""
    tok = tokenizer(template)
    got = text(tok, (ChatMessage("developer", "Never delete files."),
                     ChatMessage("user", "Hi")))
    assert f"<|im_start|>{role}\nNever delete files.<|im_end|>" in got
