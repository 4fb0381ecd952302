"""What every front door shares: the `Door` the front renders through, and the base of
every door's request body (`DoorRequest`) with its one way of being read
(`decode_body`).

    decode_body(body, Kind) -> (Kind, ignored)   the body, and its unknown top-level
                                                 fields (sanitised, sorted)
    validation_param(message) -> str             the field a msgspec error names

Each API's bodies (`openai_api.ChatRequest`, `CompletionRequest`,
`anthropic_api.MessagesRequest`, `CountTokensRequest`,
`openai_responses_api.ResponsesRequest`) derive from `DoorRequest`: lenient, as the
APIs are (an unknown top-level field is ignored, and named in X-Sanctum-Ignored).
Finding the unknown fields costs nothing for a body that has none: it is decoded first
into the same Struct forbidding unknown fields (its strict twin, made once per kind),
and only a body that fails that is decoded again leniently (the error it gets is then
the lenient decode's) and its keys read once more.

A known field with a wrong type or an out-of-range value is a 400 that names the field
(msgspec's path `$.messages[0].role` becomes `param` "messages[0].role"; a body that is
not one JSON object is `param` "body").  A body nested past `limits.MAX_JSON_DEPTH` is
refused before decoding.
"""

from __future__ import annotations

import re
import types
from functools import cache
from typing import Annotated, Any, ClassVar, Literal, Protocol, TypeVar, cast

import msgspec

from proxyd import limits as lim
from proxyd.doors.openai_fields import ignored_fields, sanitise
from proxyd.doors.unknown_fields import unknown_paths
from proxyd.events import Answer, Done, Text
from shared.errors import BadRequest
from shared.protocol import Usage


class Door(Protocol):
    """What the plumbing (proxyd/front.py) needs from a front door."""

    stream: bool
    name: str  # the door's label in the counters: "chat", "completions", ...

    def opening(self, a: Answer) -> bytes: ...
    def text(self, a: Answer, piece: Text) -> bytes: ...
    def closing(self, a: Answer, finish: str | None, usage: Usage) -> bytes: ...
    def body(self, done: Done) -> bytes: ...
    def error_event(self, message: str, code: str, extra: dict[str, Any]) -> bytes: ...
    def trailer(self, a: Answer) -> bytes: ...
    def keepalive(self) -> bytes: ...


class SanctumOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-request overrides of the seat's settings, under the body's `sanctum` key
    (every door takes it)."""

    kv: Literal["fp16", "q8"] | None = None
    speculation: bool | None = None
    # false: neither reuse nor leave a cached prompt prefix on the seat
    prompt_cache: bool | None = None
    # pins the draft length of this request (0 = plain), for measuring speculation
    draft_depth: Annotated[int, msgspec.Meta(ge=0, le=16)] | None = None
    # true: decode as a row of its own, never in a forward with other requests, so a
    # seeded answer's bytes cannot depend on its neighbours (it costs batching's gain)
    solo: bool | None = None
    # an on-demand seat's idle seconds before it sleeps after this request (as Ollama's
    # keep_alive): 0 = at once, -1 = never; unset = the seat's keep_alive_s
    keep_alive: Annotated[float, msgspec.Meta(ge=-1)] | None = None

    def generate_fields(self) -> dict[str, Any]:
        """These overrides as Generate fields."""
        return {"kv": self.kv, "speculation": self.speculation,
                "prompt_cache": self.prompt_cache, "draft_depth": self.draft_depth,
                "solo": self.solo, "keep_alive_s": self.keep_alive}


class DoorRequest(msgspec.Struct, frozen=True):
    """The base of every door's request body: the model (a route) it asks for.
    `nested_named`: the keys unknown inside the body are named too, with their paths
    (`proxyd.doors.unknown_fields`), not only those at its top level."""

    nested_named: ClassVar[bool] = False
    model: str

    @classmethod
    def opaque(cls, path: str, value: dict[str, Any]) -> bool:
        """An object inside the body this door passes over whole (its keys are not
        walked: `proxyd.doors.unknown_fields`)."""
        return False


R = TypeVar("R", bound=DoorRequest)


@cache
def strict_twin(kind: type[DoorRequest]) -> type[DoorRequest]:
    """`kind` forbidding unknown top-level fields (decoded first: see the docstring)."""
    return cast(type[DoorRequest], types.new_class(
        f"Strict{kind.__name__}", (kind,),
        {"frozen": True, "forbid_unknown_fields": True}))


def decode_body(body: bytes, kind: type[R]) -> tuple[R, tuple[str, ...]]:
    """The body as `kind`, and the unknown top-level fields it had (sanitised)."""
    if not body:
        raise BadRequest("the request body is empty; expected a JSON object", param="body")
    lim.check_depth(body)
    try:
        try:
            req = cast(R, msgspec.json.decode(body, type=strict_twin(kind)))
            top: tuple[str, ...] = ()
        except msgspec.ValidationError:
            req = msgspec.json.decode(body, type=kind)
            top = ignored_fields(body, kind)
        inside = unknown_paths(msgspec.json.decode(body), kind, kind.opaque) \
            if kind.nested_named else ()
        if inside:
            return req, tuple(sorted({*top, *(sanitise(p) for p in inside)}))
        return req, top
    except msgspec.ValidationError as exc:
        text = str(exc)
        raise BadRequest(f"invalid request: {text}", param=validation_param(text)) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}", param="body") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply", param="body") from None


_AT = re.compile(r" - at `\$\.?([^`]*)`$")
# A field named in the message itself: one that is missing, or unknown where unknown
# fields are refused (`sanctum`).
_NAMED = re.compile(r"^Object (?:missing required|contains unknown) field `([^`]*)`")


def validation_param(message: str) -> str:
    """The field a msgspec ValidationError names, as `param`: "messages[0].role" for
    "... - at `$.messages[0].role`", "model" for a missing top-level `model`, "body"
    for the body itself (not an object); a map's value (`$.logit_bias[...]`) is named
    by the map."""
    at = _AT.search(message)
    path = at.group(1).replace("[...]", "") if at else ""
    named = _NAMED.match(message)
    if named:
        path = f"{path}.{named.group(1)}" if path else named.group(1)
    return path or "body"
