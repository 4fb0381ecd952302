"""A seat's decode shapes compiled before it serves (`seatd.warm_shapes`): which
backends warm up, which requests they run, and that those requests run the verify
widths they are for through the real engine, on the demo pair, without touching the
seat's own figures."""

from __future__ import annotations

from typing import Any

import pytest

from seatd import warm_shapes
from seatd.adaptive import MAX_DEPTH, DepthStats
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


@pytest.mark.parametrize(("context", "caps"), [
    (2048, [256, 512, 768, 1024, 1280, 1536, 1792, 2048]),
    (32768, [256 * k for k in range(1, 9)]),  # past WARM_CONTEXT: met as it comes
    (300, [256]),
    (100, [256]),  # a context under one step: that step
])
def test_the_capacities_warmed(context: int, caps: list[int]) -> None:
    assert warm_shapes.capacities(context) == caps
    # measured on CUDA only: elsewhere the first step
    assert warm_shapes.capacities(context, "metal") == [256]
    assert len(warm_shapes.plan(False, context, "metal")) == 2


def test_the_plan_covers_every_capacity_and_the_model_drafters_depths_in_both_bands(
        ) -> None:
    lookup = warm_shapes.plan(False, 2048)
    assert {r.kind for r in lookup} == {"lookup"}
    # one request per capacity and band, its prompt in the capacity's last step, longest first
    assert [r.prompt_tokens for r in lookup[::2]] == [1800, 1544, 1288, 1032, 776, 520,
                                                      264, 30]
    assert all(r.prompt_tokens + r.params.max_tokens <= 2048 for r in lookup)
    assert {(r.prompt_tokens, r.params.temperature > 0) for r in lookup} == {
        (p, s) for p in (1800, 1544, 1288, 1032, 776, 520, 264, 30) for s in (False, True)}
    both = warm_shapes.plan(True, 2048)
    assert {(r.depth, r.params.temperature > 0) for r in both
            if r.kind == "model" and not r.measure} == {
        (d, s) for d in range(1, MAX_DEPTH + 1) for s in (False, True)}
    # a model drafter's request leaves room for a round of its depth after its first token
    compiling = [r for r in both if r.kind == "model" and not r.measure]
    assert all(r.params.max_tokens == r.depth + 2 for r in compiling)
    assert all(r.params.seed is not None for r in both if r.params.temperature > 0)
    # then, last, every depth from a plain token up is timed for some rounds in each band
    measure = [r for r in both if r.measure]
    assert both[-len(measure):] == measure
    assert {(r.depth, r.params.temperature > 0) for r in measure} == {
        (d, s) for d in range(MAX_DEPTH + 1) for s in (False, True)}
    assert all(r.params.max_tokens >= 4 * (r.depth + 1) for r in measure)
    assert not any(r.measure for r in warm_shapes.plan(False, 2048))  # no drafter to time


def test_the_warm_up_runs_every_width_at_each_capacity_through_the_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from seatd.engine_types import output_width
    from seatd.model_load import load_for_compute

    target = load_for_compute(target_dir(), None)
    drafter = load_for_compute(drafter_dir(), None)
    verified: list[tuple[int, float, str, int]] = []
    verify = Engine._verify_step

    def counting(self: Engine, lane: Any, depths: list[int], split: Any = None) -> Any:
        row = lane.rows[0]
        before = len(verified)
        out = verify(self, lane, depths, split)
        capacity = lane.cache.kv_layers[0].keys[0][0].shape[2]
        verified.insert(before, (depths[0], row.params.temperature,
                                 type(row.work.spec.drafter).__name__, capacity))
        return out

    monkeypatch.setattr(Engine, "_verify_step", counting)
    full = warm_shapes.plan(True, target.context_length)
    runs = [r for r in full if r.kind == "lookup" and r.prompt_tokens in (30, 264)] + \
        [r for r in full if r.kind == "model" and r.depth == 3 and not r.measure]
    warmed = warm_shapes.warm_up(target.model, target.tokenizer, target.context_length,
                                 output_width(target.model), drafter.model, runs)
    assert warmed.requests == len(runs) == 6 and warmed.failed == 0
    # every verify width at both capacities, in both bands, each at its own capacity
    for cap in (256, 512):
        for t in (0.0, 0.7):
            assert {d for d, temp, kind, c in verified
                    if kind == "Cycling" and temp == t and c == cap} >= set(
                range(1, LOOKUP_MAX_DEPTH + 1)), (cap, t)
    # the model drafter at its depth (a request's later round, nearer its end, runs narrower)
    assert {(d, t) for d, t, kind, _ in verified if kind == "ModelDrafter"} >= {
        (3, 0.0), (3, 0.7)}
    assert max(d for d, _, kind, _ in verified if kind == "ModelDrafter") == 3


def test_a_cycling_lookup_asks_for_every_depth_in_turn() -> None:
    lookup = warm_shapes.Cycling()
    lookup.start(list(range(100, 132)))  # 32 tokens: the cycle's first depth is 15
    widths = []
    for _ in range(len(warm_shapes.CYCLE)):
        got = lookup.find(LOOKUP_MAX_DEPTH)
        assert got == lookup.find(LOOKUP_MAX_DEPTH)  # a round asks the same twice
        widths.append(len(got))
        lookup.extend([7, 8, 9])  # a round that kept two tokens: the next depth all the same
    assert sorted(widths) == list(range(LOOKUP_MAX_DEPTH + 1))
    assert lookup.find(3) == [100, 101, 102]  # never more than asked


def test_a_proposing_lookup_always_finds_what_it_is_asked_for() -> None:
    lookup = warm_shapes.Proposing()
    lookup.start([5, 6, 7, 8, 9])
    assert lookup.find(3) == [5, 6, 7] and lookup.key == 16
    lookup.extend([42])  # a token no earlier text holds: still a full match
    assert lookup.find(4) == [5, 6, 7, 8]


@pytest.mark.parametrize("fails", [False, True])
def test_a_seat_on_a_gpu_warms_up_in_its_engines_idle_time_and_loads_even_if_that_fails(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    """The worker's load on a GPU backend (its name stood in for: this machine has no
    GPU) gives its engine the warm-up, with the seat's drafter, as idle work; a warm-up
    that cannot start is logged and the seat loads and serves as it would have."""
    from seatd import worker as worker_module
    from seatd.worker import SeatWorker
    from shared.config import parse_config

    calls: list[Any] = []
    handed: list[Any] = []

    class Warming:
        def __init__(self, model: Any, tokenizer: Any, context_length: int, width: int,
                     drafter_model: Any = None, on_measured: Any = None) -> None:
            calls.append(drafter_model)
            handed.append(on_measured)
            if fails:
                raise RuntimeError("no kernel for this shape")

        def step(self) -> bool:
            return False

    monkeypatch.setattr(worker_module, "backend", lambda: "cuda")
    monkeypatch.setattr(warm_shapes, "Warming", Warming)
    config = parse_config(
        f'[seatd]\nstate_dir = "{tmp_path}"\n[[seat]]\nname = "demo"\n'
        'model = "builtin:demo"\ndrafter = { kind = "model", path = "builtin:demo-drafter" }\n'
        'kv = "fp16"\n[[route]]\nmodel = "demo"\nladder = ["demo"]\n')
    seat = SeatWorker(config, config.seat_by_name("demo"))
    loaded = seat.load()
    assert loaded.engine is not None
    assert len(calls) == 1 and calls[0] is loaded.speculation.drafter_model is not None
    # what it measures goes to the seat's own figures
    assert handed[0] == loaded.speculation.take_times
    assert (loaded.engine.idle is None) is fails
    seat.loaded = loaded
    assert seat.pong(0.0).warming is not fails  # its pongs say so, for /health
    seat.mlx.shutdown(wait=False)


def test_a_request_is_served_while_the_seat_warms_up_and_the_warm_up_still_ends() -> None:
    """The engine's thread takes warm-up steps only when no request has work: a request
    submitted in the middle of the warm-up gets the answer it gets from an engine that
    never warmed, and the warm-up goes on after it to its end."""
    import threading

    from seatd.engine_io import Outbox, Transcript, Work
    from seatd.engine_types import output_width
    from seatd.kv_budget import KVBudget
    from seatd.model_load import load_for_compute
    from shared.protocol import Generate, SamplingParams

    target = load_for_compute(target_dir(), None)
    width = output_width(target.model)
    runs = [r for r in warm_shapes.plan(False, target.context_length) if r.prompt_tokens == 30]
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=5)

    def engine() -> tuple[Engine, threading.Event]:
        rang = threading.Event()
        return Engine(target.model, target.tokenizer, target.context_length, width, 4,
                      KVBudget(1 << 30), outbox=Outbox(rang.set)), rang

    def answer(engine: Engine, rang: threading.Event) -> Any:
        request = Generate("q", False, params, prompt="Say the days of the week.")
        engine.submit(Work(request, target.tokenizer.encode("Say the days of the week."),
                           "fp16"))
        seen = Transcript()
        while "q" not in seen.ended:
            assert rang.wait(60.0)
            rang.clear()
            seen.read(engine.outbox)
        return seen.result("q")

    warm, rang = engine()
    warming = warm_shapes.Warming(target.model, target.tokenizer, target.context_length,
                                  width, None, runs)
    assert warming.step()  # the first warm-up request is in
    done = threading.Event()

    def idle() -> bool:
        more = warming.step()
        if not more:
            done.set()
        return more

    warm.idle = idle
    thread = threading.Thread(target=warm.run)
    thread.start()
    try:
        got = answer(warm, rang)
        assert done.wait(120.0)
    finally:
        warm.stop()
        thread.join()
    assert warm.idle is None  # the thread let go of it once it had ended
    assert warming.warmed is not None and warming.warmed.requests == len(runs) == 2
    assert warming.warmed.failed == 0
    cold, rang = engine()
    cold_thread = threading.Thread(target=cold.run)
    cold_thread.start()
    try:
        want = answer(cold, rang)
    finally:
        cold.stop()
        cold_thread.join()
    assert got.token_ids == want.token_ids and got.text == want.text


def test_the_measure_runs_time_each_depth_and_hand_the_seat_its_figures() -> None:
    """The warm-up's last requests, every shape compiled, time a plain token and a round
    at each depth, in each band, through the real engine; the seat's bands start from
    those times (and no acceptance), so its first request has a round policy."""
    from seatd.engine_types import output_width
    from seatd.model_load import load_for_compute
    from shared.protocol import Generate, SamplingParams
    from tests.spec_models import model_seat

    target = load_for_compute(target_dir(), None)
    drafter = load_for_compute(drafter_dir(), None)
    runs = [r for r in warm_shapes.plan(True, target.context_length)
            if r.measure and r.depth in (0, 2)]
    got: list[dict[bool, dict[int, float]]] = []
    warmed = warm_shapes.warm_up(target.model, target.tokenizer, target.context_length,
                                 output_width(target.model), drafter.model, runs, got.append)
    assert warmed.requests == len(runs) == 4 and warmed.failed == 0
    assert len(got) == 1 and set(got[0]) == {False, True}
    for sampled in (False, True):
        # (a round near a request's end drafts what room is left: a depth of its own)
        assert set(got[0][sampled]) >= {0, 2} and all(t > 0 for t in got[0][sampled].values())
    seat = model_seat(target.model, target.tokenizer_hash)
    request = Generate("r", False, SamplingParams(temperature=0, max_tokens=8))
    fresh = seat.plan(request, "fp16")
    assert fresh is not None and fresh.policy is None  # a warm depth, pinned
    seat.take_times({False: {**got[0][False], 1: got[0][False][2] * 0.8}})
    seeded = seat.plan(request, "fp16")
    assert seeded is not None and seeded.policy is not None
    assert seeded.policy.seconds[0] == got[0][False][0]
    assert seat.bands[False].accept == DepthStats().accept
    assert seat.bands[True].seconds == {}  # the band it was not given
    # the counters show what the seat's rounds cost by depth, and only the band it has
    shown = seat.cost_snapshot()
    assert shown["round_greedy_d0"] == round(got[0][False][0] * 1e6)
    assert shown["round_greedy_d1"] == round(got[0][False][2] * 0.8 * 1e6)
    assert not any(k.startswith("round_sampled") for k in shown)
