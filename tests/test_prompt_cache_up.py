"""The prompt cache end to end through `sanctum up`: the second turn of a chat reports
the reused prefix in usage.prompt_tokens_details.cached_tokens, the seat's own
counters agree, and `sanctum.prompt_cache: false` opts a request out."""

from __future__ import annotations

import json

import pytest

from tests.procs import http, running
from tests.spec_models import HELDOUT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("chars", "reused"), [(2400, 512), (900, 0)])
def test_second_turn_reports_cached_tokens(chars: int, reused: int) -> None:
    """Turn 2 resumes from turn 1's prefix: cached_tokens > 0, counted by the seat; a
    chat far under one prefill chunk (about 300 tokens) too, at the turn boundary where
    its first prompt opened the answer; the answer is the one an opted-out request
    gets."""
    text = "\n\n".join(p.read_text() for p in sorted(HELDOUT.glob("*.py")))[:chars]
    with running() as s:
        messages = [{"role": "user", "content": text}]
        body = {"model": "demo", "messages": messages, "max_tokens": 8, "temperature": 0}
        status, _, raw = http("POST", f"{s.url}/v1/chat/completions", body)
        assert status == 200, raw
        first = json.loads(raw)
        prompt = first["usage"]["prompt_tokens"]
        assert prompt > 513 if reused else 200 < prompt < 400
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Now add type hints."}]
        status, _, raw = http("POST", f"{s.url}/v1/chat/completions", {**body,
                              "messages": messages})
        assert status == 200, raw
        second = json.loads(raw)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        # at least the grid; off it, all of the first prompt but its answer's opening
        assert cached >= 512 if reused else prompt - 4 <= cached < prompt
        # A request may opt out: no lookup, nothing reused, the same answer.
        status, _, raw = http("POST", f"{s.url}/v1/chat/completions", {
            **body, "messages": messages, "sanctum": {"prompt_cache": False}})
        assert status == 200, raw
        out = json.loads(raw)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert out["choices"][0]["message"] == second["choices"][0]["message"]
        status, _, raw = http("GET", f"{s.url}/counters")
        seat = json.loads(raw)["seats"]["demo"]
        assert seat["prompt_cache_lookups"] == 2 and seat["prompt_cache_hits"] == 1
        assert seat["prompt_cache_reused_tokens"] == cached
        assert seat["prompt_cache_entries"] >= 1 and seat["prompt_cache_bytes"] > 0
