"""Which door a path is, and each door's error shape (proxyd/doors/__init__.py, proxyd/app.py)."""

from __future__ import annotations

import json

import pytest

from proxyd.app import error_response
from proxyd.doors import door_of, error_body
from shared.errors import BadRequest, NoPrivateSeat, PromptTooLong, SanctumError


@pytest.mark.parametrize(("path", "door"), [
    ("/v1/chat/completions", "chat"),
    ("/v1/completions", "completions"),
    ("/v1/messages", "messages"),
    ("/v1/messages/count_tokens", "messages"),
    ("/v1/responses", "responses"),
    ("/v1/models", None),
    ("/v1/messages/batches", None),
    ("/health", None),
])
def test_door_of(path: str, door: str | None) -> None:
    assert door_of(path) == door


@pytest.mark.parametrize(("exc", "openai_type", "anthropic_type"), [
    (BadRequest("bad", param="top_k"), "invalid_request_error", "invalid_request_error"),
    (PromptTooLong("long", prompt_tokens=9, cap=8), "invalid_request_error",
     "request_too_large"),
    (NoPrivateSeat("down"), "server_error", "overloaded_error"),
])
def test_error_shape_by_door(exc: SanctumError, openai_type: str, anthropic_type: str) -> None:
    """OpenAI's shape at the OpenAI doors (and anywhere else), Anthropic's at its door;
    the type returned is the one the door's counter is labelled with."""
    for door in ("chat", "completions", "responses", None):
        body, kind = error_body(door, exc)
        assert body == exc.body() and kind == openai_type
        assert set(body) == {"error"} and body["error"]["code"] == exc.code
    body, kind = error_body("messages", exc)
    assert body["type"] == "error" and body["error"]["type"] == kind == anthropic_type
    assert body["error"]["code"] == exc.code


def test_an_error_no_retry_changes_says_so() -> None:
    """`should_retry = False` is the header the openai and anthropic SDKs obey."""
    exc = SanctumError("cannot count here", code="no_tokenizer", status=501)
    assert "x-should-retry" not in error_response(exc).headers
    exc.should_retry = False
    response = error_response(exc, rid="r1")
    assert response.status == 501 and response.headers["x-should-retry"] == "false"
    assert response.body is not None
    assert json.loads(bytes(response.body))["error"]["code"] == "no_tokenizer"
