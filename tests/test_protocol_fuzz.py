"""Fuzzing the frame readers: nothing a peer sends can stop a seat or seatd.

Two halves.  The pure readers (`protocol.read_request`, `read_control`, the seat
side's `read_frames`) get random bytes and mutated valid frames (truncated, bits
flipped, bytes cut or inserted, tags swapped, field values swapped for values of
other types) and must return a message or a `Refused` whose answer can be sent,
never raise.  Then a real seatd with a real worker on the demo model gets a burst of
hostile frames over its real sockets: each one is answered as the pure reader says,
nothing restarts, the next good request is served, and the counters say how many
were refused.

The suite runs a few seconds of it; a longer run raises the examples:

    SANCTUM_FUZZ_EXAMPLES=50000 pytest tests/test_protocol_fuzz.py -k pure -s --timeout=0

and prints how many inputs were tried and what each got (`FUZZ ...` lines);
SANCTUM_FUZZ_BURST=50000 does the same for the real sockets (`MEASURED` lines).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.utils.monitor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import protocol
from shared.protocol import (
    BadFrame,
    Cancel,
    ChatMessage,
    ControlError,
    Final,
    Generate,
    GetCounters,
    Ok,
    Ping,
    Pong,
    Refused,
    Rejected,
    RestartSeat,
    SamplingParams,
    Shutdown,
    StatusQuery,
)
from shared.seat_side import read_frames, refusal_reply
from tests.procs import Sanctum, free_port
from tests.test_seat_client import GEN, outcome_of, pair  # noqa: F401 (a fixture)

EXAMPLES = int(os.environ.get("SANCTUM_FUZZ_EXAMPLES", "600"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TALLY: collections.Counter[str] = collections.Counter()

# ---------------------------------------------------------------------------
# Strategies: valid messages, then ways to break their frames

text = st.text(max_size=12)
sampling = st.builds(
    SamplingParams,
    temperature=st.floats(0.0, protocol.MAX_TEMPERATURE),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    top_k=st.integers(0, protocol.INT64_MAX),
    max_tokens=st.integers(1, protocol.MAX_NEW_TOKENS),
    stop=st.lists(text, max_size=3).map(tuple),
    seed=st.none() | st.integers(-(2**63), 2**64 - 1),
)
generate = st.builds(
    Generate, request_id=text, stream=st.booleans(), params=sampling,
    messages=st.none() | st.lists(st.builds(ChatMessage, role=text, content=text),
                                  max_size=3).map(tuple),
    prompt=st.none() | text, kv=st.none() | st.sampled_from(["fp16", "q8"]),
    speculation=st.none() | st.booleans(), draft_depth=st.none() | st.integers(0, 16),
    prefix=st.none() | text,
    prefix_ids=st.none() | st.lists(st.integers(0, protocol.MAX_TOKEN_ID),
                                    max_size=4).map(tuple),
)
requests = st.one_of(
    generate, st.builds(Cancel, text), st.builds(Ping, sent_at=st.floats(allow_nan=False)),
    st.just(GetCounters()), st.builds(Shutdown, drain_s=st.floats(0.0, 100.0)),
)
controls = st.one_of(st.just(StatusQuery()), st.just(GetCounters()),
                     st.builds(RestartSeat, text))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                    st.text(max_size=8), st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
ALL_TAGS = sorted(protocol.REQUEST_TAGS | protocol.CONTROL_TAGS | protocol.REPLY_TAGS)


BYTE_OPS = ("truncate", "flip", "cut", "insert")
FIELD_OPS = ("tag", "value", "version", "drop")


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[msgspec.Struct],
            ops: tuple[str, ...] = BYTE_OPS + FIELD_OPS) -> bytes:
    """A valid frame, broken one way (sometimes twice)."""
    frame = protocol.encode(draw(valid))
    for _ in range(draw(st.integers(1, 2))):
        how = draw(st.sampled_from(ops))
        if how == "truncate":
            frame = frame[:draw(st.integers(0, max(len(frame) - 1, 0)))]
        elif how in ("flip", "cut", "insert") and frame:
            at = draw(st.integers(0, len(frame) - 1))
            if how == "flip":
                frame = frame[:at] + bytes([frame[at] ^ (1 << draw(st.integers(0, 7)))]) \
                    + frame[at + 1:]
            elif how == "cut":
                frame = frame[:at] + frame[at + draw(st.integers(1, 4)):]
            else:
                frame = frame[:at] + draw(st.binary(min_size=1, max_size=4)) + frame[at:]
        elif how in ("tag", "value", "version", "drop"):
            try:
                fields = msgspec.msgpack.decode(frame)
            except msgspec.DecodeError:
                continue  # already broken past reading
            if not isinstance(fields, dict):
                continue
            target = fields
            if how == "value" and isinstance(fields.get("params"), dict) and draw(st.booleans()):
                target = fields["params"]
            if how == "tag":
                target["type"] = draw(st.sampled_from(ALL_TAGS) | st.text(max_size=6) | values)
            elif how == "version":
                target["version"] = draw(st.integers(-3, 5) | values)
            elif target and how == "drop":
                del target[draw(st.sampled_from(sorted(target, key=str)))]
            elif target:
                target[draw(st.sampled_from(sorted(target, key=str)))] = draw(values)
            frame = msgspec.msgpack.encode(fields)
    return frame


any_payload = st.one_of(
    st.binary(max_size=256),
    values.map(msgspec.msgpack.encode),
    mutated(requests),
    mutated(requests, FIELD_OPS),  # frames that still parse: tags, types, values, versions
    mutated(controls),
)

# ---------------------------------------------------------------------------
# The pure readers


def tally(kind: str, result: object) -> None:
    TALLY[kind + ":inputs"] += 1
    if isinstance(result, Refused):
        TALLY[f"{kind}:refused:{result.reason}"] += 1
    else:
        TALLY[f"{kind}:taken:{type(result).__name__}"] += 1


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    for key in sorted(TALLY):
        print(f"FUZZ {key} {TALLY[key]}")


def assert_answerable(refused: Refused) -> None:
    """A refusal's answer is a frame any peer reads: BadFrame, or the request's 400."""
    assert refused.reason in protocol.BAD_FRAME_REASONS
    assert 0 < len(refused.error) <= protocol.ERROR_CHARS + 3
    answer = protocol.read_reply(protocol.encode(refusal_reply(refused, "s", 1, 1)))
    if refused.reason == "invalid_value" and refused.request_id is not None:
        assert isinstance(answer, Final) and answer.request_id == refused.request_id
        assert isinstance(answer.outcome, Rejected) and answer.outcome.status == 400
    else:
        assert isinstance(answer, BadFrame) and answer.reason == refused.reason
    control = protocol.control_reply_decoder.decode(
        protocol.encode(protocol.control_refusal(refused)))
    assert isinstance(control, ControlError) and control.reason == refused.reason


@FUZZ
@given(any_payload)
def test_pure_request_reader_never_raises(payload: bytes) -> None:
    """Any payload reads as a request or as a refusal with a sendable answer."""
    got = protocol.read_request(payload)
    tally("request", got)
    if isinstance(got, Refused):
        assert_answerable(got)
    else:
        assert isinstance(got, Generate | Cancel | Ping | GetCounters | Shutdown)
        assert getattr(got, "version", protocol.PROTOCOL_VERSION) == protocol.PROTOCOL_VERSION


@FUZZ
@given(any_payload, st.lists(st.binary(max_size=8), max_size=3), st.integers(0, 3))
def test_pure_multipart_readers_never_raise(payload: bytes, extra: list[bytes],
                                            at: int) -> None:
    """Any multipart shape reads on the seat's socket and on seatd's control socket."""
    parts = [*extra[:at], payload, *extra[at:]]
    _, seat = read_frames([b"peer", *parts])
    control = protocol.read_control_frames([b"peer", b"", *parts])
    tally("seat_frames", seat)
    tally("control_frames", control)
    for got in (seat, control):
        if isinstance(got, Refused):
            assert_answerable(got)
    if extra:
        assert isinstance(seat, Refused) and seat.reason == "wrong_parts"


@settings(max_examples=max(EXAMPLES // 6, 50), deadline=None, database=None)
@given(requests)
def test_pure_valid_requests_read_back(message: msgspec.Struct) -> None:
    """A message within the bounds reads back as itself: the bounds refuse only bad values."""
    assert protocol.read_request(protocol.encode(message)) == message


# ---------------------------------------------------------------------------
# The proxy's side: what it takes from a client never meets the protocol's bounds,
# and a refused Generate ends its attempt at once

wide_int = st.integers(-(2**70), 2**70) | st.integers(-3, 40)
client_field = {
    "temperature": st.floats(-1.0, 1e6) | st.floats(0.0, 2.0),
    "top_p": st.floats(-1.0, 2.0),
    "top_k": wide_int,
    "max_tokens": wide_int,
    "max_completion_tokens": wide_int,
    "seed": wide_int,
    "stop": st.text(max_size=300) | st.lists(st.text(max_size=300), max_size=20),
    "sanctum": st.fixed_dictionaries({}, optional={
        "kv": st.sampled_from(["fp16", "q8", "fp8"]), "draft_depth": st.integers(-2, 20),
        "speculation": st.booleans(), "solo": st.booleans()}),
}
client_body = st.fixed_dictionaries(
    {"model": st.just("brain"), "prompt": st.text(min_size=1, max_size=40)},
    optional=client_field)


@settings(max_examples=max(EXAMPLES // 3, 100), deadline=None, database=None)
@given(client_body)
def test_pure_whatever_the_proxy_takes_a_seat_takes(body: dict[str, Any]) -> None:
    """A completion body the proxy accepts (its limits are the default config's) becomes
    a Generate that a seat reads as such: the proxy is at least as strict as the seat."""
    from proxyd.doors.openai_api import overrides, parse_completion
    from shared.config import ProxyConfig
    from shared.errors import SanctumError

    try:
        req, prompt, params = parse_completion(json.dumps(body).encode(), ProxyConfig())
    except SanctumError:
        TALLY["proxy_body:refused_by_proxy"] += 1
        return
    gen = Generate("0123456789abcdef0123456789abcdef", req.stream, params, prompt=prompt,
                   **overrides(req))
    assert protocol.read_request(protocol.encode(gen)) == gen
    TALLY["proxy_body:taken_by_both"] += 1



async def test_a_badframe_naming_the_request_ends_its_attempt(pair) -> None:  # noqa: F811
    """A BadFrame that names the attempt's request (a seat of another version) fails it
    now, with the seat's reason, on a clock that never moved; garbage is counted."""
    client, seat, clock = pair
    before = clock()
    task, _ = await outcome_of(client)
    await seat.expect(Generate)
    await seat.sock.send_multipart([seat.peer, b"\xc1 garbage"])
    await seat.send(BadFrame("protocol version 2; this peer speaks version 3",
                             "wrong_version", GEN.request_id, speaks=3))
    final = await asyncio.wait_for(task, 5)
    assert final.outcome == protocol.Failed(
        "wrong_version", "protocol version 2; this peer speaks version 3")
    assert client.bad_frames == 1 and clock() == before


# ---------------------------------------------------------------------------
# A real seatd and worker

BODY_LIMIT = 65536
COMPLETION_LIMIT = 1024
FRAME_BOUND = protocol.max_frame_bytes(BODY_LIMIT, COMPLETION_LIMIT)
MODEL = os.environ.get("SANCTUM_TEST_MODEL", "builtin:demo")
CONFIG = f"""
[proxy]
listen = "127.0.0.1:{{port}}"
max_body_bytes = {BODY_LIMIT}
max_completion_tokens = {COMPLETION_LIMIT}

[seatd]
heartbeat_s = 0.5
drain_s = 5.0
backoff_initial_s = 0.2

[[seat]]
name = "demo"
model = "{MODEL}"
max_prompt_tokens = 1536

[[route]]
model = "demo"
ladder = ["demo"]
"""
BURST = int(os.environ.get("SANCTUM_FUZZ_BURST", "300"))  # hostile frames per socket
REPLY_MS = 60_000  # a frame unanswered this long is a hung receiver


def dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def reply_of(sock: zmq.Socket[Any]) -> list[bytes]:
    assert sock.poll(REPLY_MS), "no answer"
    return sock.recv_multipart()


def hostile_payloads(n: int, valid: list[msgspec.Struct], reader: Any) -> list[bytes]:
    """`n` broken frames that `reader` refuses: seeded mutations of valid ones."""
    rng = random.Random(20261201)
    out: list[bytes] = []
    while len(out) < n:
        frame = bytearray(protocol.encode(rng.choice(valid)))
        how = rng.randrange(4)
        if how == 0:
            frame = frame[:rng.randrange(len(frame))]
        elif how == 1:
            for _ in range(rng.randint(1, 6)):
                frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        elif how == 2:
            fields = msgspec.msgpack.decode(bytes(frame))
            key = rng.choice(sorted(fields))
            fields[key] = rng.choice([-5, 2**64 - 1, float("nan"), "x" * 300, [1], {"a": 1},
                                      None, True, b"\x00"])
            frame = bytearray(msgspec.msgpack.encode(fields))
        else:
            frame = bytearray(rng.randbytes(rng.randint(0, 64)))
        if isinstance(reader(bytes(frame)), Refused):
            out.append(bytes(frame))
    return out


def wait_dropped(sock: zmq.Socket[Any], payload: bytes) -> None:
    """Send `payload` and wait for the peer to drop the connection (its MAXMSGSIZE)."""
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.send(payload)
        assert monitor.poll(REPLY_MS), "the oversized frame did not drop its connection"
        event = zmq.utils.monitor.recv_monitor_message(monitor)
        assert event["event"] == zmq.EVENT_DISCONNECTED
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


@pytest.fixture(scope="module")
def seatd() -> Iterator[Sanctum]:
    """`sanctum seatd` with the demo seat, its worker answering pings."""
    s = Sanctum(CONFIG.format(port=free_port()), command="seatd")
    try:
        ctx: zmq.Context[Any] = zmq.Context()
        sock = dealer(ctx, f"ipc://{s.state}/seat-demo.sock")
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                sock.send(protocol.encode(Ping()))
                if sock.poll(500):
                    pong = protocol.reply_decoder.decode(sock.recv())
                    if isinstance(pong, Pong) and pong.ready:
                        break
                    time.sleep(0.1)  # loading: ask again in a moment
            else:
                raise AssertionError(f"the worker never got ready:\n{s.logs()[-3000:]}")
        finally:
            sock.close(linger=0)
            ctx.term()
        s.remember_tree()
        yield s
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop() == 0, s.logs()[-3000:]


@pytest.mark.slow
def test_a_real_worker_answers_every_hostile_frame_and_serves_the_next(seatd: Sanctum) -> None:
    """A burst of broken frames on the worker's socket: each answered as the pure reader
    says, one 10-MB frame over the bound drops only its sender's connection, then a good
    Generate is served by the same process and bad_frames equals what was sent."""
    ctx: zmq.Context[Any] = zmq.Context()
    endpoint = f"ipc://{seatd.state}/seat-demo.sock"
    sock = dealer(ctx, endpoint)
    try:
        sock.send(protocol.encode(Ping()))
        first = protocol.reply_decoder.decode(reply_of(sock)[0])
        assert isinstance(first, Pong)
        valid: list[msgspec.Struct] = [
            Generate("f1", False, SamplingParams(max_tokens=2), prompt="hi"),
            Ping(), Cancel("f2"), GetCounters()]
        sent: list[tuple[list[bytes], Refused]] = []
        for payload in hostile_payloads(BURST, valid, protocol.read_request):
            refused = protocol.read_request(payload)
            assert isinstance(refused, Refused)
            sent.append(([payload], refused))
        good = protocol.encode(Ping())
        for parts in ([good, good], [b"", good], [good, b"", good]):
            sent.append((parts, Refused("wrong_parts", "")))
        out_of_vocab = Generate("v1", True, SamplingParams(), prompt="x", prefix="a",
                                prefix_ids=(2**30,))
        sent.append(([protocol.encode(out_of_vocab)], Refused("invalid_value", "", "v1")))
        kinds: collections.Counter[str] = collections.Counter()
        for parts, refused in sent:
            sock.send_multipart(parts)
            answer = protocol.reply_decoder.decode(reply_of(sock)[0])
            if refused.reason == "invalid_value" and refused.request_id is not None:
                assert isinstance(answer, Final) and answer.request_id == refused.request_id
                assert isinstance(answer.outcome, Rejected) and answer.outcome.status == 400
                kinds["final_rejected_400"] += 1
            else:
                assert isinstance(answer, BadFrame) and answer.reason == refused.reason, answer
                kinds[f"bad_frame:{answer.reason}"] += 1
        print(f"\nMEASURED worker burst: {len(sent)} frames, answers {dict(kinds)}")

        big = dealer(ctx, endpoint)
        huge = Generate("h1", True, SamplingParams(), prompt="x" * 10_000_000)
        assert len(protocol.encode(huge)) > FRAME_BOUND
        wait_dropped(big, protocol.encode(huge))
        big.close(linger=0)

        sock.send(protocol.encode(Generate("ok1", False, SamplingParams(max_tokens=4,
                                                                        temperature=0.0),
                                           prompt="def main():\n")))
        while True:
            frame = protocol.reply_decoder.decode(reply_of(sock)[0])
            if isinstance(frame, Final):
                break
        assert frame.request_id == "ok1" and frame.outcome == Ok(), frame
        assert frame.usage.completion_tokens > 0
        sock.send(protocol.encode(GetCounters()))
        counters = protocol.reply_decoder.decode(reply_of(sock)[0])
        assert isinstance(counters, protocol.CountersReply)
        assert counters.counters["bad_frames"] == len(sent)
        assert counters.counters["bad_frames_by_reason"] == dict(
            collections.Counter(refused.reason for _, refused in sent))
        sock.send(protocol.encode(Ping()))
        last = protocol.reply_decoder.decode(reply_of(sock)[0])
        assert isinstance(last, Pong) and last.pid == first.pid
        assert last.incarnation == first.incarnation
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.slow
def test_seatd_control_answers_every_hostile_frame_and_serves_the_next(
        seatd: Sanctum) -> None:
    """The same on seatd's control socket: ControlError for each broken frame, an
    oversized one drops its sender, then a StatusQuery is served and counts them all."""
    ctx: zmq.Context[Any] = zmq.Context()
    endpoint = f"ipc://{seatd.state}/seatd.sock"
    sock = dealer(ctx, endpoint)
    try:
        valid: list[msgspec.Struct] = [StatusQuery(), GetCounters(), RestartSeat("nobody")]
        sent: list[tuple[list[bytes], str]] = []
        for payload in hostile_payloads(BURST, valid, protocol.read_control):
            refused = protocol.read_control(payload)
            assert isinstance(refused, Refused)
            sent.append(([b"", payload], refused.reason))
        good = protocol.encode(StatusQuery())
        for parts in ([good], [b"x", good], [b"", b"", good]):
            sent.append((parts, "wrong_parts"))
        kinds: collections.Counter[str] = collections.Counter()
        for parts, reason in sent:
            sock.send_multipart(parts)
            answer = protocol.control_reply_decoder.decode(reply_of(sock)[-1])
            assert isinstance(answer, ControlError) and answer.reason == reason, answer
            kinds[reason] += 1
        print(f"\nMEASURED control burst: {len(sent)} frames, ControlError by reason "
              f"{dict(kinds)}")

        big = dealer(ctx, endpoint)
        wait_dropped(big, b"x" * (protocol.CONTROL_MAX_FRAME_BYTES + 1))
        big.close(linger=0)

        sock.send_multipart([b"", protocol.encode(StatusQuery())])
        status = protocol.control_reply_decoder.decode(reply_of(sock)[-1])
        assert isinstance(status, protocol.StatusReply)
        assert status.bad_frames == len(sent)
        (row,) = status.seats
        assert row.name == "demo" and row.state in ("READY", "BUSY") and row.restarts == 0
    finally:
        sock.close(linger=0)
        ctx.term()
