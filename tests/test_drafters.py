"""The lookup drafter: what it proposes from the context, and how it settles."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seatd.drafters import LookupDrafter
from seatd.sampling import Chained
from shared.protocol import SamplingParams

P = SamplingParams(temperature=0.0)


@pytest.mark.parametrize(
    ("context", "k", "proposal"),
    [
        ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),  # trigram match
        ([5, 6, 7, 5, 6], 3, [7, 5, 6]),  # bigram; continuation may run into the tail
        ([4, 8, 4], 4, [8, 4]),  # unigram, clipped at the end
        ([1, 2, 3], 2, []),  # nothing repeats
        ([7, 1, 2, 7, 3, 2, 7], 1, [3]),  # the latest earlier match wins
    ],
)
def test_lookup_proposals(context: list[int], k: int, proposal: list[int]) -> None:
    """It copies what followed the latest earlier occurrence of the longest tail n-gram."""
    d = LookupDrafter()
    d.start(context)
    assert d.find(k) == proposal


def test_settle_keeps_only_verified_tokens() -> None:
    """After a round the context holds the kept drafts and the verifier's token."""
    d = LookupDrafter()
    d.start([1, 2, 3, 1, 2])
    draft = d.propose(3, P, Chained(1), 0)
    assert draft is not None and draft.tokens.tolist() == [3, 1, 2]
    d.settle(1, 3, 42, draft.tokens.tolist())
    assert d.context == [1, 2, 3, 1, 2, 3, 42]


def _scan(ctx: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """The lookup rule read off its definition: a scan of the whole context."""
    for n in range(max_n, min_n - 1, -1):
        if len(ctx) <= n:
            continue
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start : start + n] == ctx[-n:]:
                return ctx[start + n : start + n + k]
    return []


@given(st.lists(st.integers(0, 5), max_size=40), st.lists(st.integers(0, 5), max_size=20),
       st.integers(1, 6))
def test_the_index_finds_what_a_scan_finds(prompt: list[int], more: list[int], k: int) -> None:
    """The incremental index proposes exactly what scanning the context would, as the
    context grows token by token after the prompt."""
    d = LookupDrafter()
    d.start(prompt)
    assert d.find(k) == _scan(prompt, k)
    for i, t in enumerate(more):
        d.plain(t)
        assert d.find(k) == _scan(prompt + more[: i + 1], k)
