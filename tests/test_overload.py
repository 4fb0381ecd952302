"""Overload with a real seat: a full queue is refused at once with 503 `overloaded` and
Retry-After, the waiting request is still served, and the seat's circuit stays closed
(busy is not broken).  A client that leaves while its request waits gives its queue
place up at once."""

from __future__ import annotations

import http.client as httpclient
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import zmq

from shared import protocol
from tests.procs import Sanctum, http, running, wait_for
from tests.spec_models import snippet

pytestmark = pytest.mark.slow

CONFIG = """
[proxy]
listen = "127.0.0.1:{port}"
breaker_threshold = 3

[seatd]
heartbeat_s = 0.5

[[seat]]
name = "demo"
model = "builtin:demo"
max_prompt_tokens = 1536
prompt_cache_mb = 0
max_batch = 1   # one row decoding: the queue forms right behind it
max_queued = 1

[[route]]
model = "demo"
ladder = ["demo"]
"""


@pytest.fixture(scope="module")
def up() -> Iterator[Sanctum]:
    with running(lambda port: CONFIG.format(port=port)) as s:
        yield s


def assert_busy_refusals(s: Sanctum, refusals: list[tuple[int, dict[str, str], bytes]],
                         reason: str) -> None:
    """Four refusals, each 503 `overloaded` with Retry-After for `reason`; counted as
    overload and as a fallback reason; the seat's circuit still closed (threshold 3)."""
    assert len(refusals) == 4
    for status, headers, body in refusals:
        error = json.loads(body)["error"]
        assert (status, error["code"], headers.get("Retry-After")) == (503, "overloaded", "1")
        assert error["attempts"] == f"demo=failed:{reason}"
    counters = json.loads(http("GET", s.url + "/counters")[2])
    assert counters["proxy"]["overloaded"] == 4
    assert counters["proxy"]["fallbacks"] == {reason: 4}
    assert counters["proxy"]["circuits"]["demo"] == "closed"


def test_a_full_queue_is_refused_with_retry_after(up: Sanctum) -> None:
    """Behind a decoding request, one waits in the queue and four more are refused; once
    the refusals are counted the decoding client leaves, and the waiting one is served."""
    client = openai.OpenAI(base_url=up.url + "/v1", api_key="x", max_retries=0, timeout=300)
    started, leave = threading.Event(), threading.Event()
    long_text: list[str] = []

    def long_request() -> None:
        stream = client.completions.create(model="demo", prompt=snippet(600), max_tokens=400,
                                           temperature=0.7, seed=1, stream=True)
        for chunk in stream:
            started.set()
            long_text.append(chunk.choices[0].text if chunk.choices else "")
            if leave.is_set():  # no need to wait out the rest of its decode
                stream.close()
                return

    queued: list[int] = []
    answers: list[bytes] = []

    def queued_request() -> None:
        status, _, body = http("POST", up.url + "/v1/completions",
                               {"model": "demo", "prompt": "def f(x):", "max_tokens": 4},
                               timeout=300)
        queued.append(status)
        answers.append(body)

    a = threading.Thread(target=long_request)
    a.start()
    assert started.wait(120)
    b = threading.Thread(target=queued_request)
    b.start()
    # b takes the seat's one queue place behind the decoding request.
    wait_for("one request queued", lambda: up.health()["seats"]["demo"]["queued"] == 1,
             logs=up.logs)
    refusals = []
    for _ in range(4):  # more than the breaker's threshold
        refusals.append(http("POST", up.url + "/v1/completions",
                             {"model": "demo", "prompt": "x = 1", "max_tokens": 2}))
    assert a.is_alive(), "the long request ended before the queue was tested"
    assert_busy_refusals(up, refusals, "queue_full")
    leave.set()
    b.join(300)
    a.join(300)
    assert queued == [200] and "".join(long_text), answers
    status, _, _ = http("POST", up.url + "/v1/completions",
                        {"model": "demo", "prompt": "x = 1", "max_tokens": 2})
    assert status == 200


def test_a_request_waiting_too_long_in_the_queue_is_busy_not_broken() -> None:
    """With queue_timeout_s = 2, four requests still queued behind a long decode after 2 s
    are taken back: 503 `overloaded` with Retry-After, the seat's circuit untouched, the
    seat drops them unstarted (counted cancelled), and the decode in flight goes on until
    its client closes it (the fifth cancel)."""
    config = CONFIG.replace(
        "max_queued = 1", "max_queued = 4\nqueue_timeout_s = 2.0\nfirst_token_timeout_s = 30")
    with running(lambda port: config.format(port=port)) as s:
        assert _frames_of_one_request(s) == ["started", "chunk", "chunk", "chunk", "final"]
        base = _seat(s)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)
        # Up to the context's end: the seat must still be decoding it when its client
        # closes it, and the proxy writes ahead of a client that reads slowly.
        stream = client.completions.create(model="demo", prompt=snippet(600), max_tokens=1800,
                                           temperature=0.7, seed=1, stream=True)
        first = next(iter(stream))
        assert first.model == "demo"
        # Four at once (more than the breaker's threshold): all fit the queue, none starts.
        refused: list[tuple[int, dict[str, str], bytes]] = []
        askers = [threading.Thread(target=lambda: refused.append(http(
            "POST", s.url + "/v1/completions",
            {"model": "demo", "prompt": "def f(x):", "max_tokens": 4}, timeout=60)))
            for _ in range(4)]
        for t in askers:
            t.start()
        for t in askers:
            t.join(120)
        # Taken back, they gave their queue places up at once (the decode still runs).
        wait_for("the queue empty", lambda: s.health()["seats"]["demo"]["queued"] == 0,
                 timeout=10, logs=s.logs)
        seat = _seat(s)
        assert seat["cancelled"] - base["cancelled"] == 4
        assert seat["served"] == base["served"], "the long decode ended before it was closed"
        more = [c.choices[0].text for c, _ in zip(stream, range(5), strict=False)]
        assert len(more) == 5, "the decode in flight stopped"
        assert _seat(s)["served"] == base["served"], "the long decode ended before it was closed"
        stream.close()
        assert_busy_refusals(s, refused, "queue_timeout")
        # None of the four was served; the stream closed above is the fifth cancel.
        seat = _wait_seat(s, lambda c: c["cancelled"] - base["cancelled"] >= 5)
        assert seat["cancelled"] - base["cancelled"] == 5 and seat["served"] == base["served"]
        status, _, _ = http("POST", s.url + "/v1/completions",
                            {"model": "demo", "prompt": "x = 1", "max_tokens": 2})
        assert status == 200


def test_a_client_that_leaves_while_queued_gives_its_place_up_at_once(up: Sanctum) -> None:
    """A client that goes away while its request waits behind a decode: the seat drops the
    request unstarted (counted cancelled) while the decode still runs, the next client
    takes the freed place, and the seat decodes not one token for the one that left."""
    client = openai.OpenAI(base_url=up.url + "/v1", api_key="x", max_retries=0, timeout=300)
    base, decoded_before = _seat(up), _tokens_decoded(up)
    started = threading.Event()
    long_usage: list[int] = []

    def long_request() -> None:
        stream = client.completions.create(model="demo", prompt=snippet(600), max_tokens=400,
                                           temperature=0.7, seed=1, stream=True,
                                           stream_options={"include_usage": True})
        for chunk in stream:
            started.set()
            if chunk.usage is not None:
                long_usage.append(chunk.usage.completion_tokens)

    a = threading.Thread(target=long_request)
    a.start()
    assert started.wait(120)
    # The one that leaves takes the seat's one queue place, then closes its connection.
    conn = httpclient.HTTPConnection("127.0.0.1", up.port, timeout=60)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"model": "demo", "prompt": "def f(x):", "max_tokens": 50,
                                  "stream": True}))
    wait_for("one request queued", lambda: up.health()["seats"]["demo"]["queued"] == 1,
             logs=up.logs)
    assert conn.sock is not None
    conn.sock.close()
    conn.close()
    seat = _wait_seat(up, lambda c: c["cancelled"] > base["cancelled"])
    assert seat["cancelled"] == base["cancelled"] + 1
    # Counted before the decode in front of it ended: dropped unstarted, not started late.
    assert seat["served"] == base["served"], "the long request ended before the queue was tested"
    status, _, body = http("POST", up.url + "/v1/completions",
                           {"model": "demo", "prompt": "x = 1", "max_tokens": 4}, timeout=300)
    assert status == 200, body  # the freed place, not queue_full
    a.join(300)
    seat = _seat(up)
    assert (seat["served"] - base["served"], seat["cancelled"] - base["cancelled"]) == (2, 1)
    answered = long_usage[0] + json.loads(body)["usage"]["completion_tokens"]
    assert seat["completion_tokens"] - base["completion_tokens"] == answered
    # Every token the seat decoded since went to the two that stayed.
    assert _tokens_decoded(up) - decoded_before == answered


def _seat(s: Sanctum) -> dict[str, Any]:
    """The seat's own counters, read from it now."""
    seat: dict[str, Any] = json.loads(http("GET", s.url + "/counters")[2])["seats"]["demo"]
    return seat


def _wait_seat(s: Sanctum, ok: Any, timeout: float = 60) -> dict[str, Any]:
    """The seat's counters once `ok(counters)` holds, or as they are at the deadline."""
    def met() -> dict[str, Any] | None:
        seat = _seat(s)
        return seat if ok(seat) else None

    try:
        found: dict[str, Any] = wait_for("the seat's counters", met, timeout=timeout)
        return found
    except AssertionError:  # the caller's assertion says what the counters show
        return _seat(s)


def _tokens_decoded(s: Sanctum) -> int:
    """Every token the seat's worker has decoded, cancelled requests' too, from a pong it
    sends now (health's pong can be a heartbeat old)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{s.state / 'seat-demo.sock'}")
    try:
        sock.send(protocol.encode(protocol.Ping(sent_at=time.monotonic())))
        while True:
            assert sock.poll(10_000), "the seat did not answer a ping"
            reply = protocol.reply_decoder.decode(sock.recv())
            if isinstance(reply, protocol.Pong):
                return reply.tokens_generated
    finally:
        sock.close()
        ctx.term()


def _frames_of_one_request(s: Sanctum) -> list[str]:
    """Ask the seat's worker directly (a second peer on its socket): the frame kinds of
    one request, pongs aside. The worker says it started before its first chunk."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{s.state / 'seat-demo.sock'}")
    try:
        params = protocol.SamplingParams(temperature=0.0, max_tokens=3)
        sock.send(protocol.encode(protocol.Generate("direct", False, params, prompt="x =")))
        kinds: list[str] = []
        while not kinds or kinds[-1] != "final":
            assert sock.poll(60_000), kinds
            reply = protocol.reply_decoder.decode(sock.recv())
            kinds.append(type(reply).__name__.lower())
        return kinds
    finally:
        sock.close()
        ctx.term()
