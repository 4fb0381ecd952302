"""Model drafters drafting together, on the packaged drafter: every row's drafts are
those its own drafter proposes alone, round after round, whatever the others keep
(greedy and seeded rows: their draws are keyed, so batch shapes cannot move them
beyond float ties), and rows leave without disturbing the rest."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from seatd.drafters import ModelDrafter
from seatd.engine_types import output_width
from seatd.rows_drafter import Ask, RowsDrafter
from seatd.sampling import draws_for
from shared.protocol import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35]]
PARAMS = [SamplingParams(max_tokens=32, temperature=0),
          SamplingParams(max_tokens=32, temperature=0.8, seed=3),
          SamplingParams(max_tokens=32, temperature=0)]


@pytest.fixture(scope="module")
def drafter_model() -> Any:
    from seatd.model_load import load_for_compute
    from shared.builtin import resolve_model

    return load_for_compute(resolve_model("builtin:demo-drafter"), None).model


def _started(model: Any, prompt: list[int]) -> ModelDrafter:
    d = ModelDrafter(model)
    d.start(prompt)
    return d


def test_rows_draft_as_their_drafters_alone(drafter_model: Any) -> None:
    width = output_width(drafter_model)
    alone = [_started(drafter_model, p) for p in PROMPTS]
    batch = RowsDrafter.for_model(drafter_model)
    assert batch is not None
    for i, p in enumerate(PROMPTS):
        assert batch.join(str(i), _started(drafter_model, p))
    draws = [draws_for(p, width) for p in PARAMS]
    position = [0, 0, 0]
    # Rounds of (depth, kept) per row: rejections, full acceptance, a row that sits out
    # (depth 0: it made a plain token instead), ragged depths.
    rounds = [[(3, 1), (3, 3), (3, 0)], [(2, 2), (0, 0), (4, 1)], [(4, 0), (2, 1), (1, 1)]]
    for plan in rounds:
        asks = {str(i): Ask(k, PARAMS[i], draws[i], position[i])
                for i, (k, _) in enumerate(plan) if k}
        got = batch.propose(asks)
        assert set(got) == set(asks)
        for i, (k, kept) in enumerate(plan):
            if k == 0:  # the target made a token without a draft
                token = 100 + i
                alone[i].plain(token)
                batch.members[i].drafter.plain(token)
                position[i] += 1
                continue
            want = alone[i].propose(k, PARAMS[i], draws[i], position[i])
            mine = [int(t) for t in got[str(i)].tokens.tolist()]
            theirs = [int(t) for t in want.tokens.tolist()]
            assert mine == theirs, (plan, i)
            # The target kept `kept` drafts and made one token of its own.
            out = [*theirs[:kept], 200 + i]
            tokens = out[:-1] + [0] * (k - kept)
            alone[i].settle(kept, k, out[-1], tokens)
            batch.settle(str(i), kept, k, out[-1], tokens)
            position[i] += len(out)
    # A row leaves; the others draft on as before.
    batch.keep(["0", "2"])
    asks = {str(i): Ask(2, PARAMS[i], draws[i], position[i]) for i in (0, 2)}
    got = batch.propose(asks)
    for i in (0, 2):
        want = alone[i].propose(2, PARAMS[i], draws[i], position[i])
        assert [int(t) for t in got[str(i)].tokens.tolist()] == [
            int(t) for t in want.tokens.tolist()], i


def test_unseeded_sampled_rows_carry_their_draft_distribution(drafter_model: Any) -> None:
    """Rejection sampling needs q for each draft: one (k, V) row of probabilities each."""
    batch = RowsDrafter.for_model(drafter_model)
    assert batch is not None
    params = SamplingParams(max_tokens=8, temperature=0.7)
    batch.join("a", _started(drafter_model, PROMPTS[0]))
    got = batch.propose({"a": Ask(3, params, draws_for(params, output_width(drafter_model)), 0)})
    probs = got["a"].probs
    assert probs is not None and probs.shape[0] == 3
    assert mx.allclose(probs.sum(axis=-1), mx.ones((3,)), atol=1e-4)

