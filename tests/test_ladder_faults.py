"""The ladder under injected faults: proxyd is real, seats are fault-injecting fakes
that speak the real protocol, and the hosted rung is a real HTTP server."""

from __future__ import annotations

import http.client as httpclient
import json
import time
from collections.abc import Iterator

import openai
import pytest

from shared.clock import ManualClock
from tests.procs import http
from tests.rig import Rig

MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture
def make_rig() -> Iterator[object]:
    rigs: list[Rig] = []

    def make(**kw: object) -> Rig:
        rig = Rig(**kw)  # type: ignore[arg-type]
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.stop()


def client(rig: Rig) -> openai.OpenAI:
    return openai.OpenAI(base_url=rig.url + "/v1", api_key="x", max_retries=0, timeout=30)


def chat(rig: Rig, model: str = "private", stream: bool = False,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    return http("POST", rig.url + "/v1/chat/completions",
                body={"model": model, "messages": MSG, "stream": stream}, headers=headers)


def sse_events(body: bytes) -> list[str]:
    return [block for block in body.decode().split("\n\n") if block.strip()]


def test_crash_before_first_token_falls_back(make_rig) -> None:
    """A worker that dies before its first token: the next rung answers and is named."""
    rig = make_rig(modes={"brain": "crash_before_first", "coder": "ok"})
    raw = client(rig).chat.completions.with_raw_response.create(model="private", messages=MSG)
    done = raw.parse()
    assert done.model == "coder"
    assert raw.headers["x-sanctum-seat"] == "coder"
    assert raw.headers["x-sanctum-attempts"] == "brain=failed:worker_lost; coder=ok"
    assert done.choices[0].message.content == "t1 t2 t3 t4 t5 t6 t7 t8 "
    c = rig.counters()["proxy"]
    assert c["fallbacks"] == {"worker_lost": 1} and c["answered_by"] == {"coder": 1}


def test_crash_before_first_token_stream_names_fallback(make_rig) -> None:
    """Streaming, the openai client sees the fallback seat's name in every chunk."""
    rig = make_rig(modes={"brain": "crash_before_first", "coder": "ok"})
    chunks = list(client(rig).chat.completions.create(model="private", messages=MSG,
                                                      stream=True))
    assert {c.model for c in chunks} == {"coder"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() \
        == "t1 t2 t3 t4 t5 t6 t7 t8"


def sse_json(body: bytes) -> tuple[str, list[dict[str, object]]]:
    """(the streamed text, the JSON of every event) of an SSE body."""
    datas = [json.loads(e.split("data: ", 1)[1]) for e in sse_events(body)
             if "data: {" in e]
    text = "".join(c["delta"].get("content") or "" for d in datas  # type: ignore[index]
                   for c in d.get("choices", []))  # type: ignore[attr-defined]
    return text, datas


def test_crash_midstream_is_continued_by_the_next_local_seat(make_rig) -> None:
    """A worker killed after three tokens: the next local rung is given "t1 t2 t3 " and
    goes on from t4; the client reads one complete answer and [DONE], and the private
    request never reached the hosted rung."""
    rig = make_rig(modes={"brain": "crash_midstream", "coder": "ok"})
    code, headers, body = chat(rig, stream=True)
    text, datas = sse_json(body)
    assert code == 200 and headers["X-Sanctum-Seat"] == "brain"
    assert headers["X-Sanctum-Attempts"] == "brain=streaming"
    assert text == "t1 t2 t3 t4 t5 t6 t7 t8 "
    assert b"data: [DONE]" in body and sse_events(body)[-1].startswith("event: sanctum")
    sanctum = datas[-1]["sanctum"]
    assert sanctum["attempts"] == "brain=failed:worker_lost; coder=ok"  # type: ignore[index]
    assert sanctum["segments"] == [  # type: ignore[index]
        {"seat": "brain", "tokens": 3, "served": 0, "outcome": "failed:worker_lost"},
        {"seat": "coder", "tokens": 5, "served": 1, "outcome": "ok"}]
    [generate] = rig.events("coder", "generate")
    assert generate["prefix"] == "t1 t2 t3 "
    assert rig.upstream.requests == []
    c = rig.counters()["proxy"]
    assert c["continuations"] == {"by_reason": {"worker_lost": 1}, "by_pair": {"brain>coder": 1},
                                  "prefill_refused": {}}
    assert c["midstream_aborts"] == 0


def test_a_private_stream_never_continues_off_the_box(make_rig) -> None:
    """Both local seats die with the answer begun (the second as soon as it is asked to
    continue): a private request ends with an error event naming the seat that broke and
    no [DONE], and the hosted rung saw nothing; on a route that allows off-box use the
    same faults are continued by the hosted rung, asked with the text sent as a trailing
    assistant message."""
    rig = make_rig(modes={"brain": "crash_midstream", "coder": "crash_midstream"})
    code, headers, body = chat(rig, stream=True)
    events = sse_events(body)
    assert code == 200 and headers["X-Sanctum-Seat"] == "brain"
    assert events[-1].startswith("event: error") and "data: [DONE]" not in body.decode()
    err = json.loads(events[-1].split("data: ", 1)[1])["error"]
    assert err["code"] == "midstream_failure" and err["seat"] == "brain"
    assert "worker_lost" in err["message"]
    assert err["attempts"] == "brain=failed:worker_lost; coder=failed:worker_lost"
    assert rig.upstream.requests == []
    assert rig.counters()["proxy"]["midstream_aborts"] == 1
    rig.start_fake("brain", "crash_midstream")
    rig.start_fake("coder", "crash_midstream")
    code, headers, body = chat(rig, model="open", stream=True)
    text, datas = sse_json(body)
    assert text == "t1 t2 t3 hosted says hi " and b"data: [DONE]" in body
    [asked] = rig.upstream.requests
    assert asked["messages"][-1] == {"role": "assistant", "content": "t1 t2 t3 "}
    assert datas[-1]["sanctum"]["attempts"] == (  # type: ignore[index]
        "brain=failed:worker_lost; coder=failed:worker_lost; hosted=ok")
    with pytest.raises(openai.APIError):
        rig.start_fake("brain", "crash_midstream")
        rig.start_fake("coder", "crash_midstream")
        list(client(rig).chat.completions.create(model="private", messages=MSG, stream=True))


def test_crash_midgeneration_non_stream_falls_back(make_rig) -> None:
    """A non-stream request that fails mid-generation falls back: nothing was sent."""
    rig = make_rig(modes={"brain": "crash_midstream", "coder": "ok"})
    code, headers, body = chat(rig)
    assert code == 200
    assert json.loads(body)["model"] == "coder"
    assert headers["X-Sanctum-Attempts"] == "brain=failed:worker_lost; coder=ok"


def test_hung_worker_is_lost_by_heartbeat(make_rig) -> None:
    """A worker that stops answering everything is lost within the liveness window."""
    rig = make_rig(modes={"brain": "hang", "coder": "ok"})
    code, headers, body = chat(rig)
    assert code == 200 and json.loads(body)["model"] == "coder"
    # Found by the heartbeat, or by the queue clock, which checks the heartbeat first:
    # a seat gone silent is lost, never merely busy.
    assert headers["X-Sanctum-Attempts"].split(";")[0] == "brain=failed:worker_lost"


def test_silent_seat_times_out_and_is_cancelled_before_next_rung(make_rig) -> None:
    """A seat alive but silent hits the first-token timeout; it is cancelled while the
    next rung is still generating, not left working beside it.

    The proxy sends the cancel before the next rung's request, but the two seats are
    separate processes reading their own sockets, so which of them logs first can differ
    by a fraction of a millisecond. The next rung here takes 50 ms a token, so the
    cancel must reach the silent seat well before that rung's answer is done.
    """
    rig = make_rig(modes={"brain": "silent", "coder": "slow"})
    code, headers, _body = chat(rig)
    assert code == 200
    assert headers["X-Sanctum-Attempts"] == "brain=failed:first_token_timeout; coder=ok"
    cancel = rig.events("brain", "cancel")
    final = rig.events("coder", "final")
    assert cancel and final and cancel[0]["t"] < final[0]["t"]
    assert cancel[0]["request_id"] == final[0]["request_id"]


def test_a_request_left_in_a_seats_queue_moves_on_without_blaming_the_seat(make_rig) -> None:
    """A seat that pongs but never starts the request (as if queued behind others): after
    queue_timeout_s the request is taken back and the next rung answers; busy is not
    broken, so four such requests leave the seat's circuit closed (threshold 3)."""
    rig = make_rig(modes={"brain": "queued", "coder": "ok"})
    for _ in range(4):
        code, headers, _ = chat(rig)
        assert code == 200
        assert headers["X-Sanctum-Attempts"] == "brain=failed:queue_timeout; coder=ok"
    c = rig.counters()["proxy"]
    assert c["fallbacks"] == {"queue_timeout": 4}
    assert c["circuits"]["brain"] == "closed"
    # Each was taken back from the queue (the fake logs the Cancel when it reads it).
    deadline = time.monotonic() + 5
    while len(rig.events("brain", "cancel")) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(rig.events("brain", "cancel")) == 4


def test_every_rung_queued_too_long_is_503_overloaded(make_rig) -> None:
    """When every local rung is still queueing, the client hears 'busy, retry'."""
    rig = make_rig(modes={"brain": "queued", "coder": "queued"})
    code, headers, body = chat(rig)
    err = json.loads(body)["error"]
    assert (code, err["code"], headers.get("Retry-After")) == (503, "overloaded", "1")
    assert err["attempts"] == "brain=failed:queue_timeout; coder=failed:queue_timeout"
    assert rig.counters()["proxy"]["overloaded"] == 1


def test_stall_after_first_token(make_rig) -> None:
    """A stalled stream is continued by the next rung; non-stream falls back from the start."""
    rig = make_rig(modes={"brain": "stall", "coder": "ok"})
    code, _, body = chat(rig, stream=True)
    text, datas = sse_json(body)
    assert code == 200 and text == "t1 t2 t3 t4 t5 t6 t7 t8 "
    assert datas[-1]["sanctum"]["attempts"] == "brain=failed:stall_timeout; coder=ok"  # type: ignore[index]
    code, headers, body = chat(rig)
    assert code == 200 and json.loads(body)["model"] == "coder"
    assert json.loads(body)["choices"][0]["message"]["content"] == "t1 t2 t3 t4 t5 t6 t7 t8 "
    assert headers["X-Sanctum-Attempts"] == "brain=failed:stall_timeout; coder=ok"
    assert rig.events("brain", "cancel"), "the stalled attempt was not cancelled"


def test_not_ready_seat_is_not_sent_work(make_rig) -> None:
    """A seat that says it is not ready fails at once, without being sent the request."""
    rig = make_rig(modes={"brain": "not_ready", "coder": "ok"})
    code, headers, _ = chat(rig)
    assert code == 200
    assert headers["X-Sanctum-Attempts"] == "brain=failed:not_ready; coder=ok"
    assert rig.events("brain", "generate") == []


def test_seat_413_is_returned_unchanged_without_fallback(make_rig) -> None:
    """A deterministic 413 from a seat reaches the client as it is; no rung is tried."""
    rig = make_rig(modes={"brain": "reject413", "coder": "ok"})
    code, _headers, body = chat(rig, model="open")
    err = json.loads(body)["error"]
    assert code == 413
    assert err["code"] == "context_length_exceeded"
    assert (err["prompt_tokens"], err["cap"], err["seat"], err["limit"]) == \
        (9000, 4096, "brain", "seat_cap")
    assert err["attempts"] == "brain=rejected:413"
    assert rig.events("coder", "generate") == [] and rig.upstream.requests == []


def test_decline_is_invisible_to_the_ladder(make_rig) -> None:
    """A seat that declines speculation still answers: no fallback, and the header says so."""
    rig = make_rig(modes={"brain": "decline", "coder": "ok"})
    code, headers, body = chat(rig, model="open")
    assert code == 200 and json.loads(body)["model"] == "brain"
    assert headers["X-Sanctum-Speculation"] == "declined:no_drafter"
    assert headers["X-Sanctum-Attempts"] == "brain=ok"
    assert rig.events("coder", "generate") == [] and rig.upstream.requests == []


def test_client_disconnect_cancels_generation_in_seat(make_rig) -> None:
    """A client that goes away mid-stream stops the seat's generation within a few tokens."""
    rig = make_rig(modes={"brain": "slow", "coder": "ok"}, tokens=400)
    conn = httpclient.HTTPConnection("127.0.0.1", rig.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"model": "private", "messages": MSG, "stream": True}))
    resp = conn.getresponse()
    seen = 0
    while seen < 5:
        if resp.fp.readline().startswith(b"data: "):
            seen += 1
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 5
    while not rig.events("brain", "cancel") and time.monotonic() < deadline:
        time.sleep(0.05)
    cancel = rig.events("brain", "cancel")
    assert cancel, "seat never saw a cancel"
    assert cancel[0]["tokens"] < 40
    assert rig.counters()["proxy"]["client_disconnects"] == 1


@pytest.mark.parametrize("stream", [True, False])
def test_client_that_leaves_while_queued_is_taken_back_at_once(make_rig, stream: bool) -> None:
    """A client that goes away while its request waits in a seat's queue: the seat gets the
    cancel before its queue clock runs out, no other rung is tried for nobody, and the
    disconnect is counted."""
    rig = make_rig(modes={"brain": "queued", "coder": "ok"})
    conn = httpclient.HTTPConnection("127.0.0.1", rig.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"model": "private", "messages": MSG, "stream": stream}))
    deadline = time.monotonic() + 10
    while not rig.events("brain", "generate") and time.monotonic() < deadline:
        time.sleep(0.02)
    [generate] = rig.events("brain", "generate")
    assert conn.sock is not None
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 10
    while rig.counters()["proxy"]["client_disconnects"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    proxy = rig.counters()["proxy"]
    assert proxy["client_disconnects"] == 1
    # Taken back as the client left, not by brain's queue clock (1 s), which falls back.
    assert proxy["fallbacks"] == {} and proxy["attempts"] == {"brain": {"failed": 1}}
    assert [e["request_id"] for e in rig.events("brain", "cancel")] == [generate["request_id"]]
    assert rig.events("coder", "generate") == [] and rig.upstream.requests == []


def test_private_request_never_leaves_the_box(make_rig) -> None:
    """Every local rung down: a private request gets 503 no_private_seat; upstream saw nothing."""
    rig = make_rig(modes={"brain": "crash_before_first", "coder": "crash_before_first"})
    code, _, body = chat(rig, model="private")
    err = json.loads(body)["error"]
    assert code == 503 and err["code"] == "no_private_seat"
    assert "hosted" in err["message"] and err["attempts"].startswith("brain=failed:")
    assert rig.upstream.requests == []
    assert rig.counters()["proxy"]["offbox_blocked"] == 1
    # The same failure on a route that allows off-box use does reach the upstream.
    code, headers, body = chat(rig, model="open")
    assert code == 200 and json.loads(body)["model"] == "hosted"
    assert len(rig.upstream.requests) == 1
    assert headers["X-Sanctum-Attempts"].endswith("hosted=ok")


def test_header_opt_in(make_rig) -> None:
    """On an `offbox = "header"` route only X-Sanctum-Offbox: allow reaches off-box rungs."""
    rig = make_rig(modes={"brain": "not_ready", "coder": "not_ready"})
    assert chat(rig, model="optin")[0] == 503
    assert rig.upstream.requests == []
    code, _, body = chat(rig, model="optin", headers={"X-Sanctum-Offbox": "allow"})
    assert code == 200 and json.loads(body)["model"] == "hosted"


def test_circuit_opens_on_real_failures_and_recovers(make_rig) -> None:
    """Three real failures open brain's circuit; it is skipped, probed after cool-down, closed."""
    clock = ManualClock()
    rig = make_rig(modes={"brain": "internal_error", "coder": "ok"}, cooldown=1.0, clock=clock)
    for _ in range(3):
        assert chat(rig)[1]["X-Sanctum-Attempts"] == "brain=failed:internal_error; coder=ok"
    _, headers, _ = chat(rig)
    assert headers["X-Sanctum-Attempts"] == "brain=skipped:circuit_open; coder=ok"
    assert len(rig.events("brain", "generate")) == 3
    rig.start_fake("brain", "ok")
    clock.advance(0.9)  # not yet cooled down
    rig.wait_health(lambda h: h["seats"]["brain"]["ready"] and h["seats"]["coder"]["ready"])
    assert chat(rig)[1]["X-Sanctum-Attempts"] == "brain=skipped:circuit_open; coder=ok"
    clock.advance(0.2)
    # A moved clock makes every seat's last pong look old until its next one comes.
    rig.wait_health(lambda h: h["seats"]["brain"]["ready"] and h["seats"]["coder"]["ready"])
    _, headers, _ = chat(rig)
    assert headers["X-Sanctum-Attempts"] == "brain=ok"
    assert rig.counters()["proxy"]["circuits"]["brain"] == "closed"


def test_client_errors_do_not_open_the_circuit(make_rig) -> None:
    """413s are the seat working: any number of them leaves the circuit closed."""
    rig = make_rig(modes={"brain": "reject413", "coder": "ok"})
    for _ in range(5):
        assert chat(rig)[0] == 413
    assert rig.counters()["proxy"]["circuits"]["brain"] == "closed"


def test_answered_by_reconciles_with_seats_served(make_rig) -> None:
    """After a mixed run with fallbacks, the proxy's answered_by equals each seat's own served."""
    rig = make_rig(modes={"brain": "ok", "coder": "ok"})
    for i in range(9):
        if i == 3:  # start_fake waits until health shows the new process ready
            rig.start_fake("brain", "crash_before_first")
        if i == 6:
            rig.start_fake("brain", "ok")
        assert chat(rig, stream=bool(i % 2))[0] == 200
    data = rig.counters()
    answered = data["proxy"]["answered_by"]
    served = {name: c["served"] for name, c in data["seats"].items() if c is not None}
    # The fake restarts its own counter with each process; sum what its processes served.
    brain_served = sum(1 for e in rig.events("brain", "final"))
    assert answered.get("coder", 0) == served["coder"]
    assert answered.get("brain", 0) == brain_served
    assert sum(answered.values()) == 9
