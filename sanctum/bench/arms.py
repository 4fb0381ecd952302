"""The things a benchmark compares.  Each arm measures one workload per call.

Figures every generating arm reports (seconds from the request leaving the client):

    ttft_s          first text
    e2e_s           last byte of the answer
    decode_tps      (completion tokens - 1) / (last text - first text)
    completion_tokens, prompt_tokens
"""

from __future__ import annotations

import http.client
import itertools
import json
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sanctum.bench.stats import quantile
from sanctum.bench.workloads import Workload


def decode_figures(t0: float, times: list[float], end: float, tokens: int,
                   prompt_tokens: int) -> dict[str, float]:
    """Figures from the arrival times of text pieces.  Pure."""
    if not times:
        raise RuntimeError("the answer had no text")
    first, last = times[0], times[-1]
    figures = {"ttft_s": first - t0, "e2e_s": end - t0, "completion_tokens": float(tokens),
               "prompt_tokens": float(prompt_tokens)}
    if tokens > 1 and last > first:
        figures["decode_tps"] = (tokens - 1) / (last - first)
    return figures


class OpenAIArm:
    """An OpenAI-compatible server through the official openai client, streaming."""

    def __init__(self, base_url: str, model: str, temperature: float, max_tokens: int,
                 workloads: dict[str, Workload], seed: int | None = 1) -> None:
        import openai

        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="bench", max_retries=0,
                                    timeout=600)
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.workloads = workloads
        self.seed = seed  # None: unseeded requests (no `seed` field sent)
        self.extra_body: dict[str, Any] = {}  # e.g. the request's `sanctum` options
        self.last_headers: dict[str, str] = {}
        self.last_text = ""
        self.calls: Counter[str] = Counter()

    def request_seed(self, k: int) -> int | None:
        """The seed of the k-th request of a workload (from 1): the arm's one seed."""
        return self.seed

    def __call__(self, name: str) -> dict[str, float]:
        self.calls[name] += 1
        w = self.workloads[name]
        # A fresh salt per request: only a conversation's own earlier turns can be cached.
        w = w.salted(self.calls[name])
        temp = self.temperature if w.temperature is None else w.temperature
        if w.history:
            # The earlier turns, untimed: what a prompt cache could keep.
            history: Any = [{"role": r, "content": c} for r, c in w.history]
            self.client.chat.completions.create(
                model=self.model, max_tokens=1, temperature=0.0, messages=history)
        common: dict[str, Any] = dict(model=self.model, max_tokens=self.max_tokens,
                                      temperature=temp, stream=True,
                                      stream_options={"include_usage": True})
        seed = self.request_seed(self.calls[name])
        if seed is not None:  # the SDK would send `"seed": null` for None; send nothing
            common["seed"] = seed
        if self.extra_body:
            common["extra_body"] = self.extra_body
        t0 = time.perf_counter()
        raw: Any  # the SDK's raw response; its chunks are read by attribute below
        if w.kind == "chat":
            messages: Any = w.chat_messages()
            raw = self.client.chat.completions.with_raw_response.create(
                messages=messages, **common)
        else:
            raw = self.client.completions.with_raw_response.create(prompt=w.prompt, **common)
        self.last_headers = {k.lower(): v for k, v in raw.headers.items()}
        times: list[float] = []
        pieces: list[str] = []
        usage = None
        facts: dict[str, Any] = {}
        for chunk in raw.parse():
            now = time.perf_counter()
            extra = getattr(chunk, "model_extra", None) or {}
            if isinstance(extra.get("sanctum"), dict):
                facts = extra["sanctum"]
            if chunk.choices:
                c = chunk.choices[0]
                text = c.delta.content if w.kind == "chat" else c.text
                if text:
                    times.append(now)
                    pieces.append(text)
            if chunk.usage is not None:
                usage = chunk.usage
        end = time.perf_counter()
        self.last_text = "".join(pieces)
        tokens = usage.completion_tokens if usage else len(times)
        prompt = usage.prompt_tokens if usage else 0
        figures = decode_figures(t0, times, end, tokens, prompt)
        # A stream's headers leave before the seat knows how it decoded: the last
        # chunk's `sanctum` object carries the fact; the header is the fallback.
        spec = facts.get("speculation", self.last_headers.get("x-sanctum-speculation"))
        if spec is not None:
            figures["accelerated"] = 1.0 if spec == "accelerated" else 0.0
        return figures


class InProcessArm:
    """The same model driven in this process by mlx-lm's `generate_step`.

    Loaded through the seat's own `load_for_compute`, so both arms compute with
    the same weights in the same dtype; tokenized and detokenized as the seat does.
    """

    def __init__(self, model_dir: Path, temperature: float, max_tokens: int,
                 workloads: dict[str, Workload]) -> None:
        from seatd.model_load import load_for_compute

        self.loaded = load_for_compute(model_dir)
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.workloads = workloads
        self.calls: Counter[str] = Counter()

    def tokens(self, w: Workload) -> list[int]:
        return w.token_ids(self.loaded.tokenizer)

    def __call__(self, name: str) -> dict[str, float]:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_sampler

        self.calls[name] += 1
        w = self.workloads[name].salted(self.calls[name])
        tok = self.loaded.tokenizer
        t0 = time.perf_counter()
        prompt = self.tokens(w)
        detok = tok.detokenizer
        detok.reset()
        eos = set(tok.eos_token_ids)
        times: list[float] = []
        n = 0
        sampler = make_sampler(self.temperature if w.temperature is None else w.temperature)
        for token, _ in generate_step(mx.array(prompt), self.loaded.model,
                                      max_tokens=self.max_tokens, sampler=sampler):
            if int(token) in eos:
                break
            n += 1
            detok.add_token(int(token))
            if detok.last_segment:
                times.append(time.perf_counter())
        detok.finalize()
        end = time.perf_counter()
        return decode_figures(t0, times, end, n, len(prompt))


# -- proxy overhead: a null seat, called through the proxy or directly -------------


class DirectSeat:
    """Talks to a seat over ZeroMQ as the proxy does (a DEALER), without the proxy."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        from shared import protocol

        self.protocol = protocol
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def request(self, max_tokens: int, prompt: str = "hello") -> list[float]:
        """One streamed request; the arrival time of each chunk, then of the Final."""
        p = self.protocol
        gen = p.Generate(uuid.uuid4().hex, True, p.SamplingParams(max_tokens=max_tokens),
                         prompt=prompt)
        self.sock.send(p.encode(gen))
        times = []
        while True:
            if not self.sock.poll(10_000):
                raise TimeoutError("seat did not answer in 10 s")
            frame = p.reply_decoder.decode(self.sock.recv())
            if isinstance(frame, p.Started):
                continue
            times.append(time.perf_counter())
            if isinstance(frame, p.Final):
                return times

    def close(self) -> None:
        self.sock.close(linger=0)


class ProxyHTTP:
    """A lean keep-alive HTTP client streaming from the proxy (SSE), timing each event.

    Deliberately not the openai SDK: its own per-chunk cost would be charged to the proxy.
    """

    def __init__(self, base_url: str, model: str) -> None:
        host, port = base_url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)
        self.model = model

    def request(self, max_tokens: int, prompt: str = "hello") -> list[float]:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "stream": True})
        self.conn.request("POST", "/v1/completions", body,
                          {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
        times = []
        while True:
            line = r.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                times.append(time.perf_counter())
                if line.startswith(b"data: [DONE]"):
                    break
        r.read()
        return times

    def close(self) -> None:
        self.conn.close()


Client = DirectSeat | ProxyHTTP


def overhead_figures(client: Client, kind: str, requests: int, tokens: int) -> dict[str, float]:
    """`latency`: whole one-token requests.  `stream`: the gap per streamed token."""
    if kind == "latency":
        lat = []
        for _ in range(requests):
            t0 = time.perf_counter()
            client.request(1)
            lat.append(time.perf_counter() - t0)
        return {"latency_p50_s": quantile(lat, 0.5), "latency_p99_s": quantile(lat, 0.99)}
    gaps: list[float] = []
    for _ in range(requests):
        times = client.request(tokens)
        # Per-token gaps between consecutive pieces (the last frame ends the stream).
        gaps.extend(b - a for a, b in itertools.pairwise(times[:-1]))
    return {"per_token_p50_s": quantile(gaps, 0.5), "per_token_p99_s": quantile(gaps, 0.99)}


def throughput(make_client: Callable[[], Client], clients: int, seconds: float,
               tokens: int) -> dict[str, float]:
    """Requests per second from `clients` threads, each with its own connection."""
    done = [0] * clients
    errors = [0] * clients
    stop_at = time.perf_counter() + seconds
    conns = [make_client() for _ in range(clients)]

    def work(i: int) -> None:
        while time.perf_counter() < stop_at:
            try:
                conns[i].request(tokens)
                done[i] += 1
            except Exception:
                errors[i] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for c in conns:
        c.close()
    return {"rps": sum(done) / elapsed, "errors": float(sum(errors))}


# -- speculation: acceptance from the seat's counters, and mlx-lm's own speculative loop --


def acceptance_figures(verifies: int, accepted: int, per_position: list[int],
                       ) -> dict[str, float]:
    """Accepted draft tokens per verify, and the share of verifies that accepted draft
    position i (1-based: `accept_p1`, ...).  Pure."""
    if verifies <= 0:
        return {}
    out = {"accept_len": accepted / verifies}
    for i, n in enumerate(per_position):
        out[f"accept_p{i + 1}"] = n / verifies
    return out


def counter_acceptance(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Acceptance over one request from a seat's counters before and after it.  Pure."""
    def delta(key: str) -> int:
        return int(after.get(key, 0)) - int(before.get(key, 0))

    pb = list(before.get("spec_accepted_per_position", []))
    pa = list(after.get("spec_accepted_per_position", []))
    pb += [0] * (len(pa) - len(pb))
    return acceptance_figures(delta("spec_drafts"), delta("spec_accepted_tokens"),
                              [a - b for a, b in zip(pa, pb, strict=True)])


def stream_acceptance(from_draft: list[bool]) -> dict[str, float]:
    """Acceptance from mlx-lm's speculative stream: each verify yields its accepted draft
    tokens (from_draft) and then one token of the target's own.  Pure."""
    verifies, accepted, run = 0, 0, 0
    per: list[int] = []
    for d in from_draft:
        if d:
            accepted += 1
            run += 1
            while len(per) < run:
                per.append(0)
            per[run - 1] += 1
        else:
            verifies += 1
            run = 0
    if run:  # the stream stopped (max_tokens, end of text) inside a verify's accepted run
        verifies += 1
    return acceptance_figures(verifies, accepted, per)


def drafter_share(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """The share of one request's verify rounds drafted by prompt lookup.  Pure."""
    def rounds(c: dict[str, Any]) -> tuple[int, int]:
        by = dict(c.get("spec_drafts_by_drafter") or {})
        return int(by.get("lookup", 0)), sum(int(v) for v in by.values())

    (lb, tb), (la, ta) = rounds(before), rounds(after)
    return {"lookup_share": (la - lb) / (ta - tb)} if ta > tb else {}


def round_figures(before: dict[str, Any], after: dict[str, Any], tokens: float | None,
                  ) -> dict[str, float]:
    """Verify rounds per answer token over one request (`rounds_per_token`; 0: every
    token a plain step), and the seat's cost terms after it (`cost_TERM_us`: plain,
    host, lookup_host, verify_w2), which say where a seat's time went.  Pure."""
    out: dict[str, float] = {}
    if tokens:
        out["rounds_per_token"] = (int(after.get("spec_drafts", 0))
                                   - int(before.get("spec_drafts", 0))) / tokens
    terms = dict(after.get("spec_cost_us") or {})
    for term in ("plain", "host", "lookup_host", "verify_w2"):
        if term in terms:
            out[f"cost_{term}_us"] = float(terms[term])
    return out


def predicted_rate(terms: dict[str, Any], depth: int, accept_len: float) -> dict[str, float]:
    """What the seat's cost model (`spec_cost_us`) says of rounds of `depth` keeping
    `accept_len` drafts each: `predicted_tps`, the tokens/s of its drafting and verify
    time alone (draft_k + verify_wN: no host work, the ceiling host work keeps a seat
    from), and `host_share`, the host's part of a whole round; empty where a term was not
    measured.  Pure."""
    try:
        us = float(terms[f"draft_{depth}"]) + float(terms[f"verify_w{depth + 1}"])
        host = float(terms["host"])
    except KeyError:
        return {}
    if us <= 0:
        return {}
    return {"predicted_tps": (1 + accept_len) / (us / 1e6), "host_share": host / (us + host)}


class SeatSpecArm(OpenAIArm):
    """An OpenAIArm on a speculating seat that also reads the seat's acceptance counters
    (GET /counters) before and after each request; with a pinned `depth`, the tokens/s
    its cost model predicts at the acceptance the request had (`predicted_rate`)."""

    def __init__(self, base_url: str, seat: str, *args: Any, depth: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(base_url, seat, *args, **kwargs)
        self.base_url = base_url
        self.seat = seat
        self.depth = depth

    def _counters(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(self.base_url + "/counters", timeout=10) as r:
            seats = json.loads(r.read()).get("seats", {})
        return dict(seats.get(self.seat) or {})

    def __call__(self, name: str) -> dict[str, float]:
        before = self._counters()
        figures = super().__call__(name)
        after = self._counters()
        out = figures | counter_acceptance(before, after) | drafter_share(before, after)
        out |= round_figures(before, after, figures.get("completion_tokens"))
        if self.depth is not None and "accept_len" in out:
            out |= predicted_rate(dict(after.get("spec_cost_us") or {}), self.depth,
                                  out["accept_len"])
        return out


class InProcessSpecArm(InProcessArm):
    """mlx-lm's own `speculative_generate_step` in this process with the same pair
    (both loaded through `load_for_compute`) and a fixed number of draft tokens."""

    def __init__(self, model_dir: Path, drafter_dir: Path, draft_tokens: int,
                 temperature: float, max_tokens: int, workloads: dict[str, Workload]) -> None:
        from seatd.model_load import load_for_compute

        super().__init__(model_dir, temperature, max_tokens, workloads)
        self.drafter = load_for_compute(drafter_dir)
        self.draft_tokens = draft_tokens

    def supported(self) -> bool:
        """mlx-lm speculates only where every layer's cache trims (no recurrent state)."""
        from mlx_lm.models import cache as mlx_cache

        return bool(mlx_cache.can_trim_prompt_cache(
            mlx_cache.make_prompt_cache(self.loaded.model)))

    def __call__(self, name: str) -> dict[str, float]:
        import mlx.core as mx
        from mlx_lm.generate import speculative_generate_step
        from mlx_lm.sample_utils import make_sampler

        self.calls[name] += 1
        w = self.workloads[name].salted(self.calls[name])
        tok = self.loaded.tokenizer
        t0 = time.perf_counter()
        prompt = self.tokens(w)
        detok = tok.detokenizer
        detok.reset()
        eos = set(tok.eos_token_ids)
        times: list[float] = []
        flags: list[bool] = []
        n = 0
        sampler = make_sampler(self.temperature if w.temperature is None else w.temperature)
        for token, _, from_draft in speculative_generate_step(
                mx.array(prompt), self.loaded.model, self.drafter.model,
                num_draft_tokens=self.draft_tokens, max_tokens=self.max_tokens,
                sampler=sampler):
            if int(token) in eos:
                break
            n += 1
            flags.append(bool(from_draft))
            detok.add_token(int(token))
            if detok.last_segment:
                times.append(time.perf_counter())
        detok.finalize()
        end = time.perf_counter()
        return decode_figures(t0, times, end, n, len(prompt)) | stream_acceptance(flags)


# -- rollback: verify rounds on a hybrid model, recorded and rolled back or not ----------


class VerifyRoundArm(InProcessArm):
    """Verify rounds of `width` tokens on the seat's own decode path, in this process.

    `rollback=True`: each forward records what a rollback needs (`seatd.recurrent`) and
    the cache is then rolled back to `keep` tokens, as after a partial accept.  False:
    the same forwards unrecorded and never rolled back, the cost of a verify that could
    not roll a recurrent layer back.  Figures: median seconds per round and, with
    rollback, the median seconds of the rollback itself (trim plus evaluating what it
    restored)."""

    def __init__(self, model_dir: Path, workloads: dict[str, Workload], width: int,
                 keep: int, rollback: bool, rounds: int = 24) -> None:
        super().__init__(model_dir, 0.0, 0, workloads)
        self.width, self.keep, self.rollback, self.rounds = width, keep, rollback, rounds

    def __call__(self, name: str) -> dict[str, float]:
        import mlx.core as mx
        from mlx_lm.models import cache as mlx_cache

        from seatd import recurrent
        from seatd.engine_types import make_cache

        self.calls[name] += 1
        w = self.workloads[name].salted(self.calls[name])
        ids = self.tokens(w)
        model = self.loaded.model
        cache = make_cache(model, "fp16")
        model(mx.array(ids, dtype=mx.uint32)[None], cache=cache)
        mx.eval(recurrent.state_arrays(cache))
        rounds: list[float] = []
        rollbacks: list[float] = []
        for r in range(self.rounds):
            start = (r * self.width) % max(1, len(ids) - self.width)
            block = mx.array(ids[start : start + self.width], dtype=mx.uint32)[None]
            t0 = time.perf_counter()
            if self.rollback:
                with recurrent.recording():
                    logits = model(block, cache=cache)
                mx.eval(logits)
                t1 = time.perf_counter()
                mlx_cache.trim_prompt_cache(cache, self.width - self.keep)
                mx.eval(recurrent.state_arrays(cache))
                rollbacks.append(time.perf_counter() - t1)
            else:
                mx.eval(model(block, cache=cache))
                for c in cache:  # KV layers kept as short as the other arm's
                    if not isinstance(c, mlx_cache.ArraysCache):
                        c.trim(self.width - self.keep)
            rounds.append(time.perf_counter() - t0)
        out = {"round_s": statistics.median(rounds)}
        if rollbacks:
            out["rollback_s"] = statistics.median(rollbacks)
        return out
