"""On-demand seats through `sanctum up`: real seatd, proxyd and workers.

Three on-demand seats of the demo model with room for two (`max_loaded = 2`, and
separately a `memory_budget_mb` that fits two): nothing loads before its first request;
each route is answered by its own seat; the least recently used idle seat sleeps when
the third loads; a sleeping seat's next request wakes it; a seat with a stream in
flight is never put to sleep; with two seats busy there is no room, and the request
gets the one stated 503 (`no_room`, Retry-After, the budget and what holds it);
`keep_alive_s = 0` and a request's `keep_alive` put a seat to sleep as stated.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from typing import Any

import pytest

from tests.procs import Sanctum, http, running, wait_for

pytestmark = pytest.mark.slow

SEAT = """
[[seat]]
name = "{name}"
model = "builtin:demo"
max_prompt_tokens = 1536
kv_budget_mb = 64
prompt_cache_mb = 16
load = "on_demand"
{extra}
[[route]]
model = "{name}"
ladder = ["{name}"]
"""


def config(seatd: str, seats: dict[str, str]) -> Any:
    def make(port: int) -> str:
        body = "".join(SEAT.format(name=n, extra=extra) for n, extra in seats.items())
        # 10 missed heartbeats, not 3: on a 2-core machine, two seats decoding while a
        # third imports MLX and loads starve a worker's heartbeat for seconds
        return (f'[proxy]\nlisten = "127.0.0.1:{port}"\nliveness = 10\n\n'
                f"[seatd]\nliveness = 10\nbackoff_initial_s = 0.2\n{seatd}\n{body}")
    return make


def ask(s: Sanctum, route: str, **extra: Any) -> tuple[int, dict[str, str], dict[str, Any]]:
    body = {"model": route, "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 4, "temperature": 0, **extra}
    status, headers, raw = http("POST", f"{s.url}/v1/chat/completions", body, timeout=120)
    return status, headers, json.loads(raw)


def states(s: Sanctum) -> dict[str, str]:
    return {n: seat["state"] for n, seat in s.health()["seats"].items()}


def served_by(s: Sanctum, route: str) -> None:
    status, headers, body = ask(s, route)
    assert status == 200, body
    assert headers["X-Sanctum-Seat"] == route, headers


def wait_states(s: Sanctum, want: dict[str, str]) -> None:
    wait_for(f"seat states {want}", lambda: all(states(s)[n] == v for n, v in want.items()),
             timeout=60, logs=s.logs)


class Stream(threading.Thread):
    """A long streamed answer read to its end; `begun` is set at its first chunk."""

    def __init__(self, s: Sanctum, route: str) -> None:
        super().__init__(daemon=True)
        self.url, self.route = s.url, route
        self.begun = threading.Event()
        self.chunks = 0
        self.finish: str | None = None
        self.error: BaseException | None = None
        self.last = b""  # the last data line, to say how a stream ended

    def run(self) -> None:
        body = {"model": self.route, "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": 600, "temperature": 0.7, "seed": 1, "stream": True,
                # no end of text or turn (the demo's ids 0 and 2): it runs to its budget
                "logit_bias": {"0": -100, "2": -100}, "sanctum": {"speculation": False}}
        req = urllib.request.Request(f"{self.url}/v1/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                for line in r:
                    if not line.startswith(b"data: {"):
                        continue
                    self.last = line
                    chunk = json.loads(line[6:])
                    self.chunks += 1
                    self.begun.set()
                    for choice in chunk.get("choices", []):
                        self.finish = choice.get("finish_reason") or self.finish
        except BaseException as exc:  # seen by the test
            self.error = exc
            self.begun.set()


def seatd_counters(s: Sanctum) -> dict[str, Any]:
    return json.loads(http("GET", f"{s.url}/counters")[2])["seats"]


def test_three_on_demand_seats_with_room_for_two() -> None:
    seats = {"a": "", "b": "", "c": ""}
    with running(config("max_loaded = 2", seats), seats=()) as s:
        # nothing loads before its first request, and a sleeping seat is not a failure
        code, health = s.health_status()
        assert code == 200 and health["status"] == "ok", health
        assert states(s) == {"a": "sleeping", "b": "sleeping", "c": "sleeping"}
        assert all(seat["pid"] is None for seat in health["seats"].values())
        models = json.loads(http("GET", f"{s.url}/v1/models")[2])
        assert {m["id"] for m in models["data"]} == {"a", "b", "c"}
        served_by(s, "a")
        served_by(s, "b")
        assert states(s) == {"a": "ready", "b": "ready", "c": "sleeping"}
        # the third: the least recently used idle seat (a) sleeps to make room
        served_by(s, "c")
        wait_states(s, {"a": "sleeping", "b": "ready", "c": "ready"})
        # a sleeping seat's next request wakes it (b is now the least recently used)
        served_by(s, "a")
        wait_states(s, {"a": "ready", "b": "sleeping", "c": "ready"})
        pid_c = s.health()["seats"]["c"]["pid"]
        # a seat with a stream in flight is never put to sleep: c streams while b loads
        story = Stream(s, "c")
        story.start()
        assert story.begun.wait(120) and story.error is None
        served_by(s, "b")  # a (idle) sleeps for it, not c
        states_now = states(s)
        assert states_now["a"] == "sleeping" and states_now["c"] == "ready", states_now
        story.join(300)
        assert story.error is None and story.finish == "length", (story.error, story.last)
        # with b and c both busy there is no room for a: the one stated 503 (two streams
        # begun just now, so both are in flight when a is asked for)
        busy = [Stream(s, "b"), Stream(s, "c")]
        for stream in busy:
            stream.start()
        assert all(x.begun.wait(120) and x.error is None for x in busy)
        assert all(x.is_alive() for x in busy)
        status, headers, body = ask(s, "a")
        assert status == 503 and body["error"]["code"] == "no_room", body
        assert "Retry-After" in headers
        message = body["error"]["message"]
        assert "at most 2 loaded" in message and "b " in message and "c " in message
        for x in busy:
            x.join(300)
            assert x.error is None and x.finish == "length", (x.error, x.last)
        assert s.health()["seats"]["c"]["pid"] == pid_c  # never restarted under its stream
        counters = seatd_counters(s)
        assert counters["c"]["loads"] == 1 and counters["c"]["restarts"] == 0
        assert counters["a"]["sleeps"]["room"] >= 2 and counters["a"]["loads"] >= 1
        assert counters["c"]["load_ms"] > 0
        metrics = http("GET", f"{s.url}/metrics")[2].decode()
        assert 'sanctum_seat_state{seat="a",state="sleeping"} 1.0' in metrics
        assert "sanctum_seat_loads_total" in metrics or "sanctum_seat_loads{" in metrics


def test_a_memory_budget_that_fits_two_and_keep_alive() -> None:
    """The budget alone (about 90 MB estimated per seat, 200 MB budget) makes the room;
    keep_alive_s = 0 sleeps a seat after each answer, and a request's keep_alive
    replaces its seat's for that load."""
    seats = {"a": "", "b": "", "c": "keep_alive_s = 0"}
    with running(config("memory_budget_mb = 200", seats), seats=()) as s:
        served_by(s, "a")
        served_by(s, "b")
        # a request asking to be forgotten at once: b sleeps after its answer
        status, _, _ = ask(s, "b", sanctum={"keep_alive": 0})
        assert status == 200
        wait_states(s, {"b": "sleeping", "a": "ready"})
        # c (keep_alive_s = 0) sleeps after each answer, without evicting a
        served_by(s, "c")
        wait_states(s, {"c": "sleeping", "a": "ready"})
        served_by(s, "b")
        served_by(s, "c")  # a and b loaded: a (least recently used) makes room
        wait_states(s, {"a": "sleeping", "c": "sleeping"})
        counters = seatd_counters(s)
        assert counters["b"]["sleeps"] == {"request": 1}
        assert counters["c"]["sleeps"].get("idle", 0) >= 1
        assert counters["a"]["sleeps"] == {"room": 1}
        # the operator's view: each seat's estimate against the budget, and its state
        shown = cli(s, "status").stdout
        assert "memory budget 200 MB" in shown and "SLEEPING" in shown and "demand" in shown
        assert "90 MB estimated" in cli(s, "check").stdout  # 26 MB of weights, 64 of KV
        # `sanctum restart` wakes a sleeping seat (a, which made room for c)
        assert cli(s, "restart", "a").returncode == 0
        wait_states(s, {"a": "ready"})
        served_by(s, "a")


def cli(s: Sanctum, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sanctum.cli", *args, "--config", str(s.config)],
                          env=s.env, capture_output=True, text=True, timeout=60)


def test_a_seat_that_cannot_wake_fails_at_once(tmp_path: Any) -> None:
    """An on-demand seat whose model went away after start: seatd refuses the wake
    at once, so the request ends with the route's failure (no load wait), the attempt
    names it, and the seat stays asleep."""
    import shutil

    from shared.builtin import resolve_model

    model = tmp_path / "gone"
    shutil.copytree(resolve_model("builtin:demo"), model)
    seat = SEAT.format(name="a", extra="").replace('"builtin:demo"', json.dumps(str(model)))

    def make(port: int) -> str:
        return f'[proxy]\nlisten = "127.0.0.1:{port}"\nheartbeat_s = 0.5\n{seat}'

    with running(make, seats=()) as s:
        shutil.rmtree(model)
        status, _, body = ask(s, "a")
        assert status == 503 and body["error"]["code"] == "all_rungs_failed", body
        assert body["error"]["attempts"] == "a=skipped:wake_failed", body
        assert states(s) == {"a": "sleeping"}
