"""Concurrent streaming clients against one OpenAI-compatible server, and the figures
taken from their chunk arrival times.

An arm here measures a whole slot at once: `c=N` starts N clients together, one
streamed request each, and reports what the server did for all of them:

    agg_tps         completion tokens of every request (from its usage) / (last end -
                    first send): what the server produced per second for the slot
    ttft_p50_s, ttft_p99_s   first text chunk, from each request leaving its client
    itl_p50_s, itl_p99_s     gaps between consecutive text chunks of one request, pooled
                             over the slot's requests (per chunk: a chunk carrying several
                             tokens, as a speculative burst may, is one gap)
    slowest_s       the slowest request, send to end
    accelerated     share of requests the seat reports as accelerated (our seats only)
    mean_batch, max_batch    rows per decode step over the slot, from the seat's
                    `batch_steps{size}` counter (GET /counters before and after; our
                    seats only, once they batch)
    step_ms         milliseconds a decode step took at the slot's most rows, from the
                    seat's `batch_step_us{size}` beside `batch_steps` (our seats; the
                    bound reports its own step_ms)
    PART_ms, PART_calls     where the seat's engine spent the slot, from its
                    `engine_us{part}` and `engine_calls{part}` (`seatd.counters.PARTS`:
                    prefill forwards, drafters taking prompts, plain and verify steps,
                    the rest of its steps), e.g. prefill_ms, verify_calls; engine_ms
                    their sum (our seats)

The prefill scenario (`PREFILL`) streams ROWS long answers (ROW_FACTOR x tokens); once
all of them stream and each has sent a third of a slot's tokens in chunks (SETTLE_PART;
at most `settle_s` after all stream: a fast device would end the rows before a fixed
wait did), one request with a long prompt arrives.  The rows decoding at that moment
are compared before (from all streaming to its arrival) and during its prefill (until
its first text chunk): `prefill_itl_speed` = p99 gap before / p99 gap during, a speed
ratio (0.5: the long prefill doubled the rows' inter-token p99).

The figures are pure functions of `Stream` records; the client is plain http.client,
one connection per request, so the client side costs the same for every server.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from sanctum.bench.stats import quantile
from sanctum.bench.workloads import Workload
from seatd.memory import MB, MLX_GAUGES

PREFILL = "prefill among 7"
ROWS = 7
ROW_FACTOR = 3  # the rows' answers: 3 x the slot's tokens, to outlast the long prefill
SETTLE_S = 2.0  # the longest the rows' steady state is measured before the long prompt
SETTLE_PART = 3  # ... which arrives once every row has sent tokens / this many chunks
ARRIVE_DEADLINE_S = 45.0  # a seat that never streams all rows at once gets it then
# (long enough for a batching server to prefill all seven on a busy 2-core machine)
LONG_MAX_TOKENS = 8
CLIENT_TIMEOUT_S = 600.0
CONNECT_TRIES = 3  # a reset before the response's head is tried again, this many times in all


@dataclass
class Stream:
    """One streamed request as its client saw it (perf_counter seconds)."""

    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each text chunk
    end: float = 0.0
    tokens: int = 0  # usage.completion_tokens
    prompt_tokens: int = 0
    speculation: str | None = None  # our seats' `sanctum.speculation`, if any


def settle_chunks(tokens: int) -> int:
    """Text chunks every decoding row has sent before the long prompt arrives."""
    return max(1, tokens // SETTLE_PART)


def gaps(times: Sequence[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def concurrency_figures(streams: Sequence[Stream]) -> dict[str, float]:
    """A slot's figures from its requests.  Pure."""
    if not streams:
        raise ValueError("no requests")
    if any(not s.chunks for s in streams):
        raise RuntimeError("an answer had no text")
    t0, end = min(s.sent for s in streams), max(s.end for s in streams)
    tokens = sum(s.tokens for s in streams)
    ttft = [s.chunks[0] - s.sent for s in streams]
    itl = [g for s in streams for g in gaps(s.chunks)]
    out = {"agg_tps": tokens / (end - t0) if end > t0 else 0.0,
           "completion_tokens": float(tokens), "requests": float(len(streams)),
           "slowest_s": max(s.end - s.sent for s in streams),
           "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99)}
    if itl:
        out |= {"itl_p50_s": quantile(itl, 0.5), "itl_p99_s": quantile(itl, 0.99)}
    told = [s.speculation for s in streams if s.speculation is not None]
    if told:
        out["accelerated"] = sum(1 for t in told if t == "accelerated") / len(told)
    return out


def prefill_figures(rows: Sequence[Stream], arrive: float, first: float | None,
                    since: float) -> dict[str, float]:
    """The rows' inter-token p99 before and during a long prompt's prefill.  Pure.

    Rows counted are those decoding when the long prompt arrived (first chunk before,
    last chunk after).  Before: gaps wholly within [since, the arrival].
    During: gaps that overlap [arrival, the long request's first chunk], so a stall
    that the prefill caused counts even when it ends after that first chunk."""
    live = [r for r in rows if r.chunks and r.chunks[0] <= arrive < r.chunks[-1]]
    before = [b - a for r in live for a, b in itertools.pairwise(r.chunks)
              if a >= since and b <= arrive]
    during = [] if first is None else [b - a for r in live
                                       for a, b in itertools.pairwise(r.chunks)
                                       if b > arrive and a < first]
    out = {"rows_decoding": float(len(live)), "gaps_before": float(len(before)),
           "gaps_during": float(len(during))}
    if first is not None:
        out["long_ttft_s"] = first - arrive
    if before:
        out["itl_p99_before_s"] = quantile(before, 0.99)
    if during:
        out["itl_p99_during_s"] = quantile(during, 0.99)
    if before and during and out["itl_p99_during_s"] > 0:
        out["prefill_itl_speed"] = out["itl_p99_before_s"] / out["itl_p99_during_s"]
    return out


def _grown(before: dict[str, Any], after: dict[str, Any], name: str) -> dict[str, int]:
    """A labelled counter's growth by label between two snapshots (labels that grew)."""
    b, a = before.get(name), after.get(name)
    if not isinstance(a, dict):
        return {}
    b = b if isinstance(b, dict) else {}
    grown = {str(k): int(v) - int(b.get(k, 0)) for k, v in a.items()}
    return {k: v for k, v in grown.items() if v > 0}


def _by_size(before: dict[str, Any], after: dict[str, Any], name: str) -> dict[int, int]:
    """`_grown` of a counter labelled by batch size, by size."""
    return {int(k): v for k, v in _grown(before, after, name).items()}


def batch_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Rows per decode step over a slot, from a seat's `batch_steps` ({size: steps})
    before and after it, and a step's milliseconds at its most rows from
    `batch_step_us`.  Pure; nothing when the seat does not count them."""
    steps = _by_size(before, after, "batch_steps")
    total = sum(steps.values())
    if not total:
        return {}
    most = max(steps)
    out = {"mean_batch": sum(k * v for k, v in steps.items()) / total,
           "max_batch": float(most)}
    us = _by_size(before, after, "batch_step_us").get(most)
    if us:
        out["step_ms"] = us / steps[most] / 1e3
    return out | part_figures(before, after)


def part_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Where the seat's engine spent a slot: each part's milliseconds and calls from its
    `engine_us{part}` and `engine_calls{part}` before and after it, and `engine_ms`, their
    sum; the plain steps' milliseconds by stage (`{stage}_ms`, from `plain_step_us`:
    building, dispatching, waiting, taking); and the rows' speculative rounds by who
    drafted them (`{drafter}_rounds`, from `spec_drafts_by_drafter`: a model drafter's and
    prompt lookup's round cost apart); and the seat's speculation cost model as the slot
    left it (`cost_{term}_us`, from `spec_cost_us`: what a plain token, a verify, a
    drafter step and a round's host work cost by its own measure, which decides whether
    it drafts); and what MLX held in the seat's process as the slot left it
    (`mlx_active_mb`, `mlx_cache_mb`, `mlx_peak_mb`, from its `mlx_*_bytes` gauges).
    Pure; nothing when the seat does not count them."""
    out: dict[str, float] = {}
    for name, suffix, scale in (("engine_us", "_ms", 1e-3), ("engine_calls", "_calls", 1.0)):
        out |= {f"{part}{suffix}": n * scale for part, n in _grown(before, after, name).items()}
    parts = [v for k, v in out.items() if k.endswith("_ms")]
    if parts:
        out["engine_ms"] = sum(parts)
    out |= {f"{stage}_ms": n * 1e-3
            for stage, n in _grown(before, after, "plain_step_us").items()}
    out |= {f"{drafter}_rounds": float(n) for drafter, n
            in _grown(before, after, "spec_drafts_by_drafter").items()}
    if after.get("mlx_active_bytes"):  # counted (a loaded model is live); 0 cached is real
        out |= mlx_figures(after)
    costs = after.get("spec_cost_us")
    return out | ({f"cost_{term}_us": float(us) for term, us in costs.items()}
                  if isinstance(costs, dict) else {})


def mlx_figures(gauges: dict[str, Any]) -> dict[str, float]:
    """MLX's memory gauges (`seatd.memory.MLX_GAUGES`, bytes) as figures in MiB
    (`mlx_active_mb`, ...), those given.  Pure."""
    return {f"{name.removesuffix('_bytes')}_mb": gauges[name] / MB for name in MLX_GAUGES
            if isinstance(gauges.get(name), int)}


def seat_counters(base_url: str, seat: str) -> dict[str, Any]:
    """One seat's own counters, through the proxy's GET /counters."""
    import urllib.request

    with urllib.request.urlopen(base_url + "/counters", timeout=10) as r:
        return dict(json.loads(r.read()).get("seats", {}).get(seat) or {})


def assign(names: Sequence[str], clients: int, turn: int) -> list[str]:
    """Which workload each client sends: rotated over the clients and the rounds, so every
    concurrency level sees the same mix and both arms of a group the same prompts."""
    return [names[(i + turn) % len(names)] for i in range(clients)]


def request_body(w: Workload, model: str, max_tokens: int, temperature: float,
                 seed: int | None) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one streamed request with usage in its last chunk.  Pure."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                            "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    if w.kind == "chat":
        return "/v1/chat/completions", body | {"messages": w.chat_messages()}
    return "/v1/completions", body | {"prompt": w.prompt}


def chunk_text(event: dict[str, Any]) -> str:
    """The text an SSE event carries (completions or chat), or ''.  Pure."""
    for c in event.get("choices") or []:
        text = c.get("text")
        if text is None:
            text = (c.get("delta") or {}).get("content")
        if text:
            return str(text)
    return ""


def stream_once(base_url: str, path: str, body: dict[str, Any],
                on_chunk: Callable[[int], None] | None = None) -> Stream:
    """One streamed request; each text chunk timed as it arrives.  A connection reset
    before the response's head is tried again on a new one, timed from the first send
    (a server whose listen backlog overflows resets some of 16 connects made at once:
    mlx_lm.server's socketserver keeps 5).  `on_chunk(count)`: each text chunk as it
    arrives, with the count so far."""
    u = urlparse(base_url)

    def connect() -> http.client.HTTPConnection:
        return http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80,
                                          timeout=CLIENT_TIMEOUT_S)

    conn = connect()
    try:
        s = Stream(sent=time.perf_counter())
        for tried in range(1, CONNECT_TRIES + 1):
            try:
                conn.request("POST", path, json.dumps(body),
                             {"Content-Type": "application/json"})
                r = conn.getresponse()
                break
            except (ConnectionResetError, BrokenPipeError):
                conn.close()
                if tried == CONNECT_TRIES:
                    raise
                conn = connect()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        usage = None
        while True:
            line = r.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(data)
            if chunk_text(event):
                s.chunks.append(now)
                if on_chunk is not None:
                    on_chunk(len(s.chunks))
            if isinstance(event.get("sanctum"), dict):
                s.speculation = event["sanctum"].get("speculation", s.speculation)
            if event.get("usage"):
                usage = event["usage"]
        s.end = time.perf_counter()
        if usage is None:  # tokens come from usage for every server, or not at all
            raise RuntimeError("the stream carried no usage")
        s.tokens = int(usage.get("completion_tokens") or 0)
        s.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        return s
    finally:
        conn.close()


def _together(jobs: Sequence[Callable[[], Stream]]) -> list[Stream]:
    """Run the jobs in threads released at once; re-raise the first failure."""
    results: list[Stream | None] = [None] * len(jobs)
    errors: list[BaseException] = []
    gate = threading.Barrier(len(jobs))

    def work(i: int) -> None:
        try:
            gate.wait()
            results[i] = jobs[i]()
        except BaseException as exc:  # reported after every thread is joined
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


class ConcurrentArm:
    """One server, measured a slot at a time: `c=N` or PREFILL (see the module docstring).

    `seeded`: the k-th request gets seed 1 + k when the temperature is above 0 (never at
    0, and never for a server whose batching a seed turns off).  `max_clients`: slots
    with more clients are left empty (an arm that serves one request at a time)."""

    def __init__(self, url: str, model: str, short: Sequence[Workload],
                 rows: Sequence[Workload], long: Workload, tokens: int, temperature: float,
                 seeded: bool, max_clients: int | None = None, prefill: bool = True,
                 settle_s: float = SETTLE_S, seat: str | None = None) -> None:
        self.url, self.model = url, model
        self.short, self.rows, self.long = list(short), list(rows), long
        self.tokens, self.temperature, self.seeded = tokens, temperature, seeded
        self.max_clients, self.prefill, self.settle_s = max_clients, prefill, settle_s
        self.seat = seat  # our seat's name: its batch sizes are read from /counters
        self.calls: dict[str, int] = {}

    def _job(self, w: Workload, k: int, max_tokens: int,
             on_chunk: Callable[[int], None] | None = None) -> Callable[[], Stream]:
        seed = 1 + k if self.seeded and self.temperature > 0 else None
        # A new salt per request: no request finds another's prompt in a cache.
        path, body = request_body(w.salted(k), self.model, max_tokens, self.temperature, seed)
        return lambda: stream_once(self.url, path, body, on_chunk)

    def __call__(self, name: str) -> dict[str, float]:
        turn = self.calls.get(name, 0)
        self.calls[name] = turn + 1
        if name == PREFILL and not self.prefill:
            return {}
        if name != PREFILL and self.max_clients is not None \
                and int(name.removeprefix("c=")) > self.max_clients:
            return {}
        before = seat_counters(self.url, self.seat) if self.seat else {}
        out = self.measure_prefill(turn) if name == PREFILL else self.measure(name, turn)
        if self.seat is None:
            return out
        return out | batch_figures(before, seat_counters(self.url, self.seat))

    def measure(self, name: str, turn: int) -> dict[str, float]:
        clients = int(name.removeprefix("c="))
        by_name = {w.name: w for w in self.short}
        picks = assign([w.name for w in self.short], clients, turn)
        jobs = [self._job(by_name[n], turn * 10_000 + clients * 100 + i, self.tokens)
                for i, n in enumerate(picks)]
        return concurrency_figures(_together(jobs))

    def measure_prefill(self, turn: int) -> dict[str, float]:
        sent = [0] * ROWS  # each row's text chunks so far
        lock = threading.Condition()

        def chunked(i: int) -> Callable[[int], None]:
            def count(n: int) -> None:
                with lock:
                    sent[i] = n
                    lock.notify_all()
            return count

        names = [self.rows[i % len(self.rows)] for i in range(ROWS)]
        jobs = [self._job(w, 900_000 + turn * 100 + i, ROW_FACTOR * self.tokens, chunked(i))
                for i, w in enumerate(names)]
        rows: list[Stream] = []
        failed: list[BaseException] = []

        def run_rows() -> None:
            try:
                rows.extend(_together(jobs))
            except BaseException as exc:
                failed.append(exc)

        t_rows = threading.Thread(target=run_rows, daemon=True)
        t_rows.start()
        with lock:  # every row streaming (a seat that queues them: the deadline)
            lock.wait_for(lambda: min(sent) >= 1, ARRIVE_DEADLINE_S)
            since = time.perf_counter()
            lock.wait_for(lambda: min(sent) >= settle_chunks(self.tokens), self.settle_s)
        try:
            long = self._job(self.long, 990_000 + turn, LONG_MAX_TOKENS)()
        finally:  # the rows end before the next slot starts, whatever happened here
            t_rows.join()
        if failed:
            raise failed[0]
        out = prefill_figures(rows, long.sent, long.chunks[0] if long.chunks else None, since)
        return out | {"long_prompt_tokens": float(long.prompt_tokens)}
