"""A burst of queued chunks becomes one write downstream, and loses nothing on the way."""

from __future__ import annotations

from collections import deque

from proxyd.seat_client import merged
from shared.protocol import Chunk, Final, Ok, SeatFrame, TokenLogprob, ToolCall


def test_merged_chunks_keep_every_tool_call_and_log_probability() -> None:
    call = [ToolCall(i, f"call_{i}", "f", "{}") for i in range(2)]
    lp = [TokenLogprob(t, -0.5) for t in "abc"]
    first = Chunk("r", "a", 1, ids=(5,), logprobs=(lp[0],), prompt_tokens=9, cached_tokens=4)
    frames: deque[SeatFrame] = deque([
        Chunk("r", "", 2, ids=(6,), tool_calls=(call[0],), logprobs=(lp[1],)),
        Chunk("r", "c", 3, ids=(7,), tool_calls=(call[1],), logprobs=(lp[2],),
              speculation="accelerated"),
        Final("r", Ok(), "s", 1, 1)])
    out = merged(first, frames)
    assert (out.text, out.completion_tokens, out.ids) == ("ac", 3, (5, 6, 7))
    assert out.tool_calls == tuple(call)
    assert out.logprobs == tuple(lp)
    assert out.speculation == "accelerated"
    assert (out.prompt_tokens, out.cached_tokens) == (9, 4)  # the answer's first chunk's
    assert len(frames) == 1 and isinstance(frames[0], Final)  # the Final stays queued
