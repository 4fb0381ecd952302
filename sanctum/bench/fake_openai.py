"""A fake OpenAI upstream that answers as fast as it can: the floor of one HTTP hop.

    python -m sanctum.bench.fake_openai --port N

A bare asyncio protocol (no framework) for POST /v1/chat/completions and
/v1/completions on keep-alive connections.  A request with `"stream": true` gets
`max_tokens` one-word chunks, a finish chunk with usage and `data: [DONE]` in one
chunked response; otherwise one JSON body.  The chunks are built once per count,
so what a benchmark measures in front of it is the hop, not this server.

Tests give it a list (`Upstream(record=bodies)`, `listen(bodies)`): it then keeps
every request's JSON body there, in order, and answers what the body asks for
(built per request, not memoised), as OpenAI does:

    tools given, tool_choice not "none"   tool calls, finish_reason "tool_calls": one
                                          call to each tool (to the named one for a
                                          named tool_choice; only the first when
                                          parallel_tool_calls is false), streamed as
                                          OpenAI streams them (a first delta with
                                          index, id and name, then the arguments in
                                          pieces of ARG_PIECE characters), or whole in
                                          the message of a sync answer
    logprobs (chat: true, completions: n) every word token with its log-probability
                                          and its top alternatives (top_logprobs / n)

`sync=True` answers one JSON body even to `"stream": true` (an upstream that
ignores stream), for the readers of a whole answer.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any, cast

import msgspec

from shared.loops import new_event_loop


class _Body(msgspec.Struct):
    stream: bool = False
    max_tokens: int = 1
    messages: list[object] | None = None


_decode = msgspec.json.Decoder(_Body).decode
_decode_any = msgspec.json.Decoder().decode
_encode = msgspec.json.encode
WORD = "x"
ARG_PIECE = 3  # characters of a tool call's arguments per streamed delta
# A word's log-probability and the alternatives offered beside it, best first.
ALTERNATIVES = ((WORD, -0.25), ("y", -1.5), ("z", -3.0))
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


def arguments_for(name: str, i: int) -> str:
    """The arguments the fake calls tool `name` with (call `i` of the answer): JSON with
    escapes and non-ASCII text, so that pieces cut inside them must be joined exactly."""
    return _encode({"tool": name, "n": i, "text": 'h\u00e9llo, "world"\n'}).decode()


def _tool_calls(body: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of the calls the fake answers `body` with; [] for none."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not isinstance(tools, list) or not tools or choice == "none":
        return []
    names = [str(t["function"]["name"]) for t in tools
             if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if isinstance(choice, dict):
        names = [str(choice["function"]["name"])]
    if body.get("parallel_tool_calls") is False:
        names = names[:1]
    return [(f"call_fake_{i}", name, arguments_for(name, i)) for i, name in enumerate(names)]


def _logprobs(chat: bool, top: int, offset: int) -> dict[str, Any]:
    """One word token's log-probabilities, as chat or completions spell them."""
    alts = ALTERNATIVES[:top]
    if chat:
        return {"content": [{"token": WORD, "logprob": ALTERNATIVES[0][1],
                             "bytes": list(WORD.encode()),
                             "top_logprobs": [{"token": t, "logprob": lp,
                                               "bytes": list(t.encode())} for t, lp in alts]}]}
    return {"tokens": [WORD], "token_logprobs": [ALTERNATIVES[0][1]],
            "top_logprobs": [dict(alts)], "text_offset": [offset]}


def _top(chat: bool, body: dict[str, Any]) -> int | None:
    """How many alternatives the request asked for; None: no logprobs."""
    if chat:
        return int(body.get("top_logprobs") or 0) if body.get("logprobs") is True else None
    n = body.get("logprobs")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _sse(body: dict[str, object]) -> bytes:
    data = b"data: " + _encode(body) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def answer(chat: bool, body: dict[str, Any], sync: bool = False) -> bytes:
    """The whole HTTP response to a recorded request `body` (tool calls, logprobs)."""
    n = max(1, int(body.get("max_tokens") or 1))
    calls = _tool_calls(body) if chat else []
    top = _top(chat, body)
    words = 0 if calls else n
    finish = "tool_calls" if calls else "length"
    usage = {"prompt_tokens": 5, "completion_tokens": words + len(calls),
             "total_tokens": 5 + words + len(calls)}
    head = {"id": "fake", "created": 0, "model": "fake-model"}
    if sync or not body.get("stream"):
        choice: dict[str, object] = {"index": 0, "finish_reason": finish}
        if chat:
            message: dict[str, object] = {"role": "assistant",
                                          "content": WORD * words if words else None}
            if calls:
                message["tool_calls"] = [
                    {"id": cid, "type": "function", "function": {"name": name,
                                                                 "arguments": args}}
                    for cid, name, args in calls]
            choice["message"] = message
        else:
            choice["text"] = WORD * words
        if top is not None and words:
            per = [_logprobs(chat, top, i) for i in range(words)]
            choice["logprobs"] = (
                {"content": [t for p in per for t in p["content"]]}
                if chat else {k: [v for p in per for v in p[k]]
                              for k in ("tokens", "token_logprobs", "top_logprobs",
                                        "text_offset")})
        payload = _encode({**head, "object": "chat.completion" if chat else "text_completion",
                           "choices": [choice], "usage": usage})
        return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(payload)) + payload
    obj = "chat.completion.chunk" if chat else "text_completion"
    events: list[dict[str, object]] = []
    for i in range(words):
        c: dict[str, object] = ({"index": 0, "delta": {"content": WORD}, "finish_reason": None}
                                if chat else {"index": 0, "text": WORD, "finish_reason": None})
        if top is not None:
            c["logprobs"] = _logprobs(chat, top, i)
        events.append({"choices": [c]})
    for i, (cid, name, args) in enumerate(calls):
        first = {"index": i, "id": cid, "type": "function",
                 "function": {"name": name, "arguments": ""}}
        events.append({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None,
                                                          "tool_calls": [first]},
                                    "finish_reason": None}]})
        for k in range(0, len(args), ARG_PIECE):
            piece = {"index": i, "function": {"arguments": args[k:k + ARG_PIECE]}}
            events.append({"choices": [{"index": 0, "delta": {"tool_calls": [piece]},
                                        "finish_reason": None}]})
    end: dict[str, object] = ({"index": 0, "delta": {}, "finish_reason": finish} if chat
                              else {"index": 0, "text": "", "finish_reason": finish})
    events.append({"choices": [end]})
    events.append({"choices": [], "usage": usage})
    out = b"".join(_sse({**head, "object": obj, **e}) for e in events)
    done = b"data: [DONE]\n\n"
    out += b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done)
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n") + out


class Upstream(asyncio.Protocol):
    def __init__(self, record: list[dict[str, Any]] | None = None,
                 sync: bool = False) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.record = record  # set: keep every body and answer what it asks (tests)
        self.sync = sync

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
            chat = "chat/completions" in head.split("\r\n", 1)[0]
            assert self.transport is not None
            if self.record is not None:
                got = _decode_any(body) if body else {}
                self.record.append(got)
                self.transport.write(answer(chat, got, self.sync))
                continue
            req = _decode(body) if body else _Body()
            self.transport.write(response(chat, req.stream, max(1, req.max_tokens)))


async def listen(record: list[dict[str, Any]], sync: bool = False) -> asyncio.Server:
    """A recording fake on a free loopback port of the running loop (tests); its URL is
    `base_url(server)`."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: Upstream(record, sync), "127.0.0.1", 0)


def base_url(server: asyncio.Server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


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
