"""The prompt cache's policy as tables: longest-prefix lookup on the grid, trimming,
the exact-length rule, the byte budget with the request in flight, LRU eviction,
the too-large rule, supersession and invalidation, each with its counted reason."""

from __future__ import annotations

import pytest

from seatd.prefix_cache import Entry, PrefixCache, common_prefix


def toks(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


@pytest.mark.parametrize("a, b, want", [
    ((), (), 0),
    ((1, 2, 3), (1, 2, 3), 3),
    ((1, 2, 3), (1, 2), 2),
    ((1, 2, 3), (9, 2, 3), 0),
    (toks(1000), (*toks(700), 0), 700),
    (toks(600), toks(600), 600),
])
def test_common_prefix(a, b, want) -> None:
    """Longest common prefix, across the 256-token strides and inside one."""
    assert common_prefix(a, b) == want


# (stored entries as (length, trimmable), request common length, limit) -> reuse, lost
LOOKUPS = [
    ([(8, True)], 8, 100, 8, 0),            # exact entry
    ([(8, True)], 20, 100, 8, 0),           # entry shorter than the request
    ([(16, True)], 10, 100, 8, 0),          # longer entry trimmed, down to the grid (4)
    ([(16, True)], 12, 5, 4, 0),            # never past the limit (prompt less one)
    ([(16, False)], 10, 100, 0, 8),         # not trimmable: nothing, 8 counted lost
    ([(8, False)], 12, 100, 8, 0),          # not trimmable, exact length fits
    ([(8, False), (16, False)], 14, 100, 8, 4),  # the shorter checkpoint serves
    ([(8, True), (16, True)], 14, 100, 12, 0),   # the longer one, trimmed
    ([(3, True)], 3, 100, 0, 0),            # under one grid step: cold
]


@pytest.mark.parametrize("stored, shared, limit, reuse, lost", LOOKUPS)
def test_lookup(stored, shared, limit, reuse, lost) -> None:
    """Which entry a request resumes from, how far, and what the exact-length rule loses."""
    c = PrefixCache(10**9, align=4)
    for n, trim in stored:
        c.entries.append(Entry("fp16", toks(n), n, trim))
    request = toks(shared) + (999,) * 10
    hit = c.lookup("fp16", request, limit)
    assert (hit.reuse, hit.not_trimmable) == (reuse, lost)
    t = c.drain()
    assert t.lookups == 1 and t.hits == (1 if reuse else 0) and t.reused_tokens == reuse
    assert t.discarded == ({"not_trimmable": lost} if lost else {})


def test_lanes_do_not_share_entries() -> None:
    """A q8 entry never serves an fp16 request."""
    c = PrefixCache(10**9, align=4)
    c.insert("q8", toks(8), 10, True)
    assert c.lookup("fp16", toks(12), 100).reuse == 0
    assert c.lookup("q8", toks(12), 100).reuse == 8


def test_too_large_is_not_inserted() -> None:
    """An entry larger than the budget would evict everything: refused and counted."""
    c = PrefixCache(100, align=1)
    c.insert("kv", toks(5), 60, True)
    assert c.insert("kv", toks(7, 50), 101, True) is None
    assert len(c.entries) == 1
    assert c.drain().discarded == {"too_large": 7}


def test_lru_eviction_within_budget() -> None:
    """Least recently used goes first; a lookup refreshes an entry."""
    c = PrefixCache(100, align=1)
    c.insert("kv", toks(4, 0), 40, True)
    c.insert("kv", toks(4, 100), 40, True)
    assert c.lookup("kv", (*toks(4, 0), 7), 10).reuse == 4  # refresh the first
    c.insert("kv", toks(6, 200), 40, True)
    assert [e.tokens[0] for e in c.entries] == [0, 200]
    assert c.nbytes == 80
    assert c.drain().discarded == {"evicted": 4}


def test_reservation_counts_the_request_in_flight() -> None:
    """Entries plus the in-flight reservation stay within the budget."""
    c = PrefixCache(100, align=1)
    c.insert("kv", toks(3, 0), 30, True)
    c.insert("kv", toks(3, 10), 30, True)
    c.insert("kv", toks(3, 20), 30, True)
    c.reserve(50)
    assert c.nbytes + c.reserved <= 100 and len(c.entries) == 1
    assert c.drain().discarded == {"evicted": 6}
    # While the reservation holds, an entry that cannot fit beside it is dropped.
    assert c.insert("kv", toks(3, 30), 60, True) is None
    assert c.nbytes + c.reserved <= 100
    c.release()
    assert c.insert("kv", toks(3, 30), 60, True) is not None
    assert c.nbytes <= 100


def test_longer_trimmable_entry_supersedes_its_prefix() -> None:
    """Turn N's entry replaces turn N-1's (it serves those tokens too); no discard."""
    c = PrefixCache(1000, align=1)
    c.insert("kv", toks(4), 40, True)
    c.insert("kv", toks(8), 80, True)
    assert [len(e.tokens) for e in c.entries] == [8]
    assert c.insert("kv", toks(6), 60, True) is c.entries[0]  # already covered
    assert c.drain().discarded == {}


def test_checkpoints_of_untrimmable_state_are_kept_apart() -> None:
    """Recurrent state: each turn's checkpoint stays; each serves its exact length."""
    c = PrefixCache(1000, align=1)
    c.insert("kv", toks(4), 10, False)
    c.insert("kv", toks(8), 10, False)
    assert len(c.entries) == 2
    assert c.lookup("kv", (*toks(6), 99), 100).reuse == 4


def test_invalidation_drops_the_entry() -> None:
    """An error during a request that used an entry drops it, counted `invalidated`."""
    c = PrefixCache(1000, align=1)
    e = c.insert("kv", toks(5), 10, True)
    assert e is not None
    c.invalidate(e)
    c.invalidate(e)  # twice is harmless
    assert not c.entries
    assert c.drain().discarded == {"invalidated": 5}


def test_exact_length_entries_resume_off_the_grid() -> None:
    """A non-trimmable entry kept at a turn boundary (not a multiple of the alignment)
    serves a prompt that extends it and cuts its prefill there too, at exactly its
    length, and nothing shorter."""
    pc = PrefixCache(1_000_000, align=512)
    turn1 = tuple(range(1, 101))
    pc.insert("fp16", turn1, 10, False, "state@100")
    hit = pc.lookup("fp16", (*turn1, 7, 8, 9), 102, (100,))
    assert (hit.entry is not None, hit.reuse) == (True, 100)
    # a prompt whose prefill does not cut at 100 would compute it in other chunks
    assert pc.lookup("fp16", (*turn1, 7, 8, 9), 102).reuse == 0
    assert pc.lookup("fp16", turn1[:60] + (5,) * 50, 109, (60,)).reuse == 0


# (entry length, its cuts, request common length, request cuts) -> reuse: align 512
OFF_GRID = [
    (300, (), 300, (300,), 300),             # kept at its last turn: the next turn resumes
    (300, (), 300, (), 0),                   # the request does not cut there: cold
    (300, (120,), 250, (120, 250), 120),     # shares 250, but only 120 is both's boundary
    (300, (120,), 250, (250,), 0),           # 120 is not the request's boundary
    (300, (120, 200), 290, (120, 200), 200),  # the latest shared cut
    (700, (600,), 650, (600,), 600),         # a cut past the grid beats the grid's 512
    (700, (550,), 650, (530,), 512),         # no shared cut past the grid: the grid
]


@pytest.mark.parametrize("n, entry_cuts, shared, cuts, reuse", OFF_GRID)
def test_a_trimmable_entry_resumes_at_a_boundary_both_prefills_had(
        n: int, entry_cuts: tuple[int, ...], shared: int, cuts: tuple[int, ...],
        reuse: int) -> None:
    """Off the grid, a trimmable entry serves a request at a turn boundary where both
    prefills cut their chunks (or at the entry's own length), so the rest is computed
    in the chunks a cold request uses."""
    pc = PrefixCache(10**9, align=512)
    pc.insert("fp16", toks(n), 10, True, None, entry_cuts)
    request = toks(shared) + (99_999,) * 10
    assert pc.lookup("fp16", request, len(request) - 1, cuts).reuse == reuse


def test_a_longer_entry_supersedes_a_shorter_only_where_it_has_that_boundary() -> None:
    """A turn-boundary entry is dropped for one that extends it only when the longer
    prefill also cut there; otherwise both stay, each serving its own boundaries."""
    pc = PrefixCache(10**9, align=512)
    short = pc.insert("fp16", toks(100), 10, True, None, ())
    pc.insert("fp16", toks(300), 10, True, None, (100,))  # cut at 100: supersedes
    assert short not in pc.entries and len(pc.entries) == 1
    other = PrefixCache(10**9, align=512)
    short = other.insert("fp16", toks(100), 10, True, None, ())
    other.insert("fp16", toks(300), 10, True, None, (150,))  # no boundary at 100
    assert short in other.entries and len(other.entries) == 2
    assert other.lookup("fp16", toks(100) + (7,) * 5, 104, (100,)).reuse == 100
