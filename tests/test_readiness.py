"""Readiness that says the truth: seat, rung and route states, `/health`, the load wait,
and `sanctum up`'s ready line.

The tables hold the pure decisions (proxyd/seat_state.py, the conclusion's loading
rule, `sanctum up`'s verdict).  Fake seats (tests/rig.py) that say they load show
/health 503 then 200, a request waiting and then answered, and the wait running out
on a ManualClock.  A real `sanctum up` with the demo model, whose load waits for a
gate the test opens (tests/fakes/slow_load_worker.py), shows a request sent while
/health said 503 loading answered once the seat is ready, and the one ready line.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from proxyd.conclusion import conclude
from proxyd.ladder import Attempt, Health, Plan, Skipped, breaker_verdict
from proxyd.seat_state import SeatFacts, SeatState, route_state, rung_state, seat_state
from sanctum.cli import UpVerdict, fatal_route_names, up_verdict
from shared.clock import ManualClock
from shared.config import Config, RouteConfig, SeatConfig
from shared.errors import AllRungsFailed, Loading, NoPrivateSeat, Overloaded, SanctumError
from shared.protocol import Failed
from tests.procs import Sanctum, demo_config, free_port, http, wait_for
from tests.rig import Rig

READY, LOADING, DOWN = SeatState.READY, SeatState.LOADING, SeatState.DOWN
GRACE = 30.0

# (alive, says_ready, heard, was_ready, since_start_s) -> state
SEAT_TABLE: list[tuple[tuple[bool, bool, bool, bool, float], SeatState, str]] = [
    ((True, True, True, True, 5.0), READY, "alive and says ready"),
    ((True, False, True, False, 5.0), LOADING, "alive, not ready yet: its model loads"),
    ((True, False, True, False, 500.0), LOADING, "a long load is still a load"),
    ((False, False, False, False, 1.0), LOADING, "not heard yet: seatd may be spawning it"),
    ((False, False, False, False, GRACE), LOADING, "not heard, at the end of the grace"),
    ((False, False, False, False, GRACE + 0.1), DOWN, "never heard after the grace"),
    ((False, False, True, False, 5.0), DOWN, "heard loading, then silent: lost"),
    ((False, True, True, True, 5.0), DOWN, "was ready and went silent: lost"),
    ((True, False, True, True, 5.0), DOWN, "was ready, says not ready again (restart, drain)"),
    ((False, False, True, True, 1.0), DOWN, "was ready and was lost, even early on"),
]


@pytest.mark.parametrize(("facts", "state", "why"), SEAT_TABLE, ids=[w for *_, w in SEAT_TABLE])
def test_seat_state_table(facts: tuple[bool, bool, bool, bool, float], state: SeatState,
                          why: str) -> None:
    """A seat is loading only while it has never been ready (alive and not ready, or not
    heard within the grace); a seat that was ready and is not now is down."""
    assert seat_state(SeatFacts(*facts), GRACE) is state


RUNG_TABLE: list[tuple[SeatState | None, bool, SeatState]] = [
    (None, True, READY),  # a hosted rung whose circuit admits
    (None, False, DOWN),  # a hosted rung whose circuit is open
    (READY, True, READY),
    (READY, False, DOWN),  # a ready seat behind an open circuit is skipped
    (LOADING, True, LOADING),
    (LOADING, False, DOWN),
    (DOWN, True, DOWN),
]


@pytest.mark.parametrize(("seat", "admits", "state"), RUNG_TABLE)
def test_rung_state_table(seat: SeatState | None, admits: bool, state: SeatState) -> None:
    """A rung is its seat's state (hosted: ready) unless its circuit refuses it."""
    assert rung_state(seat, admits) is state


@pytest.mark.parametrize(("rungs", "state"), [
    ((), DOWN), ((DOWN,), DOWN), ((LOADING,), LOADING), ((DOWN, LOADING), LOADING),
    ((LOADING, READY), READY), ((DOWN, DOWN, READY), READY), ((READY,), READY),
])
def test_route_state_is_its_best_rung(rungs: tuple[SeatState, ...], state: SeatState) -> None:
    """A route is ready with any ready rung, else loading with any loading rung, else down."""
    assert route_state(rungs) is state


def test_not_ready_leaves_the_circuit_as_it_was() -> None:
    """A seat that says it is not ready told the truth: its circuit neither opens nor
    closes (a loading seat must not be skipped as broken once it is ready)."""
    assert breaker_verdict(Failed("not_ready")) is Health.UNKNOWN
    assert breaker_verdict(Failed("worker_lost")) is Health.BROKEN


# -- the conclusion of a request whose rungs were loading -----------------------------

NOT_READY = Failed("not_ready")
TWO = Plan(("a", "b"), ())


@pytest.mark.parametrize(("attempts", "loading", "plan", "error"), [
    ([("a", NOT_READY)], {"a"}, TWO, Loading),
    ([("a", NOT_READY), ("b", NOT_READY)], {"a", "b"}, Plan(("a", "b"), ("h",)), Loading),
    ([("a", NOT_READY), ("b", Skipped("circuit_open"))], {"a"}, TWO, Loading),
    # not ready after it was ready: not loading, a real failure
    ([("a", NOT_READY)], set(), TWO, AllRungsFailed),
    ([("a", NOT_READY)], set(), Plan(("a",), ("h",)), NoPrivateSeat),
    ([("a", NOT_READY), ("b", Failed("worker_lost"))], {"a"}, TWO, AllRungsFailed),
    ([("a", NOT_READY), ("b", Failed("queue_full"))], {"a"}, TWO, Overloaded),
])
def test_conclusion_of_loading_rungs(attempts: list[Attempt], loading: set[str], plan: Plan,
                                     error: type[SanctumError]) -> None:
    """No rung answered because the ones tried are still loading: 503 loading with
    Retry-After, never all_rungs_failed; a real failure beside them still counts."""
    end = conclude(attempts, plan, "m", frozenset(loading))
    assert type(end.error) is error
    if error is Loading:
        assert end.error.status == 503 and end.error.code == "loading"
        assert end.error.retry_after_s
        assert end.error.extra["loading"] == [s for s, o in attempts if o is NOT_READY]


# -- sanctum up's verdict ---------------------------------------------------------------

@pytest.mark.parametrize(("routes", "fatal", "retried", "verdict"), [
    ({}, set(), False, UpVerdict("wait")),  # proxyd not answering yet
    ({"a": "loading"}, set(), False, UpVerdict("wait")),
    ({"a": "ready"}, set(), False, UpVerdict("ready", ("a",))),
    ({"a": "ready", "b": "loading"}, set(), False, UpVerdict("wait")),
    ({"a": "ready", "b": "down"}, {"b"}, False, UpVerdict("ready", ("a",))),
    ({"a": "down", "b": "down"}, {"a", "b"}, False, UpVerdict("hopeless")),
    ({"a": "down"}, {"a"}, True, UpVerdict("wait")),  # FATAL seats are retried
    ({"a": "loading", "b": "down"}, {"b"}, False, UpVerdict("wait")),
])
def test_up_verdict(routes: dict[str, str], fatal: set[str], retried: bool,
                    verdict: UpVerdict) -> None:
    """`sanctum up` says ready once every route is ready or FATAL, with one ready at
    least, and gives up only when every route is FATAL for good."""
    assert up_verdict(routes, frozenset(fatal), retried) == verdict


def test_fatal_routes_count_only_rungs_a_request_may_use() -> None:
    """A route is FATAL when every rung it may use is a FATAL seat: a hosted rung keeps an
    off-box route alive, not a private one."""
    seats = [SeatConfig(name="a", model="m"), SeatConfig(name="b", model="m"),
             SeatConfig(name="h", kind="openai", base_url="http://x.invalid/v1",
                        upstream_model="u", offbox=True)]
    routes = [RouteConfig(model="private", ladder=["a", "h"]),
              RouteConfig(model="open", ladder=["a", "h"], offbox="allow"),
              RouteConfig(model="both", ladder=["a", "b"])]
    config = Config(seat=seats, route=routes)
    assert fatal_route_names(config, {"a"}) == {"private"}
    assert fatal_route_names(config, {"a", "b"}) == {"private", "both"}
    assert fatal_route_names(config, set()) == frozenset()


# -- fake seats that load -------------------------------------------------------------

MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(**kw: Any) -> Rig:
        rig = Rig(**kw)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.stop()


class Sent:
    """One request in a thread of its own, answered while the test looks elsewhere."""

    def __init__(self, url: str, model: str) -> None:
        self.result: tuple[int, dict[str, str], bytes] | None = None
        self.thread = threading.Thread(target=self._send, args=(url, model), daemon=True)
        self.thread.start()

    def _send(self, url: str, model: str) -> None:
        self.result = http("POST", url + "/v1/chat/completions",
                           body={"model": model, "messages": MSG, "max_tokens": 8},
                           timeout=120)

    def answer(self) -> tuple[int, dict[str, str], dict[str, Any]]:
        self.thread.join(120)
        assert self.result is not None, "the request was never answered"
        code, headers, body = self.result
        return code, headers, json.loads(body)




def health(url: str) -> tuple[int, dict[str, Any]]:
    code, _, body = http("GET", url + "/health", timeout=5)
    return code, json.loads(body)


def test_health_503_while_loading_then_answered_when_ready(make_rig: Callable[..., Rig]) -> None:
    """Seats that say they load: /health is 503 `loading` with per-route and per-seat
    state; an open route's ready hosted rung answers at once (no wait); a private
    request waits, is answered by the seat once it is ready, and /health turns 200."""
    rig = make_rig(modes={"brain": "not_ready", "coder": "not_ready"}, load_wait=60.0)
    code, body = health(rig.url)
    assert code == 503 and body["status"] == "loading"
    assert body["routes"]["private"] == {"state": "loading",
                                         "rungs": {"brain": "loading", "coder": "loading"}}
    assert body["routes"]["open"]["state"] == "ready"  # its hosted rung
    assert body["seats"]["brain"]["state"] == "loading"
    assert body["seats"]["brain"]["alive"] and not body["seats"]["brain"]["ready"]
    # A loading rung before a ready one: no wait, the first ready rung answers.
    code, headers, raw = http("POST", rig.url + "/v1/chat/completions",
                              body={"model": "open", "messages": MSG})
    assert code == 200 and json.loads(raw)["model"] == "hosted"
    assert headers["X-Sanctum-Attempts"] == \
        "brain=failed:not_ready; coder=failed:not_ready; hosted=ok"

    sent = Sent(rig.url, "private")
    waiting = wait_for("the request waits", lambda: (h := health(rig.url)[1])["seats"]
                       ["brain"]["waiting"] == 1 and h)
    assert waiting["status"] == "loading" and waiting["seats"]["coder"]["waiting"] == 1
    assert sent.result is None and rig.events("brain", "generate") == []
    rig.start_fake("brain", "ok")
    code, headers, answer = sent.answer()
    assert code == 200, answer
    assert answer["model"] == "brain" and headers["X-Sanctum-Attempts"] == "brain=ok"
    code, body = health(rig.url)
    assert code == 200 and body["status"] == "ok"
    assert body["seats"]["brain"]["state"] == "ready" and body["seats"]["brain"]["waiting"] == 0
    assert body["routes"]["private"]["rungs"] == {"brain": "ready", "coder": "loading"}
    proxy = rig.counters()["proxy"]
    assert proxy["load_waits"] == {"ready": 1}
    assert len(rig.upstream.requests) == 1  # only the open route's request left the box


def test_a_seat_warming_up_is_ready_and_health_says_it_warms(
        make_rig: Callable[..., Rig]) -> None:
    """A seat compiling its shapes in idle time (`seatd.warm_shapes.Warming`) serves:
    its route is ready and answers, and /health names it warming, the other seat not."""
    rig = make_rig(modes={"brain": "warming", "coder": "ok"})
    body = wait_for("both seats ready", lambda: (h := health(rig.url)[1])["status"] == "ok"
                    and h)
    assert body["seats"]["brain"]["warming"] and body["seats"]["brain"]["ready"]
    assert body["seats"]["coder"]["warming"] is False
    code, headers, _ = http("POST", rig.url + "/v1/chat/completions",
                            body={"model": "private", "messages": MSG})
    assert code == 200 and headers["X-Sanctum-Attempts"] == "brain=ok"


def test_load_wait_runs_out_on_the_proxy_clock(make_rig: Callable[..., Rig]) -> None:
    """Seats that never get ready: a private request waits `load_wait_s` on the proxy's
    clock, then gets 503 `loading` with Retry-After (not all_rungs_failed); no seat was
    sent it and nothing left the box."""
    clock = ManualClock()
    # The clock moves 2.5 s at once: liveness wide enough that no seat looks lost.
    rig = make_rig(modes={"brain": "not_ready", "coder": "not_ready"}, load_wait=2.0,
                   liveness=100, clock=clock)
    sent = Sent(rig.url, "private")
    wait_for("the request waits", lambda: health(rig.url)[1]["seats"]["coder"]["waiting"])
    clock.advance(1.9)
    assert health(rig.url)[1]["seats"]["coder"]["waiting"] == 1, "gave up before its time"
    clock.advance(0.6)
    code, headers, body = sent.answer()
    err = body["error"]
    assert code == 503 and err["code"] == "loading", body
    assert err["type"] == "server_error" and err["loading"] == ["brain", "coder"]
    assert int(headers["Retry-After"]) > 0
    assert rig.events("brain", "generate") == [] and rig.events("coder", "generate") == []
    assert rig.upstream.requests == []
    assert rig.counters()["proxy"]["load_waits"] == {"timeout": 1}
    assert health(rig.url)[1]["seats"]["coder"]["waiting"] == 0


def test_the_wait_counts_against_no_other_clock(make_rig: Callable[..., Rig]) -> None:
    """A request that waited longer than its seat's queue and first-token budgets (1 s,
    1.5 s on the proxy's clock) is still answered once the seat is ready: those clocks
    start when the request is sent, after the wait."""
    clock = ManualClock()
    rig = make_rig(modes={"brain": "not_ready", "coder": "not_ready"}, load_wait=10.0,
                   liveness=100, clock=clock)
    sent = Sent(rig.url, "private")
    wait_for("the request waits", lambda: health(rig.url)[1]["seats"]["brain"]["waiting"])
    clock.advance(5.0)
    rig.start_fake("brain", "ok")
    code, headers, answer = sent.answer()
    assert code == 200, answer
    assert headers["X-Sanctum-Attempts"] == "brain=ok"
    proxy = rig.counters()["proxy"]
    assert proxy["load_waits"] == {"ready": 1} and proxy["fallbacks"] == {}


def test_no_wait_configured_answers_loading_at_once(make_rig: Callable[..., Rig]) -> None:
    """`load_wait_s = 0`: a request whose only hope is a loading seat gets 503 `loading`
    at once; a seat that was ready and says not ready again (restarted) is down, not
    loading, and is passed over."""
    rig = make_rig(modes={"brain": "not_ready", "coder": "ok"}, load_wait=0.0)
    code, headers, raw = http("POST", rig.url + "/v1/chat/completions",
                              body={"model": "private", "messages": MSG})
    assert code == 200 and json.loads(raw)["model"] == "coder"
    assert headers["X-Sanctum-Attempts"] == "brain=failed:not_ready; coder=ok"
    rig.start_fake("coder", "not_ready")
    pid = rig.fakes["coder"].pid
    rig.wait_health(lambda h: h["seats"]["coder"]["pid"] == pid
                    and h["seats"]["coder"]["state"] == "down")
    code, body = health(rig.url)
    assert code == 503 and body["routes"]["private"] == {
        "state": "loading", "rungs": {"brain": "loading", "coder": "down"}}
    code, headers, raw = http("POST", rig.url + "/v1/chat/completions",
                              body={"model": "private", "messages": MSG})
    err = json.loads(raw)["error"]
    assert code == 503 and err["code"] == "loading" and err["loading"] == ["brain"], err
    assert int(headers["Retry-After"]) > 0
    assert rig.counters()["proxy"]["load_waits"] == {"timeout": 1}
    assert rig.events("brain", "generate") == []


# -- a real `sanctum up` whose demo seat loads when the test says ------------------------

SLOW_LOAD = "tests.fakes.slow_load_worker"


@pytest.mark.slow
def test_sanctum_up_request_sent_while_loading_is_answered(tmp_path: Any) -> None:
    """`sanctum up` with the demo model, its load held until the test opens the gate:
    /health is 503 with the seat alive and `loading`; a request sent then waits, and is
    answered 200 by the seat once it is ready (never all_rungs_failed); /health turns
    200; `sanctum up` prints exactly one line, the ready line, and stops clean."""
    gate = tmp_path / "gate"
    s = Sanctum(env={"SANCTUM_WORKER_MODULE": SLOW_LOAD, "SANCTUM_TEST_LOAD_GATE": str(gate)},
                split_stdout=True)
    try:
        wait_for("the worker answers, loading", lambda: (h := s.health_status())[0] == 503
                 and h[1]["seats"]["demo"]["alive"] and h, timeout=120)
        sent = Sent(s.url, "demo")
        code, body = wait_for("the request waits", lambda: (h := s.health_status())[1]
                              ["seats"]["demo"]["waiting"] == 1 and h)
        assert code == 503 and body["status"] == "loading"
        assert body["seats"]["demo"]["state"] == "loading" and not body["seats"]["demo"]["ready"]
        assert body["routes"]["demo"] == {"state": "loading", "rungs": {"demo": "loading"}}
        assert sent.result is None and s.stdout() == ""
        gate.touch()
        code, headers, answer = sent.answer()
        assert code == 200, answer
        assert answer["model"] == "demo" and headers["X-Sanctum-Attempts"] == "demo=ok"
        assert answer["choices"][0]["message"]["content"]
        code, body = s.health_status()
        assert code == 200 and body["status"] == "ok"
        assert body["seats"]["demo"]["state"] == "ready"
        line = f"sanctum: ready at http://127.0.0.1:{s.port}/v1 (models: demo)\n"
        wait_for("the ready line", lambda: s.stdout() == line)
        proxy = json.loads(http("GET", s.url + "/counters")[2])["proxy"]
        assert proxy["load_waits"] == {"ready": 1} and proxy["fallbacks"] == {}
        s.remember_tree()
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop() == 0, s.logs()[-3000:]


@pytest.mark.slow
def test_sanctum_up_stops_when_no_seat_can_load() -> None:
    """`sanctum up` whose only seat fails to load (FATAL at once): it says so, prints no
    ready line, and stops with a failure, leaving no process behind."""
    s = Sanctum(env={"SANCTUM_WORKER_MODULE": SLOW_LOAD, "SANCTUM_TEST_LOAD_FAIL": "demo",
                     "SANCTUM_TEST_LOAD_GATE": "/nonexistent"}, split_stdout=True)
    try:
        deadline = time.monotonic() + 120
        while s.proc.poll() is None and time.monotonic() < deadline:
            s.remember_tree()  # its children, to prove them gone after
            time.sleep(0.05)
        code = s.proc.wait(1)
        out, logs = s.stdout(), s.logs()
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop() == 1 and code == 1
    assert out == ""
    assert "seat demo is FATAL" in logs and "no route can be served" in logs, logs[-3000:]


@pytest.mark.slow
def test_sanctum_up_ctrl_c_while_loading_stops_everything(tmp_path: Any) -> None:
    """Ctrl-C while `sanctum up` waits for its seat to load stops everything at once:
    no ready line, exit 0, no process or socket left."""
    s = Sanctum(env={"SANCTUM_WORKER_MODULE": SLOW_LOAD,
                     "SANCTUM_TEST_LOAD_GATE": str(tmp_path / "never")}, split_stdout=True)
    try:
        wait_for("the worker answers, loading", lambda: (h := s.health_status())[0] == 503
                 and h[1]["seats"]["demo"]["alive"], timeout=120)
        s.remember_tree()
        out = s.stdout()
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop(signal.SIGINT) == 0
    assert out == ""


@pytest.mark.slow
def test_sanctum_up_serves_what_is_ready_beside_a_fatal_seat(tmp_path: Any) -> None:
    """One seat loads, the other fails to (FATAL at once): `sanctum up` names the FATAL
    seat, prints the ready line for the route it can serve, and serves it; /health
    stays 503 (the other route is not ready)."""
    gate = tmp_path / "gate"
    gate.touch()
    port = free_port()
    model = os.environ.get("SANCTUM_TEST_MODEL", "builtin:demo")
    config = demo_config(port, seats=(("demo", model, "fp16", 1536),
                                      ("bad", model, "fp16", 1536)))
    s = Sanctum(config, port=port, split_stdout=True,
                env={"SANCTUM_WORKER_MODULE": SLOW_LOAD, "SANCTUM_TEST_LOAD_GATE": str(gate),
                     "SANCTUM_TEST_LOAD_FAIL": "bad"})
    try:
        line = f"sanctum: ready at http://127.0.0.1:{port}/v1 (models: demo)\n"
        wait_for("the ready line", lambda: s.stdout() == line, timeout=120)
        assert "seat bad is FATAL" in s.logs()
        code, body = s.health_status()
        assert code == 503 and body["routes"]["demo"]["state"] == "ready"
        # The proxy never heard from bad (it failed before its first pong): "loading"
        # within the spawn grace, "down" after it; never ready.
        assert body["routes"]["bad"]["state"] != "ready"
        code, headers, raw = http("POST", s.url + "/v1/chat/completions",
                                  body={"model": "demo", "messages": MSG, "max_tokens": 4})
        assert code == 200 and headers["X-Sanctum-Attempts"] == "demo=ok", raw
        s.remember_tree()
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop() == 0, s.logs()[-3000:]
