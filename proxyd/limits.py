"""Input limits of the HTTP doors: pure checks of plain values against the config.

A door decodes its body, then hands plain values here: the body's byte count, the
number of messages, each text's length, the max_tokens asked, the stop list, the
number of tools, a schema's encoded bytes, a logit_bias's entries.  Nothing here knows
an API's shape, so every door (chat and completions today, others later) refuses the
same things with the same words.  A check returns nothing, or raises one of:

    OverSize   (PayloadTooLarge, 413 payload_too_large)  the body, or one text
    OverLimit  (BadRequest, 400 invalid_request)         a count, a number, a schema,
                                                         the body's nesting

Each names the field as `param` (`body`, `messages[3].content`, `max_tokens`,
`stop[2]`, `tools[0].function.parameters`, `logit_bias`) and carries `limit` and `actual` (`actual`
is None where it is unknown: a chunked or compressed body is refused as soon as it is
past the limit, before its end).  The door counts each as `input_refused{field}`, the
field with its indexes dropped (`field_name`).  They are subclasses only so that the
door can tell a limit from other bad input; their status and code are the tree's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from shared.config import ProxyConfig
from shared.errors import BadRequest, PayloadTooLarge, SanctumError
from shared.protocol import MAX_LOGIT_BIAS


class OverLimit(BadRequest):
    """400: a count or a number past its configured limit."""


# Arrays and objects in a body nest at most this deep.  A JSON decoder's own limit is
# Python's recursion limit, which differs between versions (3.12 counts C recursion
# apart: a field 2,000 levels deep decoded there and raised on 3.11), so a door checks
# the depth itself before decoding, and every Python refuses the same bodies alike.
MAX_JSON_DEPTH = 128
_OPENS = frozenset(b"[{")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes) -> int:
    """How deep a JSON text's arrays and objects nest (0: none); brackets inside
    strings do not count.  C-speed passes over the body, then one over its brackets
    outside strings.  A text that is not JSON gets some number: its decoder refuses it.
    Pure."""
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")  # escapes: no quote ends there
    outside = b"".join(text.split(b'"')[::2])  # every other piece between quotes
    brackets = outside.translate(None, _NOT_BRACKETS)
    if len(brackets) <= 1:
        return len(brackets)
    depth = deepest = 0
    for b in brackets:
        depth += 1 if b in _OPENS else -1
        deepest = max(deepest, depth)
    return deepest


def check_depth(body: bytes) -> None:
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise OverLimit(f"the request body nests {depth} levels deep; the limit is "
                        f"{MAX_JSON_DEPTH}", param="body", limit=MAX_JSON_DEPTH,
                        actual=depth)


class OverSize(PayloadTooLarge):
    """413: the body, or one text of it, past its configured limit."""


_INDEX = re.compile(r"\[\d+\]")


def field_name(param: str) -> str:
    """`messages[3].content` -> `messages.content`: a counter label of bounded variety."""
    return _INDEX.sub("", param)


def refused_field(exc: SanctumError) -> str | None:
    """The counter label of a limit refusal; None for any other error."""
    if isinstance(exc, OverLimit | OverSize) and exc.param:
        return field_name(exc.param)
    return None


def body_too_large(limits: ProxyConfig) -> OverSize:
    """The refusal of a body found past the limit as it was read, its full size unknown."""
    limit = limits.max_body_bytes
    return OverSize(f"the request body is larger than the limit of {limit} bytes",
                    param="body", limit=limit, actual=None)


def check_body(nbytes: int | None, limits: ProxyConfig) -> None:
    """The body's declared size (Content-Length); None: not declared, so it is held
    to the limit as it is read."""
    limit = limits.max_body_bytes
    if nbytes is not None and nbytes > limit:
        raise OverSize(f"the request body has {nbytes} bytes; the limit is {limit}",
                       param="body", limit=limit, actual=nbytes)


def check_messages(field: str, count: int, limits: ProxyConfig) -> None:
    limit = limits.max_messages
    if count > limit:
        raise OverLimit(f"{field} holds {count} messages; the limit is {limit}",
                        param=field, limit=limit, actual=count)


def check_text(field: str, chars: int, limits: ProxyConfig) -> None:
    """One message's text (a tool result's too), one tool call's arguments in an
    assistant turn, or one prompt, in characters."""
    limit = limits.max_content_chars
    if chars > limit:
        raise OverSize(f"{field} has {chars} characters; the limit is {limit}",
                       param=field, limit=limit, actual=chars)


def check_max_tokens(field: str, value: int, limits: ProxyConfig) -> None:
    limit = limits.max_completion_tokens
    if value > limit:
        raise OverLimit(f"{field} is {value}; the largest allowed is {limit}",
                        param=field, limit=limit, actual=value)


def check_stops(field: str, stops: Sequence[str], limits: ProxyConfig, *,
                listed: bool = True) -> None:
    """The stop list: how many, and each one's length; an empty one is bad input
    (a plain 400, not a limit: it would stop every answer before its first token).
    `listed` False: the client sent one string, named by `field` alone."""
    if len(stops) > limits.max_stop:
        raise OverLimit(f"{field} holds {len(stops)} stop sequences; the limit is "
                        f"{limits.max_stop}", param=field, limit=limits.max_stop,
                        actual=len(stops))
    for i, stop in enumerate(stops):
        name = f"{field}[{i}]" if listed else field
        if not stop:
            raise BadRequest("a stop sequence must not be empty", param=name)
        if len(stop) > limits.max_stop_chars:
            raise OverLimit(f"{name} has {len(stop)} characters; the limit is "
                            f"{limits.max_stop_chars}", param=name,
                            limit=limits.max_stop_chars, actual=len(stop))


def check_tools(field: str, count: int, limits: ProxyConfig) -> None:
    limit = limits.max_tools
    if count > limit:
        raise OverLimit(f"{field} holds {count} tools; the limit is {limit}",
                        param=field, limit=limit, actual=count)


def check_logit_bias(field: str, count: int, limit: int = MAX_LOGIT_BIAS) -> None:
    """How many tokens a logit_bias names: the seat's bound (the protocol's), not a
    config key (OpenAI's own limit, 300, is lower)."""
    if count > limit:
        raise OverLimit(f"{field} names {count} tokens; the limit is {limit}",
                        param=field, limit=limit, actual=count)


def check_schema(field: str, nbytes: int, limits: ProxyConfig) -> None:
    """One tool's parameters, or a response schema, as compact JSON bytes."""
    limit = limits.max_schema_bytes
    if nbytes > limit:
        raise OverLimit(f"{field} has {nbytes} bytes of JSON; the limit is {limit}",
                        param=field, limit=limit, actual=nbytes)


def encoded_bytes(field: str, value: Any) -> int:
    """A decoded JSON value's size as compact JSON: what `check_schema` measures."""
    try:
        return len(msgspec.json.encode(value))
    except RecursionError:
        raise BadRequest(f"{field} is nested too deeply", param=field) from None
