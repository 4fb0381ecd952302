"""The comparisons.  Each starts what it needs, runs one interleaved schedule,
stops everything, and returns a `Run` (stored as JSON, rendered by report.py).

    stack      our stack end to end  vs  the same model in-process (mlx-lm generate_step)
    mlx-server our stack  vs  mlx_lm.server, same model (and drafter), temperature 0 and 0.7
    proxy      proxy in front of a null seat  vs  the null seat over ZeroMQ directly
    spec       speculative  vs  plain decoding on our own seat
    cache      prompt cache on  vs  off, for the last turn of a long and a short chat
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
    wake       a sleeping on-demand seat woken by a request  vs  the same model loaded
               (sanctum.bench.wake)
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import msgspec

from sanctum.bench import arms as A
from sanctum.bench import servers
from sanctum.bench.batching import batching as run_batching
from sanctum.bench.drafter_kinds import Drafter, resolve_drafter
from sanctum.bench.flips import flips as run_flips
from sanctum.bench.grammar import grammar as run_grammar
from sanctum.bench.hop import hop as run_hop
from sanctum.bench.neighbours import neighbours as run_neighbours
from sanctum.bench.options import (
    SPEC_WORKLOADS,
    Options,
    float32_copy,
    interleaved,
    model_path,
    not_measurable,
    seat_cap,
    workloads_for,
)
from sanctum.bench.results import Run
from sanctum.bench.rules import rules as run_rules
from sanctum.bench.runner import Measure
from sanctum.bench.wake import wake
from sanctum.bench.workloads import Workload, heldout_files

# -- 1. the cost of our layers ------------------------------------------------------------


def stack(opts: Options) -> Run:
    path = model_path(opts.model)
    inproc = A.InProcessArm(path, opts.temperature, opts.tokens, {})
    cap = seat_cap(inproc.loaded.context_length, opts.tokens)
    source, workloads = workloads_for(inproc.loaded.tokenizer, cap)
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
        return interleaved(opts, "stack", "Our stack end to end against the same model in-process",
                    "in-process", arms, workloads, opts.model,
                    [f"Workloads from {source}.", f"temperature {opts.temperature:g}, "
                     f"{opts.tokens} new tokens per request, compute dtype "
                     f"{inproc.loaded.compute_dtype}."])


# -- 2. against mlx_lm.server -------------------------------------------------------------


def mlx_server(opts: Options) -> Run:
    from mlx_lm.utils import load_tokenizer

    from shared.builtin import resolve_model

    path = model_path(opts.model)
    tokenizer = load_tokenizer(path)  # type: ignore[no-untyped-call]  # mlx-lm is untyped
    import json

    ctx = int(json.loads((path / "config.json").read_text()).get("max_position_embeddings",
                                                                 2048))
    cap = seat_cap(ctx, opts.tokens)
    source, base = workloads_for(tokenizer, cap)
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
        served = float32_copy(path, wd / "model-f32")
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
        run = interleaved(opts, "mlx-server", "Our stack against mlx_lm.server, same model",
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
            return interleaved(opts, "proxy", "Proxy overhead with a null seat", "direct", arms,
                        workloads, "null seat",
                        ["The null seat answers at once with one-character tokens; every "
                         "client is Python in the benchmark process, on the same cores."])
        finally:
            proxied.close()
            direct.close()


# -- 4. speculation on and off; 5. prompt cache on and off -----------------------------


PINNED = 3  # the fixed depth an adaptive run is also measured against


def spec(opts: Options) -> Run:
    from shared.config import SeatConfig

    title = "Speculative against plain decoding on our seat, and against mlx-lm's own"
    if "speculation" not in SeatConfig.__struct_fields__:
        return not_measurable("spec", title, "seats have no speculation option", opts.model)
    with tempfile.TemporaryDirectory(prefix="sanctum-bench-") as work:
        try:
            drafter = resolve_drafter(opts.drafter, Path(work))
        except ValueError as exc:
            return not_measurable("spec", title, f"no drafter model ({exc})", opts.model)
        return _spec(opts, title, drafter)


def _spec(opts: Options, title: str, drafter: Drafter) -> Run:
    from mlx_lm.utils import load_tokenizer

    path = model_path(opts.model)
    tokenizer = load_tokenizer(path)  # type: ignore[no-untyped-call]  # mlx-lm is untyped
    cap = seat_cap(2048, opts.tokens)
    source, base = workloads_for(tokenizer, cap)
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
        run = interleaved(opts, "spec", title, "plain", arms, workloads, opts.model,
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


def short_chat(files: list[tuple[str, str]], count: Callable[[str], int],
               tokens: int = 300) -> Workload:
    """A household's short chat: the second turn of a conversation of about `tokens`
    tokens, far under one prefill chunk (its first turn sent first).  Pure."""
    text = "\n\n".join(t for _, t in files)[: 8 * tokens]
    ask = "Now suggest better names, as a list."
    while count(f"Review this code:\n\n{text}") + count(ask) + 40 > tokens:
        text = text[: int(len(text) * 0.9)]
    first = ("user", f"Review this code:\n\n{text}")
    messages = (first, ("assistant", "It reads fine; a few names could be clearer."),
                ("user", ask))
    return Workload("turn-2", f"the second turn of a {tokens}-token chat (its first turn "
                    "sent first)", "chat", messages=messages,
                    prompt_tokens=count("".join(c for _, c in messages)), history=(first,))


def cache(opts: Options) -> Run:
    from mlx_lm.utils import load_tokenizer

    from shared.config import SeatConfig

    title = "Prompt cache on against off, the last turn of a long and of a short chat"
    if "prompt_cache_mb" not in SeatConfig.__struct_fields__:
        return not_measurable("cache", title, "seats have no prompt-cache option yet",
                               opts.model)
    path = model_path(opts.model)
    tokenizer = load_tokenizer(path)  # type: ignore[no-untyped-call]  # mlx-lm is untyped
    cap = seat_cap(2048, opts.tokens)
    source, files = heldout_files()

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    convos = [conversation(files, count, cap), short_chat(files, count)]
    by_name = {c.name: c for c in convos}
    port = servers.free_port()
    config = servers.sanctum_config(port, [
        ("cached", str(path), cap + 64, "prompt_cache_mb = 512\n"),
        ("cold", str(path), cap + 64, "prompt_cache_mb = 0\n")])
    with servers.sanctum_up(config, ("cached", "cold"), port) as url:
        arms: dict[str, tuple[str, Measure]] = {"cache on": ("seat with prompt_cache_mb = 512",
                             A.OpenAIArm(url, "cached", 0.0, opts.tokens, by_name)),
                "cache off": ("same seat, prompt_cache_mb = 0",
                              A.OpenAIArm(url, "cold", 0.0, opts.tokens, by_name))}
        return interleaved(opts, "cache", title, "cache off", arms, convos, opts.model,
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
        return not_measurable("rollback", title, f"no hybrid model ({exc})", model)
    tokenizer = load_tokenizer(path)  # type: ignore[no-untyped-call]  # mlx-lm is untyped
    source, base = workloads_for(tokenizer, seat_cap(2048, opts.tokens))
    workloads = [w for w in base if w.name in (opts.workloads or SPEC_WORKLOADS)]
    by_name = {w.name: w for w in workloads}
    width = (opts.draft_depth or 3) + 1
    keep = max(1, width // 2)
    recorded = A.VerifyRoundArm(path, by_name, width, keep, rollback=True)
    if not any(getattr(c, "trail", None) is not None or type(c).__name__ == "RollbackArraysCache"
               for c in __import__("seatd.engine_types", fromlist=["make_cache"]).make_cache(
                   recorded.loaded.model, "fp16")):
        return not_measurable("rollback", title, "the model has no rollbackable recurrent "
                               "layers", model)
    arms: dict[str, tuple[str, Measure]] = {
            "record + rollback": (f"verify of {width} tokens recorded, rolled back to {keep}",
                                  recorded),
            "unrecorded": (f"the same verify of {width} tokens, not recorded, no rollback",
                           A.VerifyRoundArm(path, by_name, width, keep, rollback=False))}
    return interleaved(opts, "rollback", title, "unrecorded", arms, workloads, model,
                [f"Workloads from {source}: each request prefills the workload's prompt, "
                 f"then times {recorded.rounds} verify rounds; figures are per-round "
                 "medians.",
                 "round_s is one verify forward (with recording where it applies) and, "
                 "with rollback, the trim to the kept tokens; rollback_s is that trim "
                 "alone, evaluated."])


# -- 7. the sampling rules; 8. float flips (each in a module of its own) -----------------


def rules(opts: Options) -> Run:

    return run_rules(opts)


def flips(opts: Options) -> Run:

    return run_flips(opts)


def neighbours(opts: Options) -> Run:

    return run_neighbours(opts)


def hop(opts: Options) -> Run:

    return run_hop(opts)


def batching(opts: Options) -> Run:

    return run_batching(opts)


def grammar(opts: Options) -> Run:

    return run_grammar(opts)


COMPARISONS: dict[str, Callable[[Options], Run]] = {
    "stack": stack, "mlx-server": mlx_server, "proxy": proxy, "spec": spec, "cache": cache,
    "rollback": rollback, "rules": rules, "flips": flips, "batching": batching, "hop": hop,
    "neighbours": neighbours, "grammar": grammar, "wake": wake,
}
