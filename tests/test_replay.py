"""A rung asked afresh for a begun answer: what of its chunks extends the text the client
has (`proxyd.replay`), chunk by chunk, with its tokens and log-probabilities."""

from __future__ import annotations

import pytest

from proxyd.replay import DIVERGED, Replay
from shared.protocol import Chunk, TokenLogprob


def chunk(text: str, tokens: int, lps: tuple[str, ...] = ()) -> Chunk:
    return Chunk("r", text, tokens, logprobs=tuple(TokenLogprob(t, -0.5) for t in lps))


@pytest.mark.parametrize(("sent", "pieces", "want"), [
    # held while it replays, then only the rest goes on
    ("ab cd ", ["ab ", "cd ", "ef "], [None, None, "ef "]),
    # a chunk across the seam: its part past the seam
    ("ab cd ", ["ab c", "d ef", " gh"], [None, "ef", " gh"]),
    # one chunk holding all that was sent and more
    ("ab ", ["ab cd "], ["cd "]),
    # it says something else than was sent: diverged, at once
    ("ab cd ", ["ab ", "ce "], [None, DIVERGED]),
    ("ab cd ", ["xy"], [DIVERGED]),
    # it says exactly what was sent, then ends: nothing goes on
    ("ab ", ["a", "b "], [None, None]),
])
def test_only_what_extends_the_sent_text_goes_on(sent: str, pieces: list[str],
                                                 want: list[object]) -> None:
    replay = Replay(sent)
    got: list[object] = []
    for n, piece in enumerate(pieces, 1):
        taken = replay.take(chunk(piece, n))
        got.append(taken.text if isinstance(taken, Chunk) else taken)
    assert got == want


def test_its_tokens_count_only_what_it_added() -> None:
    """The rung's count of tokens sent leaves out what replayed the sent text: whole
    chunks it held, and the share of the chunk across the seam."""
    replay = Replay("w0 w1 ")
    assert replay.take(chunk("w0 ", 1)) is None
    across = replay.take(chunk("w1 w2 w3 ", 4))  # 3 tokens in 9 characters, 1 replayed
    assert isinstance(across, Chunk) and across.text == "w2 w3 "
    assert across.completion_tokens == 2
    after = replay.take(chunk("w4 ", 5))
    assert isinstance(after, Chunk) and (after.text, after.completion_tokens) == ("w4 ", 3)


def test_log_probabilities_of_replayed_tokens_are_dropped() -> None:
    replay = Replay("ab")
    taken = replay.take(chunk("abcd", 3, ("a", "bc", "d")))  # "bc" straddles the seam
    assert isinstance(taken, Chunk) and taken.text == "cd"
    assert [lp.token for lp in taken.logprobs] == ["d"]
    assert taken.completion_tokens == 1
