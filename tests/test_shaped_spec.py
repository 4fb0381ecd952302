"""Shaping on the real demo pair, through the batch engine in-process: penalties and
logit_bias change answers as they should, a grammar's mask holds on every path, and a
seeded shaped answer is the same bytes (and log-probabilities) with speculation on
(model drafter, batched or alone, and lookup, at pinned depths) and off; the rejection
sampler still follows the shaped target distribution."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import msgspec
import numpy as np
import pytest

from seatd.adaptive import DepthStats
from seatd.batch import Engine
from seatd.decode import decode
from seatd.drafters import Draft, LookupDrafter, ModelDrafter
from seatd.engine_io import Ended, Text, Transcript, Work
from seatd.engine_types import DecodeResult, Speculation, make_cache, output_width
from seatd.kv_budget import KVBudget
from seatd.sampling import Draws
from seatd.shaping import Matcher, Shaper
from seatd.verify import draft_probs, verify_sampled
from shared.protocol import Generate, SamplingParams, TokenLogprob
from tests.chi2 import chi2_critical, chi_square
from tests.test_shaping import FakeMatcher

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Any, Any, Any]]:
    from seatd.model_load import load_for_compute
    from shared.builtin import resolve_model

    target = load_for_compute(resolve_model("builtin:demo"), None)
    drafter = load_for_compute(resolve_model("builtin:demo-drafter"), None)
    yield target.model, target.tokenizer, drafter.model


@dataclass
class Ask:
    params: SamplingParams
    prompt: str = PROMPT
    drafter: str | None = None  # "model" | "lookup" | "plain-only" (cannot shape)
    depth: int = 3
    grammar: Matcher | None = None
    solo: bool = False


@dataclass
class Got:
    result: DecodeResult | None = None
    error: BaseException | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Unshaping(ModelDrafter):
    """A drafter that does not say it can shape."""

    shapes = False

    def propose(self, k: int, params: SamplingParams, draws: Draws, position: int,
                shaper: Shaper | None = None) -> Draft:
        return super().propose(k, params, draws, position)


def serve(pair: tuple[Any, Any, Any], asks: Sequence[Ask], failing: bool = False
          ) -> list[Got]:
    """Every ask as a row of one engine, decoded to the end (without an error, unless
    `failing`)."""
    model, tok, drafter_model = pair
    engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30))
    out = [Got() for _ in asks]
    for i, ask in enumerate(asks):
        plan = None
        if ask.drafter is not None:
            d: Any = (ModelDrafter(drafter_model) if ask.drafter == "model"
                      else LookupDrafter() if ask.drafter == "lookup"
                      else Unshaping(drafter_model))
            plan = Speculation(d, ask.depth, DepthStats())
        request = Generate(str(i), True, ask.params, prompt=ask.prompt, solo=ask.solo or None)
        engine.submit(Work(request, tok.encode(ask.prompt), "fp16", grammar=ask.grammar,
                           spec=plan))
    seen = Transcript()
    while len(seen.ended) < len(asks):
        engine.step()
        for event in seen.read(engine.outbox):
            got = out[int(event.rid)]
            if isinstance(event, Text):
                got.ids.extend(event.ids)
                got.logprobs.extend(event.logprobs)
            elif isinstance(event, Ended):
                got.result, got.error = event.result, event.error
    for g in out:
        assert failing or g.error is None, g.error
    return out


def _result(got: Got) -> DecodeResult:
    assert got.result is not None
    return got.result


def _repeats(ids: Sequence[int]) -> int:
    return len(ids) - len(set(ids))


def test_frequency_penalty_lowers_repetition(pair: tuple[Any, Any, Any]) -> None:
    """Over seeded runs, a strong frequency penalty repeats answer tokens less."""
    seeds = range(4)
    base = serve(pair, [Ask(SamplingParams(max_tokens=24, temperature=0.8, seed=s))
                        for s in seeds])
    pen = serve(pair, [Ask(SamplingParams(max_tokens=24, temperature=0.8, seed=s,
                                          frequency_penalty=2.0)) for s in seeds])
    before = sum(_repeats(_result(g).token_ids) for g in base)
    after = sum(_repeats(_result(g).token_ids) for g in pen)
    print(f"repeated answer tokens over {len(seeds)} seeds: {before} plain, {after} penalised")
    assert after < before


def test_a_negative_bias_removes_the_greedy_first_token(pair: tuple[Any, Any, Any]) -> None:
    """logit_bias -100 on the token the unbiased greedy answer begins with: the biased
    answer never contains it."""
    plain = serve(pair, [Ask(SamplingParams(max_tokens=12, temperature=0))])[0]
    first = _result(plain).token_ids[0]
    biased = serve(pair, [Ask(SamplingParams(max_tokens=12, temperature=0,
                                             logit_bias=((first, -100.0),)))])[0]
    assert first not in _result(biased).token_ids
    assert _result(biased).token_ids


SHAPED = SamplingParams(max_tokens=16, temperature=0.9, seed=7, presence_penalty=0.6,
                        frequency_penalty=0.4, repetition_penalty=1.2,
                        logit_bias=((16, 1.5),), min_p=0.02, logprobs=2)


def test_a_seeded_shaped_answer_does_not_depend_on_speculation(
        pair: tuple[Any, Any, Any]) -> None:
    """The same bytes and log-probabilities with speculation off and on: model drafter
    (alone and drafting with other rows) and lookup, pinned depths 1 to 4."""
    ref = serve(pair, [Ask(SHAPED, solo=True)])[0]
    text = _result(ref).text
    asks = [Ask(SHAPED, drafter=kind, depth=depth, solo=solo)
            for kind, solo in (("model", True), ("model", False), ("lookup", True))
            for depth in (1, 2, 3, 4)]
    got = serve(pair, asks)
    accelerated = 0
    for ask, g in zip(asks, got, strict=True):
        where = (ask.drafter, ask.depth, ask.solo)
        assert _result(g).text == text, where
        assert g.ids == _result(ref).token_ids, where
        accelerated += _result(g).speculation.state == "accelerated"
        assert [lp.token for lp in g.logprobs] == [lp.token for lp in ref.logprobs]
        for a, b in zip(g.logprobs, ref.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4), where
            assert [t for t, _ in a.top] == [t for t, _ in b.top], where
    assert accelerated == len(asks)  # every row verified drafts (batched: the rows drafter)


def test_logprobs_of_a_greedy_answer(pair: tuple[Any, Any, Any]) -> None:
    """One log-probability per answer token, in order, each the best of its sorted
    alternatives (greedy, unshaped); the same from a speculative row."""
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=3)
    plain, fast = serve(pair, [Ask(params, solo=True),
                               Ask(params, drafter="model", depth=3, solo=True)])
    for g in (plain, fast):
        assert len(g.logprobs) == len(_result(g).token_ids) == len(g.ids)
        for lp in g.logprobs:
            values = [v for _, v in lp.top]
            assert len(values) == 3 and values == sorted(values, reverse=True)
            assert lp.logprob == pytest.approx(values[0], abs=1e-6)
            assert lp.token == lp.top[0][0] and lp.bytes == tuple(lp.token.encode())
    assert _result(fast).speculation.state == "accelerated"
    for a, b in zip(plain.logprobs, fast.logprobs, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)


def _forbid(pair: tuple[Any, Any, Any], n: int) -> set[int]:
    """The tokens the unconstrained greedy answer uses most: the grammar forbids them."""
    plain = serve(pair, [Ask(SamplingParams(max_tokens=16, temperature=0))])[0]
    ids = _result(plain).token_ids
    return set(sorted(set(ids), key=lambda t: -ids.count(t))[:n])


def test_a_grammar_holds_on_every_path(pair: tuple[Any, Any, Any]) -> None:
    """Under a mask no forbidden token is taken, plain or speculative (a lookup drafter
    that copies them is cut before them), the seeded answer is the same on each path,
    and every token went into the grammar; a shaped row whose drafter cannot shape
    declines with `constrained`."""
    model, tok, _ = pair
    width = output_width(model)
    forbidden = _forbid(pair, 3)
    params = SamplingParams(max_tokens=14, temperature=0.7, seed=3)
    kinds = (None, "model", "lookup", "plain-only")
    grammars = [FakeMatcher(width, forbidden) for _ in kinds]
    # "def sub" copies "(a, b):\n    return a" from the prompt: the lookup drafter
    # proposes forbidden tokens, which the verifier must cut.
    got = serve(pair, [Ask(params, drafter=k, depth=3, grammar=g, solo=True)
                       for k, g in zip(kinds, grammars, strict=True)])
    ref = _result(got[0]).token_ids
    assert not forbidden & set(ref)
    for k, g, grammar in zip(kinds, got, grammars, strict=True):
        assert _result(g).token_ids == ref, k
        eos = set(tok.eos_token_ids)
        assert [t for t in grammar.taken if t not in eos] == ref, k
    assert _result(got[1]).speculation.state == "accelerated"
    assert _result(got[3]).speculation.state == "declined:constrained"


class BrokenMatcher(FakeMatcher):
    """A grammar whose second mask raises, as a matcher in its error state does."""

    calls = 0

    def _count(self) -> None:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("grammar fault")

    def mask(self) -> mx.array:
        self._count()
        return super().mask()

    def masks_along(self, tokens: Sequence[int]) -> tuple[mx.array, int]:
        self._count()
        return super().masks_along(tokens)


def test_a_failing_grammar_ends_its_row_only(pair: tuple[Any, Any, Any]) -> None:
    """A grammar that raises ends its own row with that error, plain or speculative;
    the rows beside it answer as they would alone."""
    model, _, _ = pair
    width = output_width(model)
    params = SamplingParams(max_tokens=8, temperature=0)
    alone = _result(serve(pair, [Ask(params)])[0]).text
    for drafter in (None, "lookup"):
        got = serve(pair, [Ask(params, grammar=BrokenMatcher(width, set()), drafter=drafter),
                           Ask(params)], failing=True)
        assert isinstance(got[0].error, RuntimeError) and got[0].result is None
        assert _result(got[1]).text == alone, drafter


def test_a_finished_grammar_ends_the_answer(pair: tuple[Any, Any, Any]) -> None:
    """A grammar that allows five tokens and then only the end: the answer stops there,
    on the plain path and the speculative one alike."""
    model, _, _ = pair
    width = output_width(model)
    params = SamplingParams(max_tokens=30, temperature=0)
    got = serve(pair, [Ask(params, grammar=FakeMatcher(width, set(), length=5, end=0)),
                       Ask(params, drafter="model", depth=4, solo=True,
                           grammar=FakeMatcher(width, set(), length=5, end=0))])
    for g in got:
        assert len(_result(g).token_ids) == 5
        assert _result(g).finish_reason == "stop"
    assert _result(got[0]).token_ids == _result(got[1]).token_ids


TRIALS = 20_000
BATCH = 5_000


def test_rejection_sampling_follows_the_shaped_target(pair: tuple[Any, Any, Any]) -> None:
    """Unseeded speculation under penalties, bias and a mask: the first token a verify
    round emits follows the shaped target's distribution (chi-square at alpha 0.001),
    with the drafter's q shaped as its proposal is; a verifier that forgot the shaping,
    or only the penalties, fails the same gate."""
    model, tok, drafter_model = pair
    ids = tok.encode(PROMPT)
    params = SamplingParams(temperature=1.0, top_p=0.95, presence_penalty=1.0,
                            frequency_penalty=0.5, repetition_penalty=1.3,
                            logit_bias=((16, 2.0),))
    width = output_width(model)
    p_raw = model(mx.array(ids, dtype=mx.uint32)[None], cache=make_cache(model, "fp16"))[0]
    q_raw = drafter_model(mx.array(ids, dtype=mx.uint32)[None],
                          cache=make_cache(drafter_model, "fp16"))[0]
    at = len(ids) - 1
    p_at = mx.softmax(p_raw[at].astype(mx.float32))
    best = [int(t) for t in np.argsort(-np.array(p_at))[:3]]
    answer = [best[1], best[1], best[2]]  # answer tokens so far: penalties bite
    shaper = Shaper(params, width, ids, answer, FakeMatcher(width, {best[0]}))
    p = draft_probs(shaper.shape(p_raw[at][None]), params)[0]
    q = draft_probs(shaper.cursor().shape(q_raw[at][None]), params)[0]
    unshaped = draft_probs(p_raw[at][None], params)[0]
    mask_only = Shaper(SamplingParams(), width, ids, answer, FakeMatcher(width, {best[0]}))
    unpenalised = draft_probs(mask_only.shape(p_raw[at][None]), params)[0]
    support = mx.array(np.nonzero(np.array((p + q + unshaped + unpenalised) > 0))[0])
    p, q, unshaped, unpenalised = (a[support] for a in (p, q, unshaped, unpenalised))
    probs = np.array(p, dtype=np.float64)
    assert float(p_at[best[0]]) > 0.01 and probs[np.array(support) == best[0]].sum() == 0

    def emitted(target: mx.array, seed: int) -> np.ndarray:
        vocab = target.shape[-1]
        counts = np.zeros(vocab, dtype=np.int64)
        full = mx.broadcast_to(target[None, None], (BATCH, 2, vocab))
        for i in range(TRIALS // BATCH):
            key_d, key_v = mx.random.split(mx.random.key(seed * 1000 + i))
            drafts = mx.random.categorical(mx.log(q), num_samples=BATCH, key=key_d)[:, None]
            qs = mx.broadcast_to(q[None, None], (BATCH, 1, vocab))
            n, token = verify_sampled(full, drafts, qs, key_v)
            counts += np.bincount(np.array(mx.where(n > 0, drafts[:, 0], token)),
                                  minlength=vocab)
        return counts

    stat, df = chi_square(emitted(p, 21), probs, TRIALS)
    print(f"shaped: chi2={stat:.1f} df={df} critical(0.001)={chi2_critical(df):.1f}")
    assert stat < chi2_critical(df)
    for name, wrong, seed in (("unshaped", unshaped, 22), ("mask only", unpenalised, 23)):
        bad, bad_df = chi_square(emitted(wrong, seed), probs, TRIALS)
        print(f"{name} verifier: chi2={bad:.1f} df={bad_df} critical={chi2_critical(bad_df):.1f}")
        assert bad > chi2_critical(bad_df), name


def test_a_json_schema_answer_does_not_depend_on_speculation(
        pair: tuple[Any, Any, Any]) -> None:
    """With the seat's real grammar (seatd.grammar, llguidance) a seeded answer under a
    JSON schema parses, and is the same bytes plain, with the model drafter (alone and
    beside another constrained row) and with lookup."""
    import json

    from seatd.grammar import SeatGrammar

    model, tok, _ = pair
    grammars = SeatGrammar(tok, output_width(model))
    schema = {"type": "object", "required": ["name", "n"], "additionalProperties": False,
              "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    fmt = json.dumps({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=4, frequency_penalty=0.3)
    request = Generate("g", False, params, prompt="", response_format=fmt)
    kinds = ((None, True), ("model", True), ("lookup", True), ("model", False),
             ("model", False))
    got = serve(pair, [Ask(params, prompt="A person as JSON: ", drafter=k, depth=3,
                           grammar=grammars.for_request(request), solo=solo)
                       for k, solo in kinds])
    text = _result(got[0]).text
    assert set(json.loads(text)) == {"name", "n"}
    for (kind, solo), g in zip(kinds, got, strict=True):
        assert _result(g).text == text, (kind, solo)
        assert _result(g).finish_reason == "stop"
    assert all(_result(g).speculation.state == "accelerated" for g in got[1:])


def test_the_single_request_decoder_shapes_alike(pair: tuple[Any, Any, Any]) -> None:
    """seatd.decode (tests, measure.py) applies the same penalties and bias: its seeded
    answer is the engine's, plain and with a model drafter."""
    model, tok, drafter_model = pair
    params = msgspec.structs.replace(SHAPED, logprobs=None)
    ref = _result(serve(pair, [Ask(params, solo=True)])[0]).text
    ids = tok.encode(PROMPT)
    for spec in (None, Speculation(ModelDrafter(drafter_model), 3, DepthStats()),
                 Speculation(Unshaping(drafter_model), 3, DepthStats())):
        got = decode(model, tok, ids, params, kv="fp16", context_length=2048, spec=spec)
        assert got.text == ref
        if spec is not None:
            want = ("declined:constrained" if isinstance(spec.drafter, Unshaping)
                    else "accelerated")
            assert got.speculation.state == want


def test_a_grammar_finished_on_the_last_token_of_the_budget_is_a_stop(
        pair: tuple[Any, Any, Any]) -> None:
    """A structured answer whose closing token is also the max_tokens-th is whole: it ends
    by the grammar ("stop"), never as cut by the budget ("length"); one token less is cut.
    With the seat's real grammar, plain and speculative."""
    import json

    from seatd.grammar import SeatGrammar

    model, tok, _ = pair
    grammars = SeatGrammar(tok, output_width(model))
    fmt = json.dumps({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "required": ["ok"], "additionalProperties": False,
        "properties": {"ok": {"type": "boolean"}}}}})

    def answers(budget: int) -> list[DecodeResult]:
        params = SamplingParams(max_tokens=budget, temperature=0)
        request = Generate("g", False, params, prompt="", response_format=fmt)
        return [_result(g) for g in serve(pair, [
            Ask(params, prompt="JSON: ", grammar=grammars.for_request(request)),
            Ask(params, prompt="JSON: ", drafter="model", depth=4, solo=True,
                grammar=grammars.for_request(request))])]

    whole = answers(40)
    n = len(whole[0].token_ids)
    assert json.loads(whole[0].text) in ({"ok": True}, {"ok": False})
    for budget, finish in ((n, "stop"), (n - 1, "length")):
        for r in answers(budget):
            assert r.token_ids == whole[0].token_ids[:budget]
            assert r.finish_reason == finish, (budget, r.finish_reason)
