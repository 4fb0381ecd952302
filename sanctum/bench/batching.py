"""Concurrent clients on our seat against mlx_lm.server with its batching on:
interleaved, same weights, same prompts (continuous batching in the seat).

    sanctum bench run batching [--clients 1,2,4,8,16] [--rounds N] [--tokens N]
                               [--temperature T [--unseeded]] [--arms A,B]
                               [--workloads c=N,...]

`--arms`: which of mlx_lm.server, mlx_lm.server draft and bound run beside our two
seats (default all: every arm's server is up at once, and a large model's five may not
fit one device); `--workloads`: which slots (`c=N`, PREFILL) of those asked.

Arms (one `sanctum up` with two seats and two mlx_lm.server processes, all up at once):

    sanctum              the packaged demo seat as configured by default (builtin:demo,
                         drafter builtin:demo-drafter, speculation on, adaptive depth)
    sanctum plain        the same seat with speculation = false
    mlx_lm.server        mlx-lm's own server on a float32 copy of the weights our seat
                         computes with, batching on (no draft model, unseeded requests)
    mlx_lm.server draft  the same with --draft-model (a float32 copy of the drafter);
                         mlx-lm then serves one request at a time, so it is measured up
                         to DRAFT_MAX_CLIENTS clients and its other slots stay empty
    bound                mlx-lm's bare loop of batched forwards at batch N on the weights
                         the seat computes with (`sanctum.bench.bound`): every server's
                         aggregate also reads as a fraction of it

Workloads (groups of the schedule): `c=N` for each concurrency level, and PREFILL, a
~1,500-token prompt arriving among 7 decoding rows (sanctum.bench.concurrent says what
each measures).  At temperature 0 no request carries a seed; above 0 our seats get
seeded requests (a seat that batches still honours seeds) and mlx_lm.server unseeded
ones (a seed turns its batching off); such a run is stored as batching-tT.  With
`--unseeded` our seats' requests carry no seed either, as chat clients send them (they
sample by a key chain, not the keyed rule): stored as batching-tT-unseeded.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from sanctum.bench import device_memory, servers
from sanctum.bench import options as O
from sanctum.bench.bound import BOUND, BoundArm, bound_server
from sanctum.bench.concurrent import (
    CLIENT_TIMEOUT_S,
    PREFILL,
    ROW_FACTOR,
    ROWS,
    SETTLE_S,
    ConcurrentArm,
    settle_chunks,
)
from sanctum.bench.options import Options, machine
from sanctum.bench.results import ArmInfo, Run, Sample
from sanctum.bench.runner import new_run_id, run_schedule
from sanctum.bench.schedule import make_schedule
from sanctum.bench.stats import Summary, figure_values, measured, pair_ratios, summarize
from sanctum.bench.text import fmt, fmt_ratio
from sanctum.bench.workloads import Workload, build_workloads, heldout_files
from seatd.counters import DRAFTERS, PARTS, STAGES

OURS, PLAIN, MLX, MLX_DRAFT = "sanctum", "sanctum plain", "mlx_lm.server", "mlx_lm.server draft"
DRAFT_MAX_CLIENTS = 4
LONG_PROMPT_TOKENS = 1500
QUEUE_TIMEOUT_S = CLIENT_TIMEOUT_S  # a queued request waits as long as its client does
SHORT = ("code-short", "doc2body", "rename", "prose")  # the clients' prompts, rotated
ROW_PROMPTS = ("code-short", "prose")  # completions: they run to their max_tokens
GOAL_VS_MLX = 1.0  # at every level
GOAL_SPEC_VS_BEST = 1.2  # speculation on, 1 to 4 clients, over mlx-lm's faster mode
GOAL_SCALING = 3.0  # 8 clients over 1
GOAL_PREFILL = 0.5  # the long prefill at most doubles the rows' inter-token p99
GOAL_VS_PLAIN = 0.97  # the default seat against its own plain path, at every level
GOAL_BOUND = 0.85  # the plain seat at BOUND_LEVELS over the bound
BOUND_LEVELS = (8, 16)


def stem(opts: Options) -> str:
    """batching, or batching-MODEL / batching-DRAFTER / batching-tT (in that order) for a
    run off the default model, drafter or temperature; -unseeded after the temperature
    where our seats' requests carry no seed: a run of another pair never writes over
    the default pair's.  Pure."""
    from sanctum.bench.drafter_kinds import stem_part

    parts = ["batching"]
    if opts.model != Options().model:
        parts.append(stem_part(opts.model))
    if opts.drafter != Options().drafter:
        parts.append(stem_part(opts.drafter))
    if opts.temperature != 0:
        parts.append(f"t{opts.temperature:g}")
        if opts.unseeded:
            parts.append("unseeded")
    return "-".join(parts)


def long_prompt(files: Sequence[tuple[str, str]], count: Callable[[str], int],
                target: int) -> Workload:
    """Consecutive held-out files, cut at a line end to the most lines within `target`
    tokens (the workload builder's own cut may land 10% short).  Pure."""
    joined = "\n\n".join(t for _, t in files)[: 12 * target]
    lines = joined.splitlines(keepends=True)

    def head(n: int) -> str:
        return "".join(lines[:n]).rstrip("\n")

    lo, hi = 0, len(lines)
    while lo < hi:  # the largest n whose head fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(head(mid)) <= target else (lo, mid - 1)
    text = head(lo)
    return Workload("long-prompt", "consecutive held-out files", "completion", prompt=text,
                    prompt_tokens=count(text))


def kept_arms(asked: Sequence[str]) -> tuple[str, ...]:
    """The arms a run measures: our two seats always, and of the others those asked
    (none asked: all).  An arm not known is refused.  Pure."""
    others = (MLX, MLX_DRAFT, BOUND)
    unknown = [a for a in asked if a not in (OURS, PLAIN, *others)]
    if unknown:
        raise ValueError(f"no such arm {', '.join(unknown)}: arms are "
                         f"{', '.join((OURS, PLAIN, *others))}")
    return (OURS, PLAIN, *(a for a in others if not asked or a in asked))


def _seat_model(spec: str, path: Path) -> str:
    # A builtin stays a builtin in the config; a directory goes in as an absolute path
    # (the config sits in a temporary directory, and relative paths resolve from it).
    return spec if spec.startswith("builtin:") else str(path.resolve())


def batching(opts: Options) -> Run:
    from shared.builtin import resolve_model
    from shared.prompt import load_tokenizer

    title = "Concurrent clients: our seat against mlx_lm.server with its batching on"
    path = O.model_path(opts.model)
    try:
        drafter = resolve_model(opts.drafter)
    except ValueError as exc:
        return O.not_measurable("batching", title, f"no drafter model ({exc})", opts.model)
    if not (drafter / "config.json").exists():
        return O.not_measurable("batching", title, f"no drafter model at {opts.drafter}",
                                 opts.model)
    tokens, clients = opts.batch_tokens, sorted(set(opts.batch_clients))
    keep = kept_arms(opts.arms)
    ctx = int(json.loads((path / "config.json").read_text()).get("max_position_embeddings",
                                                                 2048))
    cap = O.seat_cap(ctx, ROW_FACTOR * tokens)
    tokenizer = load_tokenizer(path)
    source, files = heldout_files()

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    by_name = {w.name: w for w in build_workloads(files, count, cap)}
    short = [by_name[n] for n in SHORT if n in by_name]
    rows = [by_name[n] for n in ROW_PROMPTS if n in by_name]
    long = long_prompt(files, count, min(LONG_PROMPT_TOKENS, cap - 64))
    t = opts.temperature
    seeded = not opts.unseeded  # our seats' requests above temperature 0
    drafter_spec = _seat_model(opts.drafter, drafter)
    drafter_line = f'drafter = {{ kind = "model", path = "{drafter_spec}" }}\n'
    model = _seat_model(opts.model, path)
    # A seat that decodes one request at a time queues the others; the queue's own
    # clock (120 s by default) would refuse the last of 16 on a busy machine, and a
    # refusal is not a measurement.  Otherwise the seats run as configured by default.
    queue = f"queue_timeout_s = {QUEUE_TIMEOUT_S:g}\n"
    seats = [("bench", model, cap + 64, drafter_line + queue),
             ("plain", model, cap + 64, drafter_line + queue + "speculation = false\n")]
    mlx_depth = opts.draft_depth or 4
    # The servers stop (the stack) before their weights' directory is removed.
    with servers.workdir() as wd, ExitStack() as stack:
        served = O.float32_copy(path, wd / "model-f32")
        served_drafter = O.float32_copy(drafter, wd / "drafter-f32")
        port = servers.free_port()
        url = stack.enter_context(servers.sanctum_up(servers.sanctum_config(port, seats),
                                                     ("bench", "plain"), port))
        murl = durl = burl = ""
        if MLX in keep:
            murl = stack.enter_context(servers.mlx_lm_server(str(served), servers.free_port()))
        if MLX_DRAFT in keep:
            durl = stack.enter_context(servers.mlx_lm_server(
                str(served), servers.free_port(), draft=str(served_drafter),
                num_draft=mlx_depth))
        if BOUND in keep:
            burl = stack.enter_context(bound_server(str(path), servers.free_port()))

        def arm(u: str, name: str, seeded: bool, **kw: Any) -> ConcurrentArm:
            return ConcurrentArm(u, name, short, rows, long, tokens, t, seeded, **kw)

        arms: dict[str, tuple[str, Callable[[str], dict[str, float]]]] = {
            OURS: (f"openai-compatible HTTP -> proxyd -> a seat on {opts.model} as "
                   f"configured by default (drafter {opts.drafter}, speculation on, "
                   "adaptive depth)",
                   arm(url, "bench", seeded, seat="bench")),
            PLAIN: ("the same seat with speculation = false",
                    arm(url, "plain", seeded, seat="plain")),
            MLX: ("mlx_lm.server, batching on (no draft model, unseeded requests)",
                  arm(murl, str(served), False)),
            MLX_DRAFT: (f"mlx_lm.server --draft-model (the demo drafter), "
                        f"--num-draft-tokens {mlx_depth}: it serves one request at a time, "
                        f"measured up to {DRAFT_MAX_CLIENTS} clients",
                        arm(durl, str(served), False, max_clients=DRAFT_MAX_CLIENTS,
                            prefill=False)),
            BOUND: ("mlx-lm's bare loop of batched forwards at batch N (greedy tokens fed "
                    "back, no server), the seat's weights and dtype: the physical bound",
                    BoundArm(burl, bound_prompt(tokenizer, short), tokens)),
        }
        arms = {n: a for n, a in arms.items() if n in keep}
        if device_memory.available():
            # the driver's figure for each arm's processes, beside MLX's own
            ours = {OURS: "bench", PLAIN: "plain"}
            ports = {MLX: murl, MLX_DRAFT: durl, BOUND: burl}
            arms = {n: (d, device_memory.WithDeviceMemory(
                        m, _seat_pid(url, ours[n]) if n in ours
                        else _served_by(ports[n])))
                    for n, (d, m) in arms.items()}
        names = [n for n in [f"c={c}" for c in clients] + [PREFILL]
                 if not opts.workloads or n in opts.workloads]
        run_id = new_run_id()
        slots = make_schedule(list(arms), names, opts.batch_rounds, opts.warmup, opts.seed)
        samples = run_schedule(slots, {n: m for n, (_, m) in arms.items()}, run_id=run_id,
                               progress=_progress if opts.verbose else None)
    seeds = ("no request carries a seed" if t == 0 else
             "no request carries a seed (--unseeded: as chat clients send them)"
             if not seeded else
             "our seats' requests are seeded (1 + k), mlx_lm.server's unseeded (a seed "
             "turns its batching off)")
    workloads = {f"c={c}": f"{c} streaming client{'s' if c > 1 else ''} started together, "
                 f"one request each of {tokens} new tokens" for c in clients}
    workloads[PREFILL] = (f"{ROWS} clients decode {ROW_FACTOR * tokens}-token answers; once "
                          f"each has sent {settle_chunks(tokens)} chunks (at most "
                          f"{SETTLE_S:g} s after all stream), one request with a "
                          f"{long.prompt_tokens}-token prompt arrives")
    workloads = {n: d for n, d in workloads.items() if n in names}
    notes = [
        f"Prompts: the held-out workloads ({source}) {', '.join(n for n in SHORT if n in by_name)}"
        ", rotated over the clients and the rounds, each request with a salt of its own "
        f"(no prompt found in a cache); the decoding rows use {', '.join(ROW_PROMPTS)}, "
        f"the long prompt consecutive held-out files. Temperature {t:g}; {seeds}.",
        f"Our seats wait up to {QUEUE_TIMEOUT_S:g} s in their queue (queue_timeout_s; the "
        "default 120 s would refuse requests queued behind a serial seat's others); every "
        "other setting is the default.",
        _weights_note(opts.model),
        "Aggregate tokens/s = completion tokens of the slot's requests (their usage) over "
        "the slot's wall time, first send to last byte; TTFT from each request's send; "
        "inter-token gaps between consecutive text chunks (per chunk for every server), "
        "pooled over the slot's requests.",
        "The long-prompt scenario compares the rows decoding when it arrives: their "
        "inter-token p99 from all streaming to its arrival, against while it prefills "
        "(gaps that overlap its send to its first token); the ratio is before over during, "
        "within one slot.",
    ]

    run = Run(run_id, "batching", title, MLX, [ArmInfo(n, d) for n, (d, _) in arms.items()],
              workloads, opts.batch_rounds, opts.warmup, opts.seed, machine(opts.model),
              samples, notes, extra={"clients": clients, "tokens": tokens, "temperature": t})
    print("\n".join(table(run)), flush=True)
    return run


def _seat_pid(url: str, seat: str) -> Callable[[], set[int]]:
    """Our seat's worker process now (a restarted worker has a new pid)."""
    return lambda: {int(servers.get_health(url + "/health")["seats"][seat]["pid"])}


def _served_by(url: str | None) -> Callable[[], set[int]]:
    port = urlparse(url).port if url else None
    return lambda: device_memory.listening(port) if port else set()


def _weights_note(model: str) -> str:
    """Which weights every arm computes with: `O.float32_copy`'s rule, said of this run."""
    from seatd.model_load import on_cpu

    if on_cpu():
        return ("Every arm serves the same weights in float32: our seat dequantizes "
                f"{model} at load (load_for_compute), mlx_lm.server serves a float32 "
                "copy of those weights (and of the drafter).")
    return ("Every arm serves the same weights as stored (off the CPU our seat computes "
            f"{model} as stored, quantized ones included: load_for_compute), "
            "mlx_lm.server and the bound the same folder.")


def bound_prompt(tokenizer: Any, short: Sequence[Workload]) -> list[int]:
    """The bound's prompt: the short prompt of median length, as the seats get it."""
    prompts = sorted((w.token_ids(tokenizer) for w in short), key=len)
    return prompts[len(prompts) // 2]


def _progress(s: Sample) -> None:
    keys = ("agg_tps", "ttft_p99_s", "itl_p99_s", "rows_decoding", "prefill_itl_speed",
            "long_ttft_s")
    figs = " ".join(f"{k}={s.figures[k]:.4g}" for k in keys if k in s.figures)
    tag = "warm-up " if s.warmup else ""
    print(f"  [{s.seq:>3}] r{s.round} {tag}{s.workload:<16} {s.arm:<20} load "
          f"{s.load_before:.2f}  {s.error or figs or '(not measured)'}", file=sys.stderr,
          flush=True)


# -- the report's section (sanctum.bench.report calls these) ---------------------------


def levels(run: Run) -> list[int]:
    return sorted(int(w[2:]) for w in run.workloads if w.startswith("c="))


def _arms(run: Run) -> list[str]:
    return [a.name for a in run.arms]


def best_of_ratios(samples: list[Sample], figure: str, arm: str, others: list[str],
                   workload: str) -> list[float]:
    """Per round, `arm` over the best of `others` that measured `figure` (higher is
    better).  Pure."""
    groups: dict[int, dict[str, float]] = defaultdict(dict)
    for s in measured(samples):
        if s.workload == workload and figure in s.figures:
            groups[s.round][s.arm] = s.figures[figure]
    out = []
    for g in groups.values():
        rivals = [g[o] for o in others if o in g]
        if arm in g and rivals and max(rivals) > 0:
            out.append(g[arm] / max(rivals))
    return out


def scaling(samples: list[Sample], arm: str, hi: str, lo: str,
            figure: str = "agg_tps") -> list[float]:
    """Per round, one arm's `figure` at workload `hi` over the same at `lo`.  Pure."""
    by_round: dict[int, dict[str, float]] = defaultdict(dict)
    for s in measured(samples):
        if s.arm == arm and s.workload in (hi, lo) and figure in s.figures:
            by_round[s.round][s.workload] = s.figures[figure]
    return [g[hi] / g[lo] for g in by_round.values() if hi in g and lo in g and g[lo] > 0]


def _clients(c: int) -> str:
    return f"{c} client{'s' if c > 1 else ''}"


def prefill_speeds(run: Run, arm: str) -> list[float]:
    """The long-prefill ratio of the slots where all the rows were decoding when the long
    prompt arrived (a server that queues rows never sets the scenario up)."""
    return [s.figures["prefill_itl_speed"] for s in measured(run.samples)
            if s.arm == arm and s.workload == PREFILL and "prefill_itl_speed" in s.figures
            and s.figures.get("rows_decoding") == ROWS]


def headline(run: Run) -> list[tuple[str, Summary, float | None]]:
    out: list[tuple[str, Summary, float | None]] = []
    arms, samples = _arms(run), list(run.samples)
    for c in levels(run):
        r = pair_ratios(samples, "agg_tps", OURS, MLX, f"c={c}")
        if r:
            out.append((f"aggregate tokens/s, {OURS} over {MLX}, {_clients(c)}",
                        summarize(r), GOAL_VS_MLX))
    if MLX_DRAFT in arms:
        for c in (c for c in levels(run) if c <= DRAFT_MAX_CLIENTS):
            r = best_of_ratios(samples, "agg_tps", OURS, [MLX, MLX_DRAFT], f"c={c}")
            if r:
                out.append((f"aggregate tokens/s, {OURS} over mlx_lm.server's faster mode "
                            f"(batching or draft model), {_clients(c)}", summarize(r),
                            GOAL_SPEC_VS_BEST))
    for c in levels(run):
        r = pair_ratios(samples, "agg_tps", OURS, PLAIN, f"c={c}")
        if r:
            out.append((f"aggregate tokens/s, {OURS} over {PLAIN}, {_clients(c)}",
                        summarize(r), GOAL_VS_PLAIN))
    if BOUND in arms:  # the table has every level's; the summary the levels with a goal
        for c in (c for c in levels(run) if c in BOUND_LEVELS):
            for arm in (PLAIN, OURS):
                r = pair_ratios(samples, "agg_tps", arm, BOUND, f"c={c}")
                if r:
                    goal = GOAL_BOUND if arm == PLAIN else None
                    out.append((f"aggregate tokens/s, {arm} over the bound (mlx-lm's "
                                f"batched forward loop), {_clients(c)}", summarize(r), goal))
    # The goal is the default seat's; the plain seat's and mlx_lm.server's own scaling
    # stand beside it (the default seat's 1 client speculates, so it starts higher).
    for arm in (OURS, PLAIN, MLX):
        r = scaling(samples, arm, "c=8", "c=1")
        if r:
            out.append((f"aggregate tokens/s, {arm} at 8 clients over 1 client, per round",
                        summarize(r), GOAL_SCALING if arm == OURS else None))
    for arm in (OURS, PLAIN, MLX):
        v = prefill_speeds(run, arm)
        if v:
            out.append((f"inter-token p99 of {ROWS} decoding rows, before over during a long "
                        f"prefill, {arm}", summarize(v), GOAL_PREFILL if arm == OURS else None))
    return out


def _med(run: Run, fig: str, arm: str, w: str, fmt: Callable[[float], str]) -> str:
    v = figure_values(run.samples, fig, arm, w)
    return fmt(summarize(v).median) if v else "-"


def _seconds(x: float) -> str:

    return fmt(x, "s")


def table(run: Run) -> list[str]:
    """Per level and arm: aggregate tokens/s (median, and the per-pair ratio over
    mlx_lm.server), TTFT p50/p99, inter-token p99, slowest request; then the
    long-prompt scenario."""

    arms = _arms(run)
    lines = ["Medians over the measured rounds of each slot's figures; the ratio is per "
             "pair (same round and level, back to back).", "",
             f"| clients | arm | aggregate tok/s | over {MLX} | of the bound | TTFT p50 "
             "| TTFT p99 | inter-token p99 | slowest request | accelerated | rows per step "
             "| a step at most rows |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in levels(run):
        w = f"c={c}"
        for arm in arms:
            if not figure_values(run.samples, "agg_tps", arm, w):
                continue
            r = pair_ratios(run.samples, "agg_tps", arm, MLX, w) \
                if arm not in (MLX, BOUND) else []
            b = pair_ratios(run.samples, "agg_tps", arm, BOUND, w) if arm != BOUND else []
            lines.append(
                f"| {c} | {arm} | {_med(run, 'agg_tps', arm, w, lambda x: f'{x:.1f}')} "
                f"| {fmt_ratio(summarize(r)) if r else '-'} "
                f"| {fmt_ratio(summarize(b)) if b else '-'} "
                f"| {_med(run, 'ttft_p50_s', arm, w, _seconds)} "
                f"| {_med(run, 'ttft_p99_s', arm, w, _seconds)} "
                f"| {_med(run, 'itl_p99_s', arm, w, _seconds)} "
                f"| {_med(run, 'slowest_s', arm, w, _seconds)} "
                f"| {_med(run, 'accelerated', arm, w, lambda x: f'{x:.0%}')} "
                f"| {_med(run, 'mean_batch', arm, w, lambda x: f'{x:.2g}')} "
                f"| {_med(run, 'step_ms', arm, w, lambda x: f'{x:.3g} ms')} |")
    lines += engine_table(run, arms) + stage_table(run, arms) + memory_table(run, arms)
    if PREFILL in run.workloads:
        lines += ["", f"{run.workloads[PREFILL]}:", "",
                  "| arm | rows decoding at arrival | inter-token p99 before | during "
                  f"| before / during (goal ≥ {GOAL_PREFILL:g}x) | long prompt's first token |",
                  "|---|---|---|---|---|---|"]
        for arm in arms:
            if not figure_values(run.samples, "rows_decoding", arm, PREFILL):
                continue
            v = prefill_speeds(run, arm)
            lines.append(
                f"| {arm} | {_med(run, 'rows_decoding', arm, PREFILL, lambda x: f'{x:g}')} "
                f"of {ROWS} | {_med(run, 'itl_p99_before_s', arm, PREFILL, _seconds)} "
                f"| {_med(run, 'itl_p99_during_s', arm, PREFILL, _seconds)} "
                f"| {fmt_ratio(summarize(v)) if v else '-'} "
                f"| {_med(run, 'long_ttft_s', arm, PREFILL, _seconds)} |")
        short = [a for a in arms
                 if any(x < ROWS for x in figure_values(run.samples, "rows_decoding", a,
                                                        PREFILL))]
        if short:
            lines += ["", f"Fewer than {ROWS} rows were decoding when the long prompt arrived "
                      f"in some slots of {', '.join(short)} (requests queued, or a row not "
                      "yet started or already ended): those slots are left out of the "
                      "before / during ratio."]
    return lines


def _part(run: Run, name: str, arm: str, w: str, calls: bool) -> str:
    """A part's median milliseconds, with its median calls in brackets."""
    ms = _med(run, f"{name}_ms", arm, w, lambda x: f"{x:.1f}")
    n = _med(run, f"{name}_calls", arm, w, lambda x: f"{x:g}")
    return f"{ms} ({n})" if calls and ms != "-" else ms


def engine_table(run: Run, arms: Sequence[str]) -> list[str]:
    """Per level and seat arm, where its engine spent the slot (medians of the seat's own
    `engine_us{part}` and `engine_calls{part}` over the measured rounds): nothing for a
    run whose seats did not count them."""
    rows = []
    for c in levels(run):
        w = f"c={c}"
        for arm in arms:
            if not figure_values(run.samples, "engine_ms", arm, w):
                continue
            slots = [1e3 * s.figures["completion_tokens"] / s.figures["agg_tps"]
                     for s in run.samples if s.arm == arm and s.workload == w
                     and not s.warmup and s.figures.get("agg_tps")]
            parts = [_part(run, name, arm, w, name != "other")
                     for name in PARTS]
            rounds = " / ".join(_med(run, f"{d}_rounds", arm, w, lambda x: f"{x:g}")
                                for d in DRAFTERS)
            rows.append(f"| {c} | {arm} | {summarize(slots).median:.1f} "
                        f"| {_med(run, 'engine_ms', arm, w, lambda x: f'{x:.1f}')} "
                        f"| {' | '.join(parts)} | {rounds} |")
    if not rows:
        return []
    return ["", "Where each seat's engine spent a slot, from its own counters "
            "(milliseconds, calls in brackets; medians over the measured rounds): the "
            "slot's wall time, the engine's working steps in all, then by part: prefill "
            "forwards of joining rows, model drafters taking prompts, plain and verify "
            "decode steps, and the rest of its steps; and the rows' speculative rounds "
            "by who drafted them.  What the slot had beyond the engine's work is the "
            "requests' way in and out, and the engine waiting for them.", "",
            "| clients | arm | slot ms | engine ms | prefill | drafter prefill | plain steps "
            "| verify steps | other | rounds: model / lookup |",
            "|---|---|---|---|---|---|---|---|---|---|", *rows]


def stage_table(run: Run, arms: Sequence[str]) -> list[str]:
    """Per level and seat arm, a plain step's milliseconds by stage (the seat's
    `plain_step_us{stage}` over its plain steps, medians of the measured rounds), beside
    the bound's whole step at the same level: nothing for seats that did not count
    them."""
    rows = []
    for c in levels(run):
        w = f"c={c}"
        bound = _med(run, "step_ms", BOUND, w, lambda x: f"{x:.2f}")
        for arm in arms:
            per = {stage: [s.figures[f"{stage}_ms"] / s.figures["plain_calls"]
                           for s in run.samples if s.arm == arm and s.workload == w
                           and not s.warmup and s.figures.get("plain_calls")
                           and f"{stage}_ms" in s.figures] for stage in STAGES}
            if not any(per.values()):
                continue
            cells = [f"{summarize(v).median:.2f}" if v else "-" for v in per.values()]
            rows.append(f"| {c} | {arm} | {' | '.join(cells)} | {bound} |")
    if not rows:
        return []
    return ["", "A plain step's host time by stage, milliseconds a step (medians over the "
            "measured rounds, from each seat's own counters): building its graph (the "
            "model's call, the draws), MLX dispatching it, the host waiting for the last "
            "step's tokens, and taking them into the answers; beside it the bound's whole "
            "step at the same level.  On a device where a decode step is host-bound, the "
            "first, second and fourth are the host's work a step.", "",
            "| clients | arm | graph | dispatch | wait | take | bound's step |",
            "|---|---|---|---|---|---|---|", *rows]


def memory_table(run: Run, arms: Sequence[str]) -> list[str]:
    """Per level and arm that says (our seats and the bound), what MLX held in its
    process as the slot left it, MiB: live arrays, freed buffers kept for reuse, and the
    most live at once (a seat's since it started, the bound's in that run); and, on an
    NVIDIA card, what its driver said the arm's processes held (every arm,
    `sanctum.bench.device_memory`); medians of the measured rounds.  Nothing for a run
    whose arms did not say."""
    names = ("mlx_active_mb", "mlx_cache_mb", "mlx_peak_mb", "device_mb")
    rows = []
    for c in levels(run):
        w = f"c={c}"
        for arm in arms:
            if not any(figure_values(run.samples, n, arm, w) for n in names):
                continue
            cells = [_med(run, n, arm, w, lambda x: f"{x:,.0f}") for n in names]
            rows.append(f"| {c} | {arm} | {' | '.join(cells)} |")
    if not rows:
        return []
    return ["", "What MLX held in each process as the slot left it, MiB, by its own "
            "accounting (medians over the measured rounds): live arrays, freed buffers it "
            "keeps for reuse, and the most live at once (a seat's since it started, the "
            "bound's in that slot); and on an NVIDIA card the driver's figure for the "
            "arm's processes (nvidia-smi).  The driver's figure above the first two "
            "together is memory MLX does not count.", "",
            "| clients | arm | live | cached | peak | driver's |",
            "|---|---|---|---|---|---|", *rows]


def plot(run: Run, path: Path, plt: Any) -> bool:
    """Aggregate tokens/s and inter-token p99 against clients, one line per arm (median,
    the interquartile range as error bars)."""
    cs = levels(run)
    if not cs:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    drawn = False
    for ax, figure, label in ((axes[0], "agg_tps", "aggregate tokens/s"),
                              (axes[1], "itl_p99_s", "inter-token p99 (s)")):
        for arm in _arms(run):
            pts = [(c, summarize(v)) for c in cs
                   if (v := figure_values(run.samples, figure, arm, f"c={c}"))]
            if not pts:
                continue
            x = [c for c, _ in pts]
            y = [s.median for _, s in pts]
            err = [[s.median - s.q1 for _, s in pts], [s.q3 - s.median for _, s in pts]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=arm)
            drawn = True
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent clients", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{run.title} (median, IQR)", fontsize=9)
    fig.tight_layout()
    if drawn:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn
