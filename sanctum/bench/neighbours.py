"""Neighbours: a seeded answer alone against the same request batched with 7 others.

A row's randomness never depends on its neighbours (keyed draws, DESIGN.md), but its
floats may: eight rows in one forward are summed in other kernel shapes than one row
alone, a verify block of eight rows is padded to the deepest draft, and a prompt that
joins a busy batch is prefilled in smaller chunks.  Where the top two scores of a
position sit closer than that rounding the token can flip, and the answer parts there.

A correctness measure, not a speed comparison: nothing is interleaved.  In this process,
with the seat's own batch engine (`seatd.batch.Engine`), each held-out case (a workload,
greedy or keyed) is decoded by an engine holding that one row ("alone"), and in engines
of eight rows submitted together: the cases are laid in windows of eight (`batches`),
every row of a window is compared with its own answer alone, and a case in two windows
is compared twice, with other neighbours.  "batched" holds decoding until all eight have
joined, so every token of an answer comes from a forward of all the rows still going;
"joining" leaves the engine its own schedule (the first rows prefilled start decoding
beside fewer rows while the others prefill).  "latecomers" submits each row only once the
row before it is a few steps into its answer (or done), so every row but the first joins
a busy batch at its pace: its prompt rides the rows' steps where the model takes riders,
in forwards of other shapes than a prefill of its own, and the batch takes plain steps
meanwhile (`prompt_joining`).  The same is done with speculation (each row with its own
model drafter, depth 3), where the batch decides per step whether
a verify pays (`seatd.batch_policy`).  Where requests can ask for a lane of their own
(`Generate.solo`), the windows are decoded once more with every row solo.

Per comparison: the first answer position where the two answers differ (or none) and
the tokens compared (`sanctum.bench.flips`: up to and including that position, else the
whole answer; an answer that stopped early compares fewer).  Pure pieces (`batches`,
`until_first`, `totals`, `groups`) have table-driven tests; the rest loads models.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from sanctum.bench.flips import Case, compared_tokens, first_difference, per_thousand, rate_text
from sanctum.bench.options import Options, machine
from sanctum.bench.results import ArmInfo, Run

BATCH = 8  # a request and 7 others
DEPTH = 3  # the speculative config's pinned draft depth
CONFIGS = ("plain", f"d{DEPTH}")
HYBRID = "builtin:demo-hybrid"

# -- pure figures --------------------------------------------------------------------


def batches(n: int, size: int = BATCH) -> list[list[int]]:
    """Windows of `size` cases that cover cases 0..n-1: consecutive runs from 0, the last
    one ending at n-1 (so it overlaps the one before it when size does not divide n).
    Fewer cases than `size` fill one window cyclically (a case twice in a batch is two
    requests with the same prompt)."""
    if n <= 0:
        return []
    if n <= size:
        return [[i % n for i in range(size)]]
    starts = list(range(0, n - size + 1, size))
    if starts[-1] + size < n:
        starts.append(n - size)
    return [list(range(s, s + size)) for s in starts]


class NeighbourRow(msgspec.Struct, frozen=True):
    """One request's answer in a batch, compared token by token with its answer alone."""

    model: str
    workload: str
    rule: str  # "greedy" (t=0) or "keyed" (seeded, t>0)
    temperature: float
    config: str  # "plain", "d3"
    arm: str  # "batched", "solo"
    batch: int  # which window of cases it ran in
    neighbours: list[str]  # the other rows of its batch, in submission order
    tokens_alone: int
    tokens_batched: int
    first_diff: int | None  # answer position, None: equal answers
    compared: int
    token_alone: int | None = None  # the tokens at the first difference
    token_batched: int | None = None
    # Speculation as each answer reported it: state, verifies, accepted drafts per verify.
    state_alone: str = "off"
    state_batched: str = "off"
    verifies_alone: int = 0
    verifies_batched: int = 0
    accept_alone: float = 0.0
    accept_batched: float = 0.0
    rows_per_step: float = 0.0  # mean rows in the forwards that decoded the batched answer


def until_first(rows: Sequence[NeighbourRow]) -> tuple[float, int] | None:
    """(median, smallest) tokens until the first difference, over the answers that
    differ (the position is the count of equal tokens before it); None when none differ."""
    firsts = [r.first_diff for r in rows if r.first_diff is not None]
    if not firsts:
        return None
    return float(statistics.median(firsts)), min(firsts)


def totals(rows: Sequence[NeighbourRow]) -> tuple[int, int, float]:
    """(flips, tokens compared, flips per 1,000) over several comparisons."""
    flips = sum(1 for r in rows if r.first_diff is not None)
    compared = sum(r.compared for r in rows)
    return flips, compared, per_thousand(flips, compared)


def groups(rows: Sequence[NeighbourRow],
           ) -> list[tuple[tuple[str, str, str, str], list[NeighbourRow]]]:
    """Rows by (model, rule, config, arm), in the order they ran."""
    out: dict[tuple[str, str, str, str], list[NeighbourRow]] = {}
    for r in rows:
        key = (r.model, f"{r.rule} t={r.temperature:g}", r.config, r.arm)
        out.setdefault(key, []).append(r)
    return list(out.items())


def mean_rows(sizes: dict[int, int]) -> float:
    """Mean rows per decode forward from steps seen at each batch size."""
    steps = sum(sizes.values())
    return sum(b * n for b, n in sizes.items()) / steps if steps else 0.0


def fill_rows(others: Sequence[Sequence[int]], length: int, count: int) -> list[list[int]]:
    """`count` rows of exactly `length` tokens from `others`, taken in turn: each cut to
    `length`, a shorter one repeated until it is long enough."""
    out = []
    for i in range(count):
        ids = list(others[i % len(others)]) or [0]
        while len(ids) < length:
            ids += ids
        out.append(ids[:length])
    return out


# -- decoding with the engine ------------------------------------------------------------


def shape_difference(model: Any, prompt: Sequence[int], others: Sequence[Sequence[int]],
                     ) -> float:
    """The largest logit difference, over every position of `prompt`, between one
    forward of it alone and one of it as the last of BATCH rows (the others cut from
    `others`): how far batch shape alone moves the scores a token is chosen from."""
    import mlx.core as mx

    x = mx.array([list(prompt)], dtype=mx.uint32)
    rest = mx.array(fill_rows(others, len(prompt), BATCH - 1), dtype=mx.uint32)
    alone = model(x)[0]
    batched = model(mx.concatenate([rest, x]))[BATCH - 1]
    return float(mx.max(mx.abs(alone.astype(mx.float32) - batched.astype(mx.float32))))


def solo_offered() -> bool:
    from shared.protocol import Generate

    return "solo" in Generate.__struct_fields__


class Decoded(msgspec.Struct):
    ids: list[int]
    state: str
    verifies: int
    accept: float
    rows_per_step: float  # mean rows in the forwards that decoded it


def decode_rows(loaded: Any, drafter_model: Any, cases: Sequence[Case], config: str,
                tokens: int, solo: bool = False, together: bool = False,
                late: bool = False) -> tuple[list[Decoded], dict[int, int]]:
    """`cases` submitted together to one engine (one row each, fp16 lane) and stepped
    until every row is done; their answers and the steps seen at each batch size.

    The engine prefills one row at a time, so the first rows decode a good part of a
    short answer before the last ones join.  `together` holds decoding until every row
    has joined, so each answer is decoded in forwards of all the rows still going.
    `late` submits each case only once the case before it is done or decoding with a
    pace of its own (PACE_STEPS steps in: before that, rows reaching the engine are one
    cohort with it, `seatd.batch_policy.paced`)."""
    from seatd.adaptive import DepthStats
    from seatd.batch import Engine
    from seatd.batch_policy import PACE_STEPS
    from seatd.drafters import ModelDrafter
    from seatd.engine_io import Transcript, Work
    from seatd.engine_types import Speculation, output_width
    from seatd.kv_budget import KVBudget
    from shared.protocol import Generate, SamplingParams

    engine = Engine(loaded.model, loaded.tokenizer, loaded.context_length,
                    output_width(loaded.model), BATCH, KVBudget(1 << 34))
    # Which rows each decode forward held, so every answer knows its own neighbours'
    # count (rows join after their prefill and leave when done).  A bench-only wrapper
    # around one engine's method: it computes exactly what it computes without it.
    seen: dict[str, list[int]] = {}
    step = engine._decode

    def watched(lane: Any) -> None:
        if together and (engine.joining or engine.inbox):
            return  # prefill goes on; no row of the lane advances this step
        for r in lane.rows:
            seen.setdefault(r.rid, []).append(len(lane.rows))
        step(lane)

    setattr(engine, "_decode", watched)  # noqa: B010  # an instance attribute, not the class
    got = Transcript()
    extra: dict[str, Any] = {"solo": True} if solo else {}

    def under_way(i: int) -> bool:
        """Row i is done, or decoding with a pace of its own (`batch_policy.paced`)."""
        return f"n{i}" in got.ended or any(
            r.rid == f"n{i}" and engine.decoded - r.began >= PACE_STEPS
            for lane in engine.lanes.values() for r in lane.rows)

    for i, case in enumerate(cases):
        while late and i and not under_way(i - 1):
            engine.step()
            got.read(engine.outbox)
        params = SamplingParams(temperature=case.temperature, top_p=case.top_p,
                                top_k=case.top_k, max_tokens=tokens, seed=case.seed)
        spec = None
        if config != "plain":
            spec = Speculation(ModelDrafter(drafter_model), int(config.removeprefix("d")),
                               DepthStats())
        engine.submit(Work(Generate(f"n{i}", False, params, **extra), list(case.prompt_ids),
                           "fp16", spec=spec))
    while len(got.ended) < len(cases):
        engine.step()
        got.read(engine.outbox)
    out = []
    for i in range(len(cases)):
        result, error = got.result(f"n{i}"), got.error(f"n{i}")
        if result is None:
            raise RuntimeError(f"row {i} ({cases[i].workload}) failed: {error!r}")
        rep = result.speculation
        sizes = seen.get(f"n{i}", [])
        out.append(Decoded(list(result.token_ids), rep.state, rep.drafts,
                           rep.accepted_tokens / rep.drafts if rep.drafts else 0.0,
                           sum(sizes) / len(sizes) if sizes else 0.0))
    return out, dict(engine.batch_sizes)


def _label(case: Case) -> str:
    return f"{case.workload} {'greedy' if case.temperature == 0 else 'keyed'}"


def compare(model: str, case: Case, config: str, arm: str, batch: int,
            neighbours: list[str], alone: Decoded, other: Decoded) -> NeighbourRow:
    first = first_difference(alone.ids, other.ids)
    at: dict[str, Any] = {}
    if first is not None:
        at = dict(token_alone=alone.ids[first] if first < len(alone.ids) else None,
                  token_batched=other.ids[first] if first < len(other.ids) else None)
    return NeighbourRow(model, case.workload, "greedy" if case.temperature == 0 else "keyed",
                        case.temperature, config, arm, batch, neighbours, len(alone.ids),
                        len(other.ids), first, compared_tokens(alone.ids, other.ids),
                        state_alone=alone.state, state_batched=other.state,
                        verifies_alone=alone.verifies, verifies_batched=other.verifies,
                        accept_alone=alone.accept, accept_batched=other.accept,
                        rows_per_step=other.rows_per_step, **at)


def run_model(loaded: Any, drafter_model: Any, model: str, cases: Sequence[Case],
              tokens: int, arms: Sequence[str],
              progress: Callable[[str], None] | None = None) -> list[NeighbourRow]:
    """Every case alone and in its windows of eight, per config and arm."""
    rows: list[NeighbourRow] = []
    say = progress or (lambda text: None)
    for config in CONFIGS:
        alone = []
        for case in cases:
            t0 = time.perf_counter()
            (answer,), _ = decode_rows(loaded, drafter_model, [case], config, tokens)
            alone.append(answer)
            say(f"{model} {config} alone {_label(case)}: {len(answer.ids)} tokens, "
                f"{answer.state} ({time.perf_counter() - t0:.0f} s)")
        for arm in arms:
            for b, window in enumerate(batches(len(cases))):
                t0 = time.perf_counter()
                answers, sizes = decode_rows(loaded, drafter_model,
                                             [cases[i] for i in window], config, tokens,
                                             solo=arm == "solo", together=arm == "batched",
                                             late=arm == "latecomers")
                per_step = mean_rows(sizes)
                for j, (i, answer) in enumerate(zip(window, answers, strict=True)):
                    others = [_label(cases[k]) for n, k in enumerate(window) if n != j]
                    row = compare(model, cases[i], config, arm, b, others, alone[i], answer)
                    rows.append(row)
                    where = "equal" if row.first_diff is None else f"differ at {row.first_diff}"
                    say(f"{model} {config} {arm} #{b} {_label(cases[i])}: {row.compared} "
                        f"compared, {where}, {answer.state}, {answer.rows_per_step:.2f} rows")
                say(f"{model} {config} {arm} #{b}: {per_step:.2f} rows per step "
                    f"({time.perf_counter() - t0:.0f} s)")
    return rows


# -- the comparison: `sanctum bench run neighbours` -----------------------------------------


def neighbours(opts: Options) -> Run:
    from sanctum.bench.flips import KEYED_SEED, KEYED_T, KEYED_TOP_K, KEYED_TOP_P, cases
    from sanctum.bench.runner import new_run_id
    from seatd.model_load import load_for_compute
    from shared.builtin import resolve_model

    models = [opts.model] + ([HYBRID] if opts.model == Options().model else [])
    arms = ["batched", "joining", "latecomers", *(["solo"] if solo_offered() else [])]
    started = time.perf_counter()

    def show(text: str) -> None:
        if opts.verbose:
            print(f"  {text}", file=sys.stderr, flush=True)

    draft = load_for_compute(resolve_model(opts.drafter))
    rows: list[NeighbourRow] = []
    shape: dict[str, float] = {}
    for model in models:
        loaded = load_for_compute(resolve_model(model))
        held = cases(loaded, model, opts.workloads, opts.flip_tokens)
        shape[model] = shape_difference(loaded.model, held[0].prompt_ids,
                                        [c.prompt_ids for c in held[1:]] or [[0]])
        show(f"{model}: batch shape moves the logits by up to {shape[model]:.2g}")
        rows += run_model(loaded, draft.model, model, held, opts.flip_tokens, arms, show)
    elapsed = time.perf_counter() - started
    descriptions = {
        "alone": "the request alone: a batch engine (seatd.batch.Engine) holding that one "
                 "row",
        "batched": f"the same request as one of {BATCH} rows submitted together to one "
                   "engine (the other rows: other held-out cases, greedy and keyed, of "
                   "other lengths), decoding held until every row has joined, so each "
                   "answer is decoded in forwards of all the rows still going (rows that "
                   "joined a lane with rows in it were prefilled in the engine's smaller "
                   "chunks)",
        "joining": f"the same {BATCH} rows on the engine's own schedule: each row decodes "
                   "as soon as its prefill is in, beside the rows already decoding, so the "
                   "first rows decode part of their answer in smaller batches",
        "latecomers": f"the same {BATCH} rows, each submitted once the row before it is "
                      "a few steps into its answer: every row but the first joins a busy "
                      "batch at its pace, its "
                      "prompt riding the rows' steps where the model takes riders (the "
                      "batch taking plain steps meanwhile)",
    }
    if "solo" in arms:
        descriptions["solo"] = (f"the same {BATCH} requests, each asking for a lane of its "
                                "own (Generate.solo)")
    descriptions["d3"] = (f"speculation on: every row with its own model drafter "
                          f"(builtin:demo-drafter), depth {DEPTH} pinned; in a batch the "
                          "engine decides per step whether a verify step pays")
    notes = [f"Held-out workloads (tests/data/heldout), {opts.flip_tokens} new tokens per "
             "answer, in this process, fp16 KV lane; greedy at t=0, and keyed at "
             f"t={KEYED_T:g} with top_p {KEYED_TOP_P:g}, top_k {KEYED_TOP_K}, seed "
             f"{KEYED_SEED}.",
             f"The cases are laid in windows of {BATCH} (the last overlapping the one "
             "before it), each window one engine; every row is compared with its own "
             "answer alone, so a case in two windows is compared twice, with other "
             "neighbours.",
             f"The whole run took {elapsed:.0f} s."]
    if "solo" not in arms:
        notes.append("Requests cannot ask for a lane of their own yet (no Generate.solo): "
                     "no solo arm.")
    return Run(new_run_id(), "neighbours", "A seeded answer alone against the same request "
               f"batched with {BATCH - 1} others", "alone",
               [ArmInfo(n, d) for n, d in descriptions.items()],
               {r.workload: r.workload for r in rows}, 1, 0, 0,
               machine(" + ".join(models)), [], notes,
               extra={"neighbours": msgspec.to_builtins(rows), "tokens": opts.flip_tokens,
                      "shape_logit_diff": shape})


# -- its section of the report --------------------------------------------------------------


def stored_rows(run: Run) -> list[NeighbourRow]:
    return msgspec.convert(run.extra.get("neighbours", []), list[NeighbourRow])


def _until_text(rows: Sequence[NeighbourRow]) -> str:
    got = until_first(rows)
    return "-" if got is None else f"{got[0]:g} / {got[1]}"


def _spec_text(rows: Sequence[NeighbourRow]) -> str:
    """How the batched answers speculated: verifies and accepted drafts per verify."""
    if all(r.state_batched == "off" for r in rows):
        return "-"
    verifies = sum(r.verifies_batched for r in rows)
    alone = sum(r.verifies_alone for r in rows)
    return f"{verifies} verifies ({alone} alone)"


def headline(run: Run) -> list[tuple[str, str]]:
    """(what, figure) per model, rule, config and arm: flips per 1,000 tokens compared."""
    out = []
    for (model, rule, config, arm), rows in groups(stored_rows(run)):
        n, compared, _ = totals(rows)
        out.append((f"flips per 1,000 tokens, alone against {arm}, "
                    f"{model.removeprefix('builtin:')} {rule} {config}", rate_text(n, compared)))
    return out


def section(run: Run, title: str) -> list[str]:
    rows = stored_rows(run)
    m = run.machine
    lines = [f"## {title}", "",
             f"{run.title}. Run `{run.run_id}`, {m.get('date', '?')}, models "
             f"`{m.get('model', '?')}`. A correctness measure, not a speed comparison: "
             "nothing is interleaved. Each request is decoded alone and batched, and the "
             "token ids compared; a flip is the first position where they differ (the "
             "answers part there, so only the first counts), and the tokens compared run "
             "up to it or over the whole answer. Tokens until the first difference are "
             "the equal tokens before it, over the answers that differ.", ""]
    lines += [f"- **{a.name}**: {a.description}" for a in run.arms]
    lines += ["", *[f"- {n}" for n in run.notes]]
    shape = run.extra.get("shape_logit_diff")
    if isinstance(shape, dict) and shape:
        moved = ", ".join(f"{float(v):.2g} ({str(k).removeprefix('builtin:')})"
                          for k, v in shape.items())
        lines.append("- Batch shape alone moves the scores: the first case's prompt scored "
                     f"in one forward alone and as the last of {BATCH} rows differs by at "
                     f"most {moved} in any logit at any position. A flip needs a top-two "
                     "gap below the difference at that position.")
    lines += ["", "| model | rule | speculative | against alone | answers | flips "
              "| tokens compared | flips per 1,000 | tokens until the first difference "
              "(median / fewest) | rows in its forwards (mean) | speculation batched |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model, rule, config, arm), rs in groups(rows):
        n, compared, _ = totals(rs)
        per_step = statistics.mean(r.rows_per_step for r in rs)
        lines.append(f"| {model} | {rule} | {config} | {arm} | {len(rs)} | {n} | {compared} "
                     f"| {rate_text(n, compared)} | {_until_text(rs)} | {per_step:.2f} "
                     f"| {_spec_text(rs)} |")
    lines += ["", "Per answer (first difference: the answer position, from 0, and the "
              "tokens there alone / batched; speculation: state, verifies and accepted "
              "drafts per verify, alone / batched):", "",
              "| model | workload | rule | speculative | against alone | window "
              "| rows in its forwards | tokens alone / batched | first difference "
              "| tokens compared | tokens there | speculation |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        there = "-" if r.first_diff is None else f"{r.token_alone} / {r.token_batched}"
        spec = "-"
        if r.config != "plain":
            spec = (f"{r.state_alone} {r.verifies_alone} x {r.accept_alone:.2f} / "
                    f"{r.state_batched} {r.verifies_batched} x {r.accept_batched:.2f}")
        lines.append(f"| {r.model.removeprefix('builtin:')} | {r.workload} "
                     f"| {r.rule} t={r.temperature:g} | {r.config} | {r.arm} | {r.batch} "
                     f"| {r.rows_per_step:.2f} | {r.tokens_alone} / {r.tokens_batched} "
                     f"| {'none' if r.first_diff is None else r.first_diff} | {r.compared} "
                     f"| {there} | {spec} |")
    return [*lines, ""]
