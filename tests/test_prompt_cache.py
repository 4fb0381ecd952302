"""When the seat's prompt cache is on: config, kill switch, and the request's own say."""

from __future__ import annotations

import pytest

from seatd.prompt_cache import SeatPromptCache
from shared.config import SeatConfig
from shared.protocol import Generate, SamplingParams


@pytest.mark.parametrize("mb, env, per_request, on", [
    (512, None, None, True),
    (512, "on", True, True),
    (0, None, None, False),            # prompt_cache_mb = 0
    (512, "off", None, False),         # SANCTUM_PROMPT_CACHE=off (the launchd plists' switch)
    (512, "0", None, False),
    (512, None, False, False),         # "sanctum": {"prompt_cache": false}
])
def test_enabled(monkeypatch, mb: int, env: str | None, per_request: bool | None,
                 on: bool) -> None:
    """Off by config, by the kill switch, or by the request; on otherwise."""
    if env is None:
        monkeypatch.delenv("SANCTUM_PROMPT_CACHE", raising=False)
    else:
        monkeypatch.setenv("SANCTUM_PROMPT_CACHE", env)
    cache = SeatPromptCache(SeatConfig(name="s", model="m", prompt_cache_mb=mb), model=None)
    request = Generate("r", False, SamplingParams(), prompt_cache=per_request)
    assert cache.enabled(request) is on
    if not on:
        plan = cache.begin(request, "fp16", list(range(2000)), 8)
        assert plan.resume is None and cache.policy.tally.lookups == 0
