"""The lookup drafter: what it proposes from the context, and how it settles."""

import pytest

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
