"""A fault-injecting seat: a real process that speaks the real seat protocol.

    python -m tests.fakes.fake_seat --endpoint ipc://... --name brain --mode MODE --log FILE

It answers pings like a worker and serves `Generate` according to MODE, for the
faults a real model cannot be made to produce on demand:

    ok                 stream `--tokens` chunks, then Final(ok)
    decline            like ok, but reports speculation declined (the seat answered)
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

Every request, cancel and token is appended to the JSONL log for the test to read.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import zmq

from shared import protocol
from shared.protocol import (
    Cancel,
    Chunk,
    CountersReply,
    Failed,
    Final,
    Generate,
    GetCounters,
    Ok,
    Ping,
    Pong,
    Rejected,
    Started,
    Usage,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--mode", default="ok")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--log", required=True)
    args = ap.parse_args()

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(args.endpoint)
    served = 0
    incarnation = 1
    log = open(args.log, "a", buffering=1)
    cancelled: set[str] = set()
    muted: set[str] = set()
    ready = args.mode != "not_ready"
    # Active streams: request id -> (identity, tokens sent, request)
    active: dict[str, tuple[bytes, int, Generate]] = {}
    next_tick = time.monotonic()
    stop = False

    def note(**event: object) -> None:
        log.write(json.dumps({"t": time.time(), **event}) + "\n")

    def send(identity: bytes, msg: object) -> None:
        sock.send_multipart([identity, protocol.encode(msg)])  # type: ignore[arg-type]

    def finish(identity: bytes, rid: str, n: int) -> None:
        nonlocal served
        served += 1
        speculation = "declined:no_drafter" if args.mode == "decline" else "off"
        # Noted before it is sent: a test that reads the log after its answer sees it.
        note(event="final", request_id=rid, served=served, tokens=n)
        send(identity, Final(rid, Ok(), args.name, served, incarnation, "length",
                             Usage(5, n), speculation))

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop:
        timeout = max(0, int((next_tick - time.monotonic()) * 1000)) if active else 100
        if dict(poller.poll(timeout)).get(sock):
            identity, payload = sock.recv_multipart()
            msg = protocol.request_decoder.decode(payload)
            match msg:
                case Ping(sent_at=sent_at):
                    send(identity, Pong(args.name, os.getpid(), incarnation, ready,
                                        bool(active), sent_at, 4096, 8192, "fake"))
                case GetCounters():
                    send(identity, CountersReply(args.name, {"served": served,
                                                             "incarnation": incarnation}))
                case Cancel(request_id=rid):
                    note(event="cancel", request_id=rid,
                         tokens=active.get(rid, (b"", 0))[1])
                    cancelled.add(rid)
                    if rid in active:
                        active.pop(rid)
                        send(identity, Final(rid, protocol.Cancelled(), args.name, served,
                                             incarnation))
                case Generate(request_id=rid):
                    note(event="generate", request_id=rid, stream=msg.stream)
                    mode = args.mode
                    if mode not in ("not_ready", "crash_before_first", "hang", "queued"):
                        send(identity, Started(rid))
                    if mode == "not_ready":
                        send(identity, Final(rid, Failed("not_ready"), args.name, served,
                                             incarnation))
                    elif mode == "reject413":
                        send(identity, Final(rid, Rejected(
                            413, "prompt_too_long", "prompt has 9000 tokens; cap 4096",
                            {"prompt_tokens": 9000, "cap": 4096, "seat": args.name,
                             "limit": "seat_cap"}), args.name, served, incarnation))
                    elif mode == "internal_error":
                        send(identity, Final(rid, Failed("internal_error", "boom"), args.name,
                                             served, incarnation))
                    elif mode == "crash_before_first":
                        os.kill(os.getpid(), signal.SIGKILL)
                    elif mode == "hang":
                        note(event="hanging")
                        while True:
                            time.sleep(3600)
                    elif mode in ("silent", "queued"):
                        muted.add(rid)
                    else:
                        active[rid] = (identity, 0, msg)
        now = time.monotonic()
        if active and now >= next_tick:
            next_tick = now + (0.05 if args.mode in ("slow", "stall", "crash_midstream") else 0.0)
            for rid, (identity, n, req) in list(active.items()):
                if args.mode == "stall" and n >= 2:
                    continue
                if args.mode == "crash_midstream" and n >= 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                n += 1
                send(identity, Chunk(rid, f"t{n} ", n, served + 1))
                active[rid] = (identity, n, req)
                if n >= args.tokens:
                    active.pop(rid)
                    finish(identity, rid, n)
    sock.close(linger=0)
    ctx.term()
    if args.endpoint.startswith("ipc://"):
        try:
            os.unlink(args.endpoint[6:])
        except FileNotFoundError:
            pass


if __name__ == "__main__":
    main()
