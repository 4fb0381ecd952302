"""A seat's decode shapes compiled before it serves (`seatd.warm_shapes`): which
backends warm up, which requests they run, and that those requests run the verify
widths they are for through the real engine, on the demo pair, without touching the
seat's own figures."""

from __future__ import annotations

from typing import Any

import pytest

from seatd import warm_shapes
from seatd.adaptive import MAX_DEPTH
from seatd.batch import Engine
from seatd.drafter_choice import LOOKUP_MAX_DEPTH
from tests.spec_models import drafter_dir, target_dir


@pytest.mark.parametrize(("backend", "environ", "expected"), [
    ("cuda", {}, True),
    ("metal", {}, True),
    ("cpu", {}, False),  # no first-run compile worth a start-up
    ("cuda", {"SANCTUM_WARM_SHAPES": "0"}, False),  # the operator's word
    ("metal", {"SANCTUM_WARM_SHAPES": "off"}, False),
    ("cuda", {"SANCTUM_WARM_SHAPES": "1"}, True),
])
def test_which_backends_warm_up(backend: str, environ: dict[str, str], expected: bool) -> None:
    assert warm_shapes.wanted(backend, environ) is expected


def test_the_plan_covers_every_width_in_both_bands() -> None:
    lookup = warm_shapes.plan(False)
    assert {(d, p.temperature > 0) for _, d, p in lookup} == {
        (d, s) for d in range(1, LOOKUP_MAX_DEPTH + 1) for s in (False, True)}
    assert {k for k, _, _ in lookup} == {"lookup"}
    both = warm_shapes.plan(True)
    assert {(d, p.temperature > 0) for k, d, p in both if k == "model"} == {
        (d, s) for d in range(1, MAX_DEPTH + 1) for s in (False, True)}
    # each request leaves room for a round of its depth after its first token
    assert all(p.max_tokens == d + 2 for _, d, p in both)
    assert all(p.seed is not None for _, _, p in both if p.temperature > 0)


def test_the_warm_up_runs_each_planned_width_through_the_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from seatd.engine_types import output_width
    from seatd.model_load import load_for_compute

    target = load_for_compute(target_dir(), None)
    drafter = load_for_compute(drafter_dir(), None)
    verified: list[tuple[int, float, str]] = []
    verify = Engine._verify_step

    def counting(self: Engine, lane: Any, depths: list[int], split: Any = None) -> Any:
        row = lane.rows[0]
        verified.append((depths[0], row.params.temperature, type(row.work.spec.drafter).__name__))
        return verify(self, lane, depths, split)

    monkeypatch.setattr(Engine, "_verify_step", counting)
    full = warm_shapes.plan(True)
    runs = [r for r in full if r[0] == "lookup" and r[1] in (2, LOOKUP_MAX_DEPTH)] + \
        [r for r in full if r[0] == "model" and r[1] == 3]
    warmed = warm_shapes.warm_up(target.model, target.tokenizer, target.context_length,
                                 output_width(target.model), drafter.model, runs)
    assert warmed.requests == len(runs) == 6 and warmed.failed == 0
    # each planned width ran (a request's later round, nearer its end, runs narrower)
    assert set(verified) >= {
        (2, 0.0, "Proposing"), (2, 0.7, "Proposing"),
        (LOOKUP_MAX_DEPTH, 0.0, "Proposing"), (LOOKUP_MAX_DEPTH, 0.7, "Proposing"),
        (3, 0.0, "ModelDrafter"), (3, 0.7, "ModelDrafter")}
    assert max(d for d, _, kind in verified if kind == "ModelDrafter") == 3


def test_a_proposing_lookup_always_finds_what_it_is_asked_for() -> None:
    lookup = warm_shapes.Proposing()
    lookup.start([5, 6, 7, 8, 9])
    assert lookup.find(3) == [5, 6, 7] and lookup.key == 16
    lookup.extend([42])  # a token no earlier text holds: still a full match
    assert lookup.find(4) == [5, 6, 7, 8]


@pytest.mark.parametrize("fails", [False, True])
def test_a_seat_on_a_gpu_warms_up_before_its_engine_and_loads_even_if_that_fails(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    """The worker's load on a GPU backend (its name stood in for: this machine has no
    GPU) runs the warm-up with the seat's drafter; a warm-up that raises is logged and
    the seat loads and serves as it would have."""
    from seatd import worker as worker_module
    from seatd.worker import SeatWorker
    from shared.config import parse_config

    calls: list[Any] = []

    def warm_up(model: Any, tokenizer: Any, context_length: int, width: int,
                drafter_model: Any = None) -> warm_shapes.Warmed:
        calls.append(drafter_model)
        if fails:
            raise RuntimeError("no kernel for this shape")
        return warm_shapes.Warmed(0, 0, 0.0)

    monkeypatch.setattr(worker_module, "backend", lambda: "cuda")
    monkeypatch.setattr(warm_shapes, "warm_up", warm_up)
    config = parse_config(
        f'[seatd]\nstate_dir = "{tmp_path}"\n[[seat]]\nname = "demo"\n'
        'model = "builtin:demo"\ndrafter = { kind = "model", path = "builtin:demo-drafter" }\n'
        'kv = "fp16"\n[[route]]\nmodel = "demo"\nladder = ["demo"]\n')
    seat = SeatWorker(config, config.seat_by_name("demo"))
    loaded = seat.load()
    assert loaded.engine is not None
    assert len(calls) == 1 and calls[0] is loaded.speculation.drafter_model is not None
    seat.mlx.shutdown(wait=False)
