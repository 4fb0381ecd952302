"""A fake OpenAI-compatible upstream: a real aiohttp server on loopback.

It runs in a thread of the test process so tests can read what it saw.  Its
behaviour per request is taken from `script` (a list, one entry per request;
the last entry repeats): "ok", or a fault name handled in `_fault`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from aiohttp import web


class FakeUpstream:
    def __init__(self, script: list[str] | None = None, answer: str = "hosted says hi") -> None:
        self.script = script or ["ok"]
        self.answer = answer
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        async def down() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        index = len(self.requests)
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        action = self.script[min(index, len(self.script) - 1)]
        chat = request.path.endswith("/chat/completions")
        if action != "ok":
            return await self._fault(action, request)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in self.answer.split(" "):
            piece = word + " "
            choice = {"index": 0, "delta": {"content": piece}} if chat else \
                {"index": 0, "text": piece}
            await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        end = {"index": 0, "delta": {}, "finish_reason": "stop"} if chat else \
            {"index": 0, "text": "", "finish_reason": "stop"}
        await resp.write(b"data: " + json.dumps({"choices": [end]}).encode() + b"\n\n")
        usage = {"prompt_tokens": 7, "completion_tokens": len(self.answer.split(" ")),
                 "total_tokens": 7 + len(self.answer.split(" "))}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _fault(self, action: str, request: web.Request) -> web.StreamResponse:
        if action.startswith("status:"):
            status = int(action.split(":")[1])
            return web.json_response({"error": {"message": f"fake {status}", "type": "x",
                                                "code": f"fake_{status}"}}, status=status)
        raise ValueError(f"unknown fake action {action!r}")
