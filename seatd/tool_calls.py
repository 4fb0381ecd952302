"""Tool calls out of an answer's text, in the model family's own syntax.

The parsing is mlx-lm's (`mlx_lm/tool_parsers/*.py`, one module per family; its
TokenizerWrapper infers the family from the chat template): a call is the text between
the family's start and end markers, handed to the family's `parse_tool_call(text,
tools)`.  A seat whose tokenizer has no parser, or whose chat template knows no tools
(so that `shared.prompt` teaches the model Sanctum's own syntax), uses mlx-lm's
`json_tools` syntax:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolSplitter` runs over the committed text of one answer (what the worker's emit
gets), piece by piece:

    text outside calls     passed through; a possible partial start marker is held
                           back until it is one or is not (as stop strings are)
    a call, start to end   held whole, then parsed: each call it holds becomes a
                           ToolCall (index, id, name, arguments as JSON text)
    a call that does not   dropped (with the blanks before it), counted in
      parse, or names no    `failures`: a call's markup never reaches the client's
      tool of the request   text, where an agent could not act on it
    an unclosed call at    parsed when the family's end marker is optional (Mistral
      the end               has none; an end marker that is an EOS token never shows
                           in the text), else dropped and counted a failure
    a call the budget cut  (the answer ran out of tokens inside it: `close(cut=True)`)
                           the door's own cut call, as OpenAI returns one: its name
                           (the forced function's, the request's only tool, or the
                           first of the request's tools its text names) and the
                           arguments generated so far, never its markup as text; with
                           no name to give, dropped and counted a failure
    a call after the       dropped, neither a call nor text, when the request says
      first                 parallel_tool_calls false: the client asked for one call
    a call made before     (the same name and arguments) never sent twice: dropped,
                           and the answer ends there (`repeated`: the worker tells the
                           engine the answer is complete), with nothing after it
    blanks after a call    held: sent with the text that follows them, dropped when
                           another call or the end follows (the newline between two
                           calls is the syntax's, not content for the client)
    a continued answer     the answer's text so far replayed (`resume`): the calls
      (another seat began   its client got came apart from its text, so they are not
      it and failed)        sent again, the next call takes the next index, and a call
                           left open is completed by this seat

The markers are matched on text, not on token ids, by mlx-lm's own TextStateMachine,
so a marker split across tokens (or across chunks) is still found.  Call ids are
"call_" and 24 hex digits of a hash of the request id and the call's index: the same
answer has the same ids on every run.  The splitter is pure (no I/O); the worker feeds
it on the MLX thread and sends what comes out.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from seatd.answer import seam
from shared.prompt import template_knows_tools
from shared.protocol import ToolCall

Parser = Callable[[str, Any], Any]

SANCTUM_FAMILY = "json_tools"  # Sanctum's own syntax, for seats without one

# mlx-lm's marker matcher (an Aho-Corasick trie over text); mlx-lm leaves it unannotated.
TextStateMachine: Any = importlib.import_module("mlx_lm.generate").TextStateMachine


@dataclass(frozen=True)
class Family:
    """A model family's tool-call syntax: its markers and mlx-lm's parser for it."""

    name: str
    start: str
    end: str  # "": a call runs to the end of the answer (Mistral)
    parse: Parser
    end_optional: bool  # an unclosed call at the end of the answer is still parsed


def family_named(name: str, end_is_eos: bool = False) -> Family:
    """mlx-lm's tool parser module `name` (`mlx_lm.tool_parsers.<name>`) as a Family."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    end = str(module.tool_call_end or "")
    return Family(name, str(module.tool_call_start), end, module.parse_tool_call,
                  end_optional=end == "" or end_is_eos)


def seat_family(tokenizer: Any) -> Family:
    """The syntax a seat's model calls tools in: the family mlx-lm inferred for its
    tokenizer when the chat template renders tools, else Sanctum's own."""
    parse = getattr(tokenizer, "tool_parser", None)
    start = getattr(tokenizer, "tool_call_start", None)
    if parse is None or not start or not template_knows_tools(tokenizer):
        return family_named(SANCTUM_FAMILY)
    end = str(getattr(tokenizer, "tool_call_end", None) or "")
    config = getattr(tokenizer, "init_kwargs", None)
    name = str(config.get("tool_parser_type", "custom")) if isinstance(config, dict) \
        else "custom"
    return Family(name, str(start), end, parse,
                  end_optional=end == "" or _is_eos(tokenizer, end))


def _is_eos(tokenizer: Any, text: str) -> bool:
    """True when `text` is one EOS token: the answer ends on it and its text never shows."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # a tokenizer that cannot say: the marker is plain text
        return False
    return len(ids) == 1 and ids[0] in set(tokenizer.eos_token_ids)


def call_id(request_id: str, index: int) -> str:
    """A call's id: the same request id and index give the same id, on any run."""
    digest = hashlib.sha256(f"{request_id}\0{index}".encode()).hexdigest()
    return "call_" + digest[:24]


def tool_names(tools: Sequence[Any] | None) -> frozenset[str] | None:
    """The function names of a request's tools (OpenAI's {"type": "function",
    "function": {"name": ...}}); None when there are none to check against."""
    if not tools:
        return None
    names = set()
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str):
            names.add(name)
    return frozenset(names)


def calls_of(parsed: Any, names: frozenset[str] | None) -> list[tuple[str, str]]:
    """(name, arguments as JSON text) of each call a parser returned (a dict or a list
    of them).  Raises ValueError for anything that is not a call of a known tool."""
    items = parsed if isinstance(parsed, list) else [parsed]
    if not items:
        raise ValueError("no call")
    out = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError(f"a call is not an object: {item!r}")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("a call without a name")
        if names is not None and name not in names:
            raise ValueError(f"{name!r} is not one of the request's tools")
        # Hermes-style JSON has "arguments"; Llama-style JSON says "parameters".
        arguments = item.get("arguments", item.get("parameters", {}))
        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            raise ValueError(f"the arguments of {name!r} are not an object")
        out.append((name, json.dumps(arguments, ensure_ascii=False)))
    return out


# Where a cut call's arguments begin: JSON syntaxes' key, or Mistral's marker.
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*|\[ARGS\]')
_PART_NAME = re.compile(r'"name"\s*:\s*"([^"]+)$')  # a JSON call's name, still open


def cut_call(inner: str, names: frozenset[str] | None, forced: str | None
             ) -> tuple[str, str] | None:
    """(name, arguments so far) of a call the budget cut, from its text between the
    start marker and the cut; None when no name can be given."""
    name = forced
    if name is None and names is not None and len(names) == 1:
        name = next(iter(names))
    if name is None and names:
        at = {n: inner.find(n) for n in names if n in inner}
        if at:
            name = min(at, key=lambda n: (at[n], -len(n)))
    if name is None and names:  # a name cut short: the one tool it can only begin
        part = _PART_NAME.search(inner)
        begun = [n for n in names if part and n.startswith(part.group(1))]
        name = begun[0] if len(begun) == 1 else None
    if name is None:
        return None
    m = _ARGUMENTS.search(inner)
    return name, inner[m.end():].rstrip() if m else ""


class Split(NamedTuple):
    """What one piece of answer text became: text to send, and completed calls."""

    text: str
    calls: tuple[ToolCall, ...] = ()


class ToolSplitter:
    """One answer's text split into plain text and tool calls (module docstring)."""

    def __init__(self, family: Family, tools: Sequence[Any] | None, request_id: str,
                 parallel: bool = True, forced: str | None = None) -> None:
        self.family = family
        self.forced = forced  # the function tool_choice names
        self.tools = list(tools) if tools else None
        self.names = tool_names(tools)
        self.request_id = request_id
        self.parallel = parallel
        edges: dict[str, list[tuple[str, str]]] = {"normal": [(family.start, "tool")],
                                                   "tool": []}
        if family.end:
            edges["tool"].append((family.end, "normal"))
        self.state = TextStateMachine(edges).make_state("normal")
        self.inside = False  # within a call's markers
        self.held = ""  # the call's text so far, without its markers
        self.made = 0  # calls parsed (and kept)
        self.failures = 0  # call texts that did not parse, sent on as text
        self.dropped = 0  # calls past the first when parallel_tool_calls is false
        self.after = False  # a call was the last thing parsed
        self.gap = ""  # blanks since that call: dropped between calls and at the end
        self.closed = False
        self.made_calls: set[tuple[str, str]] = set()  # (name, arguments) of each call
        self.repeated = False  # a call came again: the answer is complete
        # A continued answer (`resume`): the calls its first part made, the text its
        # client still lacks, and the characters to come that it already has.
        self.replayed = 0
        self.unsent = ""
        self.skip = 0

    def resume(self, head: str, sent: str) -> None:
        """A continued answer: `head` is the text of the answer's tokens so far, which
        the seat that began it split as this splitter does; `sent` is the text its client
        has (the calls it has came apart).  Replays `head`, so that the calls go on from
        the next index and a call `head` leaves open is completed here.  Raises
        ValueError when `sent` is not the text `head` gave (`seatd.answer.seam`)."""
        got = self.feed(head)
        self.unsent, self.skip = seam(got.text, sent)
        self.replayed, self.failures = self.made, 0

    def _sending(self, out: Split) -> Split:
        text = out.text
        if self.unsent:
            text, self.unsent = self.unsent + text, ""
        if self.skip and text:
            cut = min(self.skip, len(text))
            text, self.skip = text[cut:], self.skip - cut
        return Split(text, out.calls)

    def feed(self, text: str) -> Split:
        """The next piece of committed answer text."""
        if self.repeated:  # the answer ended with its last new call
            return Split("")
        self.state, segments = TextStateMachine.split(self.state, text)
        return self._sending(self._take(segments))

    def close(self, cut: bool = False) -> Split:
        """The answer ended (`cut`: it ran out of tokens): what was held back, and an
        unclosed call (module docstring)."""
        if self.closed or self.repeated:
            self.closed = True
            return Split("")
        self.closed = True
        self.state, rest, where = TextStateMachine.flush(self.state)
        out = self._take([(where, rest)])
        end = Split("")
        if self.inside:
            self.inside = False
            if cut:
                end = self._cut(self.held)
            elif self.family.end_optional:
                end = self._call(self.held, closed=False)
            else:
                self.failures += 1
                self._blanks()
            self.held = ""
        self.gap = ""  # blanks after the last call
        return self._sending(Split(out.text + end.text, out.calls + end.calls))

    def _cut(self, inner: str) -> Split:
        """A call the budget cut: the cut call, or nothing (module docstring)."""
        self._blanks()  # the blanks before it belong to the call's syntax
        got = cut_call(inner, self.names, self.forced)
        if got is None or (not self.parallel and self.made >= 1):
            self.failures += got is None
            self.dropped += got is not None
            return Split("")
        name, arguments = got
        call = ToolCall(self.made, call_id(self.request_id, self.made), name, arguments)
        self.made += 1
        return Split("", (call,))

    def _blanks(self) -> str:
        gap, self.gap, self.after = self.gap, "", False
        return gap

    def _take(self, segments: Sequence[tuple[str | None, str]]) -> Split:
        texts: list[str] = []
        calls: list[ToolCall] = []
        for where, piece in segments:
            if where == "tool":
                if not self.inside:
                    self.inside, self.held = True, ""
                self.held += piece
                continue
            if self.inside:  # the end marker closed the call
                self.inside = False
                got = self._call(self.held, closed=True)
                self.held = ""
                texts.append(got.text)
                calls.extend(got.calls)
            if self.after and not piece.strip():
                self.gap += piece  # blanks after a call: text only if text follows
            else:
                texts.append(self._blanks() + piece)
        return Split("".join(texts), tuple(calls))

    def _call(self, inner: str, closed: bool) -> Split:
        """A call's text between its markers: its calls, or the text it was (with the
        blanks before it, held since the call before)."""
        try:
            found = calls_of(self.family.parse(inner, self.tools), self.names)
        except Exception:  # mlx-lm's parsers raise what they meet (ValueError, ...)
            self.failures += 1
            self._blanks()  # its blanks were the syntax's, as a good call's are
            self.after = True  # and so are those after it, unless text follows
            return Split("")
        self.gap, self.after = "", True
        calls = []
        for name, arguments in found:
            if (name, arguments) in self.made_calls:
                self.repeated = True  # the model goes round in circles: the answer ends
                break
            if not self.parallel and self.made >= 1:
                self.dropped += 1
                continue
            calls.append(ToolCall(self.made, call_id(self.request_id, self.made), name,
                                  arguments))
            self.made_calls.add((name, arguments))
            self.made += 1
        return Split("", tuple(calls))


def tool_finish(finish: str, calls: int) -> str:
    """The answer's finish_reason: "tool_calls" when it made a call and ended by itself
    (end of sequence or a stop), not when it ran out of tokens."""
    return "tool_calls" if calls and finish == "stop" else finish


def splitter_for(family: Family, tools_json: str | None, tool_choice: str | None,
                 request_id: str, parallel: bool) -> ToolSplitter | None:
    """The request's splitter: only when it has tools and tool_choice is not "none"."""
    if not tools_json or tool_choice == "none":
        return None
    tools = json.loads(tools_json)
    if not isinstance(tools, list) or not tools:
        return None
    forced = tool_choice.removeprefix("function:") \
        if tool_choice and tool_choice.startswith("function:") else None
    return ToolSplitter(family, tools, request_id, parallel, forced)
