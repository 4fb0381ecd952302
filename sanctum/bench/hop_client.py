"""A lean HTTP load client for the hop benchmark, run as its own process.

    python -m sanctum.bench.hop_client URL MODEL latency|stream|rps [options]

Keep-alive connections on one event loop (uvloop where installed), requests
prebuilt as bytes and responses read by Content-Length or chunked framing, so
that the client costs as little as it can on a machine whose cores it shares
with the servers it measures.  Prints one JSON object of figures:

    latency   whole one-token requests, one at a time: p50 and p99
    stream    streamed requests of `--tokens` and of one token, alternating; the
              time per chunk is the difference of their medians over tokens - 1
    rps       `--clients` connections for `--seconds`: requests per second
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from urllib.parse import urlparse

from sanctum.bench.stats import quantile
from shared.loops import new_event_loop


def request_bytes(host: str, path: str, model: str, stream: bool, tokens: int) -> bytes:
    if path.endswith("/chat/completions"):
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": tokens, "stream": stream}
    else:
        body = {"model": model, "prompt": "hi", "max_tokens": tokens, "stream": stream}
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def ask(self, request: bytes) -> int:
        """Send one request and read its whole response; the status code."""
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        at = lower.find(b"content-length:")
        if at >= 0:
            end = lower.index(b"\r\n", at)
            await self.reader.readexactly(int(lower[at + 15:end]))
            return status
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await self.reader.readline()).strip(), 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    return status
        raise RuntimeError(f"unframed response: {head[:200]!r}")

    def close(self) -> None:
        self.writer.close()


async def connect(host: str, port: int) -> Conn:
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    return Conn(reader, writer)


async def latency(host: str, port: int, req: bytes, n: int) -> dict[str, float]:
    conn = await connect(host, port)
    times: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        status = await conn.ask(req)
        times.append(time.perf_counter() - t0)
        if status != 200:
            raise RuntimeError(f"HTTP {status}")
    conn.close()
    return {"latency_p50_s": quantile(times, 0.5), "latency_p99_s": quantile(times, 0.99)}


async def stream(host: str, port: int, long: bytes, short: bytes, tokens: int,
                 n: int) -> dict[str, float]:
    conn = await connect(host, port)
    longs: list[float] = []
    shorts: list[float] = []
    for _ in range(n):
        for req, out in ((long, longs), (short, shorts)):
            t0 = time.perf_counter()
            if await conn.ask(req) != 200:
                raise RuntimeError("stream request failed")
            out.append(time.perf_counter() - t0)
    conn.close()
    per_chunk = (statistics.median(longs) - statistics.median(shorts)) / (tokens - 1)
    return {"per_chunk_s": per_chunk, "stream_p50_s": statistics.median(longs)}


async def rps(host: str, port: int, req: bytes, clients: int,
              seconds: float) -> dict[str, float]:
    conns = [await connect(host, port) for _ in range(clients)]
    done = [0] * clients
    errors = [0] * clients
    stop_at = time.perf_counter() + seconds

    async def work(i: int) -> None:
        while time.perf_counter() < stop_at:
            try:
                ok = await conns[i].ask(req) == 200
            except (asyncio.IncompleteReadError, ConnectionError):
                # The server ended a keep-alive connection (a request limit): a new one.
                conns[i].close()
                conns[i] = await connect(host, port)
                continue
            if ok:
                done[i] += 1
            else:
                errors[i] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(work(i) for i in range(clients)))
    elapsed = time.perf_counter() - t0
    for c in conns:
        c.close()
    return {"rps": sum(done) / elapsed, "errors": float(sum(errors))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hop_client")
    ap.add_argument("url", help="e.g. http://127.0.0.1:8800/v1/chat/completions")
    ap.add_argument("model")
    ap.add_argument("mode", choices=["latency", "stream", "rps"])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    u = urlparse(args.url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    hostport = f"{host}:{port}"
    one = request_bytes(hostport, u.path, args.model, False, 1)
    loop = new_event_loop()
    try:
        if args.mode == "latency":
            figures = loop.run_until_complete(latency(host, port, one, args.requests))
        elif args.mode == "stream":
            long = request_bytes(hostport, u.path, args.model, True, args.tokens)
            short = request_bytes(hostport, u.path, args.model, True, 1)
            figures = loop.run_until_complete(
                stream(host, port, long, short, args.tokens, args.requests))
        else:
            figures = loop.run_until_complete(rps(host, port, one, args.clients, args.seconds))
    finally:
        loop.close()
    json.dump(figures, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
