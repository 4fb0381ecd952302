"""A fault-injecting seat: a real process that speaks the real seat protocol.

    python -m tests.fakes.fake_seat --endpoint ipc://... --name brain --mode MODE --log FILE

It answers pings like a worker and serves `Generate` according to MODE, for the
faults a real model cannot be made to produce on demand:

    ok                 stream `--tokens` chunks, then Final(ok)
    decline            like ok, but reports speculation declined (the seat answered)
    warming            like ok, but pongs say it is compiling its shapes in idle time
    reject413          Final(Rejected 413) at once
    not_ready          pongs say ready=false; Generate gets Failed(not_ready)
    crash_before_first SIGKILL itself on Generate, before any chunk
    crash_midstream    three chunks, then SIGKILL itself
    hang               stop answering anything (pings too) on Generate
    silent             start the Generate (Started), then never answer it; pings answered
    queued             never start the Generate, as if queued behind others; pings answered
    stall              two chunks, then silence on that request (pings still answered)
    internal_error     Final(Failed internal_error)
    slow               one chunk every 50 ms until cancelled or `--tokens` reached
    tools              like ok; a request with tools (tool_choice not "none") gets its
                       last chunk with a call of the named tool (else the first), and a
                       call of the second tool too when there is one and
                       parallel_tool_calls; Final(ok, finish_reason "tool_calls")

A request that asks for log-probabilities (`params.logprobs` = k) gets one
TokenLogprob per chunk's token: token "tN " at -0.25 * N, with k alternatives ("tN "
itself first, then "altJ" at one less each).  A request that continues an answer
(`Generate.prefix`, "t1 t2 t3 ") goes on from the next token ("t4 "), as a seat with
the same weights would; each chunk carries its token's id (N for "tN "), as a real
seat's does, so that a fake (every fake's tokenizer is "fake") is given the exact
tokens of an answer it continues.  Every request, cancel and token is appended to the JSONL
log for the test to read.
It builds on the seat side of the protocol (shared/seat_side.py), as the null seat does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

from shared import protocol
from shared.protocol import (
    Chunk,
    Failed,
    Final,
    Generate,
    Ok,
    Ping,
    Pong,
    Rejected,
    Started,
    TokenLogprob,
    ToolCall,
    Usage,
)
from shared.seat_side import SeatSocket, serve


class FakeSeat:
    """The seat-side handler (shared/seat_side.py) that plays `mode`."""

    def __init__(self, args: argparse.Namespace, socket: SeatSocket) -> None:
        self.name = args.name
        self.mode = args.mode
        self.tokens = args.tokens
        self.socket = socket
        self.served = 0
        self.incarnation = 1
        self.log = open(args.log, "a", buffering=1)
        self.ready = args.mode != "not_ready"
        # Active streams: request id -> (identity, tokens sent, request)
        self.active: dict[str, tuple[bytes, int, Generate]] = {}
        self.next_tick = time.monotonic()

    def note(self, **event: object) -> None:
        self.log.write(json.dumps({"t": time.time(), **event}) + "\n")

    def send(self, identity: bytes, msg: protocol.Reply) -> None:
        self.socket.send(identity, msg)

    def pong(self, ping: Ping) -> Pong:
        return Pong(self.name, os.getpid(), self.incarnation, self.ready, bool(self.active),
                    ping.sent_at, 4096, 8192, "fake", warming=self.mode == "warming")

    def counters(self) -> dict[str, object]:
        return {"served": self.served, "incarnation": self.incarnation,
                "bad_frames": self.socket.bad_frames}

    def stamp(self) -> tuple[int, int]:
        return self.served, self.incarnation

    def cancel(self, identity: bytes, rid: str) -> None:
        self.note(event="cancel", request_id=rid, tokens=self.active.get(rid, (b"", 0))[1])
        if rid in self.active:
            self.active.pop(rid)
            self.send(identity, Final(rid, protocol.Cancelled(), self.name, self.served,
                                      self.incarnation))

    def generate(self, identity: bytes, msg: Generate) -> None:
        rid, mode = msg.request_id, self.mode
        self.note(event="generate", request_id=rid, stream=msg.stream, prefix=msg.prefix)
        if mode not in ("not_ready", "crash_before_first", "hang", "queued"):
            self.send(identity, Started(rid))
        if mode == "not_ready":
            self.send(identity, Final(rid, Failed("not_ready"), self.name, self.served,
                                      self.incarnation))
        elif mode == "reject413":
            self.send(identity, Final(rid, Rejected(
                413, "prompt_too_long", "prompt has 9000 tokens; cap 4096",
                {"prompt_tokens": 9000, "cap": 4096, "seat": self.name,
                 "limit": "seat_cap"}), self.name, self.served, self.incarnation))
        elif mode == "internal_error":
            self.send(identity, Final(rid, Failed("internal_error", "boom"), self.name,
                                      self.served, self.incarnation))
        elif mode == "crash_before_first":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "hang":
            self.note(event="hanging")
            while True:
                time.sleep(3600)
        elif mode in ("silent", "queued"):
            pass  # started (silent) or never started (queued); never answered
        else:
            self.active[rid] = (identity, len((msg.prefix or "").split()), msg)

    def finish(self, identity: bytes, rid: str, n: int, calls: int = 0) -> None:
        self.served += 1
        speculation = "declined:no_drafter" if self.mode == "decline" else "off"
        # Noted before it is sent: a test that reads the log after its answer sees it.
        self.note(event="final", request_id=rid, served=self.served, tokens=n)
        self.send(identity, Final(rid, Ok(), self.name, self.served, self.incarnation,
                                  "tool_calls" if calls else "length", Usage(5, n),
                                  speculation))

    def tick(self) -> float | None:
        if not self.active:
            return None
        now = time.monotonic()
        if now < self.next_tick:
            return self.next_tick - now
        slow = self.mode in ("slow", "stall", "crash_midstream")
        self.next_tick = now + (0.05 if slow else 0.0)
        for rid, (identity, n, req) in list(self.active.items()):
            if self.mode == "stall" and n >= 2:
                continue
            if self.mode == "crash_midstream" and n >= 3:
                os.kill(os.getpid(), signal.SIGKILL)
            n += 1
            begun = len((req.prefix or "").split())
            calls = self.calls(req) if n >= self.tokens else ()
            self.send(identity, Chunk(rid, f"t{n} ", n - begun, self.served + 1, ids=(n,),
                                      tool_calls=calls, logprobs=logprobs(req, n)))
            self.active[rid] = (identity, n, req)
            if n >= self.tokens:
                self.active.pop(rid)
                self.finish(identity, rid, n - begun, len(calls))
        return max(0.0, self.next_tick - time.monotonic())


    def calls(self, req: Generate) -> tuple[ToolCall, ...]:
        """The tool calls of mode `tools`: see the module docstring."""
        if self.mode != "tools" or not req.tools_json or req.tool_choice == "none":
            return ()
        names = [t["function"]["name"] for t in json.loads(req.tools_json)]
        if req.tool_choice and req.tool_choice.startswith("function:"):
            names = [req.tool_choice.removeprefix("function:")]
        elif not req.parallel_tool_calls:
            names = names[:1]
        return tuple(ToolCall(i, f"call_{i}_{req.request_id[:8]}", name,
                              json.dumps({"n": i + 1})) for i, name in enumerate(names[:2]))


def logprobs(req: Generate, n: int) -> tuple[TokenLogprob, ...]:
    top = req.params.logprobs
    if top is None:
        return ()
    token, lp = f"t{n} ", -0.25 * n
    alts = [(token, lp), *((f"alt{j}", lp - j) for j in range(1, top))][:top]
    return (TokenLogprob(token, lp, tuple(token.encode()), tuple(alts)),)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--mode", default="ok")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--log", required=True)
    args = ap.parse_args()
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    socket = SeatSocket(args.endpoint)
    try:
        serve(socket, FakeSeat(args, socket), lambda: stop)
    finally:
        socket.close()


if __name__ == "__main__":
    main()
