"""The seat's KV budget: rows in flight and the prompt cache share it."""

from __future__ import annotations

import pytest

from seatd.kv_budget import KVBudget, row_bytes


@pytest.mark.parametrize(("per_token", "prompt", "max_new", "context", "expected"), [
    (10, 100, 50, 2048, 10 * (256 + 256)),
    (10, 300, 0, 2048, 10 * (512 + 256)),
    (10, 2000, 4000, 2048, 10 * (2048 + 256)),  # the context bounds what a row reaches
    (1, 256, 0, 4096, 256 + 256),
])
def test_row_bytes(per_token: int, prompt: int, max_new: int, context: int,
                   expected: int) -> None:
    assert row_bytes(per_token, prompt, max_new, context) == expected


def test_rows_are_charged_as_the_longest_and_wait_when_over() -> None:
    spilled: list[int] = []
    b = KVBudget(budget=1000, cache_budget=400, spill=spilled.append)
    assert b.admit(100)  # 100 in flight, under the 600 the cache leaves to rows
    assert spilled[-1] == 0
    assert b.admit(300)  # two rows charged as 300 each: 600
    assert spilled[-1] == 0
    assert b.admit(300)  # 900: the cache gives 300 of its 400 back
    assert spilled[-1] == 300
    assert not b.admit(100)  # 4 x 300 = 1200 > 1000: waits
    assert b.rows == [100, 300, 300]
    b.release(300)
    assert spilled[-1] == 0 and b.in_flight == 600
    assert b.admit(100)


def test_a_request_alone_is_always_taken() -> None:
    spilled: list[int] = []
    b = KVBudget(budget=1000, cache_budget=500, spill=spilled.append)
    assert not KVBudget(1000).admit(5000)  # not alone: it waits
    assert b.admit(5000, alone=True)
    assert spilled[-1] == 4500  # everything the cache had gives way
    assert not b.admit(10)
    b.release(5000)
    assert b.rows == [] and spilled[-1] == 0
