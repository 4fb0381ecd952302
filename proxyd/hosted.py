"""A hosted rung: any OpenAI-compatible upstream, off the box or on the LAN.

It yields the same frames as a local seat (`Chunk`s, then one `Final`), so the
ladder treats both alike, plus a `Retry` frame (shared/protocol.py) before each new try of the same
rung, so that every failed try is listed in `X-Sanctum-Attempts`.  The upstream
is always asked to stream, so that a silent or stalled upstream is noticed by
the first-token and stall timeouts, whatever the client asked for.

Timeouts, per request: `connect_timeout_s` for the TCP (and TLS) connect;
`first_token_timeout_s` from sending the request to the first text;
`stall_timeout_s` between two pieces of text; `total_timeout_s` for everything
on this rung, retries and their pauses included.

How an upstream's answer ends (the `Failed` reasons; proxyd/retry.py decides
which are tried again):

    connection_reset      reset or closed at once, before any byte          retried
    silent_close          closed before any byte after holding the request  next rung
                          silent (SILENT_CLOSE_S or half the first-token
                          budget): a silent upstream is never waited on twice
    upstream_429, upstream_500/502/503/504                                 retried
    connect_failed        refused, no route, DNS                            next rung
    connect_timeout, first_token_timeout, stall_timeout, deadline          next rung
    stream_cut            closed before its finish_reason                   next rung
    malformed_stream      an event that is not a valid JSON chunk, or       next rung
                          bytes that are not an HTTP/1.x response
    upstream_error        an error event inside the stream                  next rung
    (after text was sent, "next rung" means the next rung continues the answer)
    upstream_401/403/404  the rung's key, model name or URL is wrong        next rung
    other statuses        upstream_<status>                                 next rung

400, 413 and 422 are the request's own fault and come back as `Rejected`, with
the upstream's code and message: a content-policy refusal reaches the client
with its reason.  A context-length 400 is normalised to the code
`context_length_exceeded`, which the ladder passes to a later rung (one with a
larger cap may take it).  401, 403 and 404 are not the client's fault: the
client's own key is fine, so answering 401 would mislead it; they are real
failures of this rung, never retried, and they open its circuit.

A continued answer (`Generate.prefix`: another rung began it) is asked for as an
assistant prefill (chat: the text already sent is a trailing assistant message) or
as the prompt's tail (completions), with what is left of `max_tokens`.  An upstream
that refuses a trailing assistant message answers 400, which the ladder takes as
this rung declining to continue, not as the answer's failure.

What is forwarded (tools, tool_choice, tool messages, response_format, penalties,
seed, logprobs; top_k, min_p and repetition_penalty where the seat's
`upstream_fields` lists them) is proxyd/hosted_wire.py's; a request with a field
this rung cannot honour (`ladder.unsupported`: logit_bias, or an extra sampling
field its upstream does not take) is never sent: the ladder skips the rung, and
asked anyway the rung ends the attempt `failed:unsupported_field` without a byte
on the wire.  Tool calls are read from the stream's deltas and passed on whole in
a `Chunk.tool_calls` once each is complete (the upstream's finish_reason, e.g.
`tool_calls`, ends the answer); log-probabilities ride in `Chunk.logprobs` with
the text they belong to.

A half-open circuit's probe is one try (`frames(..., tries=1)`).

A stream that ends after its finish_reason is complete, with or without
`data: [DONE]`: once the finish reason and the usage have both arrived it is
finalized at once.  A stream cut before its finish reason is a failure, never a
short answer.  The API key is sent only in the Authorization header and is
scrubbed from every message an upstream sends back.

Naming (DESIGN.md rule 4): `response.model` and `X-Sanctum-Seat` name the seat
that answered, for a hosted rung as for a local one, so a client always reads
one naming scheme and can send its next request to a name the proxy knows.  The
name the upstream gave its own model (e.g. a dated version) travels in the
`Final` and is shown as `sanctum.upstream_model`; usage is the upstream's own.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from proxyd import hosted_wire as wire
from proxyd import sse
from proxyd.ladder import UNSUPPORTED, unsupported
from proxyd.retry import GiveUp, RetryIn, RetryPolicy, next_try, parse_retry_after
from proxyd.seat_state import SeatState
from proxyd.upstream_http import (
    ConnectFailed,
    ConnectTimeout,
    Disconnected,
    Malformed,
    Response,
    Upstream,
    UpstreamError,
)
from shared.config import SeatConfig
from shared.errors import CONTEXT_LENGTH
from shared.protocol import (
    Chunk,
    Failed,
    Final,
    Generate,
    Ok,
    Outcome,
    Pong,
    Rejected,
    Retry,
    RungFrame,
    TokenLogprob,
    ToolCall,
    TryEnd,
    Usage,
)

log = structlog.get_logger()

# Statuses that are the request's own fault: the client gets them back.
CLIENT_FAULT = frozenset({400, 413, 422})
# How upstreams spell a context-length refusal (OpenAI, vLLM, llama.cpp, others).
_CONTEXT_HINTS = ("context_length", "context length", "maximum context", "exceed_context",
                  "context window", "prompt is too long", "too many tokens")
# After the finish reason, how long to wait for usage or [DONE] before finalizing.
TAIL_S = 1.0
MESSAGE_MAX = 500
# The longest SSE line an upstream may send.
LINE_MAX = 1 << 20
# The most of a whole JSON answer (an upstream that ignored `stream`) and of an error
# body that is read; past it, the answer is malformed and the error's message cut.
WHOLE_MAX = 16 << 20
ERROR_MAX = 64 << 10
# A connection closed before any byte of the response is a transient reset when it
# comes at once (a stale pooled connection, a restarting server), and a silent
# upstream when it came after this long (or half the first-token budget, if less):
# such an upstream is not asked again.
SILENT_CLOSE_S = 2.0


@dataclass(frozen=True)
class Reading:
    """What to read from the upstream's answer besides text."""

    chat: bool
    tools: bool  # the request gave tools: read tool-call deltas
    logprobs: bool  # it asked for log-probabilities

    @property
    def extras(self) -> bool:
        return self.tools or self.logprobs


class HostedClient:
    def __init__(self, seat: SeatConfig, rand: Callable[[], float] = random.random) -> None:
        assert seat.base_url is not None
        self.seat = seat
        self.name = seat.name
        self.base_url = seat.base_url.rstrip("/")
        self.served = 0
        self.policy = RetryPolicy(seat.max_attempts, seat.backoff_initial_s,
                                  seat.backoff_max_s, seat.retry_after_max_s)
        # A key pasted with its line's end (a .env file written on Windows) still works.
        self._key = os.environ.get(seat.api_key_env, "").strip() if seat.api_key_env else ""
        self._rand = rand
        self._upstream = Upstream(self.base_url, self._headers(), seat.connect_timeout_s)

    # As a rung (`proxyd.rung.Rung`): off the box, no seat of ours behind it.
    local = False
    pong: Pong | None = None

    @property
    def ready(self) -> bool:
        return True

    @property
    def state(self) -> SeatState | None:
        return None  # its circuit breaker says whether it takes requests

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        return headers

    def scrub(self, text: str) -> str:
        """An upstream's words, safe to log and to show: the key never leaves this object."""
        if self._key and len(self._key) >= 4:
            text = text.replace(self._key, "[redacted]")
        return text[:MESSAGE_MAX]

    async def close(self) -> None:
        await self._upstream.close()

    # -- one request: tries until an answer, a give-up, or the deadline ---------

    async def frames(self, gen: Generate, first_token_s: float, stall_s: float,
                     gone: Callable[[], bool] = lambda: False,
                     tries: int | None = None) -> AsyncGenerator[RungFrame, None]:
        """Tries until an answer, a give-up or the deadline; a client that went away
        (`gone()`) is never tried for again: the attempt ends `client_disconnected`.
        `tries` caps the tries below the rung's own `max_attempts` (a probe: 1)."""
        rid = gen.request_id
        field = unsupported(gen, self.seat)
        if field is not None:  # never answered without it (the ladder skips us first)
            yield Final(rid, Failed(UNSUPPORTED, f"{field}: seat {self.name}'s upstream "
                                    f"cannot honour {field}"), self.name, self.served, 0)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seat.total_timeout_s
        path, body = wire.request_body(gen, self.seat)
        payload = msgspec.json.encode(body)
        read = Reading(gen.messages is not None, gen.tools_json is not None,
                       gen.params.logprobs is not None)
        policy = self.policy
        if tries is not None and tries < policy.max_attempts:
            policy = RetryPolicy(tries, policy.backoff_initial_s, policy.backoff_max_s,
                                 policy.retry_after_max_s)
        attempt = 0
        while True:
            if attempt and gone():  # left during the back-off: no try for nobody
                yield Final(rid, Failed("client_disconnected", "the client went away"),
                            self.name, self.served, 0)
                return
            attempt += 1
            end: TryEnd | None = None
            sent = 0
            async with aclosing(self._try(rid, path, payload, read, first_token_s, stall_s,
                                          deadline)) as one_try:
                async for item in one_try:
                    if isinstance(item, TryEnd):
                        end = item
                    else:
                        sent += 1
                        yield item
            assert end is not None
            outcome = end.outcome
            if isinstance(outcome, Failed) and sent == 0:
                decision = next_try(outcome.reason, attempt, end.retry_after_s,
                                    deadline - loop.time(), policy, self._rand())
                log.info("hosted_try_failed", seat=self.name, request_id=rid, attempt=attempt,
                         reason=outcome.reason, message=outcome.message,
                         retry_after_s=end.retry_after_s,
                         next=(f"retry_in:{decision.delay_s:.3f}"
                               if isinstance(decision, RetryIn) else f"give_up:{decision.why}"))
                if isinstance(decision, RetryIn):
                    yield Retry(rid, outcome, decision.delay_s)
                    await asyncio.sleep(decision.delay_s)
                    continue
                assert isinstance(decision, GiveUp)
                if attempt > 1 or decision.why != "not_transient":
                    outcome = Failed(outcome.reason, f"{outcome.message} "
                                     f"(try {attempt}; {decision.why})".strip())
            if isinstance(outcome, Ok):
                self.served += 1
            yield Final(rid, outcome, self.name, self.served, 0,
                        finish_reason=end.finish_reason, usage=end.usage, model=end.model,
                        fingerprint=end.fingerprint)
            return

    # -- one try ----------------------------------------------------------------

    async def _try(self, rid: str, path: str, payload: bytes, read: Reading,
                   first_token_s: float, stall_s: float,
                   deadline: float) -> AsyncGenerator[Chunk | TryEnd, None]:
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        first_by = min(sent_at + first_token_s, deadline)

        def late(reason: str, until: float) -> str:
            return "deadline" if until >= deadline else reason

        try:
            resp = await self._upstream.post(path, payload, first_by)
        except ConnectTimeout:
            yield TryEnd(Failed("connect_timeout",
                                 f"no connection within {self.seat.connect_timeout_s:g}s"))
            return
        except TimeoutError:
            yield TryEnd(Failed(late("first_token_timeout", first_by),
                                 f"no response headers within {first_token_s:g}s"))
            return
        except ConnectFailed as exc:
            yield TryEnd(Failed("connect_failed", self.scrub(str(exc))))
            return
        except Disconnected as exc:
            waited = loop.time() - sent_at
            said = self.scrub(str(exc))
            if waited >= min(SILENT_CLOSE_S, first_token_s / 2):
                yield TryEnd(Failed("silent_close",
                                    f"closed without a byte after {waited:.3g}s ({said})"))
            else:
                yield TryEnd(Failed("connection_reset", said))
            return
        except Malformed as exc:
            yield TryEnd(Failed("malformed_stream",
                                 self.scrub(f"not an HTTP response: {exc}")))
            return
        clean = False
        try:
            if resp.status != 200:
                yield await self._error_end(resp, first_by)
                clean = True
                return
            if resp.content_type == "application/json":
                async for item in self._whole(rid, resp, read, first_by):
                    yield item
                clean = True
                return
            async for item in self._stream(rid, resp, read, first_by, stall_s, deadline):
                if isinstance(item, TryEnd):
                    # An answer read to its finish: what is left of the stream ([DONE],
                    # the last chunk) may still come, and the connection be reused.
                    clean = isinstance(item.outcome, Ok)
                yield item
        finally:
            # A stream left half-read, or one that failed, never goes back to the pool.
            if clean:
                resp.release()
            else:
                resp.close()

    async def _stream(self, rid: str, resp: Response, read: Reading,
                      first_by: float, stall_s: float,
                      deadline: float) -> AsyncGenerator[Chunk | TryEnd, None]:
        """The upstream's events, read as they arrive: whatever one read brings (often
        many events) becomes one Chunk of their texts, as a proxy that does not buffer
        passes on what it read, so a burst costs one write downstream, not one each.
        The tool calls completed and the log-probabilities of those events ride in it."""
        loop = asyncio.get_running_loop()
        said = _Said(wire.ToolCallAssembler(rid))
        decoder = sse.Decoder()
        partial = b""  # an unfinished line, carried to the next read
        while not said.ended:
            now = loop.time()
            if said.finish is not None:
                until, reason = min(now + min(TAIL_S, stall_s), deadline), ""
            elif said.produced == 0:
                until, reason = first_by, "first_token_timeout"
            else:
                until, reason = min(now + stall_s, deadline), "stall_timeout"
            try:
                data = await resp.read_some(until)
            except TimeoutError:
                if said.finish is not None:
                    break  # complete; the upstream just never closed
                if until >= deadline:
                    reason = "deadline"
                waited = until - now
                yield TryEnd(Failed(reason, f"upstream silent for {waited:.3g}s"))
                return
            except UpstreamError as exc:
                if said.finish is not None:
                    break
                reason = "malformed_stream" if isinstance(exc, Malformed) else "stream_cut"
                yield TryEnd(Failed(reason, self.scrub(str(exc))))
                return
            at_end = not data
            *lines, partial = (partial + data).split(b"\n")
            if len(partial) > LINE_MAX:
                yield TryEnd(Failed("malformed_stream", f"a line over {LINE_MAX} bytes"))
                return
            events = _events(decoder, lines, partial if at_end else None)
            said.ended = said.ended or at_end
            texts, done, logprobs, failure = self._take(events, said, read)
            if texts or done or logprobs:  # what arrived before a fault is the client's
                yield Chunk(rid, "".join(texts), said.produced, self.served + 1,
                            tool_calls=tuple(done), logprobs=tuple(logprobs))
            if failure is not None:
                yield failure
                return
        if said.finish is None:
            yield TryEnd(Failed("stream_cut", "the stream ended before its finish_reason"))
            return
        usage = said.usage
        if usage is None or usage.completion_tokens == 0:
            usage = Usage(usage.prompt_tokens if usage else 0, said.produced,
                          usage.cached_tokens if usage else 0)
        yield TryEnd(Ok(), finish_reason=said.finish, usage=usage, model=said.model,
                     fingerprint=said.fingerprint)

    def _take(self, events: list[sse.Event], said: _Said, read: Reading
              ) -> tuple[list[str], list[ToolCall], list[TokenLogprob], TryEnd | None]:
        """One read's events into what the stream has said: their texts, the tool calls
        they completed, their log-probabilities, and the failure one of them was (the
        events after it are not read)."""
        chat = read.chat
        texts: list[str] = []
        done: list[ToolCall] = []
        logprobs: list[TokenLogprob] = []
        for event in events:
            try:
                got = sse.piece(event, chat)
                more = (wire.extras(event.data, chat)
                        if read.extras and not got.done and got.error is None
                        else wire.NONE)
                if more.tool_deltas:
                    said.produced += 1
                    done += said.calls.feed(more.tool_deltas)
                if got.finish_reason or got.done:
                    done += said.calls.finish()  # the choice ended: every call is whole
            except sse.Malformed as exc:
                return texts, done, logprobs, TryEnd(Failed("malformed_stream",
                                                            self.scrub(str(exc))))
            if got.error is not None:
                message = str(got.error.get("message") or got.error)
                return texts, done, logprobs, TryEnd(Failed("upstream_error",
                                                            self.scrub(message)))
            said.model = got.model or said.model
            said.fingerprint = got.fingerprint or said.fingerprint
            said.usage = got.usage or said.usage
            logprobs += more.logprobs
            if got.text:
                said.produced += 1
                texts.append(got.text)
            said.finish = got.finish_reason or said.finish
            if got.done:
                # An explicit end; an upstream that never sends a finish reason
                # still said it is done.
                said.finish = said.finish or "stop"
                said.ended = True
                break
            if said.finish is not None and said.usage is not None:
                said.ended = True  # all that [DONE] could add; do not wait for it
                break
        return texts, done, logprobs, None

    async def _whole(self, rid: str, resp: Response, read: Reading,
                     first_by: float) -> AsyncIterator[Chunk | TryEnd]:
        """An upstream that ignored `stream: true` and sent one JSON body: its text,
        its message's tool calls and its log-probabilities, in one Chunk."""
        chat = read.chat
        try:
            text = (await resp.read_all(WHOLE_MAX, first_by)).decode("utf-8", "replace")
        except TimeoutError:
            yield TryEnd(Failed("first_token_timeout", "the JSON body did not arrive in time"))
            return
        except UpstreamError as exc:
            reason = "malformed_stream" if isinstance(exc, Malformed) else "stream_cut"
            yield TryEnd(Failed(reason, self.scrub(str(exc))))
            return
        try:
            got = sse.piece(sse.Event(text), chat)
            more = wire.whole_extras(text, chat) if read.extras else wire.NONE
            assembler = wire.ToolCallAssembler(rid)
            calls = assembler.feed(more.tool_deltas) + assembler.finish()
        except sse.Malformed as exc:
            yield TryEnd(Failed("malformed_stream", self.scrub(str(exc))))
            return
        if got.error is not None or got.finish_reason is None:
            yield TryEnd(Failed("malformed_stream", "a JSON body without a finished choice"))
            return
        if got.text or calls or more.logprobs:
            yield Chunk(rid, got.text, 1, self.served + 1, tool_calls=tuple(calls),
                        logprobs=more.logprobs)
        usage = got.usage or Usage(0, 1 if got.text else 0)
        yield TryEnd(Ok(), finish_reason=got.finish_reason, usage=usage, model=got.model or "",
                      fingerprint=got.fingerprint or "")

    async def _error_end(self, resp: Response, first_by: float) -> TryEnd:
        status = resp.status
        retry_after = parse_retry_after(resp.headers, time.time())
        try:
            until = max(first_by, asyncio.get_running_loop().time() + 1)
            raw = (await resp.read_all(ERROR_MAX, until)).decode("utf-8", "replace")
        except (TimeoutError, UpstreamError):
            raw = ""
        code, message = _error_fields(raw)
        message = self.scrub(message or resp.reason or f"HTTP {status}")
        return TryEnd(classify(status, code, message, self.name), retry_after)


def _error_fields(raw: str) -> tuple[str, str]:
    """(code, message) from the error bodies OpenAI-compatible servers send."""
    try:
        body = msgspec.json.decode(raw) if raw else None
    except msgspec.DecodeError:
        return "", raw.strip()
    err: Any = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, str):
        return "", err
    if not isinstance(err, dict):
        return "", raw.strip()
    code = err.get("code") or err.get("type") or ""
    message = err.get("message") or err.get("detail") or ""
    return str(code), str(message)


def classify(status: int, code: str, message: str, seat: str) -> Outcome:
    """An upstream's non-200 answer, as an outcome of this rung."""
    if status not in CLIENT_FAULT:
        return Failed(f"upstream_{status}", message)
    text = f"{code} {message}".lower()
    if status in (400, 413) and any(h in text for h in _CONTEXT_HINTS):
        code = CONTEXT_LENGTH
    return Rejected(status, code or f"upstream_{status}", message,
                    {"seat": seat, "upstream_status": status})


@dataclass
class _Said:
    """What a hosted stream has said so far."""

    calls: wire.ToolCallAssembler
    produced: int = 0  # texts and call deltas received
    finish: str | None = None
    usage: Usage | None = None
    model: str = ""
    fingerprint: str = ""
    ended: bool = False


def _events(decoder: sse.Decoder, lines: list[bytes], last: bytes | None
            ) -> list[sse.Event]:
    """The SSE events of one read's whole lines; `last` (the stream ended): its
    unfinished line, then whatever the decoder still held."""
    events = [e for e in (decoder.line(line.decode("utf-8", "replace")) for line in lines)
              if e is not None]
    if last is not None:
        if last:
            event = decoder.line(last.decode("utf-8", "replace"))
            if event is not None:
                events.append(event)
        event = decoder.end()
        if event is not None:
            events.append(event)
    return events
