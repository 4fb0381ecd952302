"""The comparisons.  Each starts what it needs, runs one interleaved schedule,
stops everything, and returns a `Run` (stored as JSON, rendered by report.py).

    stack      our stack end to end  vs  the same model in-process (mlx-lm generate_step)
    mlx-server our stack  vs  mlx_lm.server, same model (and drafter), temperature 0 and 0.7
    proxy      proxy in front of a null seat  vs  the null seat over ZeroMQ directly
    spec       speculative  vs  plain decoding on our own seat
    cache      prompt cache on  vs  off, for turn N of a conversation
    rollback   verify rounds on a hybrid model, recorded and rolled back  vs  unrecorded
    rules      keyed  vs  rejection sampling  vs  plain on one seat (sanctum.bench.rules)
    batching   concurrent clients on our seat  vs  mlx_lm.server batching, 1 to 16 clients,
               and a long prompt among decoding rows (sanctum.bench.batching)
    hop        the proxy hop: a fake OpenAI upstream directly, through nginx, and through
               proxyd with a hosted seat and with a null seat (sanctum.bench.hop)
    flips      not a speed comparison: where speculative answers leave plain ones
               (sanctum.bench.flips; nothing to interleave)
    neighbours not a speed comparison: where a request batched with 7 others leaves its
               answer alone (sanctum.bench.neighbours; nothing to interleave)
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from sanctum.bench import arms as A
from sanctum.bench import servers
from sanctum.bench.drafter_kinds import Drafter, resolve_drafter
from sanctum.bench.results import ArmInfo, Run, Sample
from sanctum.bench.runner import Measure, new_run_id, run_schedule
from sanctum.bench.schedule import make_schedule
from sanctum.bench.workloads import Workload, build_workloads, heldout_files


@dataclass
class Options:
    model: str = "builtin:demo"
    drafter: str = "builtin:demo-drafter"
    rounds: int = 6
    warmup: int = 1
    tokens: int = 64
    seed: int = 0
    temperature: float = 0.0
    # speculation: the seat's fixed draft depth (None: the seat's adaptive depth), also
    # mlx-lm's num_draft_tokens
    draft_depth: int | None = 4
    # speculation, adaptive runs: the pinned depths measured beside the adaptive seat, each
    # on a seat of its own with its cost model's prediction (default: PINNED alone)
    pinned_depths: tuple[int, ...] = ()
    # only these workloads (names before the temperature suffix); empty: each comparison's own
    workloads: tuple[str, ...] = ()
    # proxy overhead
    requests: int = 200
    clients: int = 8
    seconds: float = 3.0
    # the proxy hop: concurrent clients for requests/s (its goal is set at 16)
    hop_clients: int = 16
    # float flips: new tokens per answer (long answers: a flip can happen anywhere)
    flip_tokens: int = 256
    # concurrent clients (batching): its own defaults, so that a default run stays near
    # ten minutes on a 2-core machine; --clients, --rounds and --tokens set them
    batch_clients: tuple[int, ...] = (1, 2, 4, 8, 16)
    batch_rounds: int = 3
    batch_tokens: int = 96
    verbose: bool = True


def model_path(spec: str) -> Path:
    from sanctum.bench.shapes import PREFIX, shape_model
    from shared.builtin import resolve_model

    if spec.startswith(PREFIX):  # a random-weight model of a real shape, for speed only
        try:
            return shape_model(spec.removeprefix(PREFIX))
        except ValueError as exc:
            raise SystemExit(f"sanctum bench: {exc}") from None
    path = resolve_model(spec)
    if not (path / "config.json").exists():
        raise SystemExit(f"sanctum bench: no model at {spec!r} (give --model DIR)")
    return path


def machine(model: str) -> dict[str, str]:
    import importlib.metadata as md

    from seatd.blas import loaded_blas

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "-"

    from seatd.backend import backend, device_name

    cores = os.cpu_count() or 0
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": _cpu_name(),
        "cores": str(cores),
        "device": f"{backend()}: {device_name()}",
        # the version and its build: the same version built with and without profile-
        # guided optimisation runs pure Python 1.3-1.5x apart (deploy/interp_speed.py)
        "python": f"{platform.python_version()} (built {platform.python_build()[1]}, "
                  f"{platform.python_compiler()})",
        "mlx": version("mlx"),
        "mlx-lm": version("mlx-lm"),
        "openai": version("openai"),
        "sanctum": version("sanctum"),
        "blas": loaded_blas(),
        "model": model_label(model),
    }


def model_label(spec: str) -> str:
    """How a model is named in results: a builtin by name, a directory by its last part
    (results are published; a machine's absolute paths are not)."""
    if spec.startswith("builtin:") or "/" not in spec:
        return spec
    return f"{Path(spec).expanduser().name} (a local model directory)"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "-"


def _progress(opts: Options) -> Callable[[Sample], None] | None:
    if not opts.verbose:
        return None

    def show(s: Sample) -> None:
        figs = " ".join(f"{k}={v:.4g}" for k, v in s.figures.items()
                        if k in ("decode_tps", "ttft_s", "e2e_s", "latency_p50_s",
                                 "per_token_p50_s", "rps", "accept_len", "predicted_tps",
                                 "host_share", "lookup_share"))
        tag = "warm-up " if s.warmup else ""
        print(f"  [{s.seq:>3}] r{s.round} {tag}{s.workload:<18} {s.arm:<16} "
              f"load {s.load_before:.2f}  {s.error or figs}", file=sys.stderr, flush=True)

    return show


def _workloads(tokenizer: object, cap: int) -> tuple[str, list[Workload]]:
    source, files = heldout_files()
    encode = tokenizer.encode  # type: ignore[attr-defined]
    return source, build_workloads(files, lambda s: len(encode(s)), cap)


def _run(opts: Options, comparison: str, title: str, baseline: str,
         arms: dict[str, tuple[str, Measure]], workloads: list[Workload], model: str,
         notes: list[str]) -> Run:
    run_id = new_run_id()
    slots = make_schedule(list(arms), [w.name for w in workloads], opts.rounds, opts.warmup,
                          opts.seed)
    samples = run_schedule(slots, {n: m for n, (_, m) in arms.items()}, run_id=run_id,
                           progress=_progress(opts))
    return Run(run_id, comparison, title, baseline,
               [ArmInfo(n, d) for n, (d, _) in arms.items()],
               {w.name: f"{w.description} ({w.prompt_tokens} prompt tokens)" for w in workloads},
               opts.rounds, opts.warmup, opts.seed, machine(model), samples, notes)


def _cap(context_length: int, tokens: int) -> int:
    return max(256, min(4096, context_length - tokens - 64))


# -- 1. the cost of our layers ------------------------------------------------------------


def stack(opts: Options) -> Run:
    path = model_path(opts.model)
    inproc = A.InProcessArm(path, opts.temperature, opts.tokens, {})
    cap = _cap(inproc.loaded.context_length, opts.tokens)
    source, workloads = _workloads(inproc.loaded.tokenizer, cap)
    if opts.workloads:
        workloads = [w for w in workloads if w.name in opts.workloads]
    by_name = {w.name: w for w in workloads}
    inproc.workloads = by_name
    port = servers.free_port()
    config = servers.sanctum_config(port, [("bench", str(path), cap + 64, "")])
    with servers.sanctum_up(config, ("bench",), port) as url:
        ours = A.OpenAIArm(url, "bench", opts.temperature, opts.tokens, by_name)
        arms: dict[str, tuple[str, Measure]] = {
            "sanctum": ("openai client -> proxyd -> seat worker (`sanctum up`)", ours),
            "in-process": ("mlx-lm generate_step in the benchmark process, same weights "
                           "(load_for_compute), same BLAS", inproc),
        }
        return _run(opts, "stack", "Our stack end to end against the same model in-process",
                    "in-process", arms, workloads, opts.model,
                    [f"Workloads from {source}.", f"temperature {opts.temperature:g}, "
                     f"{opts.tokens} new tokens per request, compute dtype "
                     f"{inproc.loaded.compute_dtype}."])


# -- 2. against mlx_lm.server -------------------------------------------------------------


def _float32_copy(path: Path, dest: Path) -> Path:
    """The weights our seat computes with, saved for mlx_lm.server (same model, same dtype)."""
    import json

    from mlx_lm.utils import save

    from seatd.model_load import load_for_compute

    got = load_for_compute(path)
    if not got.was_quantized and _stored_float32(path):
        return path
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    save(dest, path, got.model, got.tokenizer, config)
    return dest


def _stored_float32(path: Path) -> bool:
    import mlx.core as mx

    return all(v.dtype == mx.float32 for f in path.glob("*.safetensors")
               for v in _weights(f).values() if mx.issubdtype(v.dtype, mx.floating))


def _weights(f: Path) -> dict[str, Any]:
    import mlx.core as mx

    got = mx.load(str(f))  # a .safetensors file loads as a dict (mx.load's type says any)
    assert isinstance(got, dict)
    return got


def mlx_server(opts: Options) -> Run:
    from mlx_lm.utils import load_tokenizer

    from shared.builtin import resolve_model

    path = model_path(opts.model)
    tokenizer = load_tokenizer(path)  # type: ignore[no-untyped-call]  # mlx-lm is untyped
    import json

    ctx = int(json.loads((path / "config.json").read_text()).get("max_position_embeddings",
                                                                 2048))
    cap = _cap(ctx, opts.tokens)
    source, base = _workloads(tokenizer, cap)
    if opts.workloads:
        base = [w for w in base if w.name in opts.workloads]
    workloads = [dataclasses.replace(w, name=f"{w.name} t={t:g}", temperature=t)
                 for t in (0.0, 0.7) for w in base]
    by_name = {w.name: w for w in workloads}
    notes = [f"Workloads from {source}.", f"{opts.tokens} new tokens per request."]
    drafter: Path | None = None
    try:
        drafter = resolve_model(opts.drafter)
        if not (drafter / "config.json").exists():
            drafter = None
    except ValueError:
        drafter = None
    from shared.config import SeatConfig

    ours_spec = "speculation" in SeatConfig.__struct_fields__ and drafter is not None
    if not ours_spec:
        notes.append("No drafter model available: plain decoding in both arms.")
    with ExitStack() as stack_, servers.workdir() as wd:
        served = _float32_copy(path, wd / "model-f32")
        if served != path:
            notes.append("mlx_lm.server serves a float32 copy of the weights our seat "
                         "computes with (load_for_compute), so both run the same model.")
        seat_extra = f'drafter = {{ kind = "model", path = "{drafter}" }}\n' if ours_spec else ""
        if ours_spec and opts.draft_depth is not None:
            seat_extra += f"draft_depth = {opts.draft_depth}\n"
            notes.append(f"Both speculate with the demo drafter, {opts.draft_depth} draft "
                         "tokens (our seat's draft_depth, mlx_lm.server's --num-draft-tokens).")
        port = servers.free_port()
        config = servers.sanctum_config(port, [("bench", str(path), cap + 64, seat_extra)])
        url = stack_.enter_context(servers.sanctum_up(config, ("bench",), port))
        mport = servers.free_port()
        murl = stack_.enter_context(servers.mlx_lm_server(
            str(served), mport, draft=str(drafter) if ours_spec else None,
            num_draft=opts.draft_depth if ours_spec else None))
        ours = A.OpenAIArm(url, "bench", 0.0, opts.tokens, by_name)
        theirs = A.OpenAIArm(murl, str(served), 0.0, opts.tokens, by_name)
        arms: dict[str, tuple[str, Measure]] = {
            "sanctum": ("openai client -> proxyd -> seat worker", ours),
                "mlx_lm.server": ("openai client -> mlx_lm.server (mlx-lm's own HTTP server)",
                                  theirs)}
        run = _run(opts, "mlx-server", "Our stack against mlx_lm.server, same model",
                   "mlx_lm.server", arms, workloads, opts.model, notes)
    spec_seen = any(s.figures.get("accelerated") for s in run.samples if s.arm == "sanctum")
    if ours_spec and not spec_seen:
        run.notes.append("Our seat never reported an accelerated answer: plain decoding.")
    return run


# -- 3. proxy overhead, null seat ---------------------------------------------------------


def proxy(opts: Options) -> Run:
    path = model_path(opts.model)  # named in the config only; the null seat loads nothing
    port = servers.free_port()
    with servers.null_stack(str(path), port) as (url, endpoint):
        proxied = A.ProxyHTTP(url, "null")
        direct = A.DirectSeat(endpoint)

        def arm(client: A.Client, make: Callable[[], A.Client]) -> Measure:
            def measure(workload: str) -> dict[str, float]:
                if workload == "throughput":
                    return A.throughput(make, opts.clients, opts.seconds, opts.tokens)
                return A.overhead_figures(client, workload, opts.requests, opts.tokens)
            return measure

        arms = {
            "proxy": ("HTTP (keep-alive, SSE) -> proxyd -> null seat",
                      arm(proxied, lambda: A.ProxyHTTP(url, "null"))),
            "direct": ("ZeroMQ DEALER -> null seat (what the proxy itself does)",
                       arm(direct, lambda: A.DirectSeat(endpoint))),
        }
        workloads = [
            Workload("latency", f"{opts.requests} one-token requests, one at a time", "completion"),
            Workload("stream", f"{opts.requests} requests of {opts.tokens} streamed tokens",
                     "completion"),
            Workload("throughput", f"{opts.clients} concurrent clients for {opts.seconds:g} s, "
                     f"{opts.tokens} tokens each", "completion"),
        ]
        try:
            return _run(opts, "proxy", "Proxy overhead with a null seat", "direct", arms,
                        workloads, "null seat",
                        ["The null seat answers at once with one-character tokens; every "
                         "client is Python in the benchmark process, on the same cores."])
        finally:
            proxied.close()
            direct.close()


# -- 4. speculation on and off; 5. prompt cache on and off -----------------------------


def _not_measurable(comparison: str, title: str, why: str, model: str) -> Run:
    return Run(new_run_id(), comparison, title, "", [], {}, 0, 0, 0, machine(model), [],
               not_measurable=why)


SPEC_WORKLOADS = ("code-short", "doc2body", "rename", "repeat", "template", "prose")
PINNED = 3  # the fixed depth an adaptive run is also measured against


def spec(opts: Options) -> Run:
    from shared.config import SeatConfig

    title = "Speculative against plain decoding on our seat, and against mlx-lm's own"
    if "speculation" not in SeatConfig.__struct_fields__:
        return _not_measurable("spec", title, "seats have no speculation option", opts.model)
    with tempfile.TemporaryDirectory(prefix="sanctum-bench-") as work:
        try:
            drafter = resolve_drafter(opts.drafter, Path(work))
        except ValueError as exc:
            return _not_measurable("spec", title, f"no drafter model ({exc})", opts.model)
        return _spec(opts, title, drafter)


def _spec(opts: Options, title: str, drafter: Drafter) -> Run:
    from mlx_lm.utils import load_tokenizer

    path = model_path(opts.model)
    tokenizer = load_tokenizer(path)  # type: ignore[no-untyped-call]  # mlx-lm is untyped
    cap = _cap(2048, opts.tokens)
    source, base = _workloads(tokenizer, cap)
    # The long-prompt workload is left out: its prefill, not decoding, sets its time.
    base = [w for w in base if w.name in (opts.workloads or SPEC_WORKLOADS)]
    workloads = [dataclasses.replace(w, name=f"{w.name} t={t:g}", temperature=t)
                 for t in (0.0, 0.7) for w in base]
    by_name = {w.name: w for w in workloads}
    depth = opts.draft_depth
    extra = drafter.seat_line()
    depth_line = f"draft_depth = {depth}\n" if depth is not None else ""
    theirs_depth = depth if depth is not None else 4
    port = servers.free_port()
    seats = [("spec", str(path), cap + 64, extra + depth_line + "speculation = true\n"),
             ("plain", str(path), cap + 64, extra + "speculation = false\n")]
    pinned = (opts.pinned_depths or (PINNED,)) if depth is None else ()
    for d in pinned:  # adaptive: also against the same seat pinned at each depth
        seats.append((f"spec-d{d}", str(path), cap + 64,
                      extra + f"draft_depth = {d}\nspeculation = true\n"))
    config = servers.sanctum_config(port, seats)
    refused = []
    mlx_spec = None
    if drafter.path is None:
        refused = ["mlx-lm's speculative_generate_step needs a draft model: it has no arm "
                   f"beside a {drafter.kind} drafter."]
    else:
        mlx_spec = A.InProcessSpecArm(path, drafter.path, theirs_depth, 0.0, opts.tokens,
                                      by_name)
        if not mlx_spec.supported():
            refused = ["mlx-lm's speculative_generate_step refuses this model (its prompt "
                       "cache cannot be trimmed: recurrent layers), so only our two arms run."]
    ours_depth = f"draft_depth = {depth}" if depth is not None else "adaptive draft depth"
    with servers.sanctum_up(config, tuple(name for name, *_ in seats), port) as url:
        arms: dict[str, tuple[str, Measure]] = {
            "speculative": (f"our seat with the drafter, speculation on, {ours_depth}",
                                A.SeatSpecArm(url, "spec", 0.0, opts.tokens, by_name,
                                              depth=depth)),
                "plain": ("our seat, same config, speculation off",
                          A.OpenAIArm(url, "plain", 0.0, opts.tokens, by_name))}
        for d in pinned:
            arms[f"speculative d{d}"] = (f"the same seat with draft_depth = {d}",
                                         A.SeatSpecArm(url, f"spec-d{d}", 0.0, opts.tokens,
                                                       by_name, depth=d))
        if mlx_spec is not None and not refused:
            arms["mlx-lm speculative"] = (
                "mlx-lm speculative_generate_step in the benchmark process, same pair "
                f"(load_for_compute), num_draft_tokens = {theirs_depth}", mlx_spec)
        run = _run(opts, "spec", title, "plain", arms, workloads, opts.model,
                   [*refused, f"Workloads from {source}.", f"{opts.tokens} new tokens per request; "
                    "acceptance length = accepted draft tokens per verify (ours from the "
                    "seat's counters before and after each request, mlx-lm's from its "
                    "from_draft flags); accept_pN = share of verifies that accepted draft "
                    "position N.",
                    "mlx-lm accepts a draft token only when it equals the target's own "
                    "sample, drawn independently of the draft; these requests are seeded, so "
                    "our seat keeps a draft while it equals the target's keyed token, drawn "
                    "with the draft's own noise (the keyed rule): at temperature > 0 the two "
                    "acceptance rates differ by design. Section 7 sets the keyed rule against "
                    "rejection sampling (unseeded requests)."])
    if not any(s.figures.get("accelerated") for s in run.samples if s.arm == "speculative"):
        return msgspec.structs.replace(
            run, not_measurable="the speculative seat never reported an accelerated answer "
            "(X-Sanctum-Speculation)")
    return run


def conversation(files: list[tuple[str, str]], count: Callable[[str], int],
                 cap: int) -> Workload:
    """A chat whose earlier turns fill most of the prompt; the timed turn adds one reply
    and one short question.  Pure: files and a token counter in."""
    joined = "\n\n".join(t for _, t in files)
    budget = max(200, cap - 200)
    first = joined[: len(joined) // 2]
    second = joined[len(joined) // 2 :]
    turns: list[tuple[str, str]] = []
    for text, share in ((first, 0.55), (second, 0.45)):
        piece = text[: 4 * int(budget * share)]
        while count(piece) > budget * share:
            piece = piece[: int(len(piece) * 0.9)]
        turns.append(("user", f"Review this code:\n\n{piece}"))
        turns.append(("assistant", "It reads fine; a few names could be clearer."))
    history = tuple(turns[:-1])
    messages = (*turns, ("user", "Now suggest better names, as a list."))
    tokens = count("".join(c for _, c in messages))
    return Workload("turn-n", "the last turn of a code-review chat (earlier turns sent first)",
                    "chat", messages=messages, prompt_tokens=tokens, history=history)


def cache(opts: Options) -> Run:
    from mlx_lm.utils import load_tokenizer

    from shared.config import SeatConfig

    title = "Prompt cache on against off, turn N of a conversation"
    if "prompt_cache_mb" not in SeatConfig.__struct_fields__:
        return _not_measurable("cache", title, "seats have no prompt-cache option yet",
                               opts.model)
    path = model_path(opts.model)
    tokenizer = load_tokenizer(path)  # type: ignore[no-untyped-call]  # mlx-lm is untyped
    cap = _cap(2048, opts.tokens)
    source, files = heldout_files()
    convo = conversation(files, lambda s: len(tokenizer.encode(s)), cap)
    by_name = {convo.name: convo}
    port = servers.free_port()
    config = servers.sanctum_config(port, [
        ("cached", str(path), cap + 64, "prompt_cache_mb = 512\n"),
        ("cold", str(path), cap + 64, "prompt_cache_mb = 0\n")])
    with servers.sanctum_up(config, ("cached", "cold"), port) as url:
        arms: dict[str, tuple[str, Measure]] = {"cache on": ("seat with prompt_cache_mb = 512",
                             A.OpenAIArm(url, "cached", 0.0, opts.tokens, by_name)),
                "cache off": ("same seat, prompt_cache_mb = 0",
                              A.OpenAIArm(url, "cold", 0.0, opts.tokens, by_name))}
        return _run(opts, "cache", title, "cache off", arms, [convo], opts.model,
                    [f"Conversation built from {source}.",
                     "Each request first sends the earlier turns (untimed, 1 token), then "
                     "times the last turn; every request salts its first message, so only "
                     "its own earlier turns can be cached."])


# -- 6. the price of rolling a recurrent layer back ---------------------------------------

HYBRID = "builtin:demo-hybrid"


def rollback(opts: Options) -> Run:
    from mlx_lm.utils import load_tokenizer

    title = "Verify rounds on a hybrid model: recorded and rolled back, against unrecorded"
    model = opts.model if opts.model != Options().model else HYBRID
    try:
        path = model_path(model)
    except ValueError as exc:
        return _not_measurable("rollback", title, f"no hybrid model ({exc})", model)
    tokenizer = load_tokenizer(path)  # type: ignore[no-untyped-call]  # mlx-lm is untyped
    source, base = _workloads(tokenizer, _cap(2048, opts.tokens))
    workloads = [w for w in base if w.name in (opts.workloads or SPEC_WORKLOADS)]
    by_name = {w.name: w for w in workloads}
    width = (opts.draft_depth or 3) + 1
    keep = max(1, width // 2)
    recorded = A.VerifyRoundArm(path, by_name, width, keep, rollback=True)
    if not any(getattr(c, "trail", None) is not None or type(c).__name__ == "RollbackArraysCache"
               for c in __import__("seatd.decode", fromlist=["make_cache"]).make_cache(
                   recorded.loaded.model, "fp16")):
        return _not_measurable("rollback", title, "the model has no rollbackable recurrent "
                               "layers", model)
    arms: dict[str, tuple[str, Measure]] = {
            "record + rollback": (f"verify of {width} tokens recorded, rolled back to {keep}",
                                  recorded),
            "unrecorded": (f"the same verify of {width} tokens, not recorded, no rollback",
                           A.VerifyRoundArm(path, by_name, width, keep, rollback=False))}
    return _run(opts, "rollback", title, "unrecorded", arms, workloads, model,
                [f"Workloads from {source}: each request prefills the workload's prompt, "
                 f"then times {recorded.rounds} verify rounds; figures are per-round "
                 "medians.",
                 "round_s is one verify forward (with recording where it applies) and, "
                 "with rollback, the trim to the kept tokens; rollback_s is that trim "
                 "alone, evaluated."])


# -- 7. the sampling rules; 8. float flips (each in a module of its own) -----------------


def rules(opts: Options) -> Run:
    from sanctum.bench.rules import rules as run_rules

    return run_rules(opts)


def flips(opts: Options) -> Run:
    from sanctum.bench.flips import flips as run_flips

    return run_flips(opts)


def neighbours(opts: Options) -> Run:
    from sanctum.bench.neighbours import neighbours as run_neighbours

    return run_neighbours(opts)


def hop(opts: Options) -> Run:
    from sanctum.bench.hop import hop as run_hop

    return run_hop(opts)


def batching(opts: Options) -> Run:
    from sanctum.bench.batching import batching as run_batching

    return run_batching(opts)


def grammar(opts: Options) -> Run:
    from sanctum.bench.grammar import grammar as run_grammar

    return run_grammar(opts)


COMPARISONS: dict[str, Callable[[Options], Run]] = {
    "stack": stack, "mlx-server": mlx_server, "proxy": proxy, "spec": spec, "cache": cache,
    "rollback": rollback, "rules": rules, "flips": flips, "batching": batching, "hop": hop,
    "neighbours": neighbours, "grammar": grammar,
}
