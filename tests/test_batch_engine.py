"""The batch engine in-process, on the packaged demo pair: rows with their own sampling
parameters, seeds, stops, lanes and drafters decode together; a row that is cancelled,
whose drafter fails or whose prefill fails ends alone; the engine runs on."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from seatd import batch
from seatd.adaptive import DepthStats, RoundPolicy, seed_times
from seatd.batch import Engine
from seatd.batch_policy import SETTLED
from seatd.counters import PARTS, STAGES
from seatd.decode import decode
from seatd.drafters import Draft, ModelDrafter
from seatd.engine_io import Admitted, RowCancelled, Text, Transcript, Work
from seatd.engine_types import DecodeResult, Resume, Speculation, output_width
from seatd.kv_budget import KVBudget
from seatd.sampling import Draws
from shared.protocol import Generate, SamplingParams

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):",
           "import os\n\ndef walk(path):", "# sort a list\ndef quicksort(xs):"]
PARAMS = [SamplingParams(max_tokens=18, temperature=0),
          SamplingParams(max_tokens=14, temperature=0.7, seed=5),
          SamplingParams(max_tokens=18, temperature=0, stop=["\n\n"]),
          SamplingParams(max_tokens=16, temperature=1.0, seed=9, top_p=0.9)]
LANES = ["fp16", "q8", "fp16", "q8"]


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any, Any]:
    from seatd.model_load import load_for_compute
    from shared.builtin import resolve_model

    target = load_for_compute(resolve_model("builtin:demo"), None)
    drafter = load_for_compute(resolve_model("builtin:demo-drafter"), None)
    return target.model, target.tokenizer, drafter.model


@dataclass
class Run:
    results: dict[int, tuple[DecodeResult | None, BaseException | None]] = field(
        default_factory=dict)
    streamed: dict[int, list[str]] = field(default_factory=dict)
    cancel: set[int] = field(default_factory=set)


class BrokenDrafter(ModelDrafter):
    """A drafter that raises on its second proposal."""

    calls = 0

    def propose(self, k: int, params: SamplingParams, draws: Draws, position: int) -> Draft:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("drafter fault")
        return super().propose(k, params, draws, position)


class Given:
    """An admission that resumes the given requests from the given caches (a broken one
    makes their prefill fail) and takes each request's own speculation plan."""

    def __init__(self, resumes: dict[str, Resume]) -> None:
        self.resumes = resumes

    def admit(self, work: Work) -> Admitted:
        return Admitted(self.resumes.get(work.rid), work.spec)


def drive(engine: Engine, n: int) -> Transcript:
    """Steps until `n` requests ended; what the engine said of each."""
    told = Transcript()
    while len(told.ended) < n:
        engine.step()
        told.read(engine.outbox)
    return told


def run(pair: tuple[Any, Any, Any], *, spec: Sequence[str | None] = (None,) * 4,
        stream: bool = True, cancel_after: dict[int, int] | None = None,
        broken_cache: int | None = None, solo: int | None = None) -> Run:
    model, tok, drafter = pair
    resumes = {str(broken_cache): Resume(cache=[object()], start=2)} \
        if broken_cache is not None else {}
    engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30),
                    Given(resumes))
    out = Run()
    cancel_after = cancel_after or {}
    works: dict[str, Work] = {}
    for i, (prompt, params, kv) in enumerate(zip(PROMPTS, PARAMS, LANES, strict=True)):
        out.streamed[i] = []
        kind = spec[i]
        plan = None
        if kind is not None:
            d = BrokenDrafter(drafter) if kind == "broken" else ModelDrafter(drafter)
            plan = Speculation(d, 3, DepthStats())
        request = Generate(str(i), stream, params, prompt=prompt, solo=True if i == solo else None)
        works[str(i)] = Work(request, tok.encode(prompt), kv, spec=plan)
        engine.submit(works[str(i)])
    told = Transcript()
    while len(told.ended) < len(PROMPTS):
        engine.step()
        for event in told.read(engine.outbox):
            if isinstance(event, Text):
                i = int(event.rid)
                if stream:
                    out.streamed[i].append(event.text)
                if event.count >= cancel_after.get(i, 1 << 30):
                    works[event.rid].cancel.set()
    for i in range(len(PROMPTS)):
        out.results[i] = (told.result(str(i)), told.error(str(i)))
    assert not engine.rows() and not engine.lanes
    assert engine.budget.rows == []
    return out


@pytest.fixture(scope="module")
def plain_ref(pair: tuple[Any, Any, Any]) -> Run:
    """The four rows batched, no drafters: the reference several tests compare with."""
    return run(pair)


@pytest.fixture(scope="module")
def mixed_ref(pair: tuple[Any, Any, Any]) -> Run:
    """The four rows batched, drafters on rows 0 and 2: another shared reference."""
    return run(pair, spec=("model", None, "model", None))


def each_as_alone(model: Any, tok: Any, prompts: dict[str, list[int]],
                  budgets: dict[str, int], results: dict[str, DecodeResult | None]) -> None:
    """Every greedy answer equals its prompt decoded alone (fp16, 4,096 context)."""
    for rid, prompt in prompts.items():
        got = results[rid]
        assert got is not None
        want = decode(model, tok, prompt, SamplingParams(max_tokens=budgets[rid],
                                                         temperature=0),
                      kv="fp16", context_length=4096)
        assert got.text == want.text, rid


def alone(pair: tuple[Any, Any, Any], i: int) -> str:
    model, tok, _ = pair
    return decode(model, tok, tok.encode(PROMPTS[i]), PARAMS[i], kv=LANES[i],
                  context_length=2048).text


def test_rows_answer_as_their_requests_alone(pair: tuple[Any, Any, Any],
                                             plain_ref: Run) -> None:
    plain = plain_ref
    fast = run(pair, spec=("model",) * 4, stream=False)
    for i in range(4):
        result, error = plain.results[i]
        assert error is None and result is not None
        assert "".join(plain.streamed[i]) == result.text  # stream pieces make the answer
        assert result.speculation.state == "off"
        spec_result, spec_error = fast.results[i]
        assert spec_error is None and spec_result is not None
        assert spec_result.speculation.state == "accelerated", i
        # Greedy and seeded rows: the same bytes with and without speculation, batched.
        assert spec_result.text == result.text, i
        assert result.text == alone(pair, i), i
    assert plain.results[2][0] is not None and plain.results[2][0].finish_reason == "stop"


def test_a_cancelled_row_leaves_the_others_whole(pair: tuple[Any, Any, Any],
                                                 mixed_ref: Run) -> None:
    ref = mixed_ref
    got = run(pair, spec=("model", None, "model", None), cancel_after={1: 3})
    result, error = got.results[1]
    assert result is None and isinstance(error, RowCancelled)
    for i in (0, 2, 3):
        assert got.results[i][1] is None
        assert got.results[i][0] is not None and ref.results[i][0] is not None
        assert got.results[i][0].text == ref.results[i][0].text, i


def test_a_failing_drafter_declines_its_row_only(pair: tuple[Any, Any, Any],
                                                 plain_ref: Run) -> None:
    ref = plain_ref
    got = run(pair, spec=("broken", "model", "model", "model"))
    states = [r.speculation.state for r, _ in (got.results[i] for i in range(4))
              if r is not None]
    assert states == ["declined:drafter_error", "accelerated", "accelerated", "accelerated"]
    for i in range(4):
        assert got.results[i][0] is not None and ref.results[i][0] is not None
        assert got.results[i][0].text == ref.results[i][0].text, i


def test_a_failing_prefill_fails_its_row_only(pair: tuple[Any, Any, Any],
                                              plain_ref: Run) -> None:
    ref = plain_ref
    got = run(pair, broken_cache=2)
    result, error = got.results[2]
    assert result is None and error is not None and not isinstance(error, RowCancelled)
    for i in (0, 1, 3):
        assert got.results[i][0] is not None and ref.results[i][0] is not None
        assert got.results[i][0].text == ref.results[i][0].text, i


def test_a_model_that_cannot_batch_serves_one_row_at_a_time(
        pair: tuple[Any, Any, Any], mixed_ref: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """Caches the batch cannot hold (sliding windows, ...) fall back to one row at a time
    in mlx-lm's own cache: the same answers, never two rows in one forward."""
    from seatd import batch
    from seatd.rows_cache import OneRow

    ref = mixed_ref  # batched, before the fallback is patched in
    monkeypatch.setattr(batch, "lane_cache", lambda model, kv: OneRow(model, kv))
    sizes: list[int] = []
    real = batch.Engine._decode

    def watched(self: Engine, lane: Any) -> None:
        sizes.append(len(lane.rows))
        real(self, lane)

    monkeypatch.setattr(batch.Engine, "_decode", watched)
    got = run(pair, spec=("model", None, "model", None))
    assert set(sizes) == {1}
    for i in range(4):
        assert got.results[i][0] is not None and ref.results[i][0] is not None
        assert got.results[i][0].text == ref.results[i][0].text, i


def test_a_solo_row_never_shares_a_forward(pair: tuple[Any, Any, Any],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`solo`: the row decodes in a lane of its own beside the batch, so its bytes are
    those of the request alone whatever its neighbours; the others still batch."""
    from seatd import batch

    shapes: list[tuple[str, int]] = []
    real = batch.Engine._decode

    def watched(self: Engine, lane: Any) -> None:
        shapes.append((lane.rows[0].rid, len(lane.rows)))
        real(self, lane)

    monkeypatch.setattr(batch.Engine, "_decode", watched)
    got = run(pair, spec=(None, "model", None, None), solo=1)
    assert {n for rid, n in shapes if rid == "1"} == {1}
    assert max(n for rid, n in shapes if rid != "1") == 2  # rows 0 and 2 share fp16
    result = got.results[1][0]
    assert result is not None and result.text == alone(pair, 1)
    # Whether an answer shared a forward with another request's rows (on CUDA that names
    # its fingerprint apart: `seatd.fingerprint.beside`).
    assert result.beside is False
    assert all(got.results[i][0].beside for i in (0, 2))  # type: ignore[union-attr]


def test_joining_rows_share_prefill_forwards(pair: tuple[Any, Any, Any],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that arrive together are prefilled by one forward per step; a row arriving
    later is prefilled first until it reaches the group's offset, then joins it; a solo
    row never shares a forward.  Every answer is the request's own alone."""
    from seatd import batch

    model, tok, _ = pair
    seen: list[tuple[tuple[str, ...], int]] = []
    real = batch.Engine._prefill_group

    def watched(self: Engine, group: Any) -> None:
        seen.append((tuple(r.rid for r in group.rows), group.done))
        real(self, group)

    monkeypatch.setattr(batch.Engine, "_prefill_group", watched)
    text = open(batch.__file__).read()
    prompts = [tok.encode(text[i * 300 : i * 300 + 1000 + 150 * i]) for i in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0)
    engine = Engine(model, tok, 4096, output_width(model), 8, KVBudget(1 << 30))
    told = Transcript()

    def submit(i: int, solo: bool = False) -> None:
        request = Generate(str(i), False, params, prompt="-", solo=True if solo else None)
        engine.submit(Work(request, prompts[i], "fp16"))

    for i in range(3):
        submit(i)
    submit(4, solo=True)
    engine.step()
    assert seen[0] == (("0", "1", "2"), 0)  # one forward for the three
    submit(3)
    while len(told.ended) < 5:
        engine.step()
        told.read(engine.outbox)
    groups = [rids for rids, _ in seen]
    first = groups.index(("3",))
    assert ("0", "1", "2", "3") in groups[first:]  # caught up, then merged
    assert all(rids == ("4",) for rids in groups if "4" in rids)
    for i in range(5):
        got = told.result(str(i))
        assert got is not None
        want = decode(model, tok, prompts[i], params, kv="fp16", context_length=4096)
        assert got.text == want.text, i


@dataclass
class Prefills:
    """What an engine's joining groups did: each prefill forward's (rows, offset before,
    tokens), and each joining row's (cache tokens, prompt tokens less 1)."""

    steps: list[tuple[int, int, int]] = field(default_factory=list)
    joined: dict[str, tuple[int, int]] = field(default_factory=dict)
    together: list[int] = field(default_factory=list)  # rows of each join of several


def watch_prefills(monkeypatch: pytest.MonkeyPatch) -> Prefills:
    from seatd import batch
    from seatd.rows_cache import RowsCache

    seen = Prefills()
    real, real_joined = batch.Engine._prefill_group, batch.Engine._joined
    real_rows = RowsCache.join_rows

    def prefill(self: Engine, group: Any) -> None:
        before, rows = group.done, len(group.rows)
        real(self, group)
        seen.steps.append((rows, before, group.done - before))

    def joined(self: Engine, row: Any) -> None:
        lane = self.lanes[row.lane]  # the row's tokens in its lane's cache, as it joins
        held = int(lane.cache.layout.valid[len(lane.rows)].sum())
        seen.joined[row.rid] = (held, row.join_at)
        real_joined(self, row)

    def join_rows(self: RowsCache, rows: list[Any], lengths: Any) -> None:
        seen.together.append(len(lengths))
        real_rows(self, rows, lengths)

    monkeypatch.setattr(batch.Engine, "_prefill_group", prefill)
    monkeypatch.setattr(batch.Engine, "_joined", joined)
    monkeypatch.setattr(RowsCache, "join_rows", join_rows)
    return seen


@pytest.mark.parametrize("fit, forwards", [
    ((0.05, 1e-7, 0.0), 1),  # a forward's fixed part dominates: one, the shorter padded
    ((0.0, 1e-3, 0.0), 3),  # every token costs: a forward at each prompt's end
], ids=["launch-bound", "token-bound"])
def test_a_cohort_of_near_lengths_prefills_past_the_shorter_prompts(
        pair: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch,
        fit: tuple[float, float, float], forwards: int) -> None:
    """Prompts of 40, 41 and 43 tokens arriving together take one forward where the
    measured prefill cost says a forward costs more than the filler tokens after the
    shorter two (their caches cut back to their own prompts as they join), and one
    forward per prompt end where it says the opposite.  Either way every answer, greedy
    and seeded, is the request's own alone."""
    from seatd import batch

    model, tok, _ = pair
    seen = watch_prefills(monkeypatch)
    text = open(batch.__file__).read()
    base = tok.encode(text[3000:4000])
    prompts = [base[:40], base[1:42], base[2:45]]
    params = [SamplingParams(max_tokens=12, temperature=0),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3),
              SamplingParams(max_tokens=12, temperature=0)]
    engine = Engine(model, tok, 4096, output_width(model), 8, KVBudget(1 << 30))
    monkeypatch.setattr(engine.prefill_cost, "fit", lambda: fit)
    for i, prompt in enumerate(prompts):
        engine.submit(Work(Generate(str(i), False, params[i], prompt="-"), prompt, "fp16"))
    told = drive(engine, 3)
    assert len(seen.steps) == forwards, seen.steps
    assert seen.steps[0][0] == 3  # the three together
    assert all(got == own for got, own in seen.joined.values()), seen.joined  # no filler
    assert len(seen.joined) == 3
    # prompts in after one forward join in one call, as one segment; one by one else
    assert seen.together == ([3] if forwards == 1 else [])
    for i, prompt in enumerate(prompts):
        got = told.result(str(i))
        assert got is not None
        want = decode(model, tok, prompt, params[i], kv="fp16", context_length=4096)
        assert got.token_ids == want.token_ids and got.text == want.text, i


def test_a_padded_prefill_stops_at_a_rows_keep_point_and_cuts(
        pair: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose prompt cache keeps its first 20 tokens and cuts at 30 (a turn's end):
    the group's padded forwards stop at both (the keep gets exactly 20 tokens of the
    row's own), then go past the shorter prompts' ends as a launch-bound forward pays.
    Every answer is its own alone, every joined cache its own prompt."""
    from seatd import batch

    model, tok, _ = pair
    seen = watch_prefills(monkeypatch)
    kept: list[int] = []
    resume = Resume(keep_at=20, keep=lambda cache: kept.append(int(cache[0].offset)),
                    cuts=(30,))
    text = open(batch.__file__).read()
    base = tok.encode(text[5000:6000])
    prompts = [base[:40], base[1:42], base[2:45]]
    params = SamplingParams(max_tokens=10, temperature=0)
    engine = Engine(model, tok, 4096, output_width(model), 8, KVBudget(1 << 30),
                    Given({"1": resume}))
    monkeypatch.setattr(engine.prefill_cost, "fit", lambda: (0.05, 1e-7, 0.0))
    for i, prompt in enumerate(prompts):
        engine.submit(Work(Generate(str(i), False, params, prompt="-"), prompt, "fp16"))
    told = drive(engine, 3)
    assert [(at, n) for _, at, n in seen.steps] == [(0, 20), (20, 10), (30, 12)], seen.steps
    assert kept == [20]
    assert all(got == own for got, own in seen.joined.values()), seen.joined
    for i, prompt in enumerate(prompts):
        got = told.result(str(i))
        assert got is not None
        want = decode(model, tok, prompt, params, kv="fp16", context_length=4096)
        assert got.token_ids == want.token_ids, i


def test_a_cohort_of_chats_joins_at_their_last_cuts_and_is_fed_the_rest(
        pair: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Chats arriving together, each cut at its system message's end and at its answer's
    header three tokens before its end (`seatd.turns`): their prefill ends at each one's
    last cut (`prefill_rows.join_point`), so the group takes the system message, then
    one padded forward to the furthest cut, where a forward a distinct cut and end took
    before; the keep at the last cut holds exactly the prompt up to it; the rows join
    together and their steps feed them the header a token a step.  Every answer is its
    request's own: greedy ones as decoded alone without cuts, seeded ones as the same
    engine gives each alone."""
    from seatd import batch

    model, tok, _ = pair
    text = open(batch.__file__).read()
    system = tok.encode(text[100:160])[:10]
    header = tok.encode(text[7000:7040])[:3]
    prompts = [system + tok.encode(text[3000 + 400 * i : 3000 + 400 * i + 90 + 25 * i])
               + header for i in range(4)]
    params = [SamplingParams(max_tokens=12, temperature=0),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3),
              SamplingParams(max_tokens=12, temperature=0),
              SamplingParams(max_tokens=12, temperature=0.8, seed=4)]

    def run(rows: list[int]) -> tuple[Transcript, list[int]]:
        kept: list[int] = []
        resumes = {str(i): Resume(keep_at=len(prompts[i]) - 4, cuts=(10, len(prompts[i]) - 4),
                                  keep=lambda cache: kept.append(int(cache[0].offset)))
                   for i in rows}
        engine = Engine(model, tok, 4096, output_width(model), 8, KVBudget(1 << 30),
                        Given(resumes))
        monkeypatch.setattr(engine.prefill_cost, "fit", lambda: (0.05, 1e-7, 0.0))
        for i in rows:
            engine.submit(Work(Generate(str(i), False, params[i], prompt="-"), prompts[i],
                               "fp16"))
        return drive(engine, len(rows)), kept

    seen = watch_prefills(monkeypatch)
    told, kept = run([0, 1, 2, 3])
    cuts = [len(p) - 4 for p in prompts]
    assert [(rows, at, n) for rows, at, n in seen.steps] == [(4, 0, 10), (4, 10, max(cuts) - 10)]
    assert sorted(kept) == sorted(cuts)
    assert seen.together == [4]
    assert {rid: got for rid, (got, _) in seen.joined.items()} == {
        str(i): c for i, c in enumerate(cuts)}
    for i, prompt in enumerate(prompts):
        got = told.result(str(i))
        assert got is not None and told.error(str(i)) is None
        assert got.completion_tokens == 12 or got.finish_reason == "stop"
        if params[i].temperature == 0:
            want = decode(model, tok, prompt, params[i], kv="fp16", context_length=4096)
            assert got.token_ids == want.token_ids, i
        else:
            alone = run([i])[0].result(str(i))
            assert alone is not None and got.token_ids == alone.token_ids, i


def test_a_cohort_prefills_in_whole_chunks_a_latecomer_keeps_pace(
        pair: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts that arrived together are one cohort: once the shortest decodes, the
    others still prefill in whole chunks (no row had a pace of its own when they
    arrived), so the batch fills at once.  A prompt arriving while those rows decode
    keeps to their pace, riding their steps.  Every answer is its own alone."""
    from seatd import batch
    from seatd.batch_policy import PACE_STEPS
    from seatd.engine_types import PREFILL_CHUNK

    model, tok, _ = pair
    # (rows, done, tokens, rows decoding, kept to their pace)
    pieces: list[tuple[str, int, int, bool, bool]] = []
    real = batch.Engine._chunk

    def watched(self: Engine, group: Any, budget: int | None = None) -> int:
        n = real(self, group, budget)
        pieces.append((",".join(r.rid for r in group.rows), group.done, n, self._decoding(),
                       self._prefill_time(group) is not None))
        return n

    rode: list[tuple[str, int]] = []  # (row, tokens) of each step a prompt rode
    real_ridden = batch.Engine._ridden

    def ridden(self: Engine, aboard: Any) -> None:
        rode.append((aboard.group.rows[0].rid, aboard.tokens))
        real_ridden(self, aboard)

    monkeypatch.setattr(batch.Engine, "_chunk", watched)
    monkeypatch.setattr(batch.Engine, "_ridden", ridden)
    text = open(batch.__file__).read()
    prompts = {"short": tok.encode(text[:400]), "long": tok.encode(text[2000:6000]),
               "late": tok.encode(text[8000:12000])}
    budgets = {"short": 64, "long": 64, "late": 8}
    engine = Engine(model, tok, 4096, output_width(model), 8, KVBudget(1 << 30))
    told = Transcript()

    def submit(rid: str) -> None:
        params = SamplingParams(max_tokens=budgets[rid], temperature=0)
        engine.submit(Work(Generate(rid, False, params, prompt="-"), prompts[rid], "fp16"))

    apart = 0  # the most KV segments a lane held: rows ~900 tokens apart keep two

    def step() -> None:
        nonlocal apart
        engine.step()
        told.read(engine.outbox)
        apart = max([apart, *(getattr(lane.cache, "segments", 1)
                              for lane in engine.lanes.values())])

    submit("short")
    submit("long")
    while not any(r.rid == "long" for lane in engine.lanes.values() for r in lane.rows):
        step()
    began = engine.decoded
    while engine.decoded - began < PACE_STEPS:  # the rows have a pace of their own
        step()
    submit("late")
    while len(told.ended) < 3:
        step()
    assert apart >= 2
    n_long = len(prompts["long"]) - 1
    cohort = [(done, n, kept) for rows, done, n, decoding, kept in pieces
              if rows == "long" and decoding]
    assert cohort, "the short row decoded while the long one prefilled"
    for done, n, kept in cohort:  # whole chunks, on the chunk grid, as if nobody decoded
        assert not kept and n == min(PREFILL_CHUNK - done % PREFILL_CHUNK, n_long - done), \
            (done, n)
    # The latecomer's pieces are sized by the decoding rows' pace (how many tokens that
    # is depends on this machine's measured times, so the test asks which rule sized it).
    late = [kept for rows, _, _, decoding, kept in pieces if rows == "late" and decoding]
    assert late and all(late), late
    # ... and ride the decoding rows' steps (the demo's attention takes riders): no
    # prompt of the cohort did, and every token of the latecomer's that rode is counted.
    assert rode and {rid for rid, _ in rode} == {"late"}, rode
    assert sum(n for _, n in rode) <= len(prompts["late"]) - 1
    each_as_alone(model, tok, prompts, budgets, {r: told.result(r) for r in prompts})


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.9, seed=11),
    SamplingParams(max_tokens=24, temperature=0),
], ids=["seeded", "greedy"])
def test_a_continued_answer_goes_on_as_the_uninterrupted_one(
        pair: tuple[Any, Any, Any], params: SamplingParams) -> None:
    """A row given the first tokens of an answer (`Generate.prefix_ids`, after the prompt,
    as the worker puts them) samples from the answer positions after them: what it adds
    is the rest of the uninterrupted answer, token for token, and its budget is the
    whole answer's."""
    model, tok, drafter = pair
    prompt = tok.encode(PROMPTS[1])
    whole = decode(model, tok, prompt, params, kv="fp16", context_length=2048)
    assert whole.completion_tokens == 24
    for cut in (1, 9):
        engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30))
        head = whole.token_ids[:cut]
        request = Generate("c", False, params, prompt="-", prefix=tok.decode(head),
                           prefix_ids=tuple(head))
        engine.submit(Work(request, prompt + head, "fp16",
                           spec=Speculation(ModelDrafter(drafter), 3, DepthStats())))
        result = drive(engine, 1).result("c")
        assert result is not None
        assert result.completion_tokens == 24 - cut
        assert result.token_ids[-(24 - cut):] == whole.token_ids[cut:], cut


def test_a_batch_takes_plain_steps_while_a_prompt_joins_at_its_pace(
        pair: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that speculate together take plain steps while a prompt joins at their pace
    (`prompt_joining`): a step that carries the prompt could not be timed, and its share
    is of their plain step.  They speculate before and after; every answer is its own
    alone."""
    from seatd import batch
    from seatd.batch_policy import PACE_STEPS

    model, tok, drafter = pair
    # (verified, a prompt was joining at the pace beside a batch): a row left alone
    # speculates whoever joins (`Engine._plan`); its partner may stop first where the
    # prompt's pace, set by measured step times, takes more steps
    steps: list[tuple[bool, bool]] = []
    real_decode = batch.Engine._decode
    real_verify = batch.Engine._verify_step
    verified = [False]

    def decode_step(self: Engine, lane: Any) -> None:
        joining = len(lane.rows) > 1 and any(
            self._prefill_time(g) is not None for g in self.groups)
        verified[0] = False
        real_decode(self, lane)
        steps.append((verified[0], joining))

    def verify_step(self: Engine, *a: Any) -> Any:
        verified[0] = True
        return real_verify(self, *a)

    monkeypatch.setattr(batch.Engine, "_decode", decode_step)
    monkeypatch.setattr(batch.Engine, "_verify_step", verify_step)
    text = open(batch.__file__).read()
    prompts = {"a": tok.encode("def fibonacci(n):"), "b": tok.encode("class Stack:"),
               "late": tok.encode(text[8000:10000])}
    budgets = {"a": 60, "b": 60, "late": 4}
    engine = Engine(model, tok, 4096, output_width(model), 8, KVBudget(1 << 30))
    told = Transcript()

    def submit(rid: str) -> None:
        params = SamplingParams(max_tokens=budgets[rid], temperature=0)
        spec = Speculation(ModelDrafter(drafter), 3, DepthStats()) if rid != "late" else None
        engine.submit(Work(Generate(rid, False, params, prompt="-"), prompts[rid], "fp16",
                           spec=spec))

    submit("a")
    submit("b")
    def rows() -> list[Any]:
        return [r for lane in engine.lanes.values() for r in lane.rows]

    while len(rows()) < 2 or not any(v for v, _ in steps) \
            or engine.decoded - max(r.began for r in rows()) < PACE_STEPS:
        engine.step()
        told.read(engine.outbox)
    submit("late")
    while len(told.ended) < 3:
        engine.step()
        told.read(engine.outbox)
    assert any(j for _, j in steps), "the late prompt joined at the rows' pace"
    assert not any(v and j for v, j in steps), "no verify step while it joined"
    assert any(v and not j for v, j in steps)
    each_as_alone(model, tok, prompts, budgets, {r: told.result(r) for r in prompts})


def test_a_joining_prompts_share_is_of_the_rows_plain_step(
        pair: tuple[Any, Any, Any]) -> None:
    """A prompt joining decoding rows at their pace takes PREFILL_SHARE of their step as
    their plain step at their size is measured (their steps are plain while it joins),
    not of their steps' average with verify steps in it; before a plain step of the size
    is settled, of that average (`Lane.step_s`)."""
    from seatd.batch import PREFILL_SHARE
    from seatd.batch_policy import SETTLED

    model, tok, _ = pair
    engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30))
    for rid, text in (("a", "def fibonacci(n):"), ("b", "class Stack:")):
        engine.submit(Work(Generate(rid, False, SamplingParams(max_tokens=64, temperature=0),
                                    prompt="-"), tok.encode(text), "fp16"))
    while sum(len(lane.rows) for lane in engine.lanes.values()) < 2:
        engine.step()
    lane = next(lane for lane in engine.lanes.values() if lane.rows)
    engine.costs = type(engine.costs)()  # nothing measured: the lane's own average
    lane.step_s = 0.300  # verify steps at twice a plain one, and more
    assert engine._prefill_time() == pytest.approx(PREFILL_SHARE * 0.300)
    for _ in range(SETTLED):
        engine.costs.observe(2, 1, 0.100)
    assert engine._prefill_time() == pytest.approx(PREFILL_SHARE * 0.100)


def test_a_batch_judges_verify_steps_on_steady_plain_steps(
        pair: tuple[Any, Any, Any]) -> None:
    """A plain step's time goes into the seat's step costs only after a plain step of
    the same rows (its forerunner's forward is what it waited on): the steps after a
    prefill, a verify step or a change of rows are counted untimed.  A verify step of a
    batch comes only once SETTLED such plain steps of its size were timed.  The answers
    are their own alone."""
    model, tok, drafter = pair
    engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30))
    seen: list[tuple[int, int, float | None]] = []
    real_observe = engine.costs.observe

    def observe(batch: int, width: int, seconds: float | None) -> None:
        seen.append((batch, width, seconds))
        real_observe(batch, width, seconds)

    engine.costs.observe = observe  # type: ignore[method-assign]
    prompts = {"a": tok.encode("def fibonacci(n):"), "b": tok.encode("class Stack:")}
    budgets = {"a": 48, "b": 48}
    for rid, prompt in prompts.items():
        params = SamplingParams(max_tokens=budgets[rid], temperature=0)
        engine.submit(Work(Generate(rid, False, params, prompt="-"), prompt, "fp16",
                           spec=Speculation(ModelDrafter(drafter), 3, DepthStats())))
    told = drive(engine, 2)
    pairs = [i for i, (b, _, _) in enumerate(seen) if b == 2]
    assert pairs, "the two rows decoded together"
    first_verify = next(i for i in pairs if seen[i][1] > 1)
    timed_plain = [i for i in pairs if seen[i][1] == 1 and seen[i][2] is not None]
    assert len([i for i in timed_plain if i < first_verify]) >= SETTLED
    assert seen[pairs[0]][2] is None, "the first step of the pair followed a change of rows"
    for i in timed_plain:
        assert i > 0 and seen[i - 1][:2] == (2, 1), "timed after a plain step of the pair"
    each_as_alone(model, tok, prompts, budgets, {r: told.result(r) for r in prompts})


def test_a_batch_where_shapes_build_on_first_use_steps_plain(
        pair: tuple[Any, Any, Any]) -> None:
    """Where each new shape is built on first use (`compiles`: CUDA), two speculating
    rows decoding together take plain steps only (`batch_policy.speculates`), their
    drafters take no prompt meanwhile, and each row verifies again once it is alone;
    each answer is its own alone."""
    model, tok, drafter = pair
    engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30),
                    compiles=True)
    seen: list[tuple[int, int]] = []
    real_observe = engine.costs.observe

    def observe(batch: int, width: int, seconds: float | None) -> None:
        seen.append((batch, width))
        real_observe(batch, width, seconds)

    engine.costs.observe = observe  # type: ignore[method-assign]
    prompts = {"a": tok.encode("def fibonacci(n):"), "b": tok.encode("class Stack:")}
    budgets = {"a": 24, "b": 64}
    drafters = {rid: ModelDrafter(drafter) for rid in prompts}
    for rid, prompt in prompts.items():
        params = SamplingParams(max_tokens=budgets[rid], temperature=0)
        engine.submit(Work(Generate(rid, False, params, prompt="-"), prompt, "fp16",
                           spec=Speculation(drafters[rid], 3, DepthStats())))
    told = drive(engine, 2)
    together = [w for b, w in seen if b == 2]
    assert together and set(together) == {1}, seen
    last = max(i for i, (b, _) in enumerate(seen) if b == 2)
    assert any(b == 1 and w > 1 for b, w in seen[last + 1:]), "b verified once alone"
    assert told.result("a") is not None and told.result("b") is not None
    assert told.result("a").speculation.state == "declined:batch_not_profitable"
    each_as_alone(model, tok, prompts, budgets, {r: told.result(r) for r in prompts})


def test_a_row_the_worker_calls_complete_ends_as_stopped(pair: tuple[Any, Any, Any]) -> None:
    """`Work.complete` (the worker saw a tool call made again): the row ends at the next
    step as an answer that stopped, not an error, short of its budget; its neighbour
    goes on to its own end."""
    model, tok, _ = pair
    engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30))
    params = SamplingParams(max_tokens=40, temperature=0)
    works = {rid: Work(Generate(rid, True, params, prompt=p), tok.encode(p), "fp16")
             for rid, p in (("a", PROMPTS[0]), ("b", PROMPTS[1]))}
    for work in works.values():
        engine.submit(work)
    told = Transcript()
    while len(told.ended) < 2:
        engine.step()
        for event in told.read(engine.outbox):
            if isinstance(event, Text) and event.rid == "a" and event.count >= 3:
                works["a"].complete.set()
    a, b = told.result("a"), told.result("b")
    assert told.error("a") is None and a is not None and a.finish_reason == "stop"
    assert a.completion_tokens < 40
    assert b is not None and b.completion_tokens == 40


def count_draws(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each draw the engine makes for a whole batch (`_sample_tempered`)."""
    together: list[int] = []
    real = Engine._sample_tempered

    def counted(logits: Any, rows: Any, *rest: Any) -> Any:
        together.append(len(rows))
        return real(logits, rows, *rest)

    monkeypatch.setattr(Engine, "_sample_tempered", staticmethod(counted))
    return together


def test_seeded_rows_sampling_by_temperature_alone_draw_together_and_keep_their_bytes(
        pair: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose sampling is temperature alone (seeded) and a greedy row, batched: their
    plain steps draw in one operation (`Engine._sample_tempered`), and every answer is
    the one its request gets alone."""
    model, tok, _ = pair
    together = count_draws(monkeypatch)
    params = {"a": SamplingParams(max_tokens=20, temperature=0.7, seed=11),
              "b": SamplingParams(max_tokens=20, temperature=1.2, seed=12),
              "c": SamplingParams(max_tokens=20, temperature=0)}
    prompts = {"a": PROMPTS[0], "b": PROMPTS[1], "c": PROMPTS[2]}
    engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30))
    for rid, p in params.items():
        engine.submit(Work(Generate(rid, False, p, prompt="-"), tok.encode(prompts[rid]),
                           "fp16"))
    told = drive(engine, 3)
    assert max(together) == 3, "the three rows drew together"
    for rid, p in params.items():
        got = told.result(rid)
        assert got is not None
        want = decode(model, tok, tok.encode(prompts[rid]), p, kv="fp16",
                      context_length=2048)
        assert got.token_ids == want.token_ids, rid


def _batched(model: Any, tok: Any, params: dict[str, SamplingParams]) -> Transcript:
    """The requests of `params` (request id: its sampling), on PROMPTS in order, batched
    by one engine until all ended."""
    engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30))
    for i, (rid, p) in enumerate(params.items()):
        engine.submit(Work(Generate(rid, False, p, prompt="-"), tok.encode(PROMPTS[i]),
                           "fp16"))
    return drive(engine, len(params))


def test_rows_temperatures_reach_the_device_once_for_each_set_of_rows(
        pair: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling rows batched: their temperatures are made on the device once for each
    set of rows decoding together (`Engine._temperatures`), not at every draw, and
    their answers are the ones each request gets alone."""
    model, tok, _ = pair
    together = count_draws(monkeypatch)
    made: list[tuple[float, ...]] = []
    real = batch._temperature_arrays

    def counted(temperatures: tuple[float, ...]) -> Any:
        made.append(temperatures)
        return real(temperatures)

    monkeypatch.setattr(batch, "_temperature_arrays", counted)
    params = {"a": SamplingParams(max_tokens=20, temperature=0.7, seed=21),
              "b": SamplingParams(max_tokens=20, temperature=1.2, seed=22),
              "c": SamplingParams(max_tokens=20, temperature=0)}
    told = _batched(model, tok, params)
    assert len(together) >= 19, "every plain step of the rows drew"
    assert made and len(made) == len(set(made)) < len(together) // 2
    for i, (rid, p) in enumerate(params.items()):
        got = told.result(rid)
        assert got is not None
        want = decode(model, tok, tok.encode(PROMPTS[i]), p, kv="fp16", context_length=2048)
        assert got.token_ids == want.token_ids, rid


def test_unseeded_sampling_rows_draw_together(
        pair: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Unseeded rows sampling by temperature alone, beside a greedy one, batched: their
    plain steps draw in one operation (on a GPU a row's own draw is launches of its
    own), and each answers in full."""
    model, tok, _ = pair
    together = count_draws(monkeypatch)
    params = {"a": SamplingParams(max_tokens=20, temperature=0.7),
              "b": SamplingParams(max_tokens=20, temperature=1.2),
              "c": SamplingParams(max_tokens=20, temperature=0)}
    told = _batched(model, tok, params)
    assert max(together) == 3, "the three rows drew together"
    want_c = decode(model, tok, tok.encode(PROMPTS[2]), params["c"], kv="fp16",
                    context_length=2048)
    for rid in params:
        got = told.result(rid)
        assert told.error(rid) is None and got is not None, rid
        assert got.completion_tokens == 20 or got.finish_reason == "stop", rid
    got_c = told.result("c")
    assert got_c is not None and got_c.token_ids == want_c.token_ids


def two_rows_verifying_at(engine: Engine, verify_s: float) -> None:
    """The engine's figures for 2 rows: a settled plain step of 10 ms, a verify step of
    every width `verify_s`."""
    engine.costs.seconds[(2, 1)], engine.costs.timed[(2, 1)] = 0.01, SETTLED
    for w in range(2, 17):
        engine.costs.seconds[(2, w)], engine.costs.timed[(2, w)] = verify_s, SETTLED


def cheap_rounds() -> tuple[DepthStats, RoundPolicy]:
    """A request's figures whose policy holds cheap rounds: 1 ms at every depth
    against a plain token's 10 ms (a few ms saved a token)."""
    stats = DepthStats()
    seed_times(stats, {0: 0.010, 1: 0.001, 2: 0.001, 3: 0.001})
    policy = RoundPolicy.from_stats(stats)
    assert policy is not None
    return stats, policy


@pytest.mark.parametrize("loses", [True, False])
def test_rows_of_a_batch_where_verifying_loses_take_no_drafter_prefill_until_alone(
        pair: tuple[Any, Any, Any], loses: bool) -> None:
    """Two speculating requests arriving together join a batch of 2.  Where a verify step
    of 2 rows was measured at 100 plain ones (a loss at any acceptance), neither row's
    model drafter takes the prompt while they decode together, their reports say why, and
    the row left alone catches its drafter up (its prefill timed, for the cost of the
    next); where it costs 1.1 plain ones, both drafters take their prompts as they
    join.  Either way every answer is its own alone."""
    model, tok, drafter = pair
    engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30))
    two_rows_verifying_at(engine, 1.0 if loses else 0.011)
    prompts = {"a": tok.encode("def fibonacci(n):"), "b": tok.encode("class Stack:")}
    budgets = {"a": 6, "b": 30}
    drafters = {rid: ModelDrafter(drafter) for rid in prompts}
    fed: dict[str, list[int]] = {rid: [] for rid in prompts}
    states: set[str] = set()
    for rid, prompt in prompts.items():
        params = SamplingParams(max_tokens=budgets[rid], temperature=0)
        engine.submit(Work(Generate(rid, False, params, prompt="-"), prompt, "fp16",
                           spec=Speculation(drafters[rid], 3, DepthStats())))
    told = Transcript()
    while len(told.ended) < 2:
        engine.step()
        told.read(engine.outbox)
        rows = [r for lane in engine.lanes.values() for r in lane.rows]
        if len(rows) == 2:
            for r in rows:
                fed[r.rid].append(drafters[r.rid]._done)
                states.add(r.report.state)
    assert fed["a"] and fed["b"], "the two rows decoded together"
    if loses:
        assert all(n == 0 for n in fed["a"] + fed["b"]), ("no drafter prefill beside", fed)
        assert states == {"declined:batch_not_profitable"}
        assert drafters["b"]._done == len(prompts["b"]) - 1, "alone, its drafter caught up"
        assert drafters["a"]._done == 0
    else:
        assert all(n == len(prompts[rid]) - 1 for rid in fed for n in fed[rid])
    assert engine.drafter_rate is not None and engine.drafter_rate > 0, "prefills timed"
    each_as_alone(model, tok, prompts, budgets, {r: told.result(r) for r in prompts})


@pytest.mark.parametrize("rate", [1.0, 1e-9])
def test_a_row_left_alone_catches_its_drafter_up_only_where_its_tokens_left_repay_it(
        pair: tuple[Any, Any, Any], rate: float) -> None:
    """As above where verifying 2 rows loses, with each request's policy holding cheap
    rounds (`cheap_rounds`) and the drafters' prefill measured at `rate` seconds a
    token.  When the shorter request ends, the row left alone (24 tokens to go, a
    context of 10) catches its drafter up where those tokens repay it (a nanosecond a
    token), not where they cannot (a second a token: 10 s against well under one), and
    finishes plain, declined as not profitable, its answer its own alone either way."""
    model, tok, drafter = pair
    engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30))
    two_rows_verifying_at(engine, 1.0)
    engine.drafter_rate = rate
    prompts = {"a": tok.encode("def fibonacci(n):"), "b": tok.encode("class Stack:")}
    budgets = {"a": 6, "b": 30}
    drafters = {rid: ModelDrafter(drafter) for rid in prompts}
    for rid, prompt in prompts.items():
        stats, policy = cheap_rounds()
        params = SamplingParams(max_tokens=budgets[rid], temperature=0)
        engine.submit(Work(Generate(rid, False, params, prompt="-"), prompt, "fp16",
                           spec=Speculation(drafters[rid], 3, stats, policy=policy)))
    told, alone, together = Transcript(), [], []
    while len(told.ended) < 2:
        engine.step()
        told.read(engine.outbox)
        rows = [r for lane in engine.lanes.values() for r in lane.rows]
        if len(rows) == 1 and rows[0].rid == "b":
            alone.append(rows[0].report.state)
        if len(rows) == 2:
            together.extend(drafters[r.rid]._done for r in rows)
    assert together and not any(together), "passed over while the two decoded together"
    assert alone, "b decoded alone after a ended"
    assert drafters["a"]._done == 0
    if rate == 1.0:
        assert drafters["b"]._done == 0, "10 s of catch-up for 24 tokens: not taken"
        assert set(alone) == {"declined:batch_not_profitable"}
    else:
        assert drafters["b"]._done >= len(prompts["b"]) - 1, "alone, its drafter caught up"
    each_as_alone(model, tok, prompts, budgets, {r: told.result(r) for r in prompts})


def test_a_row_that_begins_alone_takes_its_drafter_with_its_prompt_whatever_it_costs(
        pair: tuple[Any, Any, Any]) -> None:
    """A request alone from the start takes its drafter with its prompt even where the
    drafter's prefill was measured at a second a token and its 6 tokens could never
    repay it: its rounds keep the seat's figures current, and only a drafter passed
    over in a batch is judged by what the row has left (`catch_up_due`)."""
    model, tok, drafter = pair
    engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30))
    engine.drafter_rate = 1.0
    prompt = tok.encode("def fibonacci(n):")
    stats, policy = cheap_rounds()
    own = ModelDrafter(drafter)
    params = SamplingParams(max_tokens=6, temperature=0)
    engine.submit(Work(Generate("a", False, params, prompt="-"), prompt, "fp16",
                       spec=Speculation(own, 3, stats, policy=policy)))
    told = Transcript()
    while "a" not in told.ended:
        engine.step()
        told.read(engine.outbox)
    assert told.error("a") is None
    assert own._done >= len(prompt) - 1, "its drafter took the prompt"
    each_as_alone(model, tok, {"a": prompt}, {"a": 6}, {"a": told.result("a")})


def test_every_working_steps_time_lands_in_exactly_one_part(
        pair: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the engine's time went (`Engine.drain`), on a clock that ticks a
    millisecond a reading: a speculating request alone (its drafter takes the prompt, a
    second of readings each time, then verify rounds), then a plain one.  Every part is
    counted, each working step's `other` once, a drafter's prefill apart from the step
    or prefill it was taken in, and together the parts are the working steps' whole
    time; the decode steps are the plain and verify parts, a plain step's stages lie
    within its part; a drain empties them."""
    model, tok, drafter = pair
    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-3)
    engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30))
    whole = working = 0.0
    class Slow(ModelDrafter):  # its prefill takes a second of readings: clearly its own
        def advance(self, n: int) -> bool:
            for _ in range(1000):
                time.perf_counter()
            return super().advance(n)

    for rid, spec in (("spec", Speculation(Slow(drafter), 3, DepthStats())),
                      ("plain", None)):
        params = SamplingParams(max_tokens=12, temperature=0)
        engine.submit(Work(Generate(rid, False, params, prompt="-"),
                           tok.encode(PROMPTS[0]), "fp16", spec=spec))
        told = Transcript()
        while rid not in told.ended:
            began = time.perf_counter()
            worked = engine.step()
            if worked:  # the step's own readings lie between these two
                whole += time.perf_counter() - began - 2e-3
                working += 1
            told.read(engine.outbox)
        assert told.error(rid) is None
    drained = engine.drain()
    calls, us = drained.part_calls, drained.part_us
    assert set(calls) == set(PARTS), calls
    assert calls["other"] == working
    assert calls["drafter_prefill"] >= 1 and calls["verify"] >= 1 and calls["plain"] >= 1
    assert all(us[p] > 0 for p in PARTS), us
    assert us["drafter_prefill"] >= 1e6 * calls["drafter_prefill"]
    assert abs(sum(us.values()) - 1e6 * whole) <= sum(calls.values()), (us, whole)
    assert sum(drained.steps.values()) == calls["plain"] + calls["verify"]
    # a plain step's stages, each timed, lie within the plain part
    assert set(drained.stage_us) == set(STAGES) and all(drained.stage_us.values())
    assert sum(drained.stage_us.values()) <= us["plain"]
    again = engine.drain()
    assert (again.steps, again.part_calls, again.part_us, again.stage_us) == ({}, {}, {}, {})
