"""A device that stops computing ends its worker, and seatd starts a fresh one
(`seatd.device_probe`).

A failed step or prefill is a row's fault as long as the device still computes: the
rows it held end with the error and the others decode on.  Where the device no longer
computes (a sticky CUDA error), every row ends with the error, the engine stops, and the
worker exits DEVICE_LOST; seatd restarts it, and the next request is served.  Such a
fault cannot be produced on this machine's CPU: it is injected (`SANCTUM_FAULT_DEVICE`,
a prefill that raises and a probe that fails from then on), through the engine's and the
worker's real paths.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import openai
import pytest

from seatd import device_probe
from seatd.batch import Engine
from seatd.engine_io import Transcript, Work
from shared import exitcodes
from shared.protocol import Generate, SamplingParams
from tests.demo_engine import demo_engine
from tests.procs import Sanctum, assert_gone, http, packaged_config, running, wait_for

MARKER = "<<lose the device>>"


def test_probe_computes_on_this_device_and_reports_a_failing_one() -> None:
    assert device_probe.broken() is None

    def fails() -> None:
        raise RuntimeError("an illegal memory access was encountered")

    assert "illegal memory access" in repr(device_probe.broken(fails))


def test_exit_code_names_the_lost_device_and_is_not_fatal() -> None:
    assert exitcodes.describe(exitcodes.DEVICE_LOST) == "exit:81 (device_lost)"
    assert exitcodes.DEVICE_LOST not in exitcodes.FATAL_AT_ONCE  # restarted, with backoff


@dataclass
class Running:
    eng: Engine
    thread: threading.Thread
    rang: threading.Event
    lost: list[BaseException] = field(default_factory=list)
    device_fails: bool = False

    def probe(self) -> None:
        if self.device_fails:
            raise RuntimeError("the device is gone")
        device_probe.probe()


@pytest.fixture
def engine() -> Iterator[Running]:
    rang = threading.Event()
    eng = demo_engine(rang.set)
    run = Running(eng, threading.Thread(target=eng.run, daemon=True), rang)
    eng.probe, eng.on_device_lost = run.probe, run.lost.append
    run.thread.start()
    yield run
    eng.stop()
    run.thread.join(timeout=60)
    assert not run.thread.is_alive()


# No end of sequence (the demo's are 2 and 0): a row decodes until its max_tokens.
ENDLESS = SamplingParams(max_tokens=2000, temperature=0.0, logit_bias=((2, -100.0), (0, -100.0)))


def submit(r: Running, rid: str, params: SamplingParams, device_fault: bool = False) -> None:
    r.eng.submit(Work(Generate(rid, False, params, prompt="x"),
                      list(r.eng.tokenizer.encode(f"def {rid}(n):")), "fp16",
                      device_fault=device_fault))


def until(r: Running, told: Transcript, done: object) -> None:
    while not done():  # type: ignore[operator]
        assert r.rang.wait(60), "the engine said nothing"
        r.rang.clear()
        told.read(r.eng.outbox)


def test_a_failed_prefill_on_a_working_device_ends_its_row_alone(engine: Running) -> None:
    told = Transcript()
    submit(engine, "long", ENDLESS)
    until(engine, told, lambda: told.texts.get("long"))  # decoding
    submit(engine, "bad", SamplingParams(max_tokens=8), device_fault=True)
    until(engine, told, lambda: "bad" in told.ended)
    assert "injected device fault" in repr(told.error("bad"))
    assert engine.lost == [] and not engine.eng.stopped
    submit(engine, "next", SamplingParams(max_tokens=8, temperature=0.0))
    until(engine, told, lambda: "next" in told.ended)
    assert told.error("next") is None
    assert "long" not in told.ended  # the decoding row went on through both


def test_a_lost_device_ends_every_row_and_stops_the_engine(engine: Running) -> None:
    told = Transcript()
    submit(engine, "long", ENDLESS)
    until(engine, told, lambda: told.texts.get("long"))
    engine.device_fails = True
    submit(engine, "bad", SamplingParams(max_tokens=8), device_fault=True)
    until(engine, told, lambda: {"bad", "long"} <= set(told.ended))
    assert "injected device fault" in repr(told.error("bad"))
    assert "injected device fault" in repr(told.error("long"))  # not served to its end
    engine.thread.join(timeout=60)
    assert engine.eng.stopped and not engine.thread.is_alive()
    assert [repr(e) for e in engine.lost] == [repr(RuntimeError("the device is gone"))]


def test_a_failed_step_on_a_lost_device_stops_the_engine(engine: Running) -> None:
    """The same after a decoding step failed (not a prefill): its rows end with the
    step's error, and the engine stops."""
    told = Transcript()
    submit(engine, "long", ENDLESS)
    until(engine, told, lambda: told.texts.get("long"))

    def lost_step(*args: object) -> None:
        raise RuntimeError("a step on a lost device")

    engine.device_fails = True
    engine.eng._plain_step = lost_step  # type: ignore[method-assign]
    until(engine, told, lambda: "long" in told.ended)
    assert "a step on a lost device" in repr(told.error("long"))
    engine.thread.join(timeout=60)
    assert engine.eng.stopped and not engine.thread.is_alive()
    assert [repr(e) for e in engine.lost] == [repr(RuntimeError("the device is gone"))]


@pytest.fixture(scope="module")
def up() -> Iterator[Sanctum]:
    with running(packaged_config, env={"SANCTUM_FAULT_DEVICE": MARKER}) as s:
        yield s


@pytest.mark.slow
def test_worker_exits_device_lost_and_seatd_serves_again(up: Sanctum) -> None:
    """Through `sanctum up` with the packaged default seat: the request that lost the
    device fails (a 5xx, not a hang), the worker exits 81, seatd starts it again, and
    the next request is served by the new incarnation."""
    client = openai.OpenAI(base_url=up.url + "/v1", api_key="x", max_retries=0, timeout=120)
    before = json.loads(http("GET", up.url + "/counters")[2])["seats"]["demo"]
    pid = up.worker_pid()
    with pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(
            model="demo", max_tokens=8,
            messages=[{"role": "user", "content": f"hello {MARKER}"}])
    assert failed.value.status_code >= 500
    # the worker itself ended the row with the device's error (not a lost worker's)
    assert isinstance(failed.value.body, dict)
    assert failed.value.body["attempts"] == "demo=failed:internal_error", failed.value.body
    assert_gone({pid}, timeout=60)
    wait_for("the worker started again",
             lambda: (h := up.health()["seats"]["demo"])["ready"] and h["pid"] != pid,
             timeout=180, logs=up.logs)
    up.remember_tree()
    events = [json.loads(line) for line in up.logs().splitlines() if line.startswith("{")]
    assert any(e.get("event") == "device_lost" for e in events)
    exits = [e.get("last_exit") or "" for e in events if e.get("event") == "seat_state"]
    assert any("device_lost" in x and "(exit:81)" in x for x in exits), exits
    r = client.chat.completions.create(model="demo", max_tokens=4,
                                       messages=[{"role": "user", "content": "hello"}])
    assert r.choices[0].message.content is not None
    after = json.loads(http("GET", up.url + "/counters")[2])["seats"]["demo"]
    assert after["incarnation"] > before["incarnation"]
    assert after["served"] == before["served"] + 1
