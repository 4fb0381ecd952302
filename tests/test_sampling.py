"""Sampling: filters keep the right tokens; a seeded draw is a pure function of
(seed, position); an unseeded one comes from a key chain."""

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from seatd.sampling import (
    Chained,
    Keyed,
    draws_for,
    filter_logits,
    keyed_noise,
    position_key,
    rows_draw_alike,
    sample,
)
from shared.protocol import SamplingParams

LOGITS = mx.array([[4.0, 3.0, 2.0, 1.0, 0.0]])


def kept(params: SamplingParams) -> list[int]:
    out = np.array(filter_logits(LOGITS, params))[0]
    return [i for i, v in enumerate(out) if np.isfinite(v)]


def test_top_k_keeps_k_best() -> None:
    """top_k keeps exactly the k most likely tokens."""
    assert kept(SamplingParams(temperature=1.0, top_k=2)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0, top_k=0)) == [0, 1, 2, 3, 4]


def test_top_p_keeps_smallest_nucleus() -> None:
    """top_p keeps tokens until their mass reaches p; the best token always stays."""
    probs = np.array(mx.softmax(LOGITS, axis=-1))[0]
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert kept(SamplingParams(temperature=1.0, top_p=0.7)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0, top_p=0.01)) == [0]


@pytest.mark.parametrize("draws", [Chained(1), Keyed(1, 5)])
def test_greedy_at_zero_temperature(draws: Chained | Keyed) -> None:
    """Temperature 0 is argmax, whatever the rule or the key."""
    p = SamplingParams(temperature=0.0)
    assert int(sample(LOGITS, p, Chained(1).next_key()).item()) == 0
    assert [int(draws.token(LOGITS, p, i).item()) for i in range(5)] == [0] * 5


def test_chained_same_start_same_tokens() -> None:
    """Two key chains from one start draw the same sequence; another start differs."""
    p = SamplingParams(temperature=1.5)
    flat = mx.zeros((1, 1000))

    def draw(start: int) -> list[int]:
        keys = Chained(start)
        return [int(keys.token(flat, p, 0).item()) for _ in range(20)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_position_keys_are_a_pure_function_of_seed_and_position() -> None:
    """The key of (seed, position) is the same on every call; other pairs differ."""
    keys = {(s, i): tuple(position_key(s, i).tolist()) for s in (0, 1, 7, 2**40, -3)
            for i in range(50)}
    assert len(set(keys.values())) == len(keys)
    assert tuple(position_key(7, 12).tolist()) == keys[(7, 12)]


def test_keyed_tokens_ignore_the_order_positions_are_asked_in() -> None:
    """Position i's token does not depend on which positions were drawn before it (what
    a round schedule, a drafter or a restart would change)."""
    p = SamplingParams(temperature=1.0)
    flat = mx.zeros((1, 512))
    forward = Keyed(9, 512)
    a = [int(forward.token(flat, p, i).item()) for i in range(40)]
    backward = Keyed(9, 512)
    b = [int(backward.token(flat, p, i).item()) for i in reversed(range(40))][::-1]
    again = [int(Keyed(9, 512).token(flat, p, i).item()) for i in range(40)]
    assert a == b == again
    assert len(set(a)) > 30  # a flat distribution: forty draws, not one token repeated
    assert a != [int(Keyed(10, 512).token(flat, p, i).item()) for i in range(40)]


def test_a_block_of_positions_scores_as_its_rows_do() -> None:
    """Scores of a verify block (1, n, V) are the scores of each row at its position."""
    p = SamplingParams(temperature=0.7, top_k=50)
    logits = mx.random.normal((1, 4, 300), key=mx.random.key(3))
    draws = Keyed(4, 300)
    block = draws.scores(logits, p, 10)
    for i in range(4):
        row = Keyed(4, 300).scores(logits[0, i], p, 10 + i)
        assert mx.array_equal(block[0, i], row)
        assert int(mx.argmax(row).item()) == int(draws.token(logits[:, i], p, 10 + i).item())


def test_a_narrower_drafter_shares_the_targets_noise() -> None:
    """Noise is made at the target's width; a narrower drafter gets its first columns and a
    wider one gets -inf past the target's vocabulary (tokens the target cannot emit)."""
    draws = Keyed(5, 100)
    full = draws.noise(3)
    assert mx.array_equal(draws.noise(3, 60), full[:60])
    wide = draws.noise(3, 120)
    assert mx.array_equal(wide[:100], full) and bool(mx.all(wide[100:] == -mx.inf).item())


def test_the_rule_follows_the_seed() -> None:
    """A seeded request draws by the keyed rule, an unseeded one by a key chain."""
    assert isinstance(draws_for(SamplingParams(seed=0), 10), Keyed)
    assert isinstance(draws_for(SamplingParams(), 10), Chained)


@pytest.mark.parametrize("rows", [
    # (temperature, seed, position): seeded rows at their own positions and temperatures
    [(0.7, 1, 0), (0.7, 2, 5), (1.3, 3, 17), (0.2, 4, 2)],
    [(0.0, None, 0), (0.7, 9, 3), (0.0, None, 8), (1.0, 9, 3)],  # greedy rows among them
    [(0.7, 5, 40)],
])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_batch_of_tempered_rows_draws_each_rows_own_token(
        rows: list[tuple[float, int | None, int]], dtype: mx.Dtype) -> None:
    """The batch engine's one draw for rows sampling by temperature alone
    (`seatd.batch.Engine._sample_tempered`) gives each row the token its own keyed draw
    gives, bit for bit, whatever its neighbours."""
    from types import SimpleNamespace

    from seatd.batch import Engine, _tempered

    width = 512
    logits = (mx.random.normal((len(rows), width), key=mx.random.key(3)) * 4).astype(dtype)
    made = []
    for t, seed, position in rows:
        params = SamplingParams(temperature=t, seed=seed)
        made.append(SimpleNamespace(params=params, draws=draws_for(params, width),
                                    issued=position, shaper=None))
    assert all(_tempered(r) for r in made if r.params.temperature > 0)  # type: ignore[arg-type]
    got = Engine._sample_tempered(logits, made).tolist()  # type: ignore[arg-type]
    own = [r.draws.token(logits[b : b + 1], r.params, r.issued).item()
           for b, r in enumerate(made)]
    assert got == own
    # not a copy of greedy: the noise decides some sampled row
    assert any(g != mx.argmax(logits[b]).item() for b, g in enumerate(got)
               if rows[b][0] > 0) or len(rows) == 1


@pytest.mark.parametrize(("params", "tempered"), [
    (SamplingParams(temperature=0.7, seed=1), True),
    (SamplingParams(temperature=0.7, seed=1, top_p=0.9), False),  # a filter: row by row
    (SamplingParams(temperature=0.7, seed=1, top_k=40), False),
    (SamplingParams(temperature=0.7, seed=1, min_p=0.05), False),
    (SamplingParams(temperature=0.7), True),  # unseeded: one block of noise for them all
    (SamplingParams(temperature=0.7, top_p=0.5), False),
    (SamplingParams(temperature=0.0, seed=1), False),  # greedy
])
def test_which_rows_draw_by_temperature_alone(params: SamplingParams, tempered: bool) -> None:
    from types import SimpleNamespace

    from seatd.batch import _tempered

    row = SimpleNamespace(params=params, draws=draws_for(params, 16))
    assert _tempered(row) is tempered  # type: ignore[arg-type]


def _rows(spec: list[tuple[float, int | None]], width: int, start: int = 7) -> list[Any]:
    from types import SimpleNamespace

    made = []
    for i, (t, seed) in enumerate(spec):
        params = SamplingParams(temperature=t, seed=seed)
        draws = Keyed(seed, width) if seed is not None else Chained(start + i)
        made.append(SimpleNamespace(params=params, draws=draws, issued=i, shaper=None))
    return made


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_unseeded_rows_draw_together_from_their_own_softmax(
        temperature: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unseeded rows sampling by temperature alone draw in one block of noise
    (`Engine._sample_tempered`): one key a step for all of them, and each row's token
    follows softmax(logits / T), as `mx.random.categorical` would draw it."""
    from seatd.batch import Engine

    keys = []
    real = Chained.next_key

    def counted(self: Chained) -> mx.array:
        keys.append(self)
        return real(self)

    monkeypatch.setattr(Chained, "next_key", counted)
    p = [0.5, 0.3, 0.15, 0.05]
    B = 4000
    logits = mx.log(mx.array([p] * B))
    made = _rows([(temperature, None)] * B, 4)
    got = Engine._sample_tempered(logits, made).tolist()
    assert len(keys) == 1, "one key for the whole block, not one a row"
    want = [q ** (1 / temperature) for q in p]
    want = [q / sum(want) for q in want]
    seen = [got.count(i) / B for i in range(4)]
    assert all(abs(a - b) < 0.03 for a, b in zip(seen, want, strict=True)), (seen, want)


def test_unseeded_rows_of_one_batch_draw_independently() -> None:
    """Two unseeded rows with the same logits, step after step: each draws its own token
    (they agree about as often as two independent draws do, sum of p squared = 0.365),
    and a row's draws differ from step to step."""
    from seatd.batch import Engine

    logits = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05]] * 2))
    made = _rows([(1.0, None), (1.0, None)], 4)
    draws = [Engine._sample_tempered(logits, made).tolist() for _ in range(400)]
    same = sum(a == b for a, b in draws) / len(draws)
    assert 0.25 < same < 0.5, same
    assert len({a for a, _ in draws}) == 4


def test_seeded_greedy_and_unseeded_rows_together_keep_the_seeded_and_greedy_tokens() -> None:
    """A batch mixing all three: the seeded rows draw their own keyed tokens bit for bit,
    the greedy rows their argmax, the unseeded ones from the shared block."""
    from seatd.batch import Engine

    width = 512
    spec: list[tuple[float, int | None]] = [
        (0.7, 3), (0.9, None), (0.0, None), (1.2, None), (0.7, 4), (0.0, None)]
    logits = mx.random.normal((len(spec), width), key=mx.random.key(5)) * 4
    made = _rows(spec, width)
    got = Engine._sample_tempered(logits, made).tolist()
    for b, r in enumerate(made):
        if r.params.temperature == 0:
            assert got[b] == mx.argmax(logits[b]).item()
        elif isinstance(r.draws, Keyed):
            assert got[b] == r.draws.token(logits[b : b + 1], r.params, r.issued).item()
        else:
            assert 0 <= got[b] < width


def _gumbel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of the `mx.random.gumbel` calls made from here on."""
    calls: list[tuple[int, ...]] = []
    real = mx.random.gumbel

    def counted(*args: Any, **kwargs: Any) -> mx.array:
        calls.append(tuple(kwargs.get("shape", args[0] if args else ())))
        return real(*args, **kwargs)

    monkeypatch.setattr(mx.random, "gumbel", counted)
    return calls


@pytest.mark.parametrize("width", [512, 8192])
def test_seeded_rows_noise_is_drawn_in_one_call_bit_for_bit_each_rows_own(
        width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keyed noise of a batch's seeded rows (`keyed_noise`): one random call for all
    of them (on a GPU each row's own call is launches of its own), each row's values
    bit for bit what its own `Keyed.noise` draws, at any seed and position."""
    draws = [Keyed(seed, width) for seed in (0, 1, 7, 2**40, -3)]
    positions = [0, 5, 17, 2, 300]
    assert rows_draw_alike(width), "MLX on this backend draws a stack of keys as each alone"
    calls = _gumbel_calls(monkeypatch)
    together = keyed_noise(draws, positions, width)
    assert len(calls) == 1
    own = [Keyed(d.seed, width).noise(p) for d, p in zip(draws, positions, strict=True)]
    for b, row in enumerate(own):
        assert mx.array_equal(together[b], row).item(), b
    assert not mx.array_equal(together[0], together[1]).item()


def test_seeded_rows_draw_one_by_one_where_the_backend_draws_a_stack_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a backend's stack of keys draws other values than each key alone (its
    check says so), or the rows' noise is asked at another width than theirs, each
    row draws alone: the same values either way."""
    import seatd.sampling as sampling

    width = 256
    draws = [Keyed(seed, width) for seed in (3, 4, 5)]
    positions = [1, 1, 9]
    want = mx.stack([Keyed(d.seed, width).noise(p) for d, p in zip(draws, positions,
                                                                 strict=True)])
    monkeypatch.setattr(sampling, "rows_draw_alike", lambda width: False)
    calls = _gumbel_calls(monkeypatch)
    assert mx.array_equal(keyed_noise(draws, positions, width), want).item()
    assert len(calls) == 3
    wider = keyed_noise([Keyed(d.seed, width) for d in draws], positions, width + 3)
    assert mx.array_equal(wider[:, :width], want).item()
    assert mx.all(mx.isinf(wider[:, width:])).item()
