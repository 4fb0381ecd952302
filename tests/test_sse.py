"""Reading an upstream's SSE stream: events, pieces, and what counts as malformed."""

import pytest

from proxyd.sse import Decoder, Event, Malformed, Piece, piece
from shared.protocol import Usage


def events(lines: list[str]) -> list[Event]:
    d = Decoder()
    out = [e for line in lines if (e := d.line(line)) is not None]
    last = d.end()
    return out + ([last] if last else [])


def test_decoder_joins_data_lines_and_splits_on_blank_lines() -> None:
    """Multi-line data joins with newlines; comments and unknown fields are ignored."""
    got = events([": keep-alive\n", "data: a\n", "data: b\n", "\n", "id: 3\n",
                  "event: error\n", "data:{}\r\n", "\r\n", "data: [DONE]\n"])
    assert got == [Event("a\nb"), Event("{}", "error"), Event("[DONE]")]


def test_decoder_has_nothing_for_blank_lines_alone() -> None:
    """Blank lines without data dispatch nothing."""
    assert events(["\n", "\n"]) == []


@pytest.mark.parametrize(
    ("data", "chat", "want"),
    [
        ("[DONE]", True, Piece(done=True)),
        ('{"model":"m","choices":[{"index":0,"delta":{"content":"hi"}}]}', True,
         Piece("hi", model="m")),
        ('{"choices":[{"index":0,"delta":{"role":"assistant"}}]}', True, Piece()),
        ('{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}', True,
         Piece(finish_reason="stop")),
        ('{"choices":[{"index":0,"text":"x","finish_reason":"length"}]}', False,
         Piece("x", "length")),
        ('{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,'
         '"prompt_tokens_details":{"cached_tokens":2}}}', True, Piece(usage=Usage(7, 3, 2))),
        ('{"choices":[{"index":0,"message":{"content":"whole"},"finish_reason":"stop"}],'
         '"usage":{"prompt_tokens":1,"completion_tokens":1}}', True,
         Piece("whole", "stop", Usage(1, 1))),
        ('{"error":{"message":"overloaded","code":"x"}}', True,
         Piece(error={"message": "overloaded", "code": "x"})),
        # Python's json.dumps writes a masked token's logprob as -Infinity: still read
        ('{"choices":[{"index":0,"delta":{"content":"a"},"logprobs":{"content":'
         '[{"token":"a","logprob":-Infinity,"top_logprobs":[]}]}}]}', True, Piece("a")),
    ],
)
def test_piece(data: str, chat: bool, want: Piece) -> None:
    """Text, finish reasons, usage, errors and the end are read from an event."""
    assert piece(Event(data), chat) == want


def test_error_event_name_is_an_error() -> None:
    """`event: error` is an upstream error whatever its data says."""
    assert piece(Event('{"message":"boom"}', "error"), True).error == {"message": "boom"}


@pytest.mark.parametrize(
    "data",
    [
        '{"choices": [ {oops',
        "not json at all",
        "[1, 2]",
        '{"choices": "nope"}',
        '{"choices": [1]}',
        '{"choices": [{"delta": "x"}]}',
        '{"choices": [{"delta": {"content": 5}}]}',
        '{"choices": [], "usage": {"prompt_tokens": "many"}}',
        '{"choices": [], "usage": [1]}',
    ],
)
def test_malformed_events_raise(data: str) -> None:
    """An event that is not a valid chunk is Malformed, never skipped."""
    with pytest.raises(Malformed):
        piece(Event(data), True)
