"""Continuous batching through `sanctum up` with the packaged default seat (adaptive
speculation on the demo pair): eight concurrent seeded requests of different lengths,
sampling parameters, doors and KV lanes decode as rows of one batch.

- each streamed answer equals its own sync answer sent in the same batch conditions
  (all eight at once, the same way);
- a client that leaves mid-stream and a row whose prefill fails (an injected fault)
  end alone: the six others still give the same answers;
- the seat's counters reconcile with what the clients got: served, completion tokens,
  cancelled, failed, and every served request accelerated or declined with a reason;
- the rows were admitted together (/health) and decoded in shared forwards
  (`batch_steps` by batch size).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from seatd.counters import STAGES
from tests.lanes import rows_round_apart
from tests.procs import Sanctum, packaged_config, running, wait_for
from tests.spec_models import snippet

pytestmark = pytest.mark.slow

MARKER = "<<fail this row>>"
# (door, kv lane, temperature, top_p, seed, max_tokens, prompt length in chars, stop)
REQUESTS: list[tuple[str, str, float, float, int, int, int, list[str] | None]] = [
    ("chat", "fp16", 0.0, 1.0, 1, 28, 200, None),
    ("completions", "fp16", 0.7, 0.9, 2, 24, 900, None),
    ("chat", "q8", 1.0, 1.0, 3, 16, 400, None),
    ("completions", "q8", 0.4, 0.95, 4, 32, 120, ["\n\n\n"]),
    ("completions", "fp16", 0.0, 1.0, 5, 12, 1500, None),
    ("chat", "fp16", 0.8, 0.8, 6, 24, 60, None),
    ("completions", "q8", 0.0, 1.0, 7, 20, 700, None),
    ("chat", "fp16", 0.6, 1.0, 8, 30, 300, None),
]


@pytest.fixture(scope="module")
def up() -> Iterator[Sanctum]:
    with running(packaged_config, env={"SANCTUM_FAULT_ROW": MARKER}) as s:
        yield s


@pytest.fixture(scope="module")
def client(up: Sanctum) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key="x", max_retries=0, timeout=300)


def ask(client: openai.OpenAI, i: int, stream: bool, *, leave_after: int | None = None,
        fail: bool = False) -> dict[str, Any]:
    door, kv, temperature, top_p, seed, max_tokens, length, stop = REQUESTS[i]
    prompt = snippet(length) + (MARKER if fail else "")
    args: dict[str, Any] = dict(model="demo", max_tokens=max_tokens, temperature=temperature,
                                top_p=top_p, seed=seed, stop=stop,
                                extra_body={"sanctum": {"kv": kv}})
    if door == "chat":
        messages = [{"role": "user", "content": prompt}]
        if not stream:
            r = client.chat.completions.create(messages=messages, **args)  # type: ignore[arg-type]
            assert r.usage is not None
            return {"text": r.choices[0].message.content or "", "tokens": r.usage.completion_tokens,
                    "sanctum": r.model_extra["sanctum"]}  # type: ignore[index]
        chunks = client.chat.completions.create(messages=messages, stream=True,
                                                stream_options={"include_usage": True},
                                                **args)  # type: ignore[arg-type]
        def piece(c: Any) -> str:
            return (c.choices[0].delta.content or "") if c.choices else ""
    else:
        if not stream:
            c = client.completions.create(prompt=prompt, **args)
            assert c.usage is not None
            return {"text": c.choices[0].text, "tokens": c.usage.completion_tokens,
                    "sanctum": c.model_extra["sanctum"]}  # type: ignore[index]
        chunks = client.completions.create(prompt=prompt, stream=True,
                                           stream_options={"include_usage": True}, **args)
        def piece(c: Any) -> str:
            return c.choices[0].text if c.choices else ""
    text, tokens, seen, facts = "", 0, 0, None
    for chunk in chunks:
        seen += 1
        if leave_after is not None and seen >= leave_after:
            chunks.close()
            return {"left": True}
        text += piece(chunk)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        facts = (chunk.model_extra or {}).get("sanctum", facts)
    return {"text": text, "tokens": tokens, "sanctum": facts}


def all_at_once(client: openai.OpenAI, stream: bool, leave: int | None = None,
                fail: int | None = None) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    go = threading.Barrier(len(REQUESTS))

    def one(i: int) -> None:
        go.wait()
        try:
            out[i] = ask(client, i, stream, leave_after=3 if i == leave else None,
                         fail=i == fail)
        except openai.APIStatusError as exc:
            out[i] = {"status": exc.status_code, "error": exc.body}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert len(out) == len(REQUESTS)
    return out


def seat(up: Sanctum) -> dict[str, Any]:
    import json

    from tests.procs import http

    return json.loads(http("GET", up.url + "/counters")[2])["seats"]["demo"]


@rows_round_apart
def test_rows_batch_stream_equals_sync_and_faults_stay_in_their_row(
        up: Sanctum, client: openai.OpenAI) -> None:
    before = seat(up)
    seen: list[dict[str, Any]] = []
    watching = threading.Event()

    def watch() -> None:  # /health reports the batch live, from the seat's heartbeats
        while not watching.is_set():
            seen.append(up.health()["seats"]["demo"])
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        streamed = all_at_once(client, stream=True)
    finally:
        watching.set()
        watcher.join()
    assert max(h["rows"] for h in seen) >= 4, seen  # admitted together, not queued
    assert max(h["kv_bytes"] for h in seen) > 0
    synced = all_at_once(client, stream=False)
    for i in range(len(REQUESTS)):
        assert streamed[i]["text"] == synced[i]["text"], (i, REQUESTS[i])
        assert streamed[i]["tokens"] == synced[i]["tokens"] > 0, i
        assert streamed[i]["sanctum"]["seat"] == "demo"

    # One client leaves after three chunks, one row fails in its prefill.
    leave, fail = 1, 4
    faulted = all_at_once(client, stream=True, leave=leave, fail=fail)
    assert faulted[leave] == {"left": True}
    assert faulted[fail]["status"] >= 500, faulted[fail]
    for i in set(range(len(REQUESTS))) - {leave, fail}:
        assert faulted[i]["text"] == streamed[i]["text"], i

    served = [a for run in (streamed, synced, faulted) for a in run.values() if "text" in a]

    def cancel_counted() -> dict[str, Any] | None:
        now = seat(up)
        return now if now["cancelled"] > before["cancelled"] else None

    # The cancel reaches the seat after the client left.
    after = wait_for("the seat counting the cancel", cancel_counted, timeout=30, logs=up.logs)
    assert after["served"] - before["served"] == len(served) == 3 * len(REQUESTS) - 2
    assert after["completion_tokens"] - before["completion_tokens"] == sum(
        a["tokens"] for a in served)
    assert after["cancelled"] - before["cancelled"] == 1
    assert after["failed"] - before["failed"] == 1
    declined = sum(after["declined"].values()) - sum(before["declined"].values())
    assert after["accelerated"] - before["accelerated"] + declined == len(served)
    states = {a["sanctum"]["speculation"] for a in served}
    assert states <= {"accelerated"} | {s for s in states if s.startswith("declined:")}
    sizes = {int(k): v for k, v in after["batch_steps"].items()}
    assert max(sizes) >= 2, sizes  # rows really decoded in one forward
    # every size's steps have their time beside them, a positive time a step
    took = {int(k): v for k, v in after["batch_step_us"].items()}
    assert set(took) == set(sizes) and all(took[k] > 0 for k in sizes), (took, sizes)
    # where the engine's time went: its decode steps are the plain and verify parts with
    # the drafter prefills taken in them (the rest of those are the prefill's)
    parts = {k: v - before.get("engine_us", {}).get(k, 0) for k, v in after["engine_us"].items()}
    assert parts["prefill"] > 0 and parts["plain"] > 0 and parts["other"] > 0, parts
    steps_us = sum(took.values()) - sum(int(v) for v in before["batch_step_us"].values())
    decode_us = parts["plain"] + parts.get("verify", 0)
    rounding = sum(after["engine_calls"].values())  # a microsecond a count at most
    assert decode_us - rounding <= steps_us <= decode_us + parts.get("drafter_prefill", 0) \
        + rounding, (parts, steps_us)
    # a plain step's time by stage, within the plain part
    stages = {k: v - before.get("plain_step_us", {}).get(k, 0)
              for k, v in after["plain_step_us"].items()}
    assert set(stages) == set(STAGES) and all(v > 0 for v in stages.values()), stages
    assert sum(stages.values()) <= parts["plain"] + len(STAGES) * rounding, (stages, parts)
    assert after["rows_active"] == 0 or after["rows_active"] <= len(REQUESTS)
