"""A seat's decode shapes, compiled while it has nothing else to do (on a GPU).

On a GPU, MLX builds a kernel (and, on CUDA, a graph of them) the first time it runs a
shape.  A speculating seat runs many: a verify block of each width 2..16, greedy and
sampled, and its model drafter's steps.  Measured on an H200 with the demo pair, the
first lookup round of a width took 15-63 ms against 2.5-4.4 ms afterwards, in a request
whose plain steps took 1.5 ms: a request that met two new widths lost a third of its
speed, and the seat's figures of those depths started from the compile.  So a seat on
a GPU compiles them itself, in its engine's idle time (`Warming`): compiling them all
before serving kept a fresh H100's seat from its first request for 104 s.

    Warming(model, tokenizer, context_length, width, drafter_model, on_measured=f).step()
    warm_up(model, tokenizer, context_length, width, drafter_model) -> Warmed   all at once

runs, through a throwaway batch engine (its step costs and prefill pace, learnt while
compiling, are thrown away with it), requests alone, as a request at c=1 runs (a
batch's shapes compile as batches meet them), in both temperature bands:

- on CUDA, for each KV capacity up to WARM_CONTEXT tokens (the cache grows in steps
  of `seatd.rows_cache.STEP` columns; elsewhere the first step only), one request
  whose prompt fills the capacity's last step and whose lookup proposes every verify
  width in turn, 16 down to a plain step (`Cycling`).  On CUDA (MLX 0.32.4, an H200,
  demo pair) a width compiles again at each capacity: in-process, one request per
  prompt length, the first round of a width at a new capacity took 45-110 ms, with
  CUDA graphs or without, against 2-15 ms once compiled, and a second pass over the
  same lengths met none.  A seat warmed at one short prompt lost a third of its time
  on copy-heavy chats of 300-500 tokens to them (2.3 s of 7.0 s), a seat pinned at
  one depth a tenth.  Through a seat on a fresh H100 the sweep took 104 s;
- the model drafter pinned at each depth 1..MAX_DEPTH, on a short prompt;
- then, every shape compiled, the same short prompt decoded plainly and at each depth
  1..MAX_DEPTH again for a few rounds (`measure` runs), in both bands: the seconds of a
  round at each depth on this device, handed to the seat (`on_measured`), which starts
  its figures from them (`seatd.speculation.SeatSpeculation.take_times`).  Without them
  a fresh seat's first requests draft at fixed depths to learn what a round costs
  (`seatd.adaptive.WARM_ORDER`): through the batching bench on an H100 with the demo
  pair, where a depth-3 round of the model drafter took 5.5-8.7 ms against 2.5 ms for a
  plain token, the default seat served one client at 0.44x its own plain path's
  tokens/s.  With them its first request's rounds are chosen on this device's costs
  (the same bench after this change read 0.46x there once, and 1.26x in a later run on
  another H100, where the plain seat, which has no warm-up, compiled its first shapes
  in the measured rounds: README's GPU section says what is open).

A prompt past WARM_CONTEXT compiles its shapes as it meets them.  The seat's own
figures (`seatd.speculation.SeatSpeculation`) are not touched while shapes compile:
those requests have their own, and only the measure runs' round times reach the seat
(never an acceptance: the warm-up's text says nothing of a client's).

The CPU has no such first-run cost worth a start-up (MLX's CPU kernels are built
ahead of time), so `wanted(backend)` is False there, and an operator may turn the
warm-up off (`SANCTUM_WARM_SHAPES=0`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from seatd.adaptive import MAX_DEPTH, DepthStats
from seatd.drafter_choice import LOOKUP_MAX_DEPTH
from seatd.drafters import MATCH_CAP, LookupDrafter, ModelDrafter, match_key
from seatd.engine_io import Transcript, Work
from seatd.engine_types import Speculation
from seatd.kv_budget import KVBudget
from seatd.rows_cache import STEP
from shared.protocol import Generate, SamplingParams

log = structlog.get_logger()

TEXT = ("Sanctum warms its shapes: one two three four five six seven eight nine ten "
        "eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen.")
BANDS = ((0.0, None), (0.7, 0))  # (temperature, seed): greedy, and seeded sampling
WARM_CONTEXT = 2048  # KV capacities warmed, in tokens: a household chat's turns
CYCLE = tuple(range(LOOKUP_MAX_DEPTH, -1, -1))  # `Cycling`'s widths less one, 0: plain
LEAD = 8  # a capacity's request starts this many tokens into the capacity's last step
OFF_VALUES = frozenset({"0", "off", "false", "no"})
MEASURE_ROUNDS = 6  # rounds of each depth a measure run times


class Proposing(LookupDrafter):
    """Prompt lookup whose every round finds what it is asked for: the prompt's first k
    tokens, as a match of the longest class.  The engine takes its rounds as it takes
    any lookup's (it is one), so they run the lookup's own verify path at each width;
    the tokens it proposes are judged as any draft is, and none of it reaches a
    client."""

    def find(self, k: int) -> list[int]:
        self.matched, self.key = MATCH_CAP, match_key(MATCH_CAP)
        return self.context[:k]


class Cycling(Proposing):
    """A `Proposing` lookup whose rounds go through every depth in turn (`CYCLE`): the
    next depth each time it is asked with a context that grew since it was last asked
    (a round may ask twice), so one request runs every verify width at the capacity its
    prompt sets."""

    def __init__(self) -> None:
        super().__init__()
        self.turn, self.asked_at = -1, -1

    def find(self, k: int) -> list[int]:
        if len(self.context) != self.asked_at:
            self.turn, self.asked_at = self.turn + 1, len(self.context)
        n = CYCLE[self.turn % len(CYCLE)]
        return super().find(min(k, n)) if n else []


@dataclass(frozen=True)
class Run:
    """One warm-up request: its drafter ("lookup": `Cycling`; "model": the seat's
    drafter), pinned depth, sampling, and prompt length in tokens."""

    kind: str
    depth: int
    params: SamplingParams
    prompt_tokens: int
    measure: bool = False  # its round times go to the seat (`Warming.measured`)


@dataclass(frozen=True)
class Warmed:
    requests: int  # requests run
    failed: int  # of which ended in an error (logged; the seat serves regardless)
    seconds: float


def wanted(backend: str, environ: dict[str, str] | None = None) -> bool:
    """Whether a seat on this backend compiles its shapes before serving.  Pure."""
    env = os.environ if environ is None else environ
    if env.get("SANCTUM_WARM_SHAPES", "").strip().lower() in OFF_VALUES:
        return False
    return backend in ("cuda", "metal")


def capacities(context_length: int, backend: str = "cuda") -> list[int]:
    """The KV capacities a warm-up visits: on CUDA each step of the cache up to
    WARM_CONTEXT or the context, whichever is less; elsewhere the first step only (a
    compile per capacity was measured on CUDA alone; on Metal, which this machine has
    not, a longer warm-up would cost a start-up for nothing seen).  Pure."""
    if backend != "cuda":
        return [STEP]
    return list(range(STEP, min(context_length, WARM_CONTEXT) + 1, STEP)) or [STEP]


def plan(drafter: bool, context_length: int = WARM_CONTEXT,
         backend: str = "cuda") -> list[Run]:
    """Each warm-up request, the longest prompt first (the prefill's own shapes compile
    before the rest).  Pure."""
    runs: list[Run] = []
    rounds = 2 * len(CYCLE)  # every width, with room for rounds that kept a token
    for cap in reversed(capacities(context_length, backend)):
        # within the capacity's last step, long enough to propose from, leaving room
        prompt = min(max(cap - STEP + LEAD, 2 * LOOKUP_MAX_DEPTH), context_length - rounds)
        for temperature, seed in BANDS:
            runs.append(Run("lookup", LOOKUP_MAX_DEPTH,
                            SamplingParams(temperature=temperature, seed=seed,
                                           max_tokens=rounds), prompt))
    if drafter:
        for depth in range(MAX_DEPTH, 0, -1):
            for temperature, seed in BANDS:
                # the round drafts `depth` tokens when at least depth + 2 are left
                runs.append(Run("model", depth, SamplingParams(
                    temperature=temperature, seed=seed, max_tokens=depth + 2),
                    2 * LOOKUP_MAX_DEPTH))
        for depth in range(MAX_DEPTH + 1):  # every shape is in by now: times, not compiles
            for temperature, seed in BANDS:
                runs.append(Run("model", depth, SamplingParams(
                    temperature=temperature, seed=seed,
                    max_tokens=MEASURE_ROUNDS * (depth + 1) + 1),
                    2 * LOOKUP_MAX_DEPTH, measure=True))
    return runs


def prompt_ids(tokenizer: Any, length: int) -> list[int]:
    """TEXT's tokens repeated to `length`."""
    ids = list(tokenizer.encode(TEXT))
    while len(ids) < length:
        ids += ids
    return ids[:length]


class Warming:
    """The warm-up as steps of its own engine, one at a time: a seat takes them while its
    engine has nothing else to do (`seatd.batch.Engine.idle`), so the seat serves from
    the moment it has loaded and a request waits at most one warm-up step.

        step() -> bool     one step; False once every run has ended (then `warmed`)

    Never raises for a request's error: a shape that fails here fails the same way for a
    client, whose request the seat then declines or fails as it would."""

    def __init__(self, model: Any, tokenizer: Any, context_length: int, width: int,
                 drafter_model: Any = None, runs: list[Run] | None = None,
                 on_measured: Callable[[dict[bool, dict[int, float]]], None] | None = None
                 ) -> None:
        from seatd.batch import Engine  # the engine imports this module's callers

        if runs is None:
            from seatd.backend import backend

            runs = plan(drafter_model is not None, context_length, backend())
        self.engine = Engine(model, tokenizer, context_length, width, 1, KVBudget(1 << 40))
        self.tokenizer, self.drafter_model, self.runs = tokenizer, drafter_model, runs
        self.next, self.failed, self.seconds = 0, 0, 0.0
        self.current: tuple[str, Run] | None = None  # the request in flight, and its run
        self.seen = Transcript()
        self.warmed: Warmed | None = None
        # The measure runs' figures, by band (sampled or not): round seconds by depth
        self.figures = {sampled: DepthStats() for sampled in (False, True)}
        self.on_measured = on_measured

    def step(self) -> bool:
        if self.warmed is not None:
            return False
        t0 = time.perf_counter()
        if self.current is None:
            self._submit()
        else:
            self.engine.step()
            self.seen.read(self.engine.outbox)
            if self.current[0] in self.seen.ended:
                self._ended(*self.current)
                self.current = None
        self.seconds += time.perf_counter() - t0
        if self.current is None and self.next == len(self.runs):
            self.warmed = Warmed(len(self.runs), self.failed, self.seconds)
            measured = self.measured
            log.info("shapes_warmed", requests=len(self.runs), failed=self.failed,
                     seconds=round(self.seconds, 3),
                     round_ms={int(b): {k: round(1e3 * t, 3) for k, t in m.items()}
                               for b, m in measured.items()})
            if self.on_measured is not None and any(measured.values()):
                self.on_measured(measured)
            return False
        return True

    def _submit(self) -> None:
        if self.next == len(self.runs):
            return
        run, i = self.runs[self.next], self.next
        self.next += 1
        if run.measure:  # a depth of 0 decodes plainly, timed as the seat's plain token
            stats = self.figures[run.params.temperature > 0]
            spec = Speculation(ModelDrafter(self.drafter_model) if run.depth else None,
                               run.depth, stats)
        else:
            drafter = ModelDrafter(self.drafter_model) if run.kind == "model" else Cycling()
            spec = Speculation(drafter, run.depth, DepthStats(max_depth=run.depth))
        request = Generate(f"warm-{i}", False, run.params, prompt=TEXT,
                           speculation=True, draft_depth=run.depth, prompt_cache=False)
        self.engine.submit(Work(request, prompt_ids(self.tokenizer, run.prompt_tokens),
                                "fp16", spec=spec))
        self.current = request.request_id, run

    @property
    def measured(self) -> dict[bool, dict[int, float]]:
        """The measure runs' round seconds by depth (0: a plain token), by band."""
        return {sampled: dict(s.seconds) for sampled, s in self.figures.items()}

    def _ended(self, rid: str, run: Run) -> None:
        error = self.seen.error(rid)
        if error is not None:
            self.failed += 1
            log.warning("warm_up_request_failed", kind=run.kind, depth=run.depth,
                        prompt_tokens=run.prompt_tokens,
                        temperature=run.params.temperature, error=repr(error))


def warm_up(model: Any, tokenizer: Any, context_length: int, width: int,
            drafter_model: Any = None, runs: list[Run] | None = None,
            on_measured: Callable[[dict[bool, dict[int, float]]], None] | None = None
            ) -> Warmed:
    """The whole warm-up at once (`Warming`'s steps, one after another)."""
    warming = Warming(model, tokenizer, context_length, width, drafter_model, runs,
                      on_measured)
    while warming.step():
        pass
    assert warming.warmed is not None
    return warming.warmed
