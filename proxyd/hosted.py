"""A hosted rung: any OpenAI-compatible upstream, off the box or on the LAN.

It yields the same frames as a local seat (`Chunk`s, then one `Final`), so the
ladder treats both alike.  The upstream is always asked to stream, so that a
silent or stalled upstream is noticed by the same first-token and stall timeouts.
A hosted rung has no counter of its own: the proxy counts what it served.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from shared.config import SeatConfig
from shared.protocol import Chunk, Failed, Final, Generate, Ok, Outcome, Rejected, Usage

Frame = Chunk | Final

DETERMINISTIC = {400, 401, 403, 404, 413, 422}
CONNECT_TIMEOUT_S = 10.0


class HostedClient:
    def __init__(self, seat: SeatConfig) -> None:
        assert seat.base_url is not None
        self.seat = seat
        self.name = seat.name
        self.base_url = seat.base_url.rstrip("/")
        self.served = 0
        self._session: aiohttp.ClientSession | None = None

    @property
    def ready(self) -> bool:
        return True

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.seat.api_key_env or "", "")
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _body(self, gen: Generate) -> tuple[str, dict[str, Any]]:
        p = gen.params
        body: dict[str, Any] = {
            "model": self.seat.upstream_model or self.seat.name,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": p.temperature,
            "top_p": p.top_p,
            "max_tokens": p.max_tokens,
        }
        if p.stop:
            body["stop"] = list(p.stop)
        if p.seed is not None:
            body["seed"] = p.seed
        if gen.messages is not None:
            body["messages"] = [msgspec.structs.asdict(m) for m in gen.messages]
            for m in body["messages"]:
                if m.get("name") is None:
                    m.pop("name", None)
            return "/chat/completions", body
        body["prompt"] = gen.prompt or ""
        return "/completions", body

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _final(self, rid: str, outcome: Outcome, **kw: Any) -> Final:
        return Final(rid, outcome, self.name, self.served, 0, **kw)

    async def frames(self, gen: Generate, first_token_s: float,
                     stall_s: float) -> AsyncIterator[Frame]:
        rid = gen.request_id
        path, body = self._body(gen)
        session = await self.session()
        try:
            async with asyncio.timeout(first_token_s):
                resp = await session.post(self.base_url + path, json=body,
                                          headers=self._headers())
        except TimeoutError:
            yield self._final(rid, Failed("first_token_timeout", "no response headers"))
            return
        except aiohttp.ClientError as exc:
            yield self._final(rid, Failed("connection_failed", type(exc).__name__))
            return
        async with resp:
            if resp.status != 200:
                yield self._final(rid, await _error_outcome(resp))
                return
            async for frame in self._stream(rid, gen, resp, first_token_s, stall_s):
                yield frame

    async def _stream(self, rid: str, gen: Generate, resp: aiohttp.ClientResponse,
                      first_token_s: float, stall_s: float) -> AsyncIterator[Frame]:
        chat = gen.messages is not None
        finish: str | None = None
        usage = Usage()
        produced = 0
        timeout, reason = first_token_s, "first_token_timeout"
        while True:
            try:
                async with asyncio.timeout(timeout):
                    line = await resp.content.readline()
            except TimeoutError:
                yield self._final(rid, Failed(reason, f"upstream silent for {timeout:g}s"))
                return
            except aiohttp.ClientError as exc:
                yield self._final(rid, Failed("stream_cut", type(exc).__name__))
                return
            if not line:
                break  # the upstream closed the stream
            text = line.decode("utf-8", "replace").strip()
            if not text.startswith("data:"):
                continue
            data = text[5:].strip()
            if data == "[DONE]":
                break
            try:
                event = json.loads(data)
                if "error" in event:
                    err = event["error"] or {}
                    yield self._final(rid, Failed("upstream_error", str(err.get("message", ""))))
                    return
                if event.get("usage"):
                    u = event["usage"]
                    usage = Usage(int(u.get("prompt_tokens", 0)),
                                  int(u.get("completion_tokens", 0)))
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat \
                        else choice.get("text")
                    if piece:
                        produced += 1
                        yield Chunk(rid, piece, produced, self.served + 1)
                        timeout, reason = stall_s, "stall_timeout"
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
            except (ValueError, TypeError, AttributeError) as exc:
                yield self._final(rid, Failed("malformed_stream", str(exc)[:200]))
                return
        if finish is None:
            # Closed before a finish_reason: never present a cut answer as complete.
            yield self._final(rid, Failed("stream_cut", "stream ended without finish_reason"))
            return
        if usage.completion_tokens == 0:
            usage = Usage(usage.prompt_tokens, produced)
        self.served += 1
        yield self._final(rid, Ok(), finish_reason=finish, usage=usage)


async def _error_outcome(resp: aiohttp.ClientResponse) -> Outcome:
    try:
        body = await resp.json(content_type=None)
        err = body.get("error", {}) if isinstance(body, dict) else {}
    except (ValueError, aiohttp.ClientError):
        err = {}
    message = str(err.get("message") or resp.reason or "")
    code = str(err.get("code") or err.get("type") or f"upstream_{resp.status}")
    if resp.status in DETERMINISTIC:
        return Rejected(resp.status, code, message)
    return Failed(f"upstream_{resp.status}", message)
