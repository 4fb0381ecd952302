"""Turning a request into prompt tokens, the same way in every layer.

The seat tokenizes to generate; the proxy tokenizes to admit.  Both call
`prompt_ids` with the tokenizer of the same model directory, loaded the same
way (mlx-lm's TokenizerWrapper, which is what the seat decodes with), so the
counts agree to the token.

Tools and tool history (an assistant turn's `tool_calls_json`, a `tool` message's
result) go to the chat template as the Hugging Face convention has them when the
template renders tools ("tools" or "tool_calls" appear in it):

    {"role": "assistant", "content": ..., "tool_calls": [{"id", "type": "function",
        "function": {"name", "arguments": {...}}}]}
    {"role": "tool", "content": ..., "tool_call_id": ...}

and the tools as the template's `tools` argument.  A template that knows no tools
(the demo models' ChatML) would drop them without a word, so Sanctum renders them
itself, in its own tool-call syntax (mlx-lm's json_tools, which `seatd.tool_calls`
parses back): the tools as a system message (prepended, or appended to the first
system message) that lists them as JSON and says how to call them; an assistant turn's
calls as its content, each in `<tool_call>` tags; a tool result wrapped in
`<tool_response>` tags, as a `tool` turn where the template renders any role (ChatML
does), else as a `user` turn.  A `developer` turn goes as itself where the template
renders that role, else as a `system` turn (OpenAI's reading for models with no
developer role): never dropped, as a template that knows no such role would drop it.
"""

from __future__ import annotations

import json
import weakref
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

TOOLS_HEADER = (
    "# Tools\n\n"
    "You may call one or more functions to answer. Their signatures, as JSON, "
    "are within <tools></tools> tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\n"
    "To call a function, answer with a JSON object of its name and arguments within "
    "<tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


_knows_tools: weakref.WeakKeyDictionary[Any, tuple[object, bool]] = weakref.WeakKeyDictionary()


def template_knows_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders tools and tool calls itself.  mlx-lm's own
    renderers (`mlx_lm/chat_templates`, for models whose template is code) all do.
    Found once per tokenizer and template (a template is kilobytes to search)."""
    if getattr(tokenizer, "_chat_template", None) is not None:
        return True
    # the Hugging Face tokenizer's own attribute: through mlx-lm's wrapper it costs 2 us
    template = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "chat_template", None)
    try:
        seen, knows = _knows_tools[tokenizer]
        if seen is template:
            return knows
    except (KeyError, TypeError):
        pass
    knows = _searched_for_tools(template)
    try:
        _knows_tools[tokenizer] = (template, knows)
    except TypeError:  # not weakly referable: searched again next time
        pass
    return knows


def _searched_for_tools(template: Any) -> bool:
    if isinstance(template, dict):  # several named templates (one may be "tool_use")
        template = "\n".join(str(t) for t in template.values())
    return isinstance(template, str) and ("tools" in template or "tool_calls" in template)


_rendered_roles: dict[str, weakref.WeakKeyDictionary[Any, bool]] = {
    "tool": weakref.WeakKeyDictionary(), "developer": weakref.WeakKeyDictionary()}
_PROBE = "\x00sanctum-probe\x00"


def renders_role(tokenizer: Any, role: str) -> bool:
    """Whether the template renders the content of a turn of `role` ("tool" after a
    user turn, "developer" before one); found once per tokenizer, by rendering one.  A
    template that knows no such role may drop the turn without a word (ChatML loops
    that branch on user, system and assistant do)."""
    try:
        return _rendered_roles[role][tokenizer]
    except (KeyError, TypeError):
        pass
    probe = [{"role": "user", "content": "?"}, {"role": role, "content": _PROBE}]
    if role == "developer":
        probe.reverse()
    try:
        text = tokenizer.apply_chat_template(probe, add_generation_prompt=True,
                                             tokenize=False)
        rendered = _PROBE in str(text)
    except Exception:  # the template refuses the role
        rendered = False
    try:
        _rendered_roles[role][tokenizer] = rendered
    except TypeError:  # not weakly referable: found again next time
        pass
    return rendered


def renders_any_role(tokenizer: Any) -> bool:
    """Whether the template renders a `tool` turn's content (as ChatML renders any role)."""
    return renders_role(tokenizer, "tool")


def _arguments(raw: Any) -> Any:
    """A call's arguments as the templates want them: the JSON text decoded (a string
    that is not JSON is kept as it is)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _calls(tool_calls_json: str) -> list[dict[str, Any]]:
    """An assistant turn's calls in the HF convention, from the OpenAI JSON list."""
    calls = json.loads(tool_calls_json)
    if not isinstance(calls, list):
        raise ValueError("tool_calls is not a list")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ValueError("a tool call without a function")
        entry: dict[str, Any] = {"type": "function", "function": {
            "name": function.get("name"), "arguments": _arguments(function.get("arguments"))}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    body = json.dumps({"name": function["name"], "arguments": function["arguments"]},
                      ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _tools_text(tools: list[Any]) -> str:
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def _tools(tools_json: str | None) -> list[Any] | None:
    if not tools_json:
        return None
    tools = json.loads(tools_json)
    if not isinstance(tools, list):
        raise ValueError("tools is not a list")
    return tools or None


def conversation(tokenizer: Any, messages: Sequence[ChatMessage],
                 tools_json: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages as the chat template is given them, and its keyword arguments
    (`tools` when the template renders them): see the module docstring."""
    tools = _tools(tools_json)
    native = template_knows_tools(tokenizer)
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.role == "developer" and not renders_role(tokenizer, "developer"):
            d["role"] = "system"  # OpenAI's own reading for models with no developer role
        if m.name is not None:
            d["name"] = m.name
        if native:
            if m.tool_calls_json:
                d["tool_calls"] = _calls(m.tool_calls_json)
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
        elif m.tool_calls_json:
            texts = [_call_text(c) for c in _calls(m.tool_calls_json)]
            d["content"] = "\n".join(([m.content] if m.content else []) + texts)
        elif m.role == "tool":
            d["role"] = "tool" if renders_any_role(tokenizer) else "user"
            d["content"] = f"<tool_response>\n{m.content}\n</tool_response>"
        out.append(d)
    if tools is None:
        return out, {}
    if native:
        return out, {"tools": tools}
    text = _tools_text(tools)
    if out and out[0]["role"] == "system":
        first = out[0]["content"]
        out[0] = {**out[0], "content": f"{first}\n\n{text}" if first else text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, {}


def prompt_bound(tokenizer: Any, messages: Sequence[ChatMessage] | None = None,
                 prompt: str | None = None, tools_json: str | None = None) -> int:
    """An upper bound on `len(prompt_ids(...))`, without tokenizing: the UTF-8 bytes of
    the text the tokenizer would see (the chat template rendered), plus BOUND_SLACK.
    A token covers at least one byte of its text, so the count can never exceed it;
    it costs a template render (tens of microseconds) instead of an encode."""
    if messages is None:
        return len((prompt or "").encode("utf-8")) + BOUND_SLACK
    rendered, kwargs = conversation(tokenizer, messages, tools_json)
    return len(chat_text(tokenizer, rendered, kwargs.get("tools")).encode("utf-8")) \
        + BOUND_SLACK


def chat_text(tokenizer: Any, rendered: list[dict[str, Any]], tools: list[Any] | None) -> str:
    """The text the chat template makes of `rendered` (from `conversation`), with the
    generation prompt: what `apply_chat_template(tokenize=False)` returns, rendered
    directly with the template's compiled Jinja where `_direct` found that the same
    (half the cost: none of transformers' per-call conversions, which change nothing
    in messages that are already plain JSON)."""
    direct = _direct(tokenizer)
    if direct is not None:
        template, variables = direct
        messages = [{k: v for k, v in m.items() if v is not None} for m in rendered]
        return str(template.render(messages=messages, tools=tools, documents=None,
                                   add_generation_prompt=True, **variables))
    kwargs = {"tools": tools} if tools is not None else {}
    return str(tokenizer.apply_chat_template(rendered, add_generation_prompt=True,
                                             tokenize=False, **kwargs))


_Direct = tuple[Any, dict[str, Any]]  # the compiled template, its variables
# per tokenizer: the template string it was found for, and what was found
_directs: weakref.WeakKeyDictionary[Any, tuple[object, _Direct | None]] = \
    weakref.WeakKeyDictionary()
_DIRECT_PROBES: list[tuple[list[dict[str, Any]], list[Any] | None]] = [
    ([{"role": "system", "content": "s \u00e9"}, {"role": "user", "content": "u"},
      {"role": "assistant", "content": "a"}, {"role": "user", "content": _PROBE}], None),
    ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "",
      "tool_calls": [{"id": "c1", "type": "function",
                      "function": {"name": "f", "arguments": {"x": 1}}}]},
      {"role": "tool", "content": "r", "tool_call_id": "c1"}],
     [{"type": "function", "function": {"name": "f", "description": "d",
                                        "parameters": {"type": "object"}}}]),
]


def _direct(tokenizer: Any) -> _Direct | None:
    """The compiled template and the variables mlx-lm and transformers give it, found
    once per tokenizer and template; None (the full `apply_chat_template` every time)
    where the template is code (mlx-lm's own renderers) or several named templates, or
    where the two ways differ on a probe chat, or one refuses what the other renders."""
    hf: Any = getattr(tokenizer, "_tokenizer", None)
    template = getattr(hf, "chat_template", None)
    try:
        seen, known = _directs[tokenizer]
        if seen is template:
            return known
    except KeyError:
        pass
    except TypeError:  # not weakly referable
        return None
    found: _Direct | None = None
    if getattr(tokenizer, "_chat_template", None) is None and isinstance(template, str):
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            variables = dict(hf.special_tokens_map)
            thinking = getattr(tokenizer, "_thinking_kwarg", None)
            if thinking:
                variables[thinking] = getattr(tokenizer, "has_thinking", False)
            found = (_compile_jinja_template(template), variables)
            _directs[tokenizer] = (template, found)  # the probes render both ways
            if any(_same(tokenizer, chat, tools) is False for chat, tools in _DIRECT_PROBES):
                found = None
        except Exception:  # any surprise: the full path, which is the reference
            found = None
    _directs[tokenizer] = (template, found)
    return found


def _same(tokenizer: Any, chat: list[dict[str, Any]], tools: list[Any] | None) -> bool | None:
    """Whether the direct render of a probe equals transformers' (None: both refuse it)."""
    kwargs = {"tools": tools} if tools is not None else {}
    try:
        full: str | None = str(tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False, **kwargs))
    except Exception:
        full = None
    try:
        fast: str | None = chat_text(tokenizer, chat, tools)
    except Exception:
        fast = None
    if full is None and fast is None:
        return None
    return full == fast


def prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage] | None = None,
               prompt: str | None = None, tools_json: str | None = None) -> list[int]:
    """Token ids of a chat (template, system prompt and tools included) or of a raw prompt."""
    if messages is not None:
        rendered, kwargs = conversation(tokenizer, messages, tools_json)
        ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True,
                                            tokenize=True, **kwargs)
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer.encode(prompt or ""))
