"""The prompt cache end to end through `sanctum up`: the second turn of a chat reports
the reused prefix in usage.prompt_tokens_details.cached_tokens, the seat's own
counters agree, and `sanctum.prompt_cache: false` opts a request out."""

from __future__ import annotations

import json

import pytest

from tests.procs import http, running
from tests.spec_models import HELDOUT

pytestmark = pytest.mark.slow


def test_second_turn_reports_cached_tokens() -> None:
    """Turn 2 resumes from turn 1's prefix: cached_tokens > 0, counted by the seat."""
    text = "\n\n".join(p.read_text() for p in sorted(HELDOUT.glob("*.py")))[:2400]
    with running() as s:
        messages = [{"role": "user", "content": text}]
        body = {"model": "demo", "messages": messages, "max_tokens": 8, "temperature": 0}
        status, _, raw = http("POST", f"{s.url}/v1/chat/completions", body)
        assert status == 200, raw
        first = json.loads(raw)
        assert first["usage"]["prompt_tokens"] > 513
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Now add type hints."}]
        status, _, raw = http("POST", f"{s.url}/v1/chat/completions", {**body,
                              "messages": messages})
        assert status == 200, raw
        second = json.loads(raw)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 512
        # A request may opt out: no lookup, nothing reused.
        status, _, raw = http("POST", f"{s.url}/v1/chat/completions", {
            **body, "messages": messages, "sanctum": {"prompt_cache": False}})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        status, _, raw = http("GET", f"{s.url}/counters")
        seat = json.loads(raw)["seats"]["demo"]
        assert seat["prompt_cache_lookups"] == 2 and seat["prompt_cache_hits"] == 1
        assert seat["prompt_cache_reused_tokens"] >= 512
        assert seat["prompt_cache_entries"] >= 1 and seat["prompt_cache_bytes"] > 0
