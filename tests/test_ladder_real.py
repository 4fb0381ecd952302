"""The ladder with real demo-model seats under seatd: kills, fallbacks, reconciliation."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from tests.procs import Sanctum, assert_gone, demo_config, http, running

pytestmark = pytest.mark.slow

ROUTES = '\n[[route]]\nmodel = "private"\nladder = ["brain", "coder"]\n'


@pytest.fixture(scope="module")
def pair() -> Iterator[Sanctum]:
    model = os.environ.get("SANCTUM_TEST_MODEL", "builtin:demo")
    # brain's small cap makes long prompts skip it (cap-aware ladder).
    seats = (("brain", model, "fp16", 256), ("coder", model, "q8", 1536))
    with running(lambda port: demo_config(port, seats=seats, routes=ROUTES),
                 ("brain", "coder")) as s:
        yield s


def client(s: Sanctum) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)


def counters(s: Sanctum) -> dict:
    return json.loads(http("GET", s.url + "/counters")[2])


def kill_brain(s: Sanctum) -> int:
    pid = s.worker_pid("brain")
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_brain_back(s: Sanctum, old_pid: int) -> None:
    assert_gone({old_pid}, timeout=10)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        h = s.health()["seats"]["brain"]
        if h["ready"] and h["pid"] != old_pid:
            s.remember_tree()
            return
        time.sleep(0.1)
    raise AssertionError("brain did not come back")


def test_kill_before_request_falls_back_and_names_coder(pair: Sanctum) -> None:
    """brain SIGKILLed just before a request: coder answers, the client sees `coder`."""
    old = kill_brain(pair)
    r = client(pair).chat.completions.with_raw_response.create(
        model="private", messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=8, temperature=0)
    assert r.parse().model == "coder"
    assert r.headers["x-sanctum-attempts"].startswith("brain=failed:")
    assert r.headers["x-sanctum-attempts"].endswith("coder=ok")
    wait_brain_back(pair, old)


def _kill_when_busy(s: Sanctum, out: list[int]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        h = s.health()["seats"]["brain"]
        if h["busy"]:
            out.append(kill_brain(s))
            return
        time.sleep(0.01)


def _streamed(s: Sanctum, kill_after: int | None,
              killed: list[int]) -> tuple[str, list[str], list[dict[str, object]]]:
    """A seeded completion streamed from the `private` route, brain SIGKILLed after
    `kill_after` chunks: (its whole text, the seat named by each chunk, its segments)."""
    stream = client(s).completions.create(
        model="private", prompt="import os\n", stream=True, max_tokens=120, temperature=1.0,
        seed=1, extra_body={"sanctum": {"kv": "fp16"}})  # both seats on one KV lane
    texts, seats, segments = [], [], []
    for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            seats.append(chunk.model)
        extra = chunk.model_extra or {}
        if "sanctum" in extra:
            segments = extra["sanctum"]["segments"]
        if kill_after is not None and len(seats) == kill_after and not killed:
            killed.append(kill_brain(s))
    return "".join(texts), seats, segments


def test_kill_mid_generation(pair: Sanctum) -> None:
    """Killed mid-stream, a seeded answer is continued by coder (same weights, same KV
    lane) from the position after the tokens already sent, and the client's text equals
    the uninterrupted answer byte for byte; killed mid-sync, coder answers instead."""
    before = counters(pair)["proxy"]
    whole, seats, _ = _streamed(pair, None, [])
    assert set(seats) == {"brain"} and len(whole) > 40
    killed: list[int] = []
    continued, seats, segments = _streamed(pair, 2, killed)
    assert killed, "brain was never killed"
    assert seats[0] == "brain" and seats[-1] == "coder"
    assert [(seg["seat"], seg["outcome"]) for seg in segments] == [
        ("brain", "failed:worker_lost"), ("coder", "ok")]
    assert all(int(seg["tokens"]) > 0 for seg in segments)  # type: ignore[call-overload]
    assert continued == whole
    after = counters(pair)["proxy"]
    assert after["midstream_aborts"] == before["midstream_aborts"]
    assert after["continuations"]["by_pair"].get("brain>coder", 0) == \
        before["continuations"]["by_pair"].get("brain>coder", 0) + 1
    wait_brain_back(pair, killed.pop())

    t = threading.Thread(target=_kill_when_busy, args=(pair, killed))
    t.start()
    r = client(pair).completions.with_raw_response.create(
        model="private", prompt="import os\n", max_tokens=200, temperature=1.0, seed=1)
    t.join()
    assert killed, "brain never became busy"
    assert r.parse().model == "coder"
    assert r.headers["x-sanctum-attempts"] == "brain=failed:worker_lost; coder=ok"
    wait_brain_back(pair, killed.pop())


def test_client_disconnect_stops_real_generation(pair: Sanctum) -> None:
    """A client that leaves mid-stream: the answering seat counts the request cancelled."""
    before = {n: c["cancelled"] for n, c in counters(pair)["seats"].items()}
    stream = client(pair).completions.create(model="private", prompt="class A:\n", stream=True,
                                             max_tokens=1500, temperature=1.0, seed=3)
    for i, chunk in enumerate(stream):
        seat = chunk.model  # brain, or coder while brain's circuit is still open
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if counters(pair)["seats"][seat]["cancelled"] == before[seat] + 1:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the seat never counted the cancellation")
    # `busy` comes from the seat's next pong, up to one heartbeat later.
    deadline = time.monotonic() + 5
    while pair.health()["seats"][seat]["busy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pair.health()["seats"][seat]["busy"]


def test_answered_by_reconciles_with_real_seats(pair: Sanctum) -> None:
    """After a run with a kill and fallbacks, answered_by deltas equal served deltas."""
    c0 = counters(pair)
    for i in range(6):
        if i == 2:
            old = kill_brain(pair)
        if i == 4:
            wait_brain_back(pair, old)
        r = client(pair).chat.completions.create(
            model="private", messages=[{"role": "user", "content": f"x = {i}"}],
            max_tokens=4, stream=bool(i % 2))
        if i % 2:
            list(r)
    c1 = counters(pair)
    for seat in ("brain", "coder"):
        answered = c1["proxy"]["answered_by"].get(seat, 0) - \
            c0["proxy"]["answered_by"].get(seat, 0)
        served = c1["seats"][seat]["served"] - c0["seats"][seat]["served"]
        assert answered == served, (seat, answered, served)
    assert c1["proxy"]["answered_by"]["coder"] > c0["proxy"]["answered_by"].get("coder", 0)


def test_over_cap_prompt_skips_small_rung(pair: Sanctum) -> None:
    """A prompt over brain's cap skips it without calling it; coder, with room, answers."""
    prompt = "def f(x):\n    return x\n" * 40  # a few hundred tokens
    r = client(pair).completions.with_raw_response.create(model="private", prompt=prompt,
                                                          max_tokens=4)
    assert r.parse().model == "coder"
    assert r.headers["x-sanctum-attempts"] == "brain=skipped:over_cap; coder=ok"


def test_prompt_over_every_cap_is_413_with_numbers(pair: Sanctum) -> None:
    """Over every allowed cap: 413 context_length_exceeded with the numbers, never truncated."""
    before = counters(pair)
    prompt = "value = compute(value) + 1\n" * 400
    code, _, body = http("POST", pair.url + "/v1/completions",
                         body={"model": "private", "prompt": prompt, "max_tokens": 4})
    err = json.loads(body)["error"]
    assert code == 413 and err["code"] == "context_length_exceeded"
    assert err["limit"] == "proxy_cap" and err["seat"] == "coder"
    assert err["cap"] == 1536 - 64 and err["margin"] == 64
    assert err["prompt_tokens"] > err["cap"]
    assert err["attempts"] == "brain=skipped:over_cap; coder=skipped:over_cap"
    after = counters(pair)
    assert after["proxy"]["over_cap"] == before["proxy"]["over_cap"] + 1
    assert after["proxy"]["over_cap_prompts"]["max"] >= err["prompt_tokens"]
    # Neither seat was called: their counters did not move.
    for seat in ("brain", "coder"):
        assert after["seats"][seat]["rejected"] == before["seats"][seat]["rejected"]
    assert after["proxy"]["cap_disagreements"] == 0
