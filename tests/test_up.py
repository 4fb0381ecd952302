"""`sanctum up` end to end: the openai client, a real seat process, real signals."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import openai
import psutil
import pytest

from seatd.backend import backend
from shared.config import SeatConfig
from tests.procs import Sanctum, assert_gone, http, running, wait_for

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "def fibonacci(n):"}]


@pytest.fixture(scope="module")
def up() -> Iterator[Sanctum]:
    """One `sanctum up` for the module; leaving it is the SIGTERM test: `running` sends
    SIGTERM and proves proxyd, seatd and every worker gone, no socket file left."""
    with running() as s:
        assert len(s.remember_tree()) >= 4, "expected up, proxyd, seatd and a worker"
        yield s


@pytest.fixture
def client(up: Sanctum) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_client_chat_and_stream(up: Sanctum, client: openai.OpenAI) -> None:
    """The official client gets a completion and a stream; both name the answering seat."""
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=PROMPT, max_tokens=24, temperature=0)
    done = raw.parse()
    assert raw.headers["x-sanctum-seat"] == "demo"
    assert int(raw.headers["x-sanctum-served"]) >= 1
    assert raw.headers["x-sanctum-attempts"] == "demo=ok"
    assert raw.headers["x-request-id"]
    assert done.model == "demo"
    assert done.choices[0].message.content
    assert done.usage is not None and done.usage.completion_tokens > 0
    assert done.choices[0].finish_reason in ("stop", "length")

    chunks = list(client.chat.completions.create(
        model="demo", messages=PROMPT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content
    assert all(c.model == "demo" for c in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_stream_equals_sync(client: openai.OpenAI, temperature: float, endpoint: str) -> None:
    """For the same request and seed, streamed text equals sync text byte for byte."""
    args = dict(model="demo", max_tokens=40, temperature=temperature, seed=1234, top_p=0.95)
    if endpoint == "chat":
        sync = client.chat.completions.create(messages=PROMPT, **args)
        stream = client.chat.completions.create(messages=PROMPT, stream=True, **args)
        a = sync.choices[0].message.content
        b = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    else:
        prompt = "import os\n\ndef list_files(path):\n"
        sync = client.completions.create(prompt=prompt, **args)
        stream = client.completions.create(prompt=prompt, stream=True, **args)
        a = sync.choices[0].text
        b = "".join(c.choices[0].text for c in stream if c.choices)
    assert a and a == b


def test_seed_fixes_sampled_answer(client: openai.OpenAI) -> None:
    """The same seed at temperature 0.7 gives the same answer; the seed matters."""
    def ask(seed: int) -> str:
        r = client.completions.create(model="demo", prompt="class Stack:\n", max_tokens=40,
                                      temperature=0.9, seed=seed)
        return r.choices[0].text
    assert ask(7) == ask(7)
    assert len({ask(s) for s in (1, 2, 3)}) > 1


BAD = [
    (b"{this is not json", 400),
    (json.dumps({"model": "demo", "messages": "hi"}).encode(), 400),
    (json.dumps({"model": "demo", "messages": PROMPT, "max_tokens": -3}).encode(), 400),
    (json.dumps({"model": "demo", "messages": PROMPT, "temperature": 9}).encode(), 400),
    (json.dumps({"model": "nope", "messages": PROMPT}).encode(), 404),
]


@pytest.mark.parametrize(("raw", "status"), BAD)
def test_bad_requests_then_good(up: Sanctum, raw: bytes, status: int) -> None:
    """Malformed requests get OpenAI-shaped 4xx errors and the next request is served."""
    code, _, body = http("POST", up.url + "/v1/chat/completions", raw=raw)
    assert code == status
    err = json.loads(body)["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    code, _headers, body = http("POST", up.url + "/v1/chat/completions",
                               body={"model": "demo", "messages": PROMPT, "max_tokens": 4})
    assert code == 200, body
    assert json.loads(body)["model"] == "demo"


def test_models_health_counters_metrics(up: Sanctum) -> None:
    """The operator endpoints answer with the routes, seat health and both counter sets."""
    code, _, body = http("GET", up.url + "/v1/models")
    assert code == 200 and [m["id"] for m in json.loads(body)["data"]] == ["demo"]
    assert up.health()["seats"]["demo"]["ready"] is True
    code, _, body = http("GET", up.url + "/counters")
    data = json.loads(body)
    assert data["proxy"]["requests"] >= 1
    seat = data["seats"]["demo"]
    assert seat["served"] >= 1 and seat["prompt_tokens"] > 0 and seat["completion_tokens"] > 0
    assert seat["device"].startswith(f"{backend()}: ")  # what computes, in the seat's words
    assert data["proxy"]["answered_by"]["demo"] <= seat["served"]
    code, _, body = http("GET", up.url + "/metrics")
    text = body.decode()
    assert code == 200
    assert 'sanctum_seat_served_total{seat="demo"}' in text
    assert "sanctum_proxy_requests_total" in text
    # The batch's state is a gauge (from the seat's heartbeat), its steps a counter.
    assert '# TYPE sanctum_seat_rows_active gauge' in text
    assert 'sanctum_seat_kv_bytes{seat="demo"}' in text
    # What MLX holds in the seat's process, by its own accounting, as gauges: the loaded
    # model's arrays at least, never more live now than at its peak.
    assert 0 < seat["mlx_active_bytes"] <= seat["mlx_peak_bytes"], seat
    assert seat["mlx_cache_bytes"] >= 0
    assert '# TYPE sanctum_seat_mlx_active_bytes gauge' in text
    assert 'sanctum_seat_mlx_peak_bytes{seat="demo"}' in text
    assert 'sanctum_seat_batch_steps_total{label="1",seat="demo"}' in text
    assert 'sanctum_seat_batch_step_us_total{label="1",seat="demo"}' in text
    health = up.health()["seats"]["demo"]
    assert health["max_batch"] == 16
    assert isinstance(health["rows"], int) and isinstance(health["kv_bytes"], int)


def test_idle_seat_hands_back_mlx_cache(up: Sanctum, client: openai.OpenAI) -> None:
    """The default seat, idle for `seatd.idle_trim.AFTER_S`, hands MLX's freed buffers
    back without another request (its gauge reads 0, its log says how much), and a seeded
    answer after that is the one before it, byte for byte."""
    def seat() -> dict[str, int]:
        return dict(json.loads(http("GET", up.url + "/counters")[2])["seats"]["demo"])

    def trims() -> list[float]:  # each trim's freed MiB, from the seat's log
        lines = (json.loads(line) for line in up.logs().splitlines()
                 if '"mlx_cache_trimmed"' in line)
        return [float(e["freed_mb"]) for e in lines if e.get("event") == "mlx_cache_trimmed"]

    args: dict[str, object] = dict(model="demo", messages=PROMPT, max_tokens=32,
                                   temperature=0.7, seed=77)
    earlier = len(trims())
    before = client.chat.completions.create(**args)  # type: ignore[call-overload]
    freed = wait_for("the idle seat's MLX cache handed back",
                     lambda: trims()[earlier:], timeout=60, logs=up.logs)
    assert freed[0] > 0, "the request left nothing cached: nothing was shown"
    assert seat()["mlx_cache_bytes"] == 0
    after = client.chat.completions.create(**args)  # type: ignore[call-overload]
    assert after.choices[0].message.content == before.choices[0].message.content


def test_default_seat_bounds_mlx_cache_by_its_kv_budget(up: Sanctum) -> None:
    """A seat without a memory budget still bounds the freed buffers MLX keeps
    (`seatd.memory.cache_limit`: its KV bytes, not MLX's 95% of the device), as its log
    says once loaded."""
    events = [json.loads(line) for line in up.logs().splitlines() if '"memory_budget"' in line]
    seat = [e for e in events if e.get("event") == "memory_budget"]
    assert seat, "the seat never logged its memory figures"
    kv_mb = float(seat[-1]["kv_mb"])
    assert kv_mb == float(SeatConfig(name="demo", model="builtin:demo").kv_budget_mb)
    assert float(seat[-1]["cache_limit_mb"]) == kv_mb  # no memory budget: its KV bytes


def test_killed_worker_is_restarted_and_serves_again(up: Sanctum,
                                                     client: openai.OpenAI) -> None:
    """SIGKILL of the worker: seatd restarts it, `served` continues, incarnation goes up."""
    client.completions.create(model="demo", prompt="x = ", max_tokens=2)
    before = json.loads(http("GET", up.url + "/counters")[2])["seats"]["demo"]
    pid = up.worker_pid()
    os.kill(pid, signal.SIGKILL)
    assert_gone({pid}, timeout=10)
    wait_for("the worker restarted",
             lambda: (h := up.health()["seats"]["demo"])["ready"] and h["pid"] != pid,
             timeout=120, logs=up.logs)
    up.remember_tree()
    r = client.completions.create(model="demo", prompt="y = ", max_tokens=2)
    assert r.model == "demo"
    after = json.loads(http("GET", up.url + "/counters")[2])["seats"]["demo"]
    assert after["incarnation"] > before["incarnation"]
    assert after["served"] == before["served"] + 1


def test_sigterm_to_seatd_alone_leaves_nothing() -> None:
    """`sanctum seatd` stops its workers on SIGTERM and leaves no process or socket."""
    s = Sanctum(command="seatd")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(s.remember_tree()) < 2:
            time.sleep(0.1)
        workers = s.remember_tree() - {s.proc.pid}
        assert workers, "seatd spawned no worker"
        assert all(psutil.pid_exists(p) for p in workers)
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop() == 0


def test_a_terminal_hang_up_leaves_nothing() -> None:
    """A closing terminal sends SIGHUP to its whole foreground group: `sanctum up` stops
    everything in order (no process, no socket file left), as on SIGTERM."""
    s = Sanctum()
    try:
        s.wait_ready()
        tree = s.remember_tree()
        assert len(tree) >= 4, "expected up, proxyd, seatd and a worker"
        os.killpg(s.proc.pid, signal.SIGHUP)  # the group `up` leads, as a terminal's
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop() == 0


def test_packaged_default_answers_with_code() -> None:
    """`sanctum up` with no config serves the demo pair, which answers a chat with code."""
    s = Sanctum(packaged=True)
    try:
        s.wait_ready(("demo",))
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        raw = client.chat.completions.with_raw_response.create(
            model="demo", max_tokens=64, temperature=0,
            messages=[{"role": "user",
                       "content": 'def is_even(n):\n    """Return True if n is even."""'}])
        text = raw.parse().choices[0].message.content or ""
        assert raw.headers["x-sanctum-seat"] == "demo"
        assert raw.headers["x-sanctum-speculation"] in ("accelerated",
                                                        "declined:not_profitable")
        assert any(word in text for word in ("return", "def ", "if ", "==", "%")), text
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop() == 0
