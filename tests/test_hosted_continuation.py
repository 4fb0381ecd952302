"""A stream that breaks after its commit is finished by the next rung, and every upstream
fault class ends as a complete answer or as the right error.

proxyd runs as a real process in front of two hosted rungs, `primary` and `backup`
(fault-injecting fake OpenAI-compatible servers on loopback, tests/fakes/fake_upstream.py),
which here know one answer of 60 words, as two providers of one model would: asked to
continue an answer (a trailing assistant message), a fake goes on after the words it was
given.  Timeouts in the rig: first token 1 s, stall 0.8 s, 3 tries per rung.  Each test
states what the client received, the attempts and segments, how many requests each
upstream saw, and what a continuing rung was asked.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shared.clock import ManualClock
from tests.hosted_rig import KEY, MSG, HostedRig, sse_data, streamed_text, text_of
from tests.procs import http

WORDS = [f"w{i}" for i in range(60)]
ANSWER = " ".join(WORDS)
WHOLE = ANSWER + " "  # the fake ends every word with a space


def words(n: int, start: int = 0) -> str:
    return "".join(w + " " for w in WORDS[start:start + n])


MakeRig = Callable[..., HostedRig]


@pytest.fixture
def make_rig() -> Iterator[MakeRig]:
    rigs: list[HostedRig] = []

    def make(**kw: Any) -> HostedRig:
        rig = HostedRig(answer=ANSWER, **kw)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        try:
            assert KEY not in rig.logs(), "the API key reached the proxy's log"
        finally:
            rig.stop()


def stream(rig: HostedRig, **extra: Any) -> tuple[dict[str, str], list[dict[str, Any]],
                                                  list[str]]:
    code, headers, raw = rig.chat(stream=True, max_tokens=100, **extra)
    assert code == 200, raw
    datas, names = sse_data(raw)
    return headers, datas, names


def finish_reasons(datas: list[dict[str, Any]]) -> list[str]:
    return [c["finish_reason"] for d in datas for c in d.get("choices", [])
            if c.get("finish_reason")]


def continued_ok(rig: HostedRig, headers: dict[str, str], datas: list[dict[str, Any]],
                 names: list[str], reason: str, sent: int) -> dict[str, Any]:
    """The checks every continued answer passes: the client got the whole answer once,
    with no seam, a finish and [DONE]; the headers (sent at commit) never said `ok` for
    the attempt still streaming; the last chunk and the trailer list both segments with
    their tokens and served counts; the backup was asked once, to go on after exactly
    the `sent` words the client had."""
    assert streamed_text(datas) == WHOLE
    assert finish_reasons(datas) == ["stop"] and names == ["[DONE]", "sanctum"]
    assert headers["X-Sanctum-Seat"] == "primary"
    assert headers["X-Sanctum-Attempts"] == "primary=streaming"
    last = next(d for d in reversed(datas) if "choices" in d)["sanctum"]
    trailer = datas[-1]["sanctum"]
    assert trailer == last
    assert last["attempts"] == f"primary=failed:{reason}; backup=ok"
    assert last["seat"] == "backup" and last["served"] == 1
    assert last["segments"] == [
        {"seat": "primary", "tokens": sent, "served": 0, "outcome": f"failed:{reason}"},
        {"seat": "backup", "tokens": 60 - sent, "served": 1, "outcome": "ok"}]
    # Each chunk names the rung that wrote it.
    models = [d["model"] for d in datas if d.get("choices")]
    assert models[0] == "primary" and models[-1] == "backup"
    assert rig.tries() == (1, 1)
    asked = rig.backup.requests[0]
    assert asked["messages"] == [*MSG, {"role": "assistant", "content": words(sent)}]
    assert asked["max_tokens"] == 100 - sent
    c = rig.counters()["proxy"]
    assert c["continuations"] == {"by_reason": {reason: 1}, "by_pair": {"primary>backup": 1},
                                  "prefill_refused": {}}
    assert c["midstream_aborts"] == 0 and c["answered_by"] == {"backup": 1}
    return last


# -- broken after bytes: continued ---------------------------------------------------


def test_a_stream_cut_after_40_of_60_tokens_is_finished_by_the_next_rung(
        make_rig: MakeRig) -> None:
    """The primary's connection closes after 40 words: the backup is given those 40 as
    its answer's start and sends the other 20; the client reads one complete answer."""
    rig = make_rig(primary=["cut:40"])
    continued_ok(rig, *stream(rig), "stream_cut", 40)


def test_a_stalled_stream_is_continued_after_the_stall_budget(make_rig: MakeRig) -> None:
    """20 words, then silence: after the stall budget (0.8 s) the backup finishes it, and
    the stalled primary is asked nothing more."""
    rig = make_rig(primary=["stall:20"])
    continued_ok(rig, *stream(rig), "stall_timeout", 20)
    gap = rig.backup.arrivals[0] - rig.primary.arrivals[0]
    assert 0.8 <= gap < 2.5, gap


def test_a_quiet_stream_gets_keep_alives_between_its_texts(make_rig: MakeRig) -> None:
    """While the stalled primary sends nothing (0.8 s of stall budget), the client's
    stream gets the door's keep-alive every keepalive_s (0.1 s): SSE comments between
    the primary's 20 words and the backup's rest, which the client's parser passes over
    (the answer reads whole)."""
    rig = make_rig(primary=["stall:20"], keepalive=0.1)
    code, headers, raw = rig.chat(stream=True, max_tokens=100)
    assert code == 200
    first, _, rest = raw.partition(b": keepalive\n\n")
    assert rest, "no keep-alive in the quiet"
    # after the primary's last word, before the backup's first
    assert WORDS[19].encode() in first and WORDS[20].encode() not in first
    assert WORDS[20].encode() in rest
    continued_ok(rig, headers, *sse_data(raw), "stall_timeout", 20)


def test_a_malformed_chunk_mid_stream_is_continued(make_rig: MakeRig) -> None:
    """An event that is not JSON after 20 words: never skipped, and the backup finishes."""
    rig = make_rig(primary=["malformed:20"])
    continued_ok(rig, *stream(rig), "malformed_stream", 20)


def test_usage_of_a_continued_answer_counts_every_rungs_tokens(make_rig: MakeRig) -> None:
    """include_usage: completion tokens are both segments' (40 + 20); the prompt is what
    the finishing rung was given (its upstream's own count)."""
    rig = make_rig(primary=["cut:40"])
    _, datas, names = stream(rig, stream_options={"include_usage": True})
    usage = next(d for d in datas if d.get("usage"))["usage"]
    assert usage["completion_tokens"] == 60 and usage["prompt_tokens"] == 7
    assert names == ["[DONE]", "sanctum"]


def test_the_openai_client_reads_a_continued_stream_as_one_answer(make_rig: MakeRig) -> None:
    """The OpenAI SDK streams the continued answer to its end, stops at [DONE] and never
    sees the trailer."""
    import openai

    rig = make_rig(primary=["cut:10"])
    client = openai.OpenAI(base_url=rig.url + "/v1", api_key="x", max_retries=0, timeout=30)
    chunks = list(client.chat.completions.create(model="m", messages=MSG,  # type: ignore[arg-type]
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == WHOLE
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_completion_is_continued_with_the_sent_text_as_the_prompts_tail(
        make_rig: MakeRig) -> None:
    """/v1/completions: the backup is asked with the prompt followed by the 30 words sent,
    and the client's text is the whole answer; /metrics counts the continuation."""
    rig = make_rig(primary=["cut:30"])
    code, _, raw = http("POST", rig.url + "/v1/completions",
                        body={"model": "m", "prompt": "Q: ", "stream": True,
                              "max_tokens": 100})
    datas, names = sse_data(raw)
    assert code == 200 and names == ["[DONE]", "sanctum"]
    assert "".join(c.get("text") or "" for d in datas for c in d.get("choices", [])) == WHOLE
    asked = rig.backup.requests[0]
    assert asked["prompt"] == "Q: " + words(30) and asked["max_tokens"] == 70
    metrics = http("GET", rig.url + "/metrics")[2].decode()
    assert ('sanctum_proxy_continuations_total{from_seat="primary",reason="stream_cut",'
            'to_seat="backup"} 1.0') in metrics


def test_a_continuation_that_breaks_too_ends_with_its_error(make_rig: MakeRig) -> None:
    """The backup breaks as well, after 10 of the 40 words left: no rung is left, so the
    stream ends with an error event naming the backup's failure and no [DONE]; both
    segments are listed."""
    rig = make_rig(primary=["cut:20"], backup=["cut:10"])
    _, datas, names = stream(rig)
    assert streamed_text(datas) == words(30)
    assert names == ["error"] and finish_reasons(datas) == []
    err = datas[-1]["error"]
    assert err["code"] == "midstream_failure" and err["seat"] == "backup"
    assert "stream_cut" in err["message"]
    assert err["attempts"] == "primary=failed:stream_cut; backup=failed:stream_cut"
    assert [(s["seat"], s["tokens"]) for s in err["segments"]] == [("primary", 20),
                                                                   ("backup", 10)]
    assert rig.tries() == (1, 1)
    assert rig.counters()["proxy"]["midstream_aborts"] == 1


def refusing_then_afresh(rig: HostedRig, datas: list[dict[str, Any]], names: list[str],
                         sent: int) -> None:
    """The checks of a stream the backup finished asked afresh after it refused the
    prefill: the whole answer once, a finish and [DONE]; the backup's second request
    is the original one (no assistant turn, the whole max_tokens); its segment counts
    only the words it added."""
    assert streamed_text(datas) == WHOLE
    assert finish_reasons(datas) == ["stop"] and names == ["[DONE]", "sanctum"]
    last = datas[-1]["sanctum"]
    assert last["attempts"] == "primary=failed:stream_cut; backup=rejected:400; backup=ok"
    assert [(s["seat"], s["tokens"]) for s in last["segments"]] == [("primary", sent),
                                                                   ("backup", 60 - sent)]
    prefilled, afresh = rig.backup.requests
    assert prefilled["messages"][-1] == {"role": "assistant", "content": words(sent)}
    assert afresh["messages"] == MSG and afresh["max_tokens"] == 100


def test_a_rung_that_refuses_prefill_finishes_the_answer_asked_afresh(
        make_rig: MakeRig) -> None:
    """The backup answers 400 to a trailing assistant message: it is remembered as
    taking no prefill (counted, logged once) and asked the request afresh; its answer
    replays the 20 words the client has, and only the 40 after them go on.  A second
    stream cut on the same route asks the backup afresh at once: no prefill."""
    rig = make_rig(primary=["cut:20"], backup=["refuse_prefill"])
    _, datas, names = stream(rig)
    refusing_then_afresh(rig, datas, names, 20)
    c = rig.counters()["proxy"]["continuations"]
    assert c["prefill_refused"] == {"backup": 1}
    assert c["by_reason"] == {"stream_cut": 1}
    rig.primary.set_script(["cut:30"])
    _, datas, names = stream(rig)
    assert streamed_text(datas) == WHOLE and names == ["[DONE]", "sanctum"]
    assert datas[-1]["sanctum"]["attempts"] == "primary=failed:stream_cut; backup=ok"
    assert len(rig.backup.requests) == 3 and rig.backup.requests[2]["messages"] == MSG
    c = rig.counters()["proxy"]["continuations"]
    assert c["prefill_refused"] == {"backup": 1} and c["by_reason"] == {"stream_cut": 2}
    assert rig.logs().count('"prefill_refused"') == 1
    assert rig.counters()["proxy"]["circuits"]["backup"] == "closed"


def test_a_messages_stream_is_finished_by_a_rung_that_refuses_prefill(
        make_rig: MakeRig) -> None:
    """The same at /v1/messages: the client's text deltas make the whole answer once,
    and the stream ends with message_stop (then the `sanctum` trailer)."""
    rig = make_rig(primary=["cut:25"], backup=["refuse_prefill"])
    code, _, raw = rig.messages(stream=True)
    assert code == 200, raw
    datas, names = sse_data(raw)
    text = "".join(d["delta"].get("text", "") for d in datas
                   if d.get("type") == "content_block_delta")
    assert text == WHOLE
    assert "error" not in names and names[-2:] == ["message_stop", "sanctum"]
    stops = [d["delta"].get("stop_reason") for d in datas if d.get("type") == "message_delta"]
    assert stops == ["end_turn"]
    assert [r["messages"] for r in rig.backup.requests][1] == MSG


def test_a_rung_set_to_take_no_prefill_is_never_sent_one(make_rig: MakeRig) -> None:
    """`prefill = false`: the backup is asked afresh from the start."""
    rig = make_rig(primary=["cut:20"], backup=["ok"], backup_prefill=False)
    _, datas, names = stream(rig)
    assert streamed_text(datas) == WHOLE and names == ["[DONE]", "sanctum"]
    assert datas[-1]["sanctum"]["attempts"] == "primary=failed:stream_cut; backup=ok"
    assert [r["messages"] for r in rig.backup.requests] == [MSG]
    assert rig.counters()["proxy"]["continuations"]["prefill_refused"] == {}


@pytest.mark.parametrize(("backup", "other", "ended"), [
    (["refuse_prefill", "cut:10"], None, "failed:stream_cut"),
    (["refuse_prefill"], "another answer altogether", "failed:replay_diverged")])
def test_a_rung_asked_afresh_that_cannot_finish_leaves_the_honest_error(
        make_rig: MakeRig, backup: list[str], other: str | None, ended: str) -> None:
    """Asked afresh, the backup breaks before it has replayed the 20 words sent, or
    answers something else: the client gets no word of it, and the stream ends with
    the error of the rung that broke (the primary's cut), every try listed."""
    rig = make_rig(primary=["cut:20"], backup=backup)
    if other is not None:
        rig.backup.answer = other
    _, datas, names = stream(rig)
    assert streamed_text(datas) == words(20) and names == ["error"]
    err = datas[-1]["error"]
    assert err["seat"] == "primary" and "stream_cut" in err["message"]
    assert err["attempts"] == f"primary=failed:stream_cut; backup=rejected:400; backup={ended}"
    assert rig.tries() == (1, 2)
    assert rig.counters()["proxy"]["circuits"]["backup"] == "closed"


def test_a_rung_whose_template_refuses_the_continuation_is_passed_over(
        make_rig: MakeRig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A continuing rung whose chat template refuses the chat with the answer so far
    (a 400 from admission, as a template of another model family raises): after the
    commit that is no client error to answer with a second response, but a rung that
    cannot continue. It is passed over, never called, and the stream ends with the
    error event of the rung that broke; the door counts it as a midstream error."""
    from proxyd.admission import Admission
    from shared.errors import BadRequest

    judge = Admission.judge

    async def refusing(self: Admission, seat: Any, gen: Any, memo: Any,
                       reported_cap: int = 0) -> Any:
        if seat.name == "backup" and gen.prefix:
            raise BadRequest("the template refuses a trailing assistant turn",
                             param="messages")
        return await judge(self, seat, gen, memo, reported_cap)

    monkeypatch.setattr(Admission, "judge", refusing)
    rig = make_rig(primary=["cut:20"], clock=ManualClock())
    _, datas, names = stream(rig)
    assert streamed_text(datas) == words(20) and names == ["error"]
    err = datas[-1]["error"]
    assert err["seat"] == "primary" and "stream_cut" in err["message"]
    assert err["attempts"] == "primary=failed:stream_cut; backup=skipped:template_refused"
    assert rig.tries() == (1, 0)
    proxy = rig.counters()["proxy"]
    assert proxy["door_errors"] == {"chat": {"midstream": 1}}
    assert proxy["door_requests"] == {"chat": 1}


def test_a_continuation_is_admitted_again_with_its_longer_prompt(make_rig: MakeRig) -> None:
    """The prompt with the answer so far must fit the continuing rung's cap: a backup
    whose cap (100 tokens past its margin) holds the question (an estimate of 21) but not
    the question with 50 words of answer (227) is skipped as over cap, never called, and
    the stream ends honestly."""
    rig = make_rig(primary=["cut:50"], backup_cap=1024 + 100)
    _, datas, names = stream(rig)
    assert names == ["error"] and streamed_text(datas) == words(50)
    err = datas[-1]["error"]
    assert err["seat"] == "primary"
    assert err["attempts"] == "primary=failed:stream_cut; backup=skipped:over_cap"
    assert err["over_cap"] == [{"seat": "backup", "prompt_tokens": 227, "cap": 100}]
    assert rig.tries() == (1, 0)
    # The question alone fits the backup.
    rig.primary.set_script(["status:401"])
    code, _, raw = rig.chat()
    assert code == 200 and text_of(raw) == WHOLE and rig.tries() == (2, 1)


# -- every fault class, one table ---------------------------------------------------------

P3 = "primary=failed:upstream_503; " * 3
FAULTS = [
    # primary's script, the seats of the answer's segments, its attempts, tries
    (["status:429:retry_after=1", "ok"], ["primary"],
     "primary=failed:upstream_429; primary=ok", (2, 0)),
    (["status:429", "ok"], ["primary"], "primary=failed:upstream_429; primary=ok", (2, 0)),
    (["status:500", "ok"], ["primary"], "primary=failed:upstream_500; primary=ok", (2, 0)),
    (["status:503"], ["backup"], P3 + "backup=ok", (3, 1)),
    (["reset", "ok"], ["primary"], "primary=failed:connection_reset; primary=ok", (2, 0)),
    (["silent_close:0.7"], ["backup"], "primary=failed:silent_close; backup=ok", (1, 1)),
    (["silent"], ["backup"], "primary=failed:first_token_timeout; backup=ok", (1, 1)),
    (["slow_first:20"], ["backup"], "primary=failed:first_token_timeout; backup=ok", (1, 1)),
    (["no_done"], ["primary"], "primary=ok", (1, 0)),
    (["status:400:context_length_exceeded"], ["backup"], "primary=rejected:400; backup=ok",
     (1, 1)),
    (["cut:40"], ["primary", "backup"], "primary=failed:stream_cut; backup=ok", (1, 1)),
    (["stall:20"], ["primary", "backup"], "primary=failed:stall_timeout; backup=ok", (1, 1)),
    (["malformed:20"], ["primary", "backup"], "primary=failed:malformed_stream; backup=ok",
     (1, 1)),
]


@pytest.mark.parametrize(("script", "seats", "attempts", "tries"), FAULTS,
                         ids=[f[0][0] for f in FAULTS])
def test_every_fault_class_ends_as_a_complete_answer(make_rig: MakeRig, script: list[str],
                                                     seats: list[str], attempts: str,
                                                     tries: tuple[int, int]) -> None:
    """Each upstream fault, streamed: the client gets the whole answer and [DONE], the
    attempts and segments are listed, and each upstream saw exactly the tries its fault
    allows: a silent rung is asked once, so it is never waited on twice."""
    rig = make_rig(primary=script)
    headers, datas, names = stream(rig)
    assert streamed_text(datas) == WHOLE and finish_reasons(datas) == ["stop"]
    assert names == (["[DONE]", "sanctum"] if len(seats) > 1 else ["[DONE]"])
    sanctum = next(d for d in reversed(datas) if "choices" in d)["sanctum"]
    assert sanctum["attempts"] == attempts
    assert [seg["seat"] for seg in sanctum["segments"]] == seats
    assert sum(seg["tokens"] for seg in sanctum["segments"]) == 60
    assert headers["X-Sanctum-Attempts"].endswith(f"{seats[0]}=streaming")
    assert rig.tries() == tries


def test_a_content_filter_400_is_the_clients_answer(make_rig: MakeRig) -> None:
    """A content-policy refusal is returned as it is, with its reason and the attempt;
    no retry, no other rung."""
    rig = make_rig(primary=["status:400:content_policy_violation"])
    code, _, raw = rig.chat(stream=True)
    err = json.loads(raw)["error"]
    assert code == 400 and err["code"] == "content_policy_violation"
    assert err["attempts"] == "primary=rejected:400" and rig.tries() == (1, 0)


# -- fault classes before any byte -----------------------------------------------------


def test_silent_then_closed_is_never_asked_again(make_rig: MakeRig) -> None:
    """An upstream that takes the request, stays silent 0.7 s and closes without a byte is
    a silent upstream (`silent_close`), not a reset: it is not tried again, and the
    backup answers; nothing waited twice on the silent rung."""
    rig = make_rig(primary=["silent_close:0.7", "ok"])
    code, headers, raw = rig.chat(stream=True)
    datas, names = sse_data(raw)
    assert code == 200 and headers["X-Sanctum-Seat"] == "backup"
    assert streamed_text(datas) == WHOLE and names == ["[DONE]"]
    assert body_attempts(datas) == "primary=failed:silent_close; backup=ok"
    assert rig.tries() == (1, 1)
    gap = rig.backup.arrivals[0] - rig.primary.arrivals[0]
    assert 0.6 <= gap < 1.5, gap


def test_a_reset_at_once_is_still_retried(make_rig: MakeRig) -> None:
    """A reset before any byte, at once, is transient: the same rung is tried again."""
    rig = make_rig(primary=["reset", "ok"])
    code, headers, raw = rig.chat()
    assert code == 200 and text_of(raw) == WHOLE
    assert headers["X-Sanctum-Attempts"] == "primary=failed:connection_reset; primary=ok"
    assert rig.tries() == (2, 0)


def test_a_first_byte_slower_than_its_budget_fails_over_once(make_rig: MakeRig) -> None:
    """A first byte 20 s away: the first-token budget (1 s here) fails over once; the
    primary is not asked again and the request never waits 20 s."""
    rig = make_rig(primary=["slow_first:20"])
    code, headers, raw = rig.chat(stream=True, timeout=10)
    datas, _ = sse_data(raw)
    assert code == 200 and headers["X-Sanctum-Seat"] == "backup"
    assert body_attempts(datas) == "primary=failed:first_token_timeout; backup=ok"
    assert rig.tries() == (1, 1)
    assert rig.backup.arrivals[0] - rig.primary.arrivals[0] < 2.0


def body_attempts(datas: list[dict[str, Any]]) -> str:
    return str(next(d for d in reversed(datas) if "sanctum" in d)["sanctum"]["attempts"])


# -- recovery ----------------------------------------------------------------------------


def test_a_primary_down_6_s_is_back_within_2_s_under_steady_traffic(make_rig: MakeRig) -> None:
    """Steady traffic, a request every 0.25 s of the proxy's clock; the primary answers 503
    for its first 6 s, then is healthy.  Every request is answered (by the backup while
    the primary is down); each half-open probe is one try; the primary answers again
    within 2 s of its recovery; and the primary saw a bounded number of tries."""
    clock = ManualClock()
    rig = make_rig(primary=["status:503"], cooldown=1.0, clock=clock)
    answered: list[tuple[float, str, str]] = []
    t = 0.0
    while t < 12.0:
        if t >= 6.0 and rig.primary.script != ["ok"]:
            rig.primary.set_script(["ok"])
        code, headers, raw = rig.chat()
        assert code == 200 and text_of(raw) == WHOLE
        answered.append((t, headers["X-Sanctum-Seat"], headers["X-Sanctum-Attempts"]))
        clock.advance(0.25)
        t += 0.25
    back = next(at for at, seat, _ in answered if seat == "primary")
    assert 6.0 <= back <= 8.0, answered
    assert all(seat == "primary" for at, seat, _ in answered if at >= back)
    probes = [a for at, seat, a in answered if a.startswith("primary=failed") and at > 1.0]
    assert probes and all(a == "primary=failed:upstream_503; backup=ok" for a in probes)
    # Three requests of three tries open the circuit, then one try per probe, then one
    # try for each request from the recovery on.
    served = sum(1 for _, seat, _ in answered if seat == "primary")
    assert len(rig.primary.requests) == 9 + len(probes) + served
    assert len(probes) <= 6


def test_the_circuit_counts_a_continued_failure(make_rig: MakeRig) -> None:
    """A rung that breaks mid-stream failed for real: three such answers (each finished by
    the backup) open its circuit, and the next request skips it."""
    rig = make_rig(primary=["cut:5"])
    for _ in range(3):
        _, datas, names = stream(rig)
        assert streamed_text(datas) == WHOLE and names[0] == "[DONE]"
    assert rig.counters()["proxy"]["circuits"]["primary"] == "open"
    _, headers, raw = rig.chat()
    assert headers["X-Sanctum-Attempts"] == "primary=skipped:circuit_open; backup=ok"
    assert json.loads(raw)["sanctum"]["segments"] == [
        {"seat": "backup", "tokens": 60, "served": 4, "outcome": "ok"}]
