"""The lookup drafter: what it proposes from the context, and how it settles."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from seatd.drafters import MATCH_CAP, RECENT_STARTS, LookupDrafter, match_key
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
        # two earlier "1 2 3": the one whose earlier tokens match the tail further back
        ([8, 9, 1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 8, 9, 1, 2, 3], 1, [4]),
        ([5, 1, 2, 3, 4, 8, 9, 1, 2, 3, 6, 7, 1, 2, 3], 1, [6]),  # a tie: the latest
    ],
)
def test_lookup_proposals(context: list[int], k: int, proposal: list[int]) -> None:
    """It copies what followed the earlier occurrence of the longest tail n-gram that
    matches the context furthest back, the latest on a tie."""
    d = LookupDrafter()
    d.start(context)
    assert d.find(k) == proposal


@pytest.mark.parametrize(("matched", "key"), [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (7, 4),
                                              (8, 8), (15, 8), (16, 16), (MATCH_CAP, 16)])
def test_match_classes(matched: int, key: int) -> None:
    assert match_key(matched) == key


def test_a_copy_in_progress_matches_far_back() -> None:
    """While the answer copies a passage of the prompt, the match reaches back over
    the copied tokens (up to MATCH_CAP), and a stray trigram's match stays short."""
    passage = list(range(100, 140))
    d = LookupDrafter()
    d.start([1, 2, *passage, 3, 4])
    for t in passage[:20]:
        d.plain(t)
        follow = d.find(4)
    assert follow == passage[20:24] and d.matched == 20 and d.key == 16
    d.extend([7, 100, 101, 102])  # the passage's head again after a stray token
    assert d.find(2) == passage[3:5] and (d.matched, d.key) == (3, 3)


def test_settle_keeps_only_verified_tokens() -> None:
    """After a round the context holds the kept drafts and the verifier's token."""
    d = LookupDrafter()
    d.start([1, 2, 3, 1, 2])
    draft = d.propose(3, P, Chained(1), 0)
    assert draft is not None and draft.tokens.tolist() == [3, 1, 2]
    d.settle(1, 3, 42, draft.tokens.tolist())
    assert d.context == [1, 2, 3, 1, 2, 3, 42]


def _scan(ctx: list[int], k: int, max_n: int = 3, min_n: int = 1) -> tuple[list[int], int]:
    """The lookup rule read off its definition, a scan of the whole context: (the
    proposal, how far its match reaches back)."""
    for n in range(max_n, min_n - 1, -1):
        if len(ctx) <= n:
            continue
        starts = [s for s in range(len(ctx) - n) if ctx[s : s + n] == ctx[-n:]]
        if not starts:
            continue
        best, matched = starts[-1], n
        for start in reversed(starts[-RECENT_STARTS:] if n == max_n else []):
            m = n
            while m < min(MATCH_CAP, start + n) and ctx[start + n - m - 1] == ctx[-m - 1]:
                m += 1
            if m > matched:
                best, matched = start, m
        return ctx[best + n : best + n + k], matched
    return [], 0


@given(st.lists(st.integers(0, 5), max_size=40), st.lists(st.integers(0, 5), max_size=20),
       st.integers(1, 6))
def test_the_index_finds_what_a_scan_finds(prompt: list[int], more: list[int], k: int) -> None:
    """The incremental index proposes exactly what scanning the context would, as the
    context grows token by token after the prompt."""
    d = LookupDrafter()
    d.start(prompt)
    assert (d.find(k), d.matched) == _scan(prompt, k)
    for i, t in enumerate(more):
        d.plain(t)
        assert (d.find(k), d.matched) == _scan(prompt + more[: i + 1], k)


@given(st.lists(st.integers(0, 5), max_size=40), st.lists(st.integers(0, 5), max_size=30),
       st.lists(st.booleans(), min_size=30, max_size=30), st.integers(1, 6))
def test_tokens_indexed_late_find_what_a_scan_finds(prompt: list[int], more: list[int],
                                                    asks: list[bool], k: int) -> None:
    """Tokens taken between two matches asked for (a row stepping plainly in a batch,
    its index taken up when it drafts again) leave the lookup proposing what a scan of
    the whole context would."""
    d = LookupDrafter()
    d.start(prompt)
    for i, t in enumerate(more):
        if i % 3 == 2:
            d.extend([t])
        else:
            d.plain(t)
        if asks[i]:
            assert (d.find(k), d.matched) == _scan(prompt + more[: i + 1], k)
    assert (d.find(k), d.matched) == _scan(prompt + more, k)
