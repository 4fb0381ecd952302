"""A fault-injecting fake OpenAI-compatible upstream: a real aiohttp server on loopback.

It runs in a thread of the test process so tests can read what it saw.  Its
behaviour per request is taken from `script` (a list, one entry per request;
the last entry repeats).  Actions:

    ok                          a streamed answer: words, finish_reason, usage, [DONE]
    no_done                     the same without [DONE], then a clean close
    no_done_hold                finish_reason and usage, then the connection stays open
    status:N[:CODE][:retry_after=S]   an error body with HTTP status N (and Retry-After)
    status:N:echo_key           the error message repeats the Authorization header
    reset                       the connection is reset (RST) before any byte
    silent                      the request is read and never answered
    silent_close:S              the request is read, then S seconds of silence, then
                                the connection is closed (no status line, no byte)
    refuse_prefill              a 400 to a request ending with an assistant message (as
                                providers that take no assistant prefill answer), else ok
    slow_first:S                headers at once, the first token after S seconds
    cut:K                       K words, then the connection closes mid-stream
    stall:K                     K words, then nothing more (connection held open)
    malformed:K                 K words, then an event whose data is not JSON
    json                        an upstream that ignores stream: true (one JSON body)

A request that continues an answer (chat: a trailing assistant message;
completions: a prompt ending with a start of the answer) gets the rest of the
answer after that start, as one model asked to go on would: `answer` split at
its spaces is the list of words, and an answer cut after K words continues at
word K.  `requests`, `headers` and `actions` list, per request, the body, the
headers and the action taken.  Handlers that hang end when the server stops.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from typing import Any

from aiohttp import web


class FakeUpstream:
    def __init__(self, script: list[str] | None = None, answer: str = "hosted says hi",
                 model: str = "upstream-model") -> None:
        self.script = script or ["ok"]
        self.answer = answer
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self.arrivals: list[float] = []  # when each request came, to see a back-off
        self.headers: list[dict[str, str]] = []
        self.actions: list[str] = []
        self._cursor = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def words(self) -> list[str]:
        return self.answer.split(" ")

    def set_script(self, script: list[str]) -> None:
        """Play `script` from its first entry for the next requests."""
        self.script = script
        self._cursor = 0

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stopping = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        """Stop serving: the port refuses connections from now on."""
        if not self._thread.is_alive():
            return

        async def down() -> None:
            assert self._stopping is not None
            self._stopping.set()
            if self._runner is not None:
                await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _hold(self, seconds: float = 3600) -> None:
        """Wait, but not past the server's stop."""
        assert self._stopping is not None
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.arrivals.append(time.monotonic())
        self.headers.append(dict(request.headers))
        action = self.script[min(self._cursor, len(self.script) - 1)]
        self._cursor += 1
        self.actions.append(action)
        chat = request.path.endswith("/chat/completions")
        name, _, arg = action.partition(":")
        if name == "status":
            return self._status(arg, request)
        if name == "reset":
            sock = request.transport.get_extra_info("socket")  # type: ignore[union-attr]
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            request.transport.abort()  # type: ignore[union-attr]
            await self._hold(5)
            raise ConnectionResetError("reset by the fake")
        if name == "silent":
            await self._hold()
            raise ConnectionResetError("the fake was stopped")
        if name == "silent_close":
            await self._hold(float(arg))
            request.transport.close()  # type: ignore[union-attr]
            raise ConnectionResetError("closed by the fake")
        if name == "refuse_prefill":
            if chat and body["messages"][-1]["role"] == "assistant":
                return self._status("400:invalid_request_error", request,
                                    "the final message must have role user")
            name = "ok"
        if name == "json":
            return web.json_response(self._whole(chat))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if name == "slow_first":
            await self._hold(float(arg))
        words = self.words[self._begun(body, chat):]
        k = int(arg) if name in ("cut", "stall", "malformed") else len(words)
        for word in words[:k]:
            await resp.write(self._event(chat, word + " "))
        if name == "cut":
            request.transport.close()  # type: ignore[union-attr]
            return resp
        if name == "stall":
            await self._hold()
            return resp
        if name == "malformed":
            await resp.write(b'data: {"choices": [ {oops\n\n')
            await self._hold(2)
            return resp
        await resp.write(self._event(chat, "", finish="stop"))
        usage = {"prompt_tokens": 7, "completion_tokens": len(words),
                 "total_tokens": 7 + len(words)}
        await resp.write(self._sse({"id": "up-1", "model": self.model, "choices": [],
                                    "usage": usage}))
        if name == "no_done_hold":
            await self._hold()
            return resp
        if name != "no_done":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _begun(self, body: dict[str, Any], chat: bool) -> int:
        """How many words of the answer the request already holds (0 for a new one)."""
        if chat:
            last = body["messages"][-1]
            held = last["content"] if last["role"] == "assistant" else ""
        else:
            held = body.get("prompt") or ""
        words = self.words
        for k in range(len(words), 0, -1):
            start = "".join(w + " " for w in words[:k])
            if (held == start) if chat else held.endswith(start):
                return k
        return 0

    def _status(self, arg: str, request: web.Request, message: str = "") -> web.Response:
        parts = arg.split(":")
        status = int(parts[0])
        code, headers = f"fake_{status}", {}
        message = message or f"fake {status}"
        for part in parts[1:]:
            if part.startswith("retry_after="):
                headers["Retry-After"] = part.split("=", 1)[1]
            elif part == "echo_key":
                message = f"Incorrect API key provided: {request.headers.get('Authorization')}"
            elif part == "context_length_exceeded":
                code = part
                message = ("This model's maximum context length is 128 tokens. However, "
                           "your messages resulted in 4000 tokens.")
            elif part == "content_policy_violation":
                code = part
                message = "Your request was rejected as a result of our safety system."
            else:
                code = part
        return web.json_response(
            {"error": {"message": message, "type": "invalid_request_error" if status < 500
                       else "server_error", "param": None, "code": code}},
            status=status, headers=headers)

    def _event(self, chat: bool, piece: str, finish: str | None = None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {"content": piece} if piece else {}
        else:
            choice["text"] = piece
        return self._sse({"id": "up-1", "model": self.model, "choices": [choice]})

    def _whole(self, chat: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": self.answer + " "}
        else:
            choice["text"] = self.answer + " "
        return {"id": "up-1", "model": self.model, "choices": [choice],
                "usage": {"prompt_tokens": 7, "completion_tokens": len(self.words)}}

    @staticmethod
    def _sse(body: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\n"
