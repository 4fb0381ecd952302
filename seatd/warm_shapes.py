"""A seat's decode shapes, compiled before it serves (on a GPU).

On a GPU, MLX builds a kernel (and, on CUDA, a graph of them) the first time it runs a
shape.  A speculating seat runs many: a verify block of each width 2..16, greedy and
sampled, and its model drafter's steps.  Measured on an H200 with the demo pair, the
first lookup round of a width took 15-63 ms against 2.5-4.4 ms afterwards, in a request
whose plain steps took 1.5 ms: a request that met two new widths lost a third of its
speed, and the seat's figures of those depths started from the compile.  A server
compiles its shapes before it takes requests; so does a seat, on a GPU.

    warm_up(model, tokenizer, context_length, width, drafter_model) -> Warmed

runs, through a throwaway batch engine (its step costs and prefill pace, learnt while
compiling, are thrown away with it), one short request per verify width and
temperature band: a lookup drafter pinned at each depth 1..LOOKUP_MAX_DEPTH (one that
always finds that many tokens to propose: `Proposing`), and the model drafter pinned
at each depth 1..MAX_DEPTH.  Each request alone, as a request at
c=1 runs; a batch's shapes compile as batches meet them.  The seat's own figures
(`seatd.speculation.SeatSpeculation`) are not touched: these requests have their own.

The CPU has no such first-run cost worth a start-up (MLX's CPU kernels are built
ahead of time), so `wanted(backend)` is False there, and an operator may turn the
warm-up off (`SANCTUM_WARM_SHAPES=0`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import structlog

from seatd.adaptive import MAX_DEPTH, DepthStats
from seatd.drafter_choice import LOOKUP_MAX_DEPTH
from seatd.drafters import MATCH_CAP, LookupDrafter, ModelDrafter, match_key
from seatd.engine_io import Transcript, Work
from seatd.engine_types import Speculation
from seatd.kv_budget import KVBudget
from shared.protocol import Generate, SamplingParams

log = structlog.get_logger()

TEXT = ("Sanctum warms its shapes: one two three four five six seven eight nine ten "
        "eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen.")
BANDS = ((0.0, None), (0.7, 0))  # (temperature, seed): greedy, and seeded sampling
OFF_VALUES = frozenset({"0", "off", "false", "no"})


class Proposing(LookupDrafter):
    """Prompt lookup whose every round finds what it is asked for: the prompt's first k
    tokens, as a match of the longest class.  The engine takes its rounds as it takes
    any lookup's (it is one), so they run the lookup's own verify path at each width;
    the tokens it proposes are judged as any draft is, and none of it reaches a
    client."""

    def find(self, k: int) -> list[int]:
        self.matched, self.key = MATCH_CAP, match_key(MATCH_CAP)
        return self.context[:k]


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


def plan(drafter: bool) -> list[tuple[str, int, SamplingParams]]:
    """(drafter kind, pinned depth, params) of each warm-up request, widest first (its
    prompt's prefill compiles once, before the rest).  Pure."""
    runs: list[tuple[str, int, SamplingParams]] = []
    kinds = [("lookup", LOOKUP_MAX_DEPTH)] + ([("model", MAX_DEPTH)] if drafter else [])
    for kind, top in kinds:
        for depth in range(top, 0, -1):
            for temperature, seed in BANDS:
                # the round drafts `depth` tokens when at least depth + 2 are left
                runs.append((kind, depth, SamplingParams(temperature=temperature, seed=seed,
                                                         max_tokens=depth + 2)))
    return runs


def prompt_ids(tokenizer: Any) -> list[int]:
    ids = list(tokenizer.encode(TEXT))
    while len(ids) <= LOOKUP_MAX_DEPTH:  # enough tokens for the deepest round
        ids += ids
    return ids


def warm_up(model: Any, tokenizer: Any, context_length: int, width: int,
            drafter_model: Any = None,
            runs: list[tuple[str, int, SamplingParams]] | None = None) -> Warmed:
    """Compile the seat's c=1 decode shapes through a throwaway engine (see the module's
    docstring).  Never raises for a request's error: a shape that fails here fails the
    same way for a client, whose request the seat then declines or fails as it would."""
    from seatd.batch import Engine  # the engine imports this module's callers

    t0 = time.perf_counter()
    engine = Engine(model, tokenizer, context_length, width, 1, KVBudget(1 << 40))
    prompt = prompt_ids(tokenizer)
    failed = 0
    runs = plan(drafter_model is not None) if runs is None else runs
    seen = Transcript()
    for i, (kind, depth, params) in enumerate(runs):
        drafter = ModelDrafter(drafter_model) if kind == "model" else Proposing()
        spec = Speculation(drafter, depth, DepthStats())
        request = Generate(f"warm-{i}", False, params, prompt=TEXT,
                           speculation=True, draft_depth=depth, prompt_cache=False)
        engine.submit(Work(request, prompt, "fp16", spec=spec))
        while request.request_id not in seen.ended:
            engine.step()
            seen.read(engine.outbox)
        error = seen.error(request.request_id)
        if error is not None:
            failed += 1
            log.warning("warm_up_request_failed", kind=kind, depth=depth,
                        temperature=params.temperature, error=repr(error))
    seconds = time.perf_counter() - t0
    log.info("shapes_warmed", requests=len(runs), failed=failed, seconds=round(seconds, 3))
    return Warmed(len(runs), failed, seconds)
