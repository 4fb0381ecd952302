"""The prompt cache on the real demo pair, in process: a warm answer equals the cold
answer byte for byte on both KV lanes, speculation on and off, at temperatures 0
and 0.7; a conversation reuses its previous turn (the counters say so); the byte
budget holds under a stream of distinct long prompts."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from seatd.adaptive import DepthStats
from seatd.counters import SeatCounters
from seatd.decode import decode
from seatd.drafters import ModelDrafter
from seatd.engine_types import PREFILL_CHUNK, DecodeResult, Speculation
from seatd.kv_budget import KVBudget, row_bytes
from seatd.model_load import load_for_compute
from seatd.prompt_cache import SeatPromptCache
from shared.config import SeatConfig
from shared.protocol import Generate, SamplingParams
from tests.spec_models import HELDOUT, drafter_dir, target_dir

pytestmark = pytest.mark.slow

MAX_NEW = 8  # two verify rounds or more at depth 3: enough to tell two answers apart


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Any, Any, Any, list[int]]]:
    target = load_for_compute(target_dir())
    drafter = load_for_compute(drafter_dir())
    text = "\n\n".join(p.read_text() for p in sorted(HELDOUT.glob("*.py")))
    ids = target.tokenizer.encode(text)[:1400]
    assert len(ids) > PREFILL_CHUNK * 2 + 200
    yield target.model, drafter.model, target.tokenizer, ids


@pytest.fixture(scope="module")
def hybrid_model() -> Any:
    """The hybrid demo (gated-delta + attention), loaded once for the tests that use it."""
    from shared.builtin import resolve_model

    return load_for_compute(resolve_model("builtin:demo-hybrid"))


def _run(pair: Any, cache: SeatPromptCache | None, prompt: list[int], kv: str, temp: float,
         spec: bool, use_cache: bool = True, cuts: tuple[int, ...] = ()) -> DecodeResult:
    target, drafter, tok, _ = pair
    params = SamplingParams(temperature=temp, max_tokens=MAX_NEW, seed=7)
    request = Generate("r", False, params, prompt_cache=use_cache)
    plan = cache.begin(request, kv, prompt, MAX_NEW, cuts) if cache is not None else None
    sp = Speculation(ModelDrafter(drafter), 3, DepthStats()) if spec else None
    # As the worker does: the row in flight is charged to the seat's KV budget, here all
    # of it the prompt cache's, so the cache makes room for it (seatd/kv_budget.py).
    budget = KVBudget(cache.policy.budget, cache.policy.budget, cache.hold) if cache else None
    charge = row_bytes(cache.per_token(kv), len(prompt), MAX_NEW, 2048) if cache else 0
    if budget is not None:
        budget.admit(charge, alone=True)
    ok = False
    try:
        result = decode(target, tok, prompt, params, kv=kv, context_length=2048, spec=sp,
                        resume=plan.resume if plan else None)
        ok = True
    finally:
        if cache is not None and plan is not None:
            cache.finish(plan, ok=ok)  # kept while the row still holds its room
        if budget is not None:
            budget.release(charge)
    return result


def _seat(mb: int = 256) -> SeatConfig:
    return SeatConfig(name="s", model="builtin:demo", prompt_cache_mb=mb)


@pytest.mark.parametrize("kv", ["fp16", "q8"])
def test_warm_output_equals_cold_output(pair, kv: str) -> None:
    """Turn 2 resumed from turn 1's cached prefix answers exactly as a cold turn 2,
    speculation on and off, temperatures 0 and 0.7 (one entry reused four times)."""
    target, _, tok, ids = pair
    cache = SeatPromptCache(_seat(), target)
    turn1 = ids[: PREFILL_CHUNK + 8]
    first = _run(pair, cache, turn1, kv, 0.0, False)
    assert first.cached_tokens == 0 and cache.entries == 1
    turn2 = turn1 + tok.encode(first.text) + ids[PREFILL_CHUNK + 8 : PREFILL_CHUNK + 24]
    for spec in (False, True):
        for temp in (0.0, 0.7):
            cold = _run(pair, None, turn2, kv, temp, spec)
            warm = _run(pair, cache, turn2, kv, temp, spec)
            assert warm.cached_tokens == PREFILL_CHUNK, (spec, temp)
            assert cold.cached_tokens == 0
            assert warm.text == cold.text, (kv, spec, temp)
            assert warm.completion_tokens == cold.completion_tokens
    tally = cache.drain()
    assert tally.hits == 4 and tally.reused_tokens == 4 * PREFILL_CHUNK
    assert not tally.discarded


def test_conversation_reuses_the_previous_turn(pair) -> None:
    """Turn N resumes from turn N-1's prefix; the seat's counters prove it; the last
    turn still equals a cold answer, and a request may opt out."""
    target, _, tok, ids = pair
    cache = SeatPromptCache(_seat(), target)
    counters = SeatCounters("s", None)
    lane = "sync/fp16"
    # Each turn adds the answer and a new message; turns 2 and 3 pass a grid point.
    cuts = [PREFILL_CHUNK + 20, 2 * PREFILL_CHUNK + 20, 2 * PREFILL_CHUNK + 60]
    prompt = ids[: cuts[0]]
    reused: list[int] = []
    result = None
    for turn in range(3):
        result = _run(pair, cache, prompt, "fp16", 0.7, True)
        counters.prompt_cache(cache.drain(), lane, cache.entries, cache.nbytes)
        reused.append(result.cached_tokens)
        if turn < 2:
            prompt = prompt + tok.encode(result.text) + ids[cuts[turn] : cuts[turn + 1]]
    assert reused == [0, PREFILL_CHUNK, 2 * PREFILL_CHUNK]
    snap = counters.snapshot()
    assert snap["prompt_cache_lookups"] == 3
    assert snap["prompt_cache_hits"] == 2
    assert snap["prompt_cache_reused_tokens"] == 3 * PREFILL_CHUNK
    assert snap["lanes"][lane]["prompt_cache_hits"] == 2
    # Turn 2's entry extends turn 1's, which it supersedes: one entry per conversation.
    assert snap["prompt_cache_entries"] == 1 and snap["prompt_cache_bytes"] > 0
    assert snap["prompt_cache_discarded_tokens"] == {}
    cold = _run(pair, None, prompt, "fp16", 0.7, True)
    assert result is not None and result.text == cold.text
    opted_out = _run(pair, cache, prompt, "fp16", 0.7, True, use_cache=False)
    assert opted_out.cached_tokens == 0 and opted_out.text == cold.text
    # An opted-out request prefills in the chunks a warm or cold one does: cut at its
    # turn boundaries too, with no cache to resume from and nothing kept.
    plan = _opted_out_plan(cache, prompt, (5, 40))
    assert plan.resume is not None and plan.resume.cache is None
    assert plan.resume.cuts == (5, 40) and plan.kept is None


def _opted_out_plan(cache: SeatPromptCache, prompt: list[int],
                    cuts: tuple[int, ...]) -> Any:
    request = Generate("r", False, SamplingParams(max_tokens=1), prompt_cache=False)
    plan = cache.begin(request, "fp16", prompt, 1, cuts)
    cache.finish(plan, ok=True)
    return plan


def test_budget_holds_under_distinct_long_prompts(pair) -> None:
    """Distinct long prompts: entries plus the request in flight never exceed the
    budget; old entries are evicted and counted."""
    from seatd.backend import backend

    target = pair[0]
    # KV in float32 on the CPU, in the stored half-precision dtype on a GPU: half the bytes,
    # so half the budget makes the same prompts overflow it.
    mb = 40 if backend() == "cpu" else 20
    cache = SeatPromptCache(_seat(mb), target)
    policy = cache.policy
    seen: list[int] = []
    real_reserve = policy.reserve

    def reserve(nbytes: int) -> None:
        real_reserve(nbytes)
        seen.append(policy.nbytes + policy.reserved)

    policy.reserve = reserve  # type: ignore[method-assign]
    rng = random.Random(3)
    for _ in range(5):
        prompt = [rng.randrange(3, 4000) for _ in range(PREFILL_CHUNK + 40)]
        _run(pair, cache, prompt, "fp16", 0.0, False)
        seen.append(policy.nbytes)
        assert policy.nbytes <= mb * 1024 * 1024
    assert max(seen) <= mb * 1024 * 1024
    tally = cache.drain()
    assert tally.hits == 0 and tally.lookups == 5
    assert tally.discarded.get("evicted", 0) >= 2 * PREFILL_CHUNK
    assert 1 <= cache.entries <= 3


def test_recurrent_state_resumes_only_at_its_exact_length(pair) -> None:
    """A tiny random Mamba (state that cannot be trimmed): turn 2 resumes at turn 1's
    exact checkpoint and equals cold; a request that diverges inside the checkpoint
    resumes from nothing, and the exact-length rule counts what it threw away."""
    import mlx.core as mx
    from mlx_lm.models import mamba

    _, _, tok, _ = pair
    mx.random.seed(0)
    args = mamba.ModelArgs(model_type="mamba", vocab_size=64, hidden_size=32,
                           intermediate_size=64, state_size=4, num_hidden_layers=2,
                           conv_kernel=3, use_bias=False, use_conv_bias=True, time_step_rank=4)
    model = mamba.Model(args)
    mx.eval(model.parameters())
    recurrent = (model, None, tok, [])
    cache = SeatPromptCache(_seat(), model)
    rng = random.Random(5)
    turn1 = [rng.randrange(3, 64) for _ in range(PREFILL_CHUNK + 30)]
    _run(recurrent, cache, turn1, "fp16", 0.0, False)
    assert cache.entries == 1 and not cache.policy.entries[0].trimmable
    turn2 = turn1 + [rng.randrange(3, 64) for _ in range(40)]
    warm = _run(recurrent, cache, turn2, "fp16", 0.7, False)
    cold = _run(recurrent, None, turn2, "fp16", 0.7, False)
    assert warm.cached_tokens == PREFILL_CHUNK and warm.text == cold.text
    assert warm.completion_tokens == cold.completion_tokens
    # One long prompt leaves one checkpoint, at 1024; a request sharing 800 tokens
    # could resume at 512 if the state could be cut back: it cannot.
    cache = SeatPromptCache(_seat(), model)
    long = [rng.randrange(3, 64) for _ in range(2 * PREFILL_CHUNK + 10)]
    _run(recurrent, cache, long, "fp16", 0.0, False)
    cache.drain()
    other = long[:800] + [rng.randrange(3, 64) for _ in range(20)]
    assert _run(recurrent, cache, other, "fp16", 0.0, False).cached_tokens == 0
    assert cache.drain().discarded == {"not_trimmable": PREFILL_CHUNK}


@pytest.mark.parametrize("kv", ["fp16", "q8"])
def test_hybrid_demo_reuses_prompts_at_exact_length_while_speculating(pair, hybrid_model,
                                                                     kv: str) -> None:
    """The hybrid demo (gated-delta state that only rolls back inside a verify): turn 2
    resumes at turn 1's checkpoint and, speculating, equals the cold answer at t=0 and
    0.7; a prompt diverging inside a checkpoint resumes from nothing and the exact-length
    rule counts what it threw away."""
    _, drafter, _, ids = pair
    loaded = hybrid_model
    hybrid = (loaded.model, drafter, loaded.tokenizer, ids)
    cache = SeatPromptCache(_seat(), loaded.model)
    turn1 = ids[: PREFILL_CHUNK + 30]
    _run(hybrid, cache, turn1, kv, 0.0, True)
    assert cache.entries == 1 and not cache.policy.entries[0].trimmable
    turn2 = ids[: PREFILL_CHUNK + 70]
    for temp in (0.0, 0.7):
        warm = _run(hybrid, cache, turn2, kv, temp, True)
        cold = _run(hybrid, None, turn2, kv, temp, True)
        assert warm.cached_tokens == PREFILL_CHUNK and cold.cached_tokens == 0
        assert warm.speculation.state == cold.speculation.state == "accelerated"
        assert (warm.text, warm.completion_tokens) == (cold.text, cold.completion_tokens)
    cache = SeatPromptCache(_seat(), loaded.model)
    _run(hybrid, cache, ids[: 2 * PREFILL_CHUNK + 10], kv, 0.0, False)
    cache.drain()
    # One checkpoint, at 1024; sharing 600 tokens, a trimmable state would resume at 512.
    other = ids[:600] + [(t + 1) % 8000 for t in ids[600:620]]
    assert _run(hybrid, cache, other, kv, 0.0, False).cached_tokens == 0
    assert cache.drain().discarded == {"not_trimmable": PREFILL_CHUNK}


def test_hybrid_chat_resumes_at_turn_boundaries(pair, hybrid_model) -> None:
    """A short chat on the hybrid demo (every prompt under one prefill chunk): each turn
    resumes exactly where the previous turn's prompt opened the assistant's message, and,
    speculating, answers exactly as a cold request does."""
    _, drafter, _, _ = pair
    loaded = hybrid_model
    _short_chat_resumes_at_turn_boundaries((loaded.model, drafter, loaded.tokenizer, []))


def test_a_short_chat_resumes_at_turn_boundaries(pair) -> None:
    """The same on the attention demo, whose KV could be cut anywhere: a chat that never
    reaches the prefill grid still resumes each turn where the last one opened the
    answer (it reused nothing when reuse was on the grid alone)."""
    _short_chat_resumes_at_turn_boundaries(pair)


def _short_chat_resumes_at_turn_boundaries(hybrid: Any) -> None:
    from seatd.turns import turn_cuts, turn_marks

    model, _, tok, _ = hybrid
    marks = turn_marks(tok)
    assert marks
    cache = SeatPromptCache(_seat(), model)
    messages: list[dict[str, str]] = []
    asks = ["Write a function that adds two numbers.", "Now make it add three.",
            "Add a docstring to it."]
    previous_open = 0
    for turn, ask in enumerate(asks):
        messages.append({"role": "user", "content": ask})
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True))
        assert len(prompt) < PREFILL_CHUNK
        cuts = turn_cuts(prompt, marks)
        for temp in (0.0, 0.7):
            warm = _run(hybrid, cache, prompt, "fp16", temp, True, cuts=cuts)
            cold = _run(hybrid, SeatPromptCache(_seat(), model), prompt, "fp16", temp,
                        True, cuts=cuts)
            assert (warm.text, warm.completion_tokens) == (cold.text, cold.completion_tokens)
            if temp == 0.0:
                assert warm.cached_tokens == previous_open, turn
        # Opting out of the cache (as a seat without one does) prefills in the same chunks.
        entries = cache.entries
        off = _run(hybrid, cache, prompt, "fp16", 0.7, True, use_cache=False, cuts=cuts)
        assert off.cached_tokens == 0 and cache.entries == entries
        assert (off.text, off.completion_tokens) == (cold.text, cold.completion_tokens)
        plan = _opted_out_plan(cache, prompt, cuts)
        assert plan.resume is not None and plan.resume.cache is None
        assert plan.resume.cuts == cuts and plan.kept is None
        previous_open = cuts[-1]  # the generation prompt's <|im_start|>
        messages.append({"role": "assistant", "content": f"def add(*xs):\n    return {turn}"})
    assert previous_open > 0


def test_an_error_during_generation_drops_the_entry_it_used(pair) -> None:
    """A request that resumed from an entry and then failed: the entry is dropped and
    counted `invalidated`; the copy it would have kept is not inserted."""
    target, _, tok, ids = pair
    cache = SeatPromptCache(_seat(), target)
    turn1 = ids[: PREFILL_CHUNK + 8]
    _run(pair, cache, turn1, "fp16", 0.0, False)
    cache.drain()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, seed=7)
    longer = ids[: PREFILL_CHUNK + 40]  # past the entry's 512: resumes there
    plan = cache.begin(Generate("r", False, params), "fp16", longer, MAX_NEW)
    assert plan.resume is not None and plan.resume.start == PREFILL_CHUNK

    def boom(n: int) -> None:
        raise RuntimeError("generation failed")

    with pytest.raises(RuntimeError):
        decode(target, tok, longer, params, kv="fp16", context_length=2048,
               on_token=boom, resume=plan.resume)
    cache.finish(plan, ok=False)
    assert cache.entries == 0 and cache.policy.reserved == 0
    assert cache.drain().discarded == {"invalidated": PREFILL_CHUNK}
