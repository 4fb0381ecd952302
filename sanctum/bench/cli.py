"""`sanctum bench`: run comparisons, store their results, render the report.

    sanctum bench run [stack|mlx-server|proxy|spec|cache|rollback|rules|flips|batching|hop|
                       neighbours|grammar|all] ...
    sanctum bench report        docs/BENCHMARKS.md and plots from the stored results
    sanctum bench load          N concurrent clients against `sanctum up`
    sanctum bench grammar       under a JSON schema vs free text, speculation on and off

In-process MLX work must run on the same BLAS as the seat workers (seatd preloads
OpenBLAS into them on Linux), or the comparison measures the BLAS.  `run`
re-executes itself with the same preload when this process lacks it.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from sanctum.bench.options import Options, ensure_worker_blas

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "bench" / "results"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


UNSCHEDULED = ("rules", "flips", "neighbours", "wake")  # no interleaved rounds to count


def rounds_refusal(names: list[str], opts: Options) -> str | None:
    """Why the comparisons `names` cannot run with `opts`' rounds, if they cannot: each
    scheduled one needs more rounds, its warm-up included (`--rounds`; batching's default
    is its own), than warm-up rounds.  Pure."""
    for name in names:
        if name in UNSCHEDULED:
            continue
        rounds = opts.batch_rounds if name == "batching" else opts.rounds
        if opts.warmup < 0 or rounds <= opts.warmup:
            return (f"{name}: --rounds counts the warm-up, so it needs more rounds than "
                    f"--warmup (rounds {rounds}, warm-up {opts.warmup})")
    return None


def cmd_run(args: argparse.Namespace) -> int:
    from sanctum.bench.batching import kept_arms
    from sanctum.bench.comparisons import COMPARISONS
    from sanctum.bench.results import save_run

    ensure_worker_blas()
    # A TERM unwinds like Ctrl-C, so every server this run started is stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    d = Options()
    # --clients: concurrency levels (batching); the proxy and hop comparisons take the last.
    levels = tuple(int(c) for c in args.clients.split(",") if c) if args.clients else ()
    opts = Options(model=args.model, drafter=args.drafter, rounds=args.rounds or d.rounds,
                   warmup=args.warmup, tokens=args.tokens or d.tokens, seed=args.seed,
                   temperature=args.temperature, unseeded=args.unseeded,
                   requests=args.requests,
                   clients=levels[-1] if levels else d.clients, seconds=args.seconds,
                   hop_clients=levels[-1] if levels else d.hop_clients,
                   flip_tokens=args.flip_tokens,
                   batch_clients=levels or d.batch_clients,
                   batch_rounds=args.rounds or d.batch_rounds,
                   batch_tokens=args.tokens or d.batch_tokens)
    depth = None if args.draft_depth == "adaptive" else int(args.draft_depth)
    opts.draft_depth = depth
    opts.pinned_depths = tuple(int(d) for d in args.pinned_depths.split(",") if d)
    opts.workloads = tuple(w for w in args.workloads.split(",") if w)
    opts.arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    try:  # a name not known stops the run before any server starts
        kept_arms(opts.arms)
    except ValueError as exc:
        print(f"sanctum bench: {exc}", file=sys.stderr)
        return 2
    names = list(COMPARISONS) if args.comparison == "all" else [args.comparison]
    refused = rounds_refusal(names, opts)
    if refused:  # the schedule would refuse it only after the servers and models are up
        print(f"sanctum bench: {refused}", file=sys.stderr)
        return 2
    out = Path(args.out)
    for name in names:
        print(f"sanctum bench: {name}", file=sys.stderr, flush=True)
        run = COMPARISONS[name](opts)
        stem = spec_stem(opts) if name == "spec" else name
        if name == "batching":
            from sanctum.bench.batching import stem as batching_stem

            stem = batching_stem(opts)
        if name == "wake" and opts.model != Options().model:  # wake-shape-1b, wake-NAME
            stem = "wake-" + opts.model.removeprefix("builtin:").replace(":", "-").strip("/")\
                .rsplit("/", 1)[-1]
        save_run(run, out / f"{stem}.json")
        if run.not_measurable:
            print(f"  not measurable: {run.not_measurable}", file=sys.stderr)
    if args.report:
        return cmd_report(args)
    return 0


def spec_stem(opts: Options) -> str:
    """spec, or spec-MODEL-DRAFTER-dN / spec-adaptive for runs off the default model,
    drafter or depth."""
    from sanctum.bench.comparisons import PINNED
    from sanctum.bench.drafter_kinds import stem_part

    parts = ["spec"]
    for given, default in ((opts.model, Options().model), (opts.drafter, Options().drafter)):
        if given != default:
            parts.append(stem_part(given))
    if opts.draft_depth != Options().draft_depth:
        parts.append("adaptive" if opts.draft_depth is None else f"d{opts.draft_depth}")
    if opts.draft_depth is None and opts.pinned_depths not in ((), (PINNED,)):
        parts.append("pinned" + "-".join(map(str, opts.pinned_depths)))
    return "-".join(parts)


def cmd_report(args: argparse.Namespace) -> int:
    from sanctum.bench.report import write_report

    path = write_report(Path(args.out), Path(args.doc))
    print(f"wrote {path}")
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from sanctum.bench.load import load_test

    return load_test(args)


def add_bench(sub: Any) -> None:
    """Register `sanctum bench` on the main parser's subcommands."""
    from sanctum.bench.comparisons import COMPARISONS

    d = Options()
    bench = sub.add_parser("bench", help="interleaved A/B benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", default=str(RESULTS), help="results folder (JSON per comparison)")
        p.add_argument("--doc", default=str(REPO / "docs" / "BENCHMARKS.md"))

    run = bsub.add_parser("run", help="run comparisons and store their results")
    run.add_argument("comparison", choices=[*COMPARISONS, "all"])
    run.add_argument("--model", default=d.model,
                     help="model directory, builtin:NAME, or shape:8b / shape:1b (random "
                     "weights of an 8B or 1B model's shape, 4-bit, the demo's tokenizer: "
                     "for speed only)")
    run.add_argument("--drafter", default=d.drafter,
                     help="a drafter model (builtin:NAME or a directory), 'lookup' (prompt "
                     "lookup, no weights) or 'noise:MODEL' (MODEL's shape and tokenizer, "
                     "random weights: a drafter that never agrees)")
    run.add_argument("--rounds", type=int, default=None,
                     help=f"rounds, warm-up included (default {d.rounds}; batching "
                     f"{d.batch_rounds})")
    run.add_argument("--warmup", type=int, default=d.warmup, help="warm-up rounds, not reported")
    run.add_argument("--tokens", type=int, default=None,
                     help=f"new tokens per request (default {d.tokens}; batching "
                     f"{d.batch_tokens})")
    run.add_argument("--seed", type=int, default=d.seed, help="decides which arm starts")
    run.add_argument("--temperature", type=float, default=d.temperature)
    run.add_argument("--unseeded", action="store_true",
                     help="batching above temperature 0: our seats' requests carry no seed "
                     "(as chat clients send them), where they are seeded by default")
    run.add_argument("--workloads", default="",
                     help="comma-separated workload names to run (default: each comparison's)")
    run.add_argument("--arms", default="",
                     help="batching: comma-separated arms to run besides our two seats "
                     "(mlx_lm.server, mlx_lm.server draft, bound; default: all), so that a "
                     "large model's servers fit one device")
    run.add_argument("--draft-depth", default=str(d.draft_depth),
                     help="speculation: the seat's fixed draft depth and mlx-lm's "
                     "num_draft_tokens, or 'adaptive' (the seat's default; mlx-lm gets 4); "
                     "a depth other than the default is stored as spec-dN.json")
    run.add_argument("--pinned-depths", default="",
                     help="speculation, adaptive runs: comma-separated depths each measured "
                     "on a seat of its own beside the adaptive seat, with its cost model's "
                     "prediction (default: 3); stored as spec-...-adaptive-pinnedD-D-....json")
    run.add_argument("--requests", type=int, default=d.requests,
                     help="proxy overhead: requests per slot")
    run.add_argument("--clients", default=None,
                     help="batching: comma-separated concurrency levels (default "
                     f"{','.join(map(str, d.batch_clients))}); proxy overhead: concurrent "
                     f"clients for requests/s (the last level; default {d.clients}; "
                     f"hop {d.hop_clients})")
    run.add_argument("--seconds", type=float, default=d.seconds,
                     help="proxy overhead: seconds per requests/s slot")
    run.add_argument("--flip-tokens", type=int, default=d.flip_tokens,
                     help="float flips and neighbours: new tokens per answer")
    run.add_argument("--report", action="store_true", help="render the report afterwards")
    common(run)
    run.set_defaults(fn=cmd_run)

    rep = bsub.add_parser("report", help="render docs/BENCHMARKS.md and plots from results")
    common(rep)
    rep.set_defaults(fn=cmd_report)

    load = bsub.add_parser("load", help="N concurrent clients against `sanctum up`")
    load.add_argument("--model", default=d.model)
    load.add_argument("--clients", type=int, default=16)
    load.add_argument("--seconds", type=float, default=20.0)
    load.add_argument("--tokens", type=int, default=16)
    load.add_argument("--url", default=None, help="an already running proxy (else one is started)")
    common(load)
    load.set_defaults(fn=cmd_load)

    from sanctum.bench.grammar import add_parser as add_grammar

    add_grammar(bsub, str(RESULTS))
