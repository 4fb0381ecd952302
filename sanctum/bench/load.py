"""A load test: N concurrent clients against `sanctum up`, bounded in count and time.

The figure is requests served, errors by kind, and latency p50/p99.  Overload must
be answered, never hung: a 429 or 503 should carry Retry-After, and a request that
gets no answer within the client timeout is counted as a hang.  Loopback only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from sanctum.bench.options import machine, model_path
from sanctum.bench.stats import quantile

MAX_CLIENTS = 64
MAX_SECONDS = 300.0
CLIENT_TIMEOUT_S = 120.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Outcome:
    status: int  # 0: no answer (connection error or hang)
    latency_s: float
    retry_after: bool
    hung: bool = False


def summarize_load(outcomes: list[Outcome], seconds: float) -> dict[str, object]:
    """What the load test reports.  Pure."""
    ok = [o for o in outcomes if o.status == 200]
    overload = [o for o in outcomes if o.status in (429, 503)]
    lat = [o.latency_s for o in ok]
    return {
        "requests": len(outcomes),
        "served": len(ok),
        "served_per_s": len(ok) / seconds if seconds else 0.0,
        "errors": dict(Counter(str(o.status) for o in outcomes if o.status != 200)),
        "overload_answers": len(overload),
        "overload_without_retry_after": sum(1 for o in overload if not o.retry_after),
        "hangs": sum(1 for o in outcomes if o.hung),
        "p50_s": quantile(lat, 0.5) if lat else None,
        "p99_s": quantile(lat, 0.99) if lat else None,
    }


def check_bounds(url: str, clients: int, seconds: float) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"sanctum bench load: loopback only, not {host!r}")
    if not 1 <= clients <= MAX_CLIENTS:
        raise SystemExit(f"sanctum bench load: 1..{MAX_CLIENTS} clients")
    if not 0 < seconds <= MAX_SECONDS:
        raise SystemExit(f"sanctum bench load: at most {MAX_SECONDS:g} seconds")


def one_request(conn: http.client.HTTPConnection, body: bytes) -> Outcome:
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        return Outcome(r.status, time.perf_counter() - t0, r.getheader("Retry-After") is not None)
    except TimeoutError:
        conn.close()
        return Outcome(0, time.perf_counter() - t0, False, hung=True)
    except (OSError, http.client.HTTPException):
        conn.close()
        return Outcome(0, time.perf_counter() - t0, False)


def drive(url: str, model: str, clients: int, seconds: float, tokens: int) -> list[Outcome]:
    u = urlparse(url)
    body = json.dumps({"model": model, "prompt": "def fibonacci(n):", "max_tokens": tokens,
                       "temperature": 0}).encode()
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def work() -> None:
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80,
                                          timeout=CLIENT_TIMEOUT_S)
        while time.perf_counter() < stop_at:
            o = one_request(conn, body)
            with lock:
                outcomes.append(o)
            if o.status in (429, 503):
                time.sleep(0.05)
        conn.close()

    threads = [threading.Thread(target=work) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def load_test(args: argparse.Namespace) -> int:
    from sanctum.bench import servers

    with ExitStack() as stack:
        url, route = args.url, "bench"
        if url is None:
            path = model_path(args.model)
            port = servers.free_port()
            ctx = json.loads((path / "config.json").read_text()).get(
                "max_position_embeddings", 2048)
            cap = max(256, min(4096, int(ctx) - args.tokens - 64))
            config = servers.sanctum_config(port, [("bench", str(path), cap, "")])
            url = stack.enter_context(servers.sanctum_up(config, ("bench",), port))
        check_bounds(url, args.clients, args.seconds)
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        outcomes = drive(url, route, args.clients, args.seconds, args.tokens)
        elapsed = time.perf_counter() - t0
        load_after = os.getloadavg()[0]
    result = {"clients": args.clients, "seconds": args.seconds, "tokens": args.tokens,
              "load_before": load_before, "load_after": load_after,
              "machine": machine(args.model), **summarize_load(outcomes, elapsed)}
    out = Path(args.out) / "load.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    bad = result["hangs"] or result["overload_without_retry_after"]
    if bad:
        print("sanctum bench load: overload was not answered cleanly", file=sys.stderr)
    return 1 if bad else 0
