"""Hosted rungs under every upstream fault.

proxyd runs as a real process; its route `m` has two hosted rungs, `primary`
and `backup`, each a fault-injecting fake OpenAI-compatible server on loopback
(tests/fakes/fake_upstream.py).  Each test states what the caller received and
how many requests each upstream saw, then proves the proxy still serves a
healthy request.  Timeouts in the rig: first token 1 s, stall 0.8 s, at most 3
tries per rung, back-off 0.05-0.2 s, Retry-After honoured up to 3 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from shared.clock import ManualClock
from tests.hosted_rig import (
    KEY,
    HostedRig,
    body_of,
    sse_data,
    streamed_text,
    text_of,
)
from tests.procs import wait_for

PRIMARY = "primary says hi "
BACKUP = "backup answers here "

MakeRig = Callable[..., HostedRig]


@pytest.fixture
def make_rig() -> Iterator[MakeRig]:
    rigs: list[HostedRig] = []

    def make(*args: object, **kw: object) -> HostedRig:
        rig = HostedRig(*args, **kw)  # type: ignore[arg-type]
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        try:
            logs = rig.logs()
            assert KEY not in logs, "the API key reached the proxy's log"
        finally:
            rig.stop()


def still_serves(rig: HostedRig) -> None:
    """After the fault, with both upstreams healthy again, a request is answered in full."""
    rig.primary.set_script(["ok"])
    rig.backup.set_script(["ok"])
    code, headers, raw = rig.chat()
    assert code == 200, raw
    assert text_of(raw) in (PRIMARY, BACKUP)
    assert headers["X-Sanctum-Attempts"].endswith("=ok")
    assert KEY not in raw.decode() and KEY not in json.dumps(headers)


def answered(raw: bytes, headers: dict[str, str], seat: str) -> dict[str, object]:
    body = body_of(raw)
    assert headers["X-Sanctum-Seat"] == seat
    assert body["model"] == seat
    assert body["sanctum"]["seat"] == seat
    assert body["sanctum"]["upstream_model"] == f"{seat}-v{2 if seat == 'primary' else 7}"
    assert body["choices"][0]["finish_reason"] == "stop"
    return body


# -- retried on the same rung ---------------------------------------------------


def test_429_with_retry_after_is_honoured_then_answered(make_rig: MakeRig) -> None:
    """429 with Retry-After: 1 waits about a second, tries the same rung again, which answers."""
    rig = make_rig(primary=["status:429:retry_after=1", "ok"])
    code, headers, raw = rig.chat(timeout=10)
    assert code == 200
    answered(raw, headers, "primary")
    assert text_of(raw) == PRIMARY
    assert headers["X-Sanctum-Attempts"] == "primary=failed:upstream_429; primary=ok"
    first, second = rig.primary.arrivals
    assert second - first >= 1.0  # the retry came after the Retry-After, not before
    assert rig.tries() == (2, 0)
    still_serves(rig)


def test_a_client_gone_during_the_back_off_is_never_tried_for_again(make_rig: MakeRig) -> None:
    """The client leaves while the rung waits out a Retry-After: when the wait ends the
    attempt ends as a disconnect, with no second try upstream and no other rung asked."""
    rig = make_rig(primary=["status:429:retry_after=2", "ok"])
    with pytest.raises(OSError):  # the client gives up after 0.5 s and closes
        rig.chat(timeout=0.5)
    wait_for("the departed client noticed",
             lambda: rig.counters()["proxy"].get("client_disconnects", 0), timeout=10,
             logs=rig.logs)
    assert rig.tries() == (1, 0)
    still_serves(rig)


def test_429_with_retry_after_too_long_moves_on_at_once(make_rig: MakeRig) -> None:
    """A Retry-After longer than the rung may wait (3 s here): the next rung answers at once."""
    rig = make_rig(primary=["status:429:retry_after=30"])
    # Waiting out the 30 s Retry-After would hit this request's 10 s guard.
    code, headers, raw = rig.chat(timeout=10)
    assert code == 200
    answered(raw, headers, "backup")
    assert headers["X-Sanctum-Attempts"] == "primary=failed:upstream_429; backup=ok"
    assert rig.tries() == (1, 1)
    still_serves(rig)


def test_429_without_retry_after_backs_off_then_answers(make_rig: MakeRig) -> None:
    """429 without Retry-After: jittered back-off, two more tries, the third answers."""
    rig = make_rig(primary=["status:429", "status:429", "ok"])
    code, headers, raw = rig.chat()
    assert code == 200
    answered(raw, headers, "primary")
    assert headers["X-Sanctum-Attempts"] == \
        "primary=failed:upstream_429; primary=failed:upstream_429; primary=ok"
    assert rig.tries() == (3, 0)
    still_serves(rig)


def test_500_once_is_retried(make_rig: MakeRig) -> None:
    """One 500: the same rung is tried again and answers; the backup is never asked."""
    rig = make_rig(primary=["status:500", "ok"])
    code, headers, raw = rig.chat()
    assert code == 200 and text_of(raw) == PRIMARY
    answered(raw, headers, "primary")
    assert headers["X-Sanctum-Attempts"] == "primary=failed:upstream_500; primary=ok"
    assert rig.tries() == (2, 0)
    c = rig.counters()["proxy"]
    assert c["attempts"]["primary"] == {"failed": 1, "ok": 1}
    assert c["answered_by"] == {"primary": 1}
    still_serves(rig)


def test_503_persistent_uses_the_budget_then_falls_back(make_rig: MakeRig) -> None:
    """A 503 that persists: three tries (the budget), then the backup answers."""
    rig = make_rig(primary=["status:503"])
    code, headers, raw = rig.chat()
    assert code == 200 and text_of(raw) == BACKUP
    answered(raw, headers, "backup")
    assert headers["X-Sanctum-Attempts"] == ("primary=failed:upstream_503; " * 3) + "backup=ok"
    assert rig.tries() == (3, 1)
    c = rig.counters()["proxy"]
    assert c["attempts"]["primary"] == {"failed": 3}
    assert c["answered_by"] == {"backup": 1}
    assert c["fallbacks"] == {"upstream_503": 1}
    assert rig.counters()["hosted"] == {"primary": {"served": 0}, "backup": {"served": 1}}
    still_serves(rig)


def test_503_on_every_rung_is_a_503_for_the_client(make_rig: MakeRig) -> None:
    """Both rungs down with 503: the client gets 503 all_rungs_failed listing every try."""
    rig = make_rig(primary=["status:503"], backup=["status:503"])
    code, _, raw = rig.chat()
    err = body_of(raw)["error"]
    assert code == 503 and err["code"] == "all_rungs_failed"
    assert err["attempts"] == ("primary=failed:upstream_503; " * 3
                               + "backup=failed:upstream_503; " * 2 + "backup=failed:upstream_503")
    assert rig.tries() == (3, 3)
    still_serves(rig)


def test_reset_before_headers_is_retried(make_rig: MakeRig) -> None:
    """A connection reset before any byte is transient: tried again on the same rung."""
    rig = make_rig(primary=["reset", "ok"])
    code, headers, raw = rig.chat()
    assert code == 200 and text_of(raw) == PRIMARY
    assert headers["X-Sanctum-Attempts"] == "primary=failed:connection_reset; primary=ok"
    assert rig.tries() == (2, 0)
    still_serves(rig)


# -- silent and slow upstreams: never waited for twice ---------------------------


def test_no_response_at_all_falls_back_after_first_token_timeout(make_rig: MakeRig) -> None:
    """An upstream that never answers: one first-token timeout (1 s), no retry, backup answers."""
    rig = make_rig(primary=["silent"])
    code, headers, raw = rig.chat(timeout=10)
    assert code == 200 and text_of(raw) == BACKUP
    assert headers["X-Sanctum-Attempts"] == "primary=failed:first_token_timeout; backup=ok"
    # The backup was asked only after the primary's first-token timeout (1 s), and only
    # once. The timer starts before the primary's request is read, so the gap between
    # the two arrivals can fall short of 1 s by the time that read takes.
    gap = rig.backup.arrivals[0] - rig.primary.arrivals[0]
    assert 0.9 <= gap < 1.9, gap
    assert rig.tries() == (1, 1)
    still_serves(rig)


def test_slow_first_token_falls_back_without_retry(make_rig: MakeRig) -> None:
    """Headers at once but the first token after 3 s: one timeout at 1 s, then the backup."""
    rig = make_rig(primary=["slow_first:3"])
    code, headers, raw = rig.chat(timeout=10)
    assert code == 200 and text_of(raw) == BACKUP
    assert headers["X-Sanctum-Attempts"] == "primary=failed:first_token_timeout; backup=ok"
    assert rig.tries() == (1, 1)
    # A first token slower than usual but within the timeout is simply an answer.
    rig.primary.set_script(["slow_first:0.4"])
    code, headers, raw = rig.chat()
    assert code == 200 and text_of(raw) == PRIMARY and headers["X-Sanctum-Attempts"] == "primary=ok"
    still_serves(rig)


# -- stream hygiene ----------------------------------------------------------------


def test_stream_cut_mid_answer_is_never_complete(make_rig: MakeRig) -> None:
    """Cut after two words with no rung able to continue (the backup answers 503):
    streamed, an error event naming the cut and no [DONE]; non-stream, nothing was sent,
    so the request falls back from the start (tests/test_hosted_continuation.py has the
    continued answers)."""
    rig = make_rig(primary=["cut:2"], backup=["status:503"])
    code, headers, raw = rig.chat(stream=True)
    datas, names = sse_data(raw)
    assert code == 200 and headers["X-Sanctum-Seat"] == "primary"
    assert headers["X-Sanctum-Attempts"] == "primary=streaming"
    assert streamed_text(datas) == "primary says "
    assert names == ["error"] and "[DONE]" not in names
    err = datas[-1]["error"]
    assert err["code"] == "midstream_failure" and "stream_cut" in err["message"]
    assert err["seat"] == "primary"
    assert err["attempts"] == "primary=failed:stream_cut; " + "backup=failed:upstream_503; " * 2 \
        + "backup=failed:upstream_503"
    assert not any(c.get("finish_reason") for d in datas for c in d.get("choices", []))
    assert rig.tries() == (1, 3)
    rig.backup.set_script(["ok"])
    code, headers, raw = rig.chat()
    assert code == 200 and text_of(raw) == BACKUP
    assert headers["X-Sanctum-Attempts"] == "primary=failed:stream_cut; backup=ok"
    assert rig.tries() == (2, 4)
    c = rig.counters()["proxy"]
    assert c["midstream_aborts"] == 1 and c["answered_by"] == {"backup": 1}
    still_serves(rig)


def test_stream_stall_ends_with_error_event(make_rig: MakeRig) -> None:
    """Two words then silence, on a ladder that cannot continue (the backup's key is
    wrong): after the 0.8 s stall timeout, an error event, no [DONE]."""
    rig = make_rig(primary=["stall:2"], backup=["status:401"])
    code, headers, raw = rig.chat(stream=True)
    datas, names = sse_data(raw)
    assert code == 200 and streamed_text(datas) == "primary says "
    assert names == ["error"] and "stall_timeout" in datas[-1]["error"]["message"]
    assert rig.tries() == (1, 1)
    rig.backup.set_script(["ok"])
    code, headers, raw = rig.chat()
    assert code == 200 and text_of(raw) == BACKUP
    assert headers["X-Sanctum-Attempts"] == "primary=failed:stall_timeout; backup=ok"
    assert rig.tries() == (2, 2)
    still_serves(rig)


def test_malformed_chunk_before_commit_falls_back(make_rig: MakeRig) -> None:
    """An event that is not JSON before any text: no retry, the backup answers (stream too)."""
    rig = make_rig(primary=["malformed:0"])
    code, headers, raw = rig.chat(stream=True)
    datas, names = sse_data(raw)
    assert code == 200 and headers["X-Sanctum-Seat"] == "backup"
    assert headers["X-Sanctum-Attempts"] == "primary=failed:malformed_stream; backup=streaming"
    assert datas[-1]["sanctum"]["attempts"] == "primary=failed:malformed_stream; backup=ok"
    assert streamed_text(datas) == BACKUP and names == ["[DONE]"]
    assert rig.tries() == (1, 1)
    still_serves(rig)


def test_malformed_chunk_after_commit_is_a_terminal_error(make_rig: MakeRig) -> None:
    """An event that is not JSON after text was sent, and no rung to continue: an error
    event, never a short answer."""
    rig = make_rig(primary=["malformed:2"], backup=["status:404"])
    code, headers, raw = rig.chat(stream=True)
    datas, names = sse_data(raw)
    assert code == 200 and headers["X-Sanctum-Seat"] == "primary"
    assert streamed_text(datas) == "primary says "
    assert names == ["error"] and "malformed_stream" in datas[-1]["error"]["message"]
    assert rig.tries() == (1, 1)
    still_serves(rig)


def test_missing_done_is_finalized_at_once_with_usage(make_rig: MakeRig) -> None:
    """finish_reason and usage without [DONE]: complete at once, with the upstream's usage."""
    rig = make_rig(primary=["no_done"])
    _, headers, raw = rig.chat()
    body = answered(raw, headers, "primary")
    assert text_of(raw) == PRIMARY
    assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["completion_tokens"] == 3
    # An upstream that sends both and then holds the connection open is not waited for.
    rig.primary.set_script(["no_done_hold"])
    # The upstream holds the connection for an hour: waiting for [DONE] would hit the guard.
    _, _, raw = rig.chat(stream=True, timeout=10, stream_options={"include_usage": True})
    datas, names = sse_data(raw)
    assert names == ["[DONE]"] and streamed_text(datas) == PRIMARY
    assert datas[-1]["usage"]["completion_tokens"] == 3
    assert datas[-1]["sanctum"]["upstream_model"] == "primary-v2"
    assert rig.tries() == (2, 0)
    still_serves(rig)


def test_upstream_ignoring_stream_is_read_whole(make_rig: MakeRig) -> None:
    """A LAN server that answers one JSON body to a streaming request still answers."""
    rig = make_rig(primary=["json"])
    _, headers, raw = rig.chat()
    body = answered(raw, headers, "primary")
    assert text_of(raw) == PRIMARY and body["usage"]["completion_tokens"] == 3
    assert rig.tries() == (1, 0)
    still_serves(rig)


# -- deterministic upstream errors: never retried -----------------------------------


def test_400_context_length_moves_to_the_next_rung(make_rig: MakeRig) -> None:
    """context_length_exceeded: not retried, the next rung takes it; if none can, a 400."""
    rig = make_rig(primary=["status:400:context_length_exceeded"])
    code, headers, raw = rig.chat()
    assert code == 200 and text_of(raw) == BACKUP
    assert headers["X-Sanctum-Attempts"] == "primary=rejected:400; backup=ok"
    assert rig.tries() == (1, 1)
    assert rig.counters()["proxy"]["fallbacks"] == {"context_length_exceeded": 1}
    rig.backup.set_script(["status:400:context_length_exceeded"])
    code, headers, raw = rig.chat()
    err = body_of(raw)["error"]
    assert code == 400 and err["code"] == "context_length_exceeded"
    assert "maximum context length" in err["message"]
    assert err["attempts"] == "primary=rejected:400; backup=rejected:400"
    assert rig.tries() == (2, 2)
    assert rig.counters()["proxy"]["circuits"]["primary"] == "closed"
    still_serves(rig)


def test_400_content_policy_is_returned_with_the_upstream_reason(make_rig: MakeRig) -> None:
    """A content-policy 400 reaches the client as it is; no retry, no other rung."""
    rig = make_rig(primary=["status:400:content_policy_violation"])
    code, _, raw = rig.chat()
    err = body_of(raw)["error"]
    assert code == 400
    assert err["code"] == "content_policy_violation"
    assert err["message"] == "Your request was rejected as a result of our safety system."
    assert err["seat"] == "primary" and err["attempts"] == "primary=rejected:400"
    assert rig.tries() == (1, 0)
    assert rig.counters()["proxy"]["answered_by"] == {}
    still_serves(rig)


def test_401_with_echoed_key_falls_back_and_the_key_never_leaks(make_rig: MakeRig) -> None:
    """A wrong key upstream is this rung's fault: not retried, not a 401 to the client, and the
    key the upstream echoes is scrubbed from everything the proxy says."""
    rig = make_rig(primary=["status:401:echo_key"], backup=["status:401:echo_key"])
    code, headers, raw = rig.chat()
    assert code == 503
    err = body_of(raw)["error"]
    assert err["attempts"] == "primary=failed:upstream_401; backup=failed:upstream_401"
    assert rig.tries() == (1, 1)
    assert rig.primary.headers[0]["Authorization"] == f"Bearer {KEY}"
    everything = raw.decode() + json.dumps(headers) + json.dumps(rig.counters()) + rig.logs()
    assert KEY not in everything
    assert "[redacted]" in rig.logs()
    check = subprocess.run([sys.executable, "-m", "sanctum.cli", "check", "--config",
                            str(rig.config)], env=rig.env, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert KEY not in check.stdout + check.stderr
    still_serves(rig)


# -- circuit breaker and recovery ------------------------------------------------------


def test_primary_down_then_recovers_closes_its_circuit(make_rig: MakeRig) -> None:
    """Three failed requests open primary's circuit; while open it is skipped (not called);
    after the cool-down one probe goes to it, and when it answers the circuit closes."""
    clock = ManualClock()
    rig = make_rig(primary=["status:500"], cooldown=1.5, clock=clock)
    for i in range(3):
        code, headers, raw = rig.chat()
        assert code == 200 and text_of(raw) == BACKUP
        assert headers["X-Sanctum-Attempts"] == ("primary=failed:upstream_500; " * 3) + "backup=ok"
        assert rig.tries() == (3 * (i + 1), i + 1)
    assert rig.counters()["proxy"]["circuits"]["primary"] == "open"
    code, headers, raw = rig.chat()
    assert headers["X-Sanctum-Attempts"] == "primary=skipped:circuit_open; backup=ok"
    assert rig.tries() == (9, 4)
    rig.primary.set_script(["ok"])  # the provider recovers
    clock.advance(1.6)
    code, headers, raw = rig.chat()
    assert code == 200 and text_of(raw) == PRIMARY
    assert headers["X-Sanctum-Attempts"] == "primary=ok"
    assert rig.counters()["proxy"]["circuits"]["primary"] == "closed"
    code, headers, raw = rig.chat()
    assert headers["X-Sanctum-Attempts"] == "primary=ok"
    assert rig.tries() == (11, 4)
    c = rig.counters()
    assert c["proxy"]["answered_by"] == {"backup": 4, "primary": 2}
    assert c["hosted"] == {"primary": {"served": 2}, "backup": {"served": 4}}
    still_serves(rig)


def test_half_open_admits_one_probe(make_rig: MakeRig) -> None:
    """Half-open, the primary gets one probe; a request beside it goes to the backup."""
    clock = ManualClock()
    rig = make_rig(primary=["status:500"], cooldown=1.0, first_token=3.0, clock=clock)
    for _ in range(3):
        rig.chat()
    rig.primary.set_script(["slow_first:1.5"])
    clock.advance(1.1)
    results: dict[str, str] = {}
    before = len(rig.primary.requests)

    def ask(tag: str) -> None:
        results[tag] = rig.chat()[1]["X-Sanctum-Attempts"]

    probe = threading.Thread(target=ask, args=("probe",))
    probe.start()
    # The second request goes only once the probe is at the primary (it answers in 1.5 s).
    wait_for("the probe at the primary", lambda: len(rig.primary.requests) > before,
             timeout=10, logs=rig.logs)
    assert len(rig.primary.requests) == before + 1
    ask("beside")
    probe.join()
    assert results == {"probe": "primary=ok", "beside": "primary=skipped:circuit_open; backup=ok"}
    assert rig.counters()["proxy"]["circuits"]["primary"] == "closed"
    still_serves(rig)


def test_fallback_answers_while_primary_is_down(make_rig: MakeRig) -> None:
    """Primary's server is gone (connection refused): no retry, the backup answers with its
    own model name and usage, and only the backup is billed."""
    rig = make_rig()
    rig.primary.stop()
    code, headers, raw = rig.chat()
    body = answered(raw, headers, "backup")
    assert text_of(raw) == BACKUP
    assert headers["X-Sanctum-Attempts"] == "primary=failed:connect_failed; backup=ok"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    code, headers, raw = rig.chat(stream=True, stream_options={"include_usage": True})
    datas, names = sse_data(raw)
    assert {d["model"] for d in datas} == {"backup"} and names == ["[DONE]"]
    assert datas[-1]["usage"]["completion_tokens"] == 3
    assert rig.tries() == (0, 2)
    c = rig.counters()
    assert c["proxy"]["answered_by"] == {"backup": 2}
    assert c["proxy"]["attempts"]["primary"] == {"failed": 2}
    assert c["hosted"] == {"primary": {"served": 0}, "backup": {"served": 2}}
    code, headers, raw = rig.chat()
    assert code == 200 and text_of(raw) == BACKUP
