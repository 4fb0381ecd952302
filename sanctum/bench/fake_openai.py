"""A fake OpenAI upstream that answers as fast as it can: the floor of one HTTP hop.

    python -m sanctum.bench.fake_openai --port N

A bare asyncio protocol (no framework) for POST /v1/chat/completions and
/v1/completions on keep-alive connections.  A request with `"stream": true` gets
`max_tokens` one-word chunks, a finish chunk with usage and `data: [DONE]` in one
chunked response; otherwise one JSON body.  The chunks are built once per count,
so what a benchmark measures in front of it is the hop, not this server.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import cast

import msgspec

from shared.loops import new_event_loop


class _Body(msgspec.Struct):
    stream: bool = False
    max_tokens: int = 1
    messages: list[object] | None = None


_decode = msgspec.json.Decoder(_Body).decode
_encode = msgspec.json.encode
WORD = "x"
_cache: dict[tuple[bool, bool, int], bytes] = {}


def _chunk(chat: bool, text: str | None, finish: str | None, usage: bool = False) -> bytes:
    if chat:
        delta = {} if text is None else {"content": text}
        choice: dict[str, object] = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
        obj = "text_completion"
    body: dict[str, object] = {"id": "fake", "object": obj, "created": 0,
                               "model": "fake-model", "choices": [choice]}
    if usage:
        body["usage"] = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    data = b"data: " + _encode(body) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def response(chat: bool, stream: bool, n: int) -> bytes:
    """The whole HTTP response for a request of `n` tokens (memoised)."""
    key = (chat, stream, n)
    got = _cache.get(key)
    if got is not None:
        return got
    if stream:
        body = b"".join(_chunk(chat, WORD, None) for _ in range(n))
        body += _chunk(chat, None, "length", usage=True)
        done = b"data: [DONE]\n\n"
        body += b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done)
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        got = head + body
    else:
        choice: dict[str, object] = (
            {"index": 0, "message": {"role": "assistant", "content": WORD * n},
             "finish_reason": "length"} if chat
            else {"index": 0, "text": WORD * n, "finish_reason": "length"})
        payload = _encode({"id": "fake", "object": "chat.completion" if chat
                           else "text_completion", "created": 0, "model": "fake-model",
                           "choices": [choice],
                           "usage": {"prompt_tokens": 5, "completion_tokens": n,
                                     "total_tokens": 5 + n}})
        got = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
               % len(payload)) + payload
    _cache[key] = got
    return got


class Upstream(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            req = _decode(body) if body else _Body()
            chat = "chat/completions" in head.split("\r\n", 1)[0]
            assert self.transport is not None
            self.transport.write(response(chat, req.stream, max(1, req.max_tokens)))


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, "127.0.0.1", port, reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("listening", flush=True)
    await stop.wait()
    server.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fake_openai")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    loop = new_event_loop()
    try:
        loop.run_until_complete(serve(args.port))
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
