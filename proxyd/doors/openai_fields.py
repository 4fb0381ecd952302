"""Every top-level field of OpenAI's chat and completions bodies, and what the doors do
with it; the fields unknown to the API, found and named.

    FIELDS[name] -> Field(doors, action, reason, allowed)
    refuse_unsupported(req)          a 400 naming a refused field that asks for something
    ignored_fields(body, kind)       the body's unknown top-level fields, sanitised, sorted
    ignored_header(names)            their X-Sanctum-Ignored value, bounded

Actions: `honoured` (mapped onto the `Generate` a rung gets, proxyd/doors/openai_api.py),
`accepted` (it asks for nothing this product must do, so no action is needed),
`refused` (a 400 naming it, unless its value asks for nothing: null, or a value in
`Field.allowed`, compared with its type so that `true` is not 1).  A top-level field
not here is unknown to the OpenAI API: ignored for compatibility (clients written for
other servers send such fields), listed in `X-Sanctum-Ignored` and counted as
`ignored_fields{field}` (proxyd/app.py).  Fields inside a field (a message's, a tool's)
that the API does not know are ignored without a word, as OpenAI's own types gain
fields over time.  A test holds the request Structs and this table to the same names.

Names are sanitised to `[A-Za-z0-9_.-]` and 64 characters (a JSON key is any string;
a header and a counter label are not); the header lists at most 16, then "+N".
"""

from __future__ import annotations

import functools
import re
from typing import Any, Literal, NamedTuple

import msgspec

from shared.errors import BadRequest

# A field kept as raw JSON (accepted or refused ones): absent is this empty value.
ABSENT = msgspec.Raw(b"")


class Field(NamedTuple):
    doors: Literal["chat", "completions", "both"]
    action: Literal["honoured", "accepted", "refused"]
    reason: str
    # refused: the values that ask for nothing, so that a client sending a default
    # still gets its answer (null and absent always do)
    allowed: tuple[Any, ...] = ()


_EXT = "not OpenAI's: the extension vLLM and llama.cpp take, which clients send"
_NOT_STORED = "nothing is stored here (store is refused), so nothing reads it"
_CACHE = ("a hint to OpenAI's prompt cache; the seats' prompt cache matches prefixes "
          "by itself, and the answer is the same")

FIELDS: dict[str, Field] = {
    # -- honoured: they reach the rung as Generate / SamplingParams fields
    "model": Field("both", "honoured", "the route, whose ladder answers"),
    "messages": Field("chat", "honoured", "the chat, rendered by the seat's template"),
    "prompt": Field("completions", "honoured", "one prompt per request"),
    "stream": Field("both", "honoured", "server-sent events"),
    "stream_options": Field("both", "honoured", "include_usage: a usage chunk"),
    "temperature": Field("both", "honoured", "sampling"),
    "top_p": Field("both", "honoured", "sampling"),
    "top_k": Field("both", "honoured", _EXT),
    "min_p": Field("both", "honoured", _EXT),
    "repetition_penalty": Field("both", "honoured", _EXT),
    "presence_penalty": Field("both", "honoured", "logit shaping, in every decode path"),
    "frequency_penalty": Field("both", "honoured", "logit shaping, in every decode path"),
    "logit_bias": Field("both", "honoured", "token ids of the route's local model"),
    "max_tokens": Field("both", "honoured", "the answer's budget"),
    "max_completion_tokens": Field("both", "honoured", "the answer's budget"),
    "stop": Field("both", "honoured", "stop sequences"),
    "seed": Field("both", "honoured", "keyed randomness: a seeded answer is reproducible"),
    "logprobs": Field("both", "honoured", "from the target's distribution"),
    "top_logprobs": Field("chat", "honoured", "from the target's distribution"),
    "tools": Field("chat", "honoured", "rendered by the template, calls parsed"),
    "tool_choice": Field("chat", "honoured", "required and named: constrained decoding"),
    "parallel_tool_calls": Field("chat", "honoured", "false: the first call only"),
    "response_format": Field("chat", "honoured", "constrained decoding"),
    "echo": Field("completions", "honoured", "the answer starts with the prompt"),
    "sanctum": Field("both", "honoured", "Sanctum's own per-request overrides"),
    # -- accepted: they ask for nothing this product must do
    "user": Field("both", "accepted", "an end-user id for OpenAI's abuse monitoring; "
                  "nothing here reads it"),
    "safety_identifier": Field("chat", "accepted", "user's successor: nothing reads it"),
    "metadata": Field("chat", "accepted", "tags of a stored completion; " + _NOT_STORED),
    "service_tier": Field("chat", "accepted", "OpenAI's processing tiers; there is one "
                          "here, and the answer does not depend on it"),
    "prompt_cache_key": Field("chat", "accepted", _CACHE),
    "prompt_cache_retention": Field("chat", "accepted", _CACHE),
    "prompt_cache_options": Field("chat", "accepted", _CACHE),
    "prediction": Field("chat", "accepted", "a predicted output only speeds an answer "
                        "up: the answer is the same without it (DESIGN.md rule 1: a "
                        "fast path may decline)"),
    # -- refused unless they ask for nothing
    "n": Field("both", "refused", "one answer per request", (1,)),
    "best_of": Field("completions", "refused", "one answer per request", (1,)),
    "suffix": Field("completions", "refused", "insertion (text after the completion) "
                    "is not implemented", ("",)),
    "audio": Field("chat", "refused", "audio output is not implemented: seats answer "
                   "in text"),
    "modalities": Field("chat", "refused", "seats answer in text only", (["text"],)),
    "web_search_options": Field("chat", "refused", "there is no web search here"),
    "functions": Field("chat", "refused", "deprecated by OpenAI: send `tools`"),
    "function_call": Field("chat", "refused", "deprecated by OpenAI: send `tool_choice`"),
    "store": Field("chat", "refused", "nothing is stored here: there is no "
                   "stored-completions API", (False,)),
    "reasoning_effort": Field("chat", "refused", "the seats' models have no reasoning "
                              "effort to set"),
    "verbosity": Field("chat", "refused", "the seats' models have no verbosity to set "
                       "(medium, OpenAI's default, asks for nothing)", ("medium",)),
    "moderation": Field("chat", "refused", "no moderation runs here"),
}


def door_fields(door: Literal["chat", "completions"]) -> dict[str, Field]:
    return {k: f for k, f in FIELDS.items() if f.doors in (door, "both")}


MAX_IGNORED_LISTED = 16  # names in X-Sanctum-Ignored; past them: "+N"
MAX_IGNORED_CHARS = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\[\]-]")  # a path's brackets too
_raw_map = msgspec.json.Decoder(dict[str, msgspec.Raw])


def sanitise(name: str) -> str:
    """A field's name as a header and a counter label may carry it."""
    return _UNSAFE.sub("_", name[:MAX_IGNORED_CHARS]) or "_"


def ignored_fields(body: bytes, kind: type[msgspec.Struct]) -> tuple[str, ...]:
    """The body's top-level fields unknown to its API, sanitised and sorted; () for a
    body that is not a JSON object (its error says so)."""
    try:
        keys = _raw_map.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return ()
    known = _known(kind)
    return tuple(sorted({sanitise(k) for k in keys if k not in known}))


@functools.cache
def _known(kind: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(kind.__struct_fields__)


def ignored_header(names: tuple[str, ...]) -> str:
    """X-Sanctum-Ignored: at most MAX_IGNORED_LISTED names, then how many more."""
    shown = list(names[:MAX_IGNORED_LISTED])
    if len(names) > MAX_IGNORED_LISTED:
        shown.append(f"+{len(names) - MAX_IGNORED_LISTED}")
    return ", ".join(shown)


Refusable = tuple[tuple[str, str, tuple[Any, ...]], ...]  # (field, reason, allowed)


@functools.cache
def _refusable(kind: type[msgspec.Struct]) -> Refusable:
    return tuple((name, FIELDS[name].reason, FIELDS[name].allowed)
                 for name in kind.__struct_fields__
                 if name in FIELDS and FIELDS[name].action == "refused")


def refuse_asked(req: msgspec.Struct, refusable: Refusable) -> None:
    """A 400 for the first refused field that `req` sets to a value that asks for
    something: not null, not one of its `allowed` values (compared with their types:
    `true` is not 1).  Every door's table of fields refuses through this."""
    for name, reason, allowed in refusable:
        raw = getattr(req, name)
        if not raw:
            continue
        value = msgspec.json.decode(raw)
        if value is None or any(type(value) is type(ok) and value == ok for ok in allowed):
            continue
        hint = f"; send {msgspec.json.encode(allowed[0]).decode()} or null" \
            if allowed else ""
        raise BadRequest(f"{name} is not supported ({reason}){hint}", param=name)


def refuse_unsupported(req: msgspec.Struct) -> None:
    """`refuse_asked` by this table, for the chat and completions bodies."""
    refuse_asked(req, _refusable(type(req)))
