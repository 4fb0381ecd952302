"""The aiohttp application: OpenAI endpoints, the ladder loop, counters.

Response headers are sent only at the commit point (the answering seat's first
text), so `X-Sanctum-Seat` and `X-Sanctum-Attempts` are true when they leave.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import uuid
from contextlib import aclosing
from typing import Any

import structlog
import zmq.asyncio
from aiohttp import web

from proxyd import breaker, responses
from proxyd.admission import Admission, Verdict
from proxyd.breaker import Breaker, BreakerPolicy
from proxyd.counters import ProxyCounters, render_metrics
from proxyd.hosted import HostedClient
from proxyd.ladder import (
    Phase,
    Skipped,
    Step,
    attempts_header,
    context_refusal,
    decide,
    fallback_reason,
    offbox_allowed,
    outcome_label,
    plan,
)
from proxyd.openai_api import overrides, parse_chat, parse_completion, tools_json
from proxyd.responses import Answer, Kind
from proxyd.seat_client import SeatClient
from shared.config import Config, RouteConfig, control_endpoint, worker_endpoint
from shared.errors import (
    AllRungsFailed,
    NoPrivateSeat,
    NotFound,
    Overloaded,
    PromptTooLong,
    SanctumError,
    Unauthorized,
    client_error,
)
from shared.protocol import (
    Chunk,
    Failed,
    Final,
    Generate,
    GetCounters,
    Ok,
    Outcome,
    Rejected,
    Retry,
    control_reply_decoder,
    encode,
)
from shared.protocol import SeatCounters as SeatCountersReply

log = structlog.get_logger()

REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# Failures that say nothing about the seat's health: its circuit neither opens nor closes.
# A seat whose queue is full, or that could not start a request in queue_timeout_s,
# is busy: the request goes on down the ladder, and the seat's circuit is untouched.
BUSY = ("queue_full", "queue_timeout")
NOT_THE_SEATS_FAULT = ("client_disconnected", *BUSY)


class Proxy:
    """Everything the handlers share, built once from the config."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.seats = {s.name: s for s in config.seat}
        self.routes = {r.model: r for r in config.route}
        self.counters = ProxyCounters()
        self.admission = Admission(config)
        self.clients: dict[str, SeatClient | HostedClient] = {}
        self.breakers: dict[str, Breaker] = {s.name: Breaker() for s in config.seat}
        self.breaker_policy = BreakerPolicy(config.proxy.breaker_threshold,
                                            config.proxy.breaker_cooldown_s)
        self.ctx: zmq.asyncio.Context | None = None
        keys_env = config.proxy.api_keys_env
        raw = os.environ.get(keys_env, "") if keys_env else ""
        self.api_keys = {k.strip() for k in raw.split(",") if k.strip()}

    async def start(self) -> None:
        await self.admission.start()
        self.ctx = zmq.asyncio.Context()
        p = self.config.proxy
        for seat in self.config.local_seats:
            client = SeatClient(seat.name, worker_endpoint(self.config, seat.name), self.ctx,
                                p.heartbeat_s, p.liveness, seat.queue_timeout_s)
            client.start()
            self.clients[seat.name] = client
        for seat in config_hosted(self.config):
            self.clients[seat.name] = HostedClient(seat)

    def admit(self, name: str) -> tuple[bool, bool]:
        """(may this attempt go to the rung, is it the half-open rung's one probe)."""
        before = self.breakers[name]
        self.breakers[name], ok = breaker.admit(before, time.monotonic(), self.breaker_policy)
        return ok, ok and breaker.took_probe(before, self.breakers[name])

    def settle(self, name: str, outcome: Outcome, probe: bool) -> None:
        """Feed an attempt's end to its rung's breaker: only real failures count.  An
        attempt that ends without a verdict frees the probe slot only if it held it."""
        if isinstance(outcome, Failed) and outcome.reason in NOT_THE_SEATS_FAULT:
            if probe:
                self.breakers[name] = breaker.release(self.breakers[name])
            return
        real = isinstance(outcome, Failed)
        self.breakers[name] = breaker.record(self.breakers[name], real, time.monotonic(),
                                             self.breaker_policy)

    async def stop(self) -> None:
        await self.admission.stop()
        await asyncio.gather(*(c.close() for c in self.clients.values()))
        if self.ctx is not None:
            self.ctx.term()

    async def supervisor_totals(self) -> dict[str, dict[str, Any]]:
        """Restart totals that seatd owns (restarts, memory_restarts); {} if it is away."""
        assert self.ctx is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(control_endpoint(self.config))
        try:
            await sock.send_multipart([b"", encode(GetCounters())])
            frames = await asyncio.wait_for(sock.recv_multipart(), 1.0)
            reply = control_reply_decoder.decode(frames[-1])
        except (TimeoutError, zmq.ZMQError, ValueError):
            return {}
        finally:
            sock.close(linger=0)
        if not isinstance(reply, SeatCountersReply):
            return {}
        return {name: {k: v for k, v in c.items() if k in ("restarts", "memory_restarts")}
                for name, c in reply.seats.items()}

    async def seat_counters(self) -> dict[str, dict[str, Any] | None]:
        local = {n: c for n, c in self.clients.items() if isinstance(c, SeatClient)}
        names = list(local)
        got = await asyncio.gather(*(local[n].counters() for n in names))
        return dict(zip(names, got, strict=True))


def config_hosted(config: Config) -> list[Any]:
    return [s for s in config.seat if s.kind == "openai"]


PROXY = web.AppKey("proxy", Proxy)


def request_id(request: web.Request) -> str:
    given = request.headers.get("X-Request-Id", "")
    return given if REQUEST_ID.match(given) else uuid.uuid4().hex


# -- middleware -----------------------------------------------------------


def error_response(exc: SanctumError, rid: str | None = None) -> web.Response:
    headers = {"X-Request-Id": rid} if rid else {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    return web.json_response(exc.body(), status=exc.status, headers=headers or None)


@web.middleware
async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except SanctumError as exc:
        if exc.status < 500:
            request.app[PROXY].counters.inc("bad_requests")
        return error_response(exc, request.get("request_id"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        body = {"error": {"message": exc.reason, "type": "invalid_request_error",
                          "code": exc.reason.lower().replace(" ", "_"), "param": None}}
        return web.json_response(body, status=exc.status)


@web.middleware
async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
    keys = request.app[PROXY].api_keys
    if keys and request.path != "/health":
        given = request.headers.get("Authorization", "")
        token = given[7:].strip() if given.lower().startswith("bearer ") else ""
        if token not in keys:
            raise Unauthorized("missing or unknown API key")
    return await handler(request)


# -- the ladder loop ------------------------------------------------------


async def _write(response: web.StreamResponse, data: bytes) -> bool:
    try:
        await response.write(data)
        return True
    except (ConnectionError, RuntimeError):
        return False


def _gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


async def serve(request: web.Request, kind: Kind, route: RouteConfig, gen: Generate,
                include_usage: bool) -> web.StreamResponse:
    proxy = request.app[PROXY]
    counters = proxy.counters
    rid = gen.request_id
    may_leave = offbox_allowed(route, request.headers.get("X-Sanctum-Offbox"))
    ladder = plan(route, proxy.seats, may_leave)
    attempts: list[tuple[str, Outcome | Skipped]] = []
    created = int(time.time())
    started = time.monotonic()

    probes: set[str] = set()  # rungs this request holds the half-open probe of

    def record(seat: str, outcome: Outcome | Skipped) -> None:
        attempts.append((seat, outcome))
        counters.inc("attempts", seat, outcome_label(outcome).split(":")[0])
        if not isinstance(outcome, Skipped):
            proxy.settle(seat, outcome, seat in probes)

    def left(seat: str, response: web.StreamResponse | None) -> web.StreamResponse:
        """The client went away: counted, and the attempt's end cancels the seat's work."""
        counters.inc("client_disconnects")
        record(seat, Failed("client_disconnected"))
        log.info("client_disconnected", request_id=rid, seat=seat,
                 committed=response is not None)
        return response or web.Response(status=499)

    memo: dict[Any, int] = {}
    over_cap: list[tuple[str, Verdict]] = []
    for name in ladder.rungs:
        seat_cfg = proxy.seats[name]
        client = proxy.clients[name]
        pong = client.pong if isinstance(client, SeatClient) else None
        verdict = await proxy.admission.judge(seat_cfg, gen, memo,
                                              pong.max_prompt_tokens if pong else 0)
        if not verdict.admitted:
            over_cap.append((name, verdict))
            record(name, Skipped("over_cap"))
            continue
        admitted, probe = proxy.admit(name)
        if not admitted:
            record(name, Skipped("circuit_open"))
            continue
        if probe:
            probes.add(name)
        answer = Answer(rid, kind, name, created)
        response: web.StreamResponse | None = None
        texts: list[str] = []
        first_s, stall_s = seat_cfg.first_token_timeout_s, seat_cfg.stall_timeout_s
        # An attempt also ends when the client leaves while it waits (a local seat's queue
        # place, prefill or next chunk; a hosted rung's back-off): nothing for nobody.
        frames = client.frames(gen, first_s, stall_s, gone=lambda: _gone(request))
        try:
            async with aclosing(frames) as it:
                async for frame in it:
                    if isinstance(frame, Chunk):
                        answer.served = frame.served_if_ok
                        answer.speculation = frame.speculation or answer.speculation
                        answer.fingerprint = frame.fingerprint or answer.fingerprint
                        if not gen.stream:
                            texts.append(frame.text)
                            if _gone(request):
                                return left(name, None)
                            continue
                        if response is None:
                            if _gone(request):
                                return left(name, None)
                            # Committing to this seat: it is the answering one.
                            answer.attempts = attempts_header([*attempts, (name, Ok())])
                            response = await _commit(request, answer, started)
                            if response is None:
                                return left(name, None)
                        if _gone(request) or not await _write(
                                response, responses.text_chunk(answer, frame.text)):
                            return left(name, response)
                        continue
                    if isinstance(frame, Retry):
                        # A hosted rung tries again: the failed try is listed, never served.
                        attempts.append((name, frame.outcome))
                        counters.inc("attempts", name, "failed")
                        continue
                    assert isinstance(frame, Final)
                    outcome = frame.outcome
                    if isinstance(outcome, Failed) and outcome.reason == "client_disconnected":
                        return left(name, response)
                    record(name, outcome)
                    phase = Phase.AFTER_COMMIT if response is not None else Phase.BEFORE_COMMIT
                    step = decide(outcome, phase)
                    log.info("attempt", request_id=rid, seat=name, outcome=outcome_label(outcome),
                             phase=phase.value, step=step.value)
                    if step is Step.NEXT_RUNG:
                        counters.inc("fallbacks", fallback_reason(outcome))
                        break
                    if step is Step.RETURN_ERROR:
                        assert isinstance(outcome, Rejected)
                        if outcome.status == 413 and verdict.tokens is not None:
                            # We admitted what the seat refused: the layers disagree.
                            counters.inc("cap_disagreements")
                            log.error("cap_disagreement", seat=name, proxy_tokens=verdict.tokens,
                                      proxy_cap=verdict.cap,
                                      seat_tokens=outcome.extra.get("prompt_tokens"),
                                      seat_cap=outcome.extra.get("cap"))
                        raise client_error(outcome.status, outcome.code, outcome.message,
                                           attempts=attempts_header(attempts), **outcome.extra)
                    if step is Step.ABORT_STREAM:
                        assert response is not None
                        counters.inc("midstream_aborts")
                        reason = outcome_label(outcome)
                        await _write(response, responses.error_event(
                            f"seat {name} failed after the answer began ({reason}); "
                            "the answer is incomplete", "midstream_failure",
                            seat=name, attempts=attempts_header(attempts)))
                        return response
                    if step is Step.STOP:
                        return response or web.Response(status=499)
                    # DONE
                    counters.inc("answered_by", name)
                    answer.served = frame.served
                    answer.speculation = frame.speculation
                    answer.upstream_model = frame.model
                    answer.fingerprint = frame.fingerprint or answer.fingerprint
                    answer.attempts = attempts_header(attempts)
                    usage = responses.usage_body(frame.usage.prompt_tokens,
                                                 frame.usage.completion_tokens,
                                                 frame.usage.cached_tokens)
                    log.info("answered", request_id=rid, seat=name, attempts=answer.attempts,
                             prompt_tokens=frame.usage.prompt_tokens,
                             completion_tokens=frame.usage.completion_tokens,
                             ttft_s=round(frame.ttft_s, 4),
                             elapsed_s=round(time.monotonic() - started, 4))
                    if not gen.stream:
                        body = responses.full_body(answer, "".join(texts), frame.finish_reason,
                                                   usage)
                        return web.json_response(body, headers=answer.headers(), dumps=_dumps)
                    if response is None:
                        response = await _commit(request, answer, started)
                        if response is None:  # answered, but its client left meanwhile
                            counters.inc("client_disconnects")
                            return web.Response(status=499)
                    await _write(response, responses.last_chunks(
                        answer, frame.finish_reason, usage if include_usage else None))
                    return response
        except asyncio.CancelledError:
            # The proxy is stopping past its drain: end a begun answer honestly.
            if response is not None:
                counters.inc("midstream_aborts")
                await _write(response, responses.error_event(
                    "the proxy stopped before the answer was complete", "proxy_shutdown",
                    seat=name))
            raise
    # Every allowed rung failed or was skipped; nothing was sent.
    header = attempts_header(attempts)
    refused = context_refusal(attempts)
    if refused is not None:
        # No later rung could take it: the prompt is the client's to shorten.
        raise client_error(refused.status, refused.code, refused.message, attempts=header,
                           **refused.extra)
    if over_cap and len(over_cap) == len(attempts):
        # No rung this request may use can hold the prompt: deterministic, a 413.
        name, biggest = max(over_cap, key=lambda nv: nv[1].cap or 0)
        counters.inc("over_cap")
        counters.refused(biggest.tokens or 0)
        raise PromptTooLong(
            f"prompt has {biggest.tokens} tokens; the largest allowed seat ({name}) admits "
            f"at most {biggest.cap} (its cap {biggest.seat_cap} less a margin of "
            f"{biggest.margin})",
            prompt_tokens=biggest.tokens, cap=biggest.cap, margin=biggest.margin, seat=name,
            limit="proxy_cap", attempts=header)
    if any(isinstance(o, Failed) and o.reason in BUSY for _, o in attempts) and all(
            isinstance(o, Skipped) or (isinstance(o, Failed) and o.reason in BUSY)
            for _, o in attempts):
        # Busy, not broken: every rung that was tried was full, or too long in starting.
        counters.inc("overloaded")
        raise Overloaded(f"every seat of route {route.model!r} is busy; retry shortly",
                         attempts=header)
    if ladder.filtered_offbox:
        counters.inc("offbox_blocked")
        raise NoPrivateSeat(
            "every local seat for this private request failed; off-box seats "
            f"({', '.join(ladder.filtered_offbox)}) are not allowed for it",
            attempts=header)
    raise AllRungsFailed(f"every seat of route {route.model!r} failed", attempts=header)


async def _commit(request: web.Request, answer: Answer,
                  started: float) -> web.StreamResponse | None:
    """Send the headers (and the API's opening chunk, if it has one); None when the
    client is already gone."""
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", **answer.headers()})
    try:
        await response.prepare(request)
    except ConnectionError:
        return None
    first = responses.first_chunk(answer)
    if first:
        await _write(response, first)
    return response


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


# -- handlers -------------------------------------------------------------


def _route(proxy: Proxy, model: str) -> RouteConfig:
    route = proxy.routes.get(model)
    if route is None:
        raise NotFound(f"no route named {model!r}; GET /v1/models lists them", param="model")
    return route


def _begin(request: web.Request) -> str:
    """Count the request and give it its id (the client's, when it sent a usable one)."""
    request.app[PROXY].counters.inc("requests")
    rid: str = request_id(request)
    request["request_id"] = rid
    return rid


async def _dispatch(request: web.Request, kind: Kind, req: Any,
                    gen: Generate) -> web.StreamResponse:
    route = _route(request.app[PROXY], req.model)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return await serve(request, kind, route, gen, usage)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    rid = _begin(request)
    req, messages, params = parse_chat(await request.read())
    gen = Generate(rid, req.stream, params, messages=messages, tools_json=tools_json(req),
                   **overrides(req))
    return await _dispatch(request, "chat", req, gen)


async def completions(request: web.Request) -> web.StreamResponse:
    rid = _begin(request)
    req, prompt, params = parse_completion(await request.read())
    gen = Generate(rid, req.stream, params, prompt=prompt, **overrides(req))
    return await _dispatch(request, "completion", req, gen)


async def models(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    data = [{"id": r.model, "object": "model", "created": 0, "owned_by": "sanctum",
             "ladder": list(r.ladder), "offbox": r.offbox} for r in proxy.config.route]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    seats = {}
    for name, c in proxy.clients.items():
        if not isinstance(c, SeatClient):
            continue
        pong = c.pong
        seats[name] = {"ready": c.ready, "alive": c.alive, "busy": bool(pong and pong.busy),
                       "incarnation": pong.incarnation if pong else None,
                       "pid": pong.pid if pong else None,
                       "queued": pong.queued if pong else 0}
    ready = any(s["ready"] for s in seats.values())
    return web.json_response({"status": "ok" if ready else "degraded", "seats": seats})


async def counters(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    snapshot = proxy.counters.snapshot()
    snapshot["circuits"] = {n: b.circuit.value for n, b in proxy.breakers.items()}
    seats = await proxy.seat_counters()
    for name, totals in (await proxy.supervisor_totals()).items():
        if seats.get(name) is not None:
            seats[name].update(totals)  # type: ignore[union-attr]
    hosted = {n: {"served": c.served} for n, c in proxy.clients.items()
              if isinstance(c, HostedClient)}
    return web.json_response({"proxy": snapshot, "seats": seats,
                              "hosted": hosted})


async def metrics(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    body = render_metrics(proxy.counters, await proxy.seat_counters())
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


async def _lifecycle(app: web.Application) -> Any:
    proxy = app[PROXY]
    await proxy.start()
    yield
    await proxy.stop()


def make_app(config: Config) -> web.Application:
    app = web.Application(middlewares=[errors, auth], client_max_size=32 * 1024 * 1024)
    app[PROXY] = Proxy(config)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/counters", counters)
    app.router.add_get("/metrics", metrics)
    return app
