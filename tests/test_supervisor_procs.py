"""seatd with real worker processes: crashes, hangs, bad models, drains and orphans.

Each test starts real processes (`sanctum up` or `sanctum seatd`) on the small
test model and proves they stopped.  Times are bounded generously by the
configured windows; the measured numbers are printed (`pytest -s`).
"""

from __future__ import annotations

import http.client as httpclient
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sanctum.cli import _control
from shared import protocol
from shared.config import load_config
from tests.procs import Sanctum, assert_gone, free_port, http

pytestmark = pytest.mark.slow

HEARTBEAT_S = 0.5
LIVENESS = 3
WINDOW_S = HEARTBEAT_S * LIVENESS
DRAIN_S = 20.0
MODEL = os.environ.get("SANCTUM_TEST_MODEL", "builtin:demo")
# Relative to the config file's folder, which is a fresh temporary one.
MISSING = "no-such-model"

CONFIG = """
[proxy]
listen = "127.0.0.1:{port}"
heartbeat_s = {hb}

[seatd]
heartbeat_s = {hb}
liveness = {liveness}
drain_s = {drain}
backoff_initial_s = 0.2
max_crashes = {max_crashes}
{seats}
{routes}
"""

SEAT = """
[[seat]]
name = "{name}"
model = "{model}"
max_prompt_tokens = 1536
{extra}
"""


def config_text(port: int, seats: list[tuple[str, str, str]], routes: dict[str, list[str]],
                max_crashes: int = 5) -> str:
    seat_text = "".join(SEAT.format(name=n, model=m, extra=x) for n, m, x in seats)
    route_text = "".join(f'\n[[route]]\nmodel = "{r}"\nladder = {json.dumps(ladder)}\n'
                         for r, ladder in routes.items())
    return CONFIG.format(port=port, hb=HEARTBEAT_S, liveness=LIVENESS, drain=DRAIN_S,
                         max_crashes=max_crashes, seats=seat_text, routes=route_text)


def measured(what: str, seconds: float) -> None:
    print(f"\nMEASURED {what}: {seconds:.2f}s")


def control(s: Sanctum, message: Any) -> Any:
    old = os.environ.get("SANCTUM_STATE_DIR")
    os.environ["SANCTUM_STATE_DIR"] = str(s.state)
    try:
        return _control(load_config(s.config), message)
    finally:
        if old is None:
            del os.environ["SANCTUM_STATE_DIR"]
        else:
            os.environ["SANCTUM_STATE_DIR"] = old


def cli(s: Sanctum, *args: str) -> subprocess.CompletedProcess[str]:
    """The operator's `sanctum` command against this instance."""
    return subprocess.run([sys.executable, "-m", "sanctum.cli", *args, "--config", str(s.config)],
                          env=s.env, capture_output=True, text=True, timeout=60)


def status(s: Sanctum) -> dict[str, protocol.SeatStatus]:
    return {row.name: row for row in control(s, protocol.StatusQuery()).seats}


def seat_counters(s: Sanctum, seat: str) -> dict[str, Any]:
    return dict(control(s, protocol.GetCounters()).seats[seat])


def wait_for(what: str, cond: Callable[[], Any], timeout: float, s: Sanctum) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = cond()
        except (OSError, ValueError, KeyError, SystemExit):
            got = None
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout}s\n{s.logs()[-4000:]}")


def ready_with_new_pid(s: Sanctum, seat: str, old: int) -> Callable[[], bool]:
    def cond() -> bool:
        row = status(s)[seat]
        return row.state == "READY" and row.pid not in (None, old)
    return cond


def ask(s: Sanctum, route: str, max_tokens: int, stream: bool = False,
        timeout: float = 120) -> tuple[int, dict[str, str], bytes]:
    body = {"model": route, "prompt": "def main():\n", "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    return http("POST", s.url + "/v1/completions", body=body, timeout=timeout)


class Background:
    """A request running in a thread while the test does something to the seat."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:
            self.error = exc

    def get(self, timeout: float) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "request did not finish"
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sanctum]:
    """`sanctum up`: seats a and b on the test model, `broken` on a missing path and
    `empty` on a model folder with nothing in it."""
    port = free_port()
    empty = tmp_path_factory.mktemp("empty-model")
    text = config_text(port, [("a", MODEL, ""), ("b", MODEL, ""), ("broken", MISSING, ""),
                              ("empty", str(empty), "")],
                       {"a": ["a", "b"], "solo": ["a"], "b": ["b"], "broken": ["broken"]})
    s = Sanctum(text, port=port)
    try:
        s.wait_ready(seats=("a", "b"))
        yield s
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop() == 0, s.logs()[-3000:]


def test_missing_model_is_fatal_with_its_reason(trio: Sanctum) -> None:
    """A model path that does not exist: FATAL at once, naming the path; others serve."""
    s = trio
    row = wait_for("broken seat FATAL", lambda: status(s)["broken"].state == "FATAL" and
                   status(s)["broken"], 30, s)
    assert row.last_exit is not None
    assert row.last_exit.startswith("model_load_failed:"), row.last_exit
    assert f"{MISSING} does not exist" in row.last_exit
    assert row.restarts == 0 and row.pid is None, "a load failure must not be retried"
    time.sleep(3 * WINDOW_S)
    again = status(s)["broken"]
    assert again.state == "FATAL" and again.restarts == 0
    for route in ("a", "b"):
        code, headers, _ = ask(s, route, 4)
        assert code == 200 and headers["X-Sanctum-Seat"] == route
    code, _, body = ask(s, "broken", 4)
    assert code == 503, body
    shown = cli(s, "status")
    assert shown.returncode == 0, shown.stderr
    line = next(row for row in shown.stdout.splitlines() if row.startswith("broken "))
    assert "FATAL" in line and f"{MISSING} does not exist" in line, shown.stdout
    a_line = next(row for row in shown.stdout.splitlines() if row.startswith("a "))
    assert "READY" in a_line or "BUSY" in a_line
    # the device column: what the worker said computes its model; none for a seat that
    # never loaded one
    assert a_line.rstrip().endswith(status(s)["a"].device) and status(s)["a"].device
    assert status(s)["a"].device.split(":")[0] in ("cpu", "cuda", "metal")
    assert status(s)["broken"].device == "" and line.rstrip().endswith("-")


def test_model_that_fails_to_load_is_fatal_in_the_workers_words(
        trio: Sanctum) -> None:
    """A model folder the worker cannot load: exit 79, FATAL with the loader's own error."""
    s = trio
    row = wait_for("empty seat FATAL", lambda: status(s)["empty"].state == "FATAL" and
                   status(s)["empty"], 120, s)
    assert row.last_exit is not None and row.last_exit.startswith("model_load_failed:")
    assert "config.json" in row.last_exit and row.last_exit.endswith("(exit:79)"), row.last_exit
    assert row.restarts == 0 and row.pid is None
    assert not list(s.state.glob("exit-*")), "seatd takes the reason file it reads"
    asked = time.monotonic()
    assert isinstance(control(s, protocol.RestartSeat("empty")), protocol.ControlOk)
    wait_for("empty FATAL again", lambda: status(s)["empty"].state == "FATAL"
             and status(s)["empty"].restarts == 1, 120, s)
    measured("restart of an unloadable-model seat -> FATAL again (worker spawned)",
             time.monotonic() - asked)


def test_restart_command_retries_a_fatal_seat(trio: Sanctum) -> None:
    """`sanctum restart SEAT` gives a FATAL seat another start; it fails the same way."""
    s = trio
    wait_for("broken FATAL", lambda: status(s)["broken"].state == "FATAL", 30, s)
    before = status(s)["broken"].restarts
    asked = time.monotonic()
    done = cli(s, "restart", "broken")
    assert done.returncode == 0 and "restarting broken" in done.stdout, done.stderr
    wait_for("broken FATAL again", lambda: status(s)["broken"].state == "FATAL"
             and status(s)["broken"].restarts == before + 1, 30, s)
    measured("restart of a missing-model seat -> FATAL again (seatd preflight)",
             time.monotonic() - asked)
    assert "does not exist" in (status(s)["broken"].last_exit or "")
    done = cli(s, "restart", "nobody")
    assert done.returncode == 1 and "no local seat named 'nobody'" in done.stderr


def test_sigkill_mid_request_falls_back_and_served_continues(
        trio: Sanctum) -> None:
    """SIGKILL mid-request: the ladder answers from b, a restarts, `served` continues."""
    s = trio
    assert ask(s, "solo", 2)[0] == 200
    before = seat_counters(s, "a")
    old = status(s)["a"]
    assert old.pid is not None
    job = Background(lambda: ask(s, "a", 400))  # seconds of decoding: killed well within
    wait_for("a busy", lambda: status(s)["a"].state == "BUSY", 30, s)
    killed = time.monotonic()
    os.kill(old.pid, signal.SIGKILL)
    wait_for("a noticed", lambda: status(s)["a"].pid != old.pid, 10, s)
    measured("worker SIGKILL -> seatd noticed", time.monotonic() - killed)
    wait_for("a back", ready_with_new_pid(s, "a", old.pid), 60, s)
    measured("worker SIGKILL -> READY again", time.monotonic() - killed)
    code, headers, body = job.get(timeout=180)
    assert code == 200, body
    assert headers["X-Sanctum-Seat"] == "b"
    assert headers["X-Sanctum-Attempts"].startswith("a=failed:"), headers
    row = status(s)["a"]
    assert row.restarts == old.restarts + 1 and row.last_exit == "signal:SIGKILL"
    s.remember_tree()
    wait_for("proxy sees a", lambda: s.health()["seats"]["a"]["ready"]
             and s.health()["seats"]["a"]["pid"] == row.pid, 30, s)
    code, headers, _ = ask(s, "solo", 2)
    assert code == 200 and headers["X-Sanctum-Seat"] == "a"
    after = seat_counters(s, "a")
    assert after["incarnation"] > before["incarnation"]
    assert after["served"] == before["served"] + 1
    assert int(headers["X-Sanctum-Served"]) == after["served"]


def test_sigkill_mid_stream_ends_with_an_error_event(trio: Sanctum) -> None:
    """A stream cut by a worker's death ends with an error event and no [DONE]."""
    s = trio
    wait_for("a ready", lambda: s.health()["seats"]["a"]["ready"], 60, s)
    pid = status(s)["a"].pid
    assert pid is not None
    first = threading.Event()

    def stream() -> tuple[int, bytes]:
        # Read line by line, to kill the worker only once the stream has committed.
        conn = httpclient.HTTPConnection("127.0.0.1", int(s.url.rsplit(":", 1)[1]),
                                         timeout=120)
        body = {"model": "solo", "prompt": "def main():\n", "max_tokens": 1200,
                "temperature": 0, "stream": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        lines = []
        while line := resp.readline():  # chunked decoding, ends with the body
            lines.append(line)
            if line.startswith(b"data: "):
                first.set()
        conn.close()
        return resp.status, b"".join(lines)

    job = Background(stream)
    assert first.wait(60), "no token streamed"
    os.kill(pid, signal.SIGKILL)
    code, body = job.get(timeout=120)
    assert code == 200
    text = body.decode()
    assert "event: error" in text and "data: [DONE]" not in text, text[-500:]
    wait_for("a back", ready_with_new_pid(s, "a", pid), 60, s)
    s.remember_tree()


def test_sigstopped_worker_is_killed_within_liveness_and_restarted(
        trio: Sanctum) -> None:
    """A worker that stops answering (SIGSTOP) is lost within the window, killed, restarted."""
    s = trio
    wait_for("a ready", lambda: status(s)["a"].state == "READY", 60, s)
    old = status(s)["a"]
    assert old.pid is not None
    stopped = time.monotonic()
    os.kill(old.pid, signal.SIGSTOP)
    try:
        wait_for("a lost", lambda: status(s)["a"].state != "READY", 10 * WINDOW_S + 5, s)
        latency = time.monotonic() - stopped
        measured(f"SIGSTOP -> lost (window {WINDOW_S:g}s)", latency)
        assert latency < WINDOW_S + 3 * HEARTBEAT_S + 2.0, latency
        assert_gone({old.pid}, timeout=10)
    finally:
        try:
            os.kill(old.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    wait_for("a back", ready_with_new_pid(s, "a", old.pid), 60, s)
    measured("SIGSTOP -> READY again", time.monotonic() - stopped)
    row = status(s)["a"]
    assert row.restarts == old.restarts + 1
    assert row.last_exit is not None and "no heartbeat" in row.last_exit
    s.remember_tree()
    # The proxy recovers on its own, from heartbeats alone.
    wait_for("proxy sees a", lambda: s.health()["seats"]["a"]["pid"] == row.pid
             and s.health()["seats"]["a"]["ready"], 30, s)
    code, headers, _ = ask(s, "solo", 2)
    assert code == 200 and headers["X-Sanctum-Seat"] == "a"


def test_sigterm_during_long_generation_drains_it() -> None:
    """SIGTERM to `sanctum up` mid-stream: the answer completes, then nothing is left."""
    port = free_port()
    s = Sanctum(config_text(port, [("demo", MODEL, "")], {"demo": ["demo"]}), port=port)
    try:
        s.wait_ready()
        s.remember_tree()
        tokens = 160  # seconds of decoding on this CPU, well inside the drain
        job = Background(lambda: ask(s, "demo", tokens, stream=True, timeout=DRAIN_S + 40))
        wait_for("busy", lambda: status(s)["demo"].state == "BUSY", 30, s)
        time.sleep(0.3)
        s.remember_tree()
        sent = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        code, _, body = job.get(timeout=DRAIN_S + 40)
        finished = time.monotonic() - sent
        assert s.proc.wait(timeout=DRAIN_S + 30) == 0
        measured("SIGTERM -> stream complete", finished)
        measured("SIGTERM -> `sanctum up` exited", time.monotonic() - sent)
    except BaseException:
        s.kill_everything()
        raise
    logs = s.logs()
    assert s.stop() == 0
    text = body.decode()
    assert code == 200 and text.rstrip().endswith("data: [DONE]"), text[-500:]
    assert "event: error" not in text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    finals = [c for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")]
    assert finals and finals[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert "worker_killed_at_deadline" not in logs and "drain deadline passed" not in logs


@pytest.mark.parametrize("when", ["importing", "ready"])
def test_sigkill_of_seatd_takes_its_workers_along(when: str) -> None:
    """SIGKILL of seatd, while workers import or once they serve: they die within seconds."""
    port = free_port()
    s = Sanctum(config_text(port, [("a", MODEL, ""), ("b", MODEL, "")], {"a": ["a", "b"]}),
                port=port, command="seatd")
    try:
        wait_for("workers", lambda: len(s.remember_tree()) >= 3, 60, s)
        if when == "ready":
            wait_for("ready", lambda: all(r.state == "READY" for r in status(s).values()), 60, s)
        workers = s.remember_tree() - {s.proc.pid}
        killed = time.monotonic()
        s.proc.kill()
        s.proc.wait(timeout=10)
        assert_gone(workers, timeout=5)
        measured(f"seatd SIGKILL ({when}) -> workers gone", time.monotonic() - killed)
    except BaseException:
        s.kill_everything()
        raise
    s.log.close()
    # Killed processes cannot remove their socket files; the next seatd rebinds them.
    shutil.rmtree(s.dir, ignore_errors=True)


def test_memory_budget_recycles_after_draining_then_gives_up() -> None:
    """Over its memory budget a worker drains and is replaced, counted in memory_restarts."""
    port = free_port()
    text = config_text(port, [("demo", MODEL, "memory_budget_mb = 1")], {"demo": ["demo"]},
                       max_crashes=2)
    s = Sanctum(text, port=port, command="seatd")
    try:
        wait_for("FATAL", lambda: status(s)["demo"].state == "FATAL", 120, s)
        row = status(s)["demo"]
        counted = seat_counters(s, "demo")
        s.remember_tree()
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop() == 0
    assert row.last_exit is not None and "over budget 1 MB" in row.last_exit, row.last_exit
    assert "drained and exit:0" in row.last_exit
    assert counted["memory_restarts"] == 2 and row.restarts == 1


def test_hung_decode_thread_is_a_stalled_seat(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens stop moving while pongs go on: killed after its stall limit, then restarted."""
    from tests.fakes import stalling_worker

    monkeypatch.setenv("SANCTUM_WORKER_MODULE", "tests.fakes.stalling_worker")
    port = free_port()
    stall_s = 2.0
    s = Sanctum(config_text(port, [("demo", MODEL, f"stall_timeout_s = {stall_s}")],
                            {"demo": ["demo"]}), port=port)
    try:
        s.wait_ready()
        old = status(s)["demo"]
        assert old.pid is not None
        began = time.monotonic()
        job = Background(lambda: ask(s, "demo", 1500, timeout=60))
        wait_for("stalled seat killed", lambda: status(s)["demo"].pid != old.pid,
                 stalling_worker.STALL_AFTER_S + stall_s + 30, s)
        took = time.monotonic() - began
        measured(f"request start -> hung seat killed (hangs at ~{stalling_worker.STALL_AFTER_S}s,"
                 f" stall limit {stall_s:g}s)", took)
        assert took > stall_s, "killed before its stall limit could have passed"
        row = status(s)["demo"]
        assert row.last_exit is not None and "stalled: no token for" in row.last_exit
        assert f"limit {stall_s:g}s" in row.last_exit, row.last_exit
        assert_gone({old.pid}, timeout=10)
        code, _, body = job.get(timeout=60)
        assert code >= 500 and b"demo=failed:" in body, body
        wait_for("restarted", ready_with_new_pid(s, "demo", old.pid), 60, s)
        s.remember_tree()
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop() == 0
