"""Drafter choice per round on the packaged demo pair, through a seat's own speculation
set-up (`SeatSpeculation`, as the worker plans a request) and the batch engine: a copy-heavy
prompt drafts by lookup in some rounds and by the model in others, each counted by drafter;
the answer's bytes equal plain decoding's, greedy and seeded; a seat whose model drafter
does not pay still drafts by lookup; the cost model's terms come from the rounds."""

from __future__ import annotations

from typing import Any

import pytest

from seatd.adaptive import MAX_DEPTH, observe
from seatd.batch import Drafting, Engine
from seatd.batch_policy import StepPlan
from seatd.counters import SeatCounters
from seatd.drafters import LookupDrafter, ModelDrafter
from seatd.engine_io import Transcript, Work
from seatd.engine_types import DecodeResult, output_width
from seatd.kv_budget import KVBudget
from seatd.speculation import SeatSpeculation
from shared.protocol import Generate, SamplingParams
from tests.spec_models import lookup_seat, model_seat, snippet, target_dir

COPY = "Repeat this code exactly:\n\n" + snippet(700) + "\n\nRepeated:\n\n"
TIMES = {0: 0.040, **{k: 0.045 + 0.010 * k for k in range(1, 7)}}  # a model round by depth


@pytest.fixture(scope="module")
def target() -> Any:
    from seatd.model_load import load_for_compute

    return load_for_compute(target_dir(), None)


def seat(target: Any, accept: float) -> SeatSpeculation:
    """The demo seat's speculation, past its warm-up: model rounds cost TIMES, the
    drafter keeps `accept` of each position, and the cost model has seen verifies."""
    spec: SeatSpeculation = model_seat(target.model, target.tokenizer_hash)
    for stats in spec.bands.values():
        for k, t in TIMES.items():
            stats.seen[k], stats.seconds[k] = 1, t
        stats.accept = [accept] * 6
        stats.requests = 1
    spec.costs.observe_plain(TIMES[0])
    for k in (2, 5):  # drafting is 0.010 a token; the verify the rest
        spec.costs.observe_round(k, 0.010 * k, TIMES[k] - 0.010 * k - 0.001, TIMES[k])
    return spec


def answers(target: Any, spec: SeatSpeculation | None, params: SamplingParams,
            prompts: tuple[str, ...] = (COPY,)) -> list[DecodeResult]:
    """The prompts' answers, decoded together.  After every step, each row whose model
    drafter holds its own cache is checked to be in step with the target: the tokens in
    its cache and those it has yet to feed are the prompt and every answer token the
    host has taken, whichever drafter drafted them."""
    engine = Engine(target.model, target.tokenizer, 2048, output_width(target.model), 8,
                    KVBudget(1 << 30))
    for i, prompt in enumerate(prompts):
        request = Generate(f"r{i}", False, params, prompt=prompt)
        plan = spec.plan(request, "fp16") if spec is not None else None
        engine.submit(Work(request, target.tokenizer.encode(prompt), "fp16", spec=plan))
    seen = Transcript()
    while len(seen.ended) < len(prompts):
        engine.step()
        seen.read(engine.outbox)
        for lane in engine.lanes.values():
            for row in lane.rows:
                drafter = row.work.spec.drafter if row.work.spec is not None else None
                if not isinstance(drafter, ModelDrafter) or not drafter.cache \
                        or not row.draft.drafter_in or not row.draft.speculating:
                    continue
                taken = row.issued - int(row.unread) - row.start
                assert drafter.cache[0].offset + len(drafter.pending) \
                    == len(row.work.prompt) + taken, row.rid
    results = [seen.error(f"r{i}") or seen.result(f"r{i}") for i in range(len(prompts))]
    for result in results:
        assert isinstance(result, DecodeResult), result
    return results  # type: ignore[return-value]


def answer(target: Any, spec: SeatSpeculation | None, params: SamplingParams,
           prompt: str = COPY) -> DecodeResult:
    return answers(target, spec, params, (prompt,))[0]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=48, temperature=0),
                                    SamplingParams(max_tokens=48, temperature=0.8, seed=3)],
                         ids=["greedy", "seeded"])
def test_copy_drafts_by_lookup_and_keeps_its_bytes(target: Any, params: SamplingParams) -> None:
    plain = answer(target, None, params)
    spec = seat(target, 0.7)
    seeded, rounds_before = spec.costs.snapshot(), spec.costs.rounds
    plan = spec.plan(Generate("p", False, params), "fp16")
    assert plan is not None and isinstance(plan.drafter, ModelDrafter)
    assert isinstance(plan.lookup, LookupDrafter) and plan.lookup_policies
    fast = answer(target, spec, params)
    assert fast.text == plain.text and fast.token_ids == plain.token_ids
    report = fast.speculation
    assert report.state == "accelerated"
    if params.temperature == 0:  # the model copies: the lookup's drafts are kept
        rounds, _, kept = report.by_drafter["lookup"]
        assert rounds > 0 and kept > 0
        # ... and drafted deeper than the model drafter goes (its rounds cost a verify)
        assert len(report.accepted_per_position) > MAX_DEPTH
        # A copy in progress matches far back: rounds of the long-match classes.
        assert any(s.rounds for key, s in spec.lookup_stats[False].items() if key >= 8)
    # The seat's figures, the lookup's and the model drafter's, are kept apart for
    # greedy and sampled requests.
    sampled = params.temperature > 0
    assert not any(s.rounds for s in spec.lookup_stats[not sampled].values())
    # Each lookup round's time also counts for the seat's lookup rounds of every class.
    pooled = spec.lookup_rounds[sampled]
    assert sum(pooled.timed.values()) == sum(
        c for s in spec.lookup_stats[sampled].values() for d, c in s.timed.items() if d > 0)
    assert not spec.lookup_rounds[not sampled].timed
    assert sum(pooled.timed.values()) > 0 or params.temperature > 0
    assert spec.bands[sampled].rounds > 0 and spec.bands[not sampled].rounds == 0
    assert sum(r for r, _, _ in report.by_drafter.values()) == report.drafts
    assert sum(k for _, _, k in report.by_drafter.values()) == report.accepted_tokens
    counters = SeatCounters("s", None)
    counters.speculation(report, "sync/fp16")
    snap = counters.snapshot()
    for name, index in (("spec_drafts_by_drafter", 0), ("spec_accepted_by_drafter", 2)):
        assert snap[name] == {d: t[index] for d, t in report.by_drafter.items()}
    # The rounds alone fed the cost model: some were split and timed apart.
    assert spec.costs.rounds > rounds_before
    terms = spec.costs.snapshot()
    assert terms != seeded and {"plain", "host"} <= set(terms)


def test_rows_batched_together_draft_by_lookup_and_keep_their_bytes(
        target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two copy-heavy rows in one batch, each choosing its drafter round by round (their
    model drafters drafting together where both draft by the model).  The seat's round
    times stay as set up (`seat`): the first row decodes alone for a while, and what its
    rounds' wall-clock times would teach the seat is this machine's load, not the
    choice under test (a busy moment once left no lookup round in a full run)."""
    from seatd import batch

    params = SamplingParams(max_tokens=40, temperature=0)
    other = "Repeat this code exactly:\n\n" + snippet(1400)[700:] + "\n\nRepeated:\n\n"
    prompts = (COPY, other)
    alone = [answer(target, None, params, p) for p in prompts]
    spec = seat(target, 0.7)
    monkeypatch.setattr(spec.costs, "observe_round", lambda *a, **k: None)
    monkeypatch.setattr(spec.costs, "observe_plain", lambda *a, **k: None)
    monkeypatch.setattr(batch, "observe", lambda stats, drafted, kept, seconds:
                        observe(stats, drafted, kept, None))  # acceptance, not time
    # ... and the batch verifies whenever its rows draft: whether a verify step pays at
    # 2 rows is the engine's measured step times (seatd.batch_policy), this machine's load.
    monkeypatch.setattr(batch, "decide_step",
                        lambda wants, size, costs, joining=False, compiles=False:
                        StepPlan(tuple(d for d, _ in wants)))
    together = answers(target, spec, params, prompts)
    for got, want in zip(together, alone, strict=True):
        assert got.token_ids == want.token_ids
        assert got.speculation.state == "accelerated"
    assert any("lookup" in got.speculation.by_drafter for got in together)


def test_a_seat_whose_model_drafter_does_not_pay_still_drafts_by_lookup(target: Any) -> None:
    params = SamplingParams(max_tokens=48, temperature=0)
    spec = seat(target, 0.02)  # the model drafter is hopeless at these round times
    plan = spec.plan(Generate("p", False, params), "fp16")
    assert plan is not None and plan.decline is None
    assert isinstance(plan.drafter, LookupDrafter) and plan.lookup is None
    fast = answer(target, spec, params)
    assert fast.text == answer(target, None, params).text
    assert fast.speculation.state == "accelerated"
    assert set(fast.speculation.by_drafter) == {"lookup"}
    # A pinned depth drafts by the model alone.
    pinned = spec.plan(Generate("p", False, params, draft_depth=3), "fp16")
    assert pinned is not None and isinstance(pinned.drafter, ModelDrafter)
    assert pinned.lookup is None



def test_a_match_class_is_trusted_once_the_seat_drafted_or_judged_enough_of_it(
        target: Any) -> None:
    """A request's first match of a class drafts at once only where the seat had drafted
    or judged TRUSTED_ROUNDS rounds of that class when the request began: plain steps
    counted in the same figures do not count, nor do the other band's rounds."""
    from seatd.speculation import TRUSTED_ROUNDS

    spec = seat(target, 0.7)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    figures = spec.lookup_stats[False]
    figures[16].seen = {0: 100, 7: TRUSTED_ROUNDS}
    figures[8].seen = {0: 100, 5: TRUSTED_ROUNDS - 1}
    figures[3].seen = {0: 100}
    spec.lookup_stats[True][4].seen = {3: TRUSTED_ROUNDS}
    plan = spec.plan(Generate("p", False, greedy), "fp16")
    assert plan is not None and plan.lookup_trusted == frozenset({16})
    sampled = spec.plan(Generate("q", False, SamplingParams(max_tokens=8, temperature=0.5)),
                        "fp16")
    assert sampled is not None and sampled.lookup_trusted == frozenset({4})


def _lookup_alone_events(target: Any, spec: SeatSpeculation,
                         monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[str, int]],
                                                                    DecodeResult]:
    """The answer of COPY on a seat whose model drafter does not pay, and its lookup's
    events in order: ("judged", class) where a passed-over match was counted,
    ("drafted", class) where a round was decided to draft by lookup, ("counted", class)
    where a verified round was counted (by the class of the match it drafted from,
    which the context's newest token may have lengthened since the decision)."""
    events: list[tuple[str, int]] = []
    judge, alone, figures = Engine._judge_shadow, Engine._lookup_alone, Engine._figures

    def judging(row: Any, lookup: Any, policies: Any, stats: Any, trusted: Any) -> None:
        before = row.draft.shadow
        judge(row, lookup, policies, stats, trusted)
        if before is not None and row.draft.shadow is None:
            events.append(("judged", before[0]))

    def drafting(self: Engine, row: Any, room: int) -> tuple[int, float]:
        k, expected = alone(self, row, room)
        if k:
            events.append(("drafted", row.work.spec.drafter.key))
        return k, expected

    def counting(row: Any, spec: Any) -> Any:
        events.append(("counted", row.draft.lookup_key))
        return figures(row, spec)

    monkeypatch.setattr(Engine, "_judge_shadow", staticmethod(judging))
    monkeypatch.setattr(Engine, "_figures", staticmethod(counting))
    monkeypatch.setattr(Engine, "_lookup_alone", drafting)
    return events, answer(target, spec, SamplingParams(max_tokens=48, temperature=0))


def test_a_lookup_drafting_alone_judges_a_class_before_it_drafts_by_it(
        target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A seat with no figures of any match class: the request drafts by a class only
    once its own text has judged a match of it or of a shorter class (passed over, or
    drafted by a round decided at another class); the answer keeps its bytes."""
    spec = seat(target, 0.02)
    plan = spec.plan(Generate("p", False, SamplingParams(max_tokens=48)), "fp16")
    assert plan is not None and isinstance(plan.drafter, LookupDrafter)
    assert plan.lookup_trusted == frozenset()
    events, fast = _lookup_alone_events(target, spec, monkeypatch)
    drafted = [c for what, c in events if what == "drafted"]
    assert drafted, events  # the copy is long enough to draft by lookup
    for c in set(drafted):
        first = events.index(("drafted", c))
        assert any(what in ("judged", "counted") and k <= c for what, k in events[:first]), \
            events
    plain = answer(target, None, SamplingParams(max_tokens=48, temperature=0))
    assert fast.token_ids == plain.token_ids


def test_a_lookup_drafting_alone_drafts_a_trusted_class_at_its_first_match(
        target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from seatd.speculation import TRUSTED_ROUNDS

    spec = seat(target, 0.02)
    for figures in spec.lookup_stats[False].values():
        figures.seen = {0: 10, 4: TRUSTED_ROUNDS}
        figures.accept = [0.95] * len(figures.accept)
    events, _ = _lookup_alone_events(target, spec, monkeypatch)
    assert events and events[0][0] == "drafted", events


def test_a_lookup_seat_drafts_by_match_class_once_warm(target: Any) -> None:
    """A seat whose only drafter is the lookup keeps its figures by match class, as a
    model seat's lookup does: a stray short match that seldom holds does not park the
    copies that do.  Warming up (no policy yet) it drafts at the depth it tries."""
    spec = lookup_seat(target.model, target.tokenizer_hash)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    warming = spec.plan(Generate("w", False, greedy), "fp16")
    assert warming is not None and isinstance(warming.drafter, LookupDrafter)
    assert warming.policy is None and warming.lookup_policies is None
    greedy_figures = spec.bands[False]
    for k, t in TIMES.items():
        greedy_figures.seen[k], greedy_figures.seconds[k] = 1, t
    greedy_figures.accept = [0.05] * 6  # over every match: hopeless, as one figure
    greedy_figures.requests = 10
    figures = spec.lookup_stats[False]
    for key, seen, accept in ((16, {0: 10, 6: 8}, 0.97), (2, {0: 10, 3: 8}, 0.05)):
        figures[key].seen = seen
        figures[key].accept = [accept] * len(figures[key].accept)
    plan = spec.plan(Generate("p", False, greedy), "fp16")
    assert plan is not None and plan.decline is None
    assert isinstance(plan.drafter, LookupDrafter) and plan.lookup_policies
    assert plan.lookup_trusted == frozenset({2, 16})
    assert plan.lookup_policies[16].best() > 0 and plan.lookup_policies[2].best() == 0


def test_a_lookup_seat_takes_a_copy_up_again_from_a_bigram(
        target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A seat whose only drafter is the lookup drafts from bigrams too, by their own
    class: where a sampled answer strays from the copy for a token, the copy's next
    bigram drafts again a step before a trigram would.  Its seeded answer keeps its
    bytes."""
    from seatd.speculation import TRUSTED_ROUNDS

    spec = lookup_seat(target.model, target.tokenizer_hash)
    seeded = SamplingParams(max_tokens=64, temperature=0.8, seed=5)
    band = spec.bands[True]
    for k, t in TIMES.items():
        band.seen[k], band.seconds[k] = 1, t
    band.accept, band.requests = [0.9] * 6, 10
    for figures in spec.lookup_stats[True].values():
        figures.seen = {0: 10, 4: TRUSTED_ROUNDS}
        figures.accept = [0.95] * len(figures.accept)
    drafted: list[int] = []
    alone = Engine._lookup_alone

    def drafting(self: Engine, row: Any, room: int) -> tuple[int, float]:
        k, expected = alone(self, row, room)
        if k:
            drafted.append(row.work.spec.drafter.matched)
        return k, expected

    monkeypatch.setattr(Engine, "_lookup_alone", drafting)
    fast = answer(target, spec, seeded)
    assert 2 in drafted, drafted  # a round drafted from a match of two tokens alone
    monkeypatch.setattr(Engine, "_lookup_alone", alone)
    plain = answer(target, None, seeded)
    assert fast.token_ids == plain.token_ids


def test_a_drafter_that_pays_greedily_is_judged_apart_when_sampling(target: Any) -> None:
    """Greedy rounds that keep most drafts do not send sampled requests to the model
    drafter: a sampled draft is kept only where the target's draw lands on it, and the
    seat keeps the model drafter's figures by whether the request samples.  A sampled
    request whose band says the model does not pay drafts by the lookup alone."""
    spec = seat(target, 0.9)
    spec.bands[True].accept = [0.02] * 6  # sampled, its drafts seldom hold
    greedy = spec.plan(Generate("g", False, SamplingParams(max_tokens=8, temperature=0)),
                       "fp16")
    sampled = spec.plan(Generate("s", False, SamplingParams(max_tokens=8, temperature=0.7,
                                                            seed=1)), "fp16")
    assert greedy is not None and isinstance(greedy.drafter, ModelDrafter)
    assert greedy.stats is spec.bands[False]
    assert sampled is not None and sampled.decline is None
    assert isinstance(sampled.drafter, LookupDrafter) and sampled.lookup_policies


@pytest.mark.parametrize(("trusted", "answer", "judged"), [
    # an untrusted class: judged once its first JUDGE_TOKENS tokens held
    (frozenset(), [7], None),
    (frozenset(), [7, 8], (2, 2)),
    (frozenset(), [9], (6, 0)),  # a miss at once: judged whole
    # a trusted class: judged when the whole match held, or where it missed
    (frozenset({8}), [7, 8], None),
    (frozenset({8}), [7, 8, 9, 1], (6, 3)),
    (frozenset({8}), [7, 8, 9, 10, 11, 12], (6, 6)),
])
def test_a_passed_over_match_is_judged_early_where_its_class_is_not_trusted(
        trusted: frozenset[int], answer: list[int], judged: tuple[int, int] | None) -> None:
    """A passed-over match of a class the request does not trust is counted as soon as
    its first JUDGE_TOKENS tokens held, as a round of that depth that kept them all: the
    copy drafts from the next step instead of after the whole match went by."""
    from types import SimpleNamespace

    from seatd.adaptive import DepthStats, RoundPolicy
    from seatd.drafter_choice import JUDGE_TOKENS

    assert JUDGE_TOKENS == 2
    follow = [7, 8, 9, 10, 11, 12]
    row = SimpleNamespace(draft=Drafting(shadow=(8, 3, follow)))
    lookup = SimpleNamespace(context=[1, 2, 3, *answer])
    policy = RoundPolicy((0.01,) * 16, (0.6,) * 15)
    stats = DepthStats(max_depth=15)
    Engine._judge_shadow(row, lookup, {8: policy}, {8: stats}, trusted)  # type: ignore[arg-type]
    if judged is None:
        assert row.draft.shadow is not None and policy.tries[0] == 0 and not stats.seen
        return
    depth, kept = judged
    assert row.draft.shadow is None
    assert stats.seen == {depth: 1}
    tried = min(kept + 1, depth)
    assert policy.tries == [1] * tried + [0] * (15 - tried)
    assert policy.hits == [1] * kept + [0] * (15 - kept)


class Skewed:
    """The engine's clock (`seatd.batch.time`), injected: real time plus what the test
    adds to it (a round's host work that the seat's figures miss)."""

    def __init__(self) -> None:
        import time

        self.real, self.skew = time, 0.0

    def perf_counter(self) -> float:
        return float(self.real.perf_counter()) + self.skew

    def monotonic(self) -> float:
        return float(self.real.monotonic())


def test_a_request_whose_rounds_cost_more_than_its_seats_figures_parks_on_its_own(
        target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seat's figures say a round pays (its policy would draft, deep, from its first
    round); on the engine's (injected) clock every verify step takes 2 s more, as host
    work per round that the figures missed would.  Each drafter runs at most OWN_TIMES
    rounds, then its own times park it for good (a probe would cost more than the rest
    of its answer); its bytes are plain decoding's."""
    import seatd.batch as engine_module
    from seatd.adaptive import OWN_TIMES

    params = SamplingParams(max_tokens=48, temperature=0.8, seed=3)
    plain = answer(target, None, params)
    spec = seat(target, 0.7)
    plan = spec.plan(Generate("p", False, params), "fp16")
    assert plan is not None and plan.policy is not None and plan.policy.best() > 0
    clock = Skewed()
    verify = Engine._verify_step

    def slow(self: Engine, *args: Any, **kw: Any) -> Any:
        out = verify(self, *args, **kw)
        clock.skew += 2.0
        return out

    monkeypatch.setattr(engine_module, "time", clock)
    monkeypatch.setattr(Engine, "_verify_step", slow)
    parked = answer(target, spec, params)
    assert parked.token_ids == plain.token_ids and parked.text == plain.text
    rounds = {who: got[0] for who, got in parked.speculation.by_drafter.items()}
    assert 0 < sum(rounds.values()) and all(n <= OWN_TIMES for n in rounds.values()), rounds
