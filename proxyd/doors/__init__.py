"""The front doors: this package holds one module pair per API (its body's reading,
`*_api.py`; its answer's writing, `*_door.py`) and what they share (`door.py`: the
`Door` protocol, and `DoorRequest`, the base of every body, with its one decoding;
`openai_fields.py`: the fields every door answers about; `openai_tools.py`: tools and
structured output);
this module, the door of each path and each door's error shape.

    door_of(path) -> str | None        "chat", "completions", "messages", "responses"
    error_body(door, exc) -> (body, type)

Every door is an adapter over the same ladder (proxyd/front.py); what differs is how
a body is read (proxyd/doors/openai_api.py, anthropic_api.py, openai_responses_api.py) and
how events and errors are written (proxyd/doors/openai_door.py, anthropic_door.py,
openai_responses_door.py).  A refusal is rendered in the shape of the door it came
to, whether the handler raised it or the middleware did (a key refused, a body too
large, a method not allowed): the Anthropic door's clients parse
`{"type": "error", "error": {"type", "message"}}`, the OpenAI doors'
`{"error": {"message", "type", "code", "param"}}`.  The `type` returned beside the
body is the label of `door_errors{door, type}`.
"""

from __future__ import annotations

from typing import Any

from proxyd.doors import anthropic_door
from shared.errors import SanctumError

PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "messages",
    "/v1/responses": "responses",
}


def door_of(path: str) -> str | None:
    return PATHS.get(path)


def error_body(door: str | None, exc: SanctumError) -> tuple[dict[str, Any], str]:
    """The error's body in the door's shape, and its type there."""
    if door == "messages":
        body = anthropic_door.error_body(exc)
        return body, str(body["error"]["type"])
    return exc.body(), exc.type
