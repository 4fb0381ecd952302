"""The concurrent-clients benchmark: its figures from chunk times, who gets a seed, and a
whole interleaved run against fake servers rendered into the report."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from sanctum.bench.batching import MLX, OURS, best_of_ratios, scaling
from sanctum.bench.concurrent import (
    PREFILL,
    ConcurrentArm,
    Stream,
    assign,
    chunk_text,
    concurrency_figures,
    gaps,
    prefill_figures,
    request_body,
    settle_chunks,
)
from sanctum.bench.report import render
from sanctum.bench.results import ArmInfo, Run
from sanctum.bench.runner import run_schedule
from sanctum.bench.schedule import make_schedule
from sanctum.bench.stats import check_interleaved
from sanctum.bench.workloads import Workload
from tests.fakes.fake_upstream import FakeUpstream


def test_slot_figures_from_chunk_times() -> None:
    """Aggregate rate over the slot's wall time; TTFT per request; gaps pooled per chunk."""
    a = Stream(sent=0.0, chunks=[1.0, 2.0, 3.0], end=3.0, tokens=6, speculation="accelerated")
    b = Stream(sent=0.0, chunks=[2.0, 2.5], end=4.0, tokens=4, speculation="off")
    f = concurrency_figures([a, b])
    assert f["agg_tps"] == pytest.approx(10 / 4)
    assert f["ttft_p50_s"] == pytest.approx(1.5)
    assert f["ttft_p99_s"] == pytest.approx(1.99)
    assert f["itl_p50_s"] == pytest.approx(1.0)  # gaps 1, 1, 0.5
    assert f["slowest_s"] == 4.0
    assert f["accelerated"] == 0.5
    assert "accelerated" not in concurrency_figures([Stream(0.0, [1.0], 1.0, 1)])
    assert gaps([1.0, 1.5, 3.0]) == [0.5, 1.5]


def test_an_answer_without_text_fails_the_slot() -> None:
    with pytest.raises(RuntimeError):
        concurrency_figures([Stream(0.0, [], 1.0, 0)])


@pytest.mark.parametrize(("rows", "first", "since", "expected"), [
    # steady 0.1 s gaps, then one 0.3 s stall straddling the arrival at 2.0: during = 0.3
    ([[i / 10 for i in range(21)] + [2.3, 2.4]], 2.2, 0.0,
     {"rows_decoding": 1, "itl_p99_before_s": 0.1, "itl_p99_during_s": 0.3,
      "long_ttft_s": 0.2, "gaps_before": 20}),
    # before counts only from `since` (all rows streaming): the 0.5 s gaps before it not
    ([[0.0, 0.5, 1.0, 1.1, 1.2, 1.3, 2.3, 2.4]], 2.2, 1.0,
     {"rows_decoding": 1, "itl_p99_before_s": 0.1, "itl_p99_during_s": 1.0,
      "gaps_before": 3}),
    # a row that ended before the arrival and one not started yet are not decoding rows
    ([[0.5, 1.0], [3.0, 3.1]], 2.5, 0.0, {"rows_decoding": 0, "gaps_before": 0}),
    # no first token from the long request: no "during" at all
    ([[1.0, 1.5, 2.5]], None, 0.0, {"rows_decoding": 1, "gaps_during": 0}),
])
def test_prefill_figures(rows: list[list[float]], first: float | None, since: float,
                         expected: dict[str, float]) -> None:
    """Only rows decoding at the arrival count; a gap overlapping the prefill is 'during',
    a gap between `since` and the arrival 'before'."""
    f = prefill_figures([Stream(0.0, r, r[-1], len(r)) for r in rows], 2.0, first, since)
    for k, v in expected.items():
        assert f[k] == pytest.approx(v), k
    if "itl_p99_during_s" in expected:
        assert f["prefill_itl_speed"] == pytest.approx(
            expected["itl_p99_before_s"] / expected["itl_p99_during_s"])
    else:
        assert "prefill_itl_speed" not in f


def test_the_long_prompt_waits_for_a_third_of_the_rows_tokens() -> None:
    """Rows of 96-token slots have sent 32 chunks each; a tiny slot still waits for one."""
    assert settle_chunks(96) == 32
    assert settle_chunks(2) == 1


def test_workloads_rotate_over_clients_and_rounds() -> None:
    assert assign(["a", "b", "c"], 4, 0) == ["a", "b", "c", "a"]
    assert assign(["a", "b", "c"], 2, 1) == ["b", "c"]


def test_request_body_and_chunk_text() -> None:
    """A seed only when given; chat goes to chat completions; text from either shape."""
    chat = Workload("w", "d", "chat", messages=(("user", "hi"),))
    path, body = request_body(chat, "m", 8, 0.0, None)
    assert path == "/v1/chat/completions" and "seed" not in body
    assert body["stream_options"] == {"include_usage": True}
    path, body = request_body(Workload("w", "d", "completion", prompt="x"), "m", 8, 0.7, 3)
    assert (path, body["prompt"], body["seed"]) == ("/v1/completions", "x", 3)
    assert chunk_text({"choices": [{"text": "a"}]}) == "a"
    assert chunk_text({"choices": [{"delta": {"content": "b"}}]}) == "b"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 1}}) == ""


def test_unseeded_arm_never_sends_a_seed() -> None:
    """mlx_lm.server turns its batching off for a seeded request: its arm sends none, and
    nobody sends one at temperature 0."""
    fake = FakeUpstream(answer="a b c")
    try:
        w = Workload("code-short", "d", "completion", prompt="def f():")
        for seeded, temperature in ((False, 0.7), (True, 0.0), (True, 0.7)):
            ConcurrentArm(fake.url.removesuffix("/v1"), "m", [w], [w], w, 4, temperature,
                          seeded)("c=2")
        seeds = [r.get("seed") for r in fake.requests]
        assert seeds[:4] == [None] * 4 and all(s is not None for s in seeds[4:])
        prompts = [sorted(r["prompt"] for r in fake.requests[i : i + 2]) for i in (0, 2, 4)]
        # A salt per request of an arm; the arms of one group send the same prompts.
        assert len(set(prompts[0])) == 2 and prompts[0] == prompts[1] == prompts[2]
    finally:
        fake.stop()


def test_interleaved_run_against_fake_servers_reports() -> None:
    """Two fake servers, two levels and the prefill scenario: an interleaved run whose
    section shows the table and the headline ratios (the fakes' speed is not asserted)."""
    fakes = [FakeUpstream(answer=" ".join(["tok"] * 12)) for _ in range(2)]
    try:
        w = Workload("code-short", "d", "completion", prompt="def f():")
        arms = {name: ConcurrentArm(f.url.removesuffix("/v1"), "m", [w], [w], w, 12, 0.0,
                                    False, settle_s=0.01)
                for name, f in zip((OURS, MLX), fakes, strict=True)}
        names = ["c=1", "c=8", PREFILL]
        slots = make_schedule(list(arms), names, 2, 1, seed=0)
        clock = itertools.count(0.0)
        samples = run_schedule(slots, arms, run_id="x", clock=lambda: next(clock))
    finally:
        for f in fakes:
            f.stop()
    assert not [s.error for s in samples if s.error]
    check_interleaved(samples)
    assert sum(len(f.requests) for f in fakes) == 2 * 2 * (1 + 8 + 7 + 1)
    run = Run("x", "batching", "t", MLX, [ArmInfo(OURS, "a"), ArmInfo(MLX, "b")],
              {n: n for n in names}, 2, 1, 0, {"date": "d", "cores": "2", "model": "m"},
              samples)
    text = render({"batching": run}, None, plot=lambda r, p: False)
    assert "## 9. Concurrent clients" in text
    assert f"| aggregate tokens/s, {OURS} over {MLX}, 8 clients | **" in text
    assert "| 8 | sanctum | " in text and "rows decoding at arrival" in text
    assert len(scaling(samples, OURS, "c=8", "c=1")) == 1
    # The goal is on the default seat's own scaling; mlx_lm.server's stands beside it.
    assert f"| aggregate tokens/s, {OURS} at 8 clients over 1 client, per round | **" in text
    assert f"| aggregate tokens/s, {MLX} at 8 clients over 1 client, per round | **" in text
    assert [line.rsplit("|", 2)[1].strip() for line in text.splitlines()
            if "at 8 clients over 1 client" in line] == ["≥ 3x", "-"] * 2  # summary, section
    assert len(best_of_ratios(samples, "agg_tps", OURS, [MLX], "c=8")) == 1


def test_plot_of_throughput_against_clients(tmp_path: Path) -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    from sanctum.bench.batching import plot

    slots = make_schedule([OURS, MLX], ["c=1", "c=4"], 3, 1, seed=0)
    clock = itertools.count(0.0)
    samples = run_schedule(slots, {a: (lambda w: {"agg_tps": 10.0, "itl_p99_s": 0.1})
                                   for a in (OURS, MLX)}, run_id="x", clock=lambda: next(clock))
    run = Run("x", "batching", "t", MLX, [ArmInfo(OURS, "a"), ArmInfo(MLX, "b")],
              {"c=1": "", "c=4": ""}, 3, 1, 0, {}, samples)
    assert plot(run, tmp_path / "batching.png", plt)
    assert (tmp_path / "batching.png").stat().st_size > 0


def test_long_prompt_fills_its_target_at_a_line_end() -> None:
    """The most whole lines within the target: one more line would pass it."""
    from sanctum.bench.batching import long_prompt

    files = [("a.py", "\n".join(f"x{i} = {i}" for i in range(100)))]

    def count(text: str) -> int:
        return len(text.split())

    w = long_prompt(files, count, 50)
    assert w.prompt_tokens == count(w.prompt) <= 50
    assert count(w.prompt + "\nx = 1") > 50
    assert w.prompt.endswith("= 15") and w.kind == "completion"


@pytest.mark.parametrize(("before", "after", "expected"), [
    ({"batch_steps": {"1": 5}}, {"batch_steps": {"1": 7, "4": 2}},
     {"mean_batch": (2 * 1 + 2 * 4) / 4, "max_batch": 4}),
    ({}, {"batch_steps": {"8": 3}}, {"mean_batch": 8, "max_batch": 8}),
    ({"batch_steps": {"2": 3}}, {"batch_steps": {"2": 3}}, {}),  # no step in the slot
    ({}, {"served": 3}, {}),  # a seat that does not count batch sizes
    # a step's time at the slot's most rows: 3 steps of 4 rows in 12,000 us
    ({"batch_steps": {"1": 5, "4": 1}, "batch_step_us": {"1": 9000, "4": 5000}},
     {"batch_steps": {"1": 7, "4": 4}, "batch_step_us": {"1": 12000, "4": 17000}},
     {"mean_batch": (2 * 1 + 3 * 4) / 5, "max_batch": 4, "step_ms": 4.0}),
])
def test_rows_per_step_from_the_seat_counters(before: dict[str, object],
                                              after: dict[str, object],
                                              expected: dict[str, float]) -> None:
    from sanctum.bench.concurrent import batch_figures

    assert batch_figures(before, after) == pytest.approx(expected)


@pytest.mark.parametrize(("before", "after", "expected"), [
    # each part's growth over the slot; a part that did not grow is left out
    ({"engine_us": {"prefill": 1000, "plain": 5000}, "engine_calls": {"prefill": 1, "plain": 2}},
     {"engine_us": {"prefill": 4000, "plain": 5000, "verify": 2500, "other": 500},
      "engine_calls": {"prefill": 3, "plain": 2, "verify": 1, "other": 1}},
     {"prefill_ms": 3.0, "verify_ms": 2.5, "other_ms": 0.5, "engine_ms": 6.0,
      "prefill_calls": 2, "verify_calls": 1, "other_calls": 1}),
    ({}, {"engine_us": {"drafter_prefill": 700}},
     {"drafter_prefill_ms": 0.7, "engine_ms": 0.7}),
    ({}, {"served": 3}, {}),  # a seat that does not count its parts
    # the rows' rounds by who drafted them
    ({"spec_drafts_by_drafter": {"model": 4}},
     {"spec_drafts_by_drafter": {"model": 9, "lookup": 12}},
     {"model_rounds": 5, "lookup_rounds": 12}),
    # a plain step's stages, milliseconds over the slot
    ({"plain_step_us": {"graph": 1000, "wait": 50}},
     {"plain_step_us": {"graph": 4000, "dispatch": 6000, "wait": 50, "take": 900}},
     {"graph_ms": 3.0, "dispatch_ms": 6.0, "take_ms": 0.9}),
    # the cost model's terms as the slot left them (gauges, not growth)
    ({"spec_cost_us": {"plain": 900}}, {"spec_cost_us": {"plain": 1300, "host": 8000}},
     {"cost_plain_us": 1300, "cost_host_us": 8000}),
    # what MLX held as the slot left it, MiB (gauges; a seat that has none, nothing)
    ({"mlx_active_bytes": 1 << 20},
     {"mlx_active_bytes": 300 << 20, "mlx_cache_bytes": 12 << 20, "mlx_peak_bytes": 1 << 30},
     {"mlx_active_mb": 300, "mlx_cache_mb": 12, "mlx_peak_mb": 1024}),
    ({}, {"mlx_active_bytes": 0, "mlx_cache_bytes": 0}, {}),
    # a seat whose cache an idle trim handed back: 0 MiB cached, a figure
    ({}, {"mlx_active_bytes": 200 << 20, "mlx_cache_bytes": 0, "mlx_peak_bytes": 1 << 30},
     {"mlx_active_mb": 200, "mlx_cache_mb": 0, "mlx_peak_mb": 1024}),
])
def test_where_the_engine_spent_a_slot_from_the_seat_counters(
        before: dict[str, object], after: dict[str, object], expected: dict[str, float]) -> None:
    from sanctum.bench.concurrent import part_figures

    assert part_figures(before, after) == pytest.approx(expected)


def test_a_connection_reset_before_the_head_is_tried_again() -> None:
    """A server that resets a connect (its listen backlog full) is asked again on a new
    connection, timed from the first send; one that keeps resetting fails the request."""
    import socket
    import struct
    import threading

    from sanctum.bench.concurrent import CONNECT_TRIES, stream_once

    sse = (b'data: {"choices":[{"index":0,"text":"hi"}]}\n\n'
           b'data: {"choices":[],"usage":{"completion_tokens":1,"prompt_tokens":2}}\n\n'
           b"data: [DONE]\n\n")
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
              b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(sse)) + sse

    def serve(resets: int, then_answer: bool) -> tuple[int, list[int], threading.Thread]:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        seen: list[int] = []

        def run() -> None:
            with listener:
                for i in range(resets + then_answer):
                    conn, _ = listener.accept()
                    with conn:
                        conn.recv(65536)
                        seen.append(i)
                        if i < resets:  # SO_LINGER 0: the close is a reset
                            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                            struct.pack("ii", 1, 0))
                            continue
                        conn.sendall(answer)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return listener.getsockname()[1], seen, thread

    port, seen, thread = serve(CONNECT_TRIES - 1, True)
    s = stream_once(f"http://127.0.0.1:{port}", "/v1/completions", {"prompt": "x"})
    thread.join(10)
    assert seen == list(range(CONNECT_TRIES)) and s.tokens == 1 and len(s.chunks) == 1
    assert s.sent < s.chunks[0]
    port, seen, thread = serve(CONNECT_TRIES, False)
    with pytest.raises(ConnectionError):
        stream_once(f"http://127.0.0.1:{port}", "/v1/completions", {"prompt": "x"})
    thread.join(10)
    assert seen == list(range(CONNECT_TRIES))
    assert not thread.is_alive()


def test_the_bound_arm_runs_mlx_lm_forwards_in_a_process_it_stops() -> None:
    """The bound: a real process on the demo's weights, measured at two batch sizes,
    refusing a body it cannot run, with no process left after it."""
    import json as _json
    import urllib.error
    import urllib.request

    import psutil

    from sanctum.bench import servers
    from sanctum.bench.bound import BoundArm, bound_server
    from shared.builtin import resolve_model

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with bound_server(str(resolve_model("builtin:demo")), servers.free_port()) as url:
        arm = BoundArm(url, list(range(5, 25)), 4)
        one, four = arm("c=1"), arm("c=4")
        assert arm(PREFILL) == {}
        req = urllib.request.Request(url + "/run", _json.dumps({"batch": 1}).encode(),
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=60)
        assert refused.value.code == 400 and "prompt" in refused.value.read().decode()
    for got in (one, four):
        assert set(got) == {"agg_tps", "prefill_ms", "step_ms", "mlx_active_mb",
                            "mlx_cache_mb", "mlx_peak_mb"} and got["agg_tps"] > 0
        # what MLX held: the weights and the run's cache at least, at most its peak
        assert 0 < got["mlx_active_mb"] <= got["mlx_peak_mb"] and got["mlx_cache_mb"] >= 0
        # B rows of 4 tokens: the prefill's and 3 steps'.
        rows = 4 if got is four else 1
        assert got["agg_tps"] == pytest.approx(
            rows * 4 * 1e3 / (got["prefill_ms"] + 3 * got["step_ms"]), rel=0.05)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


@pytest.mark.parametrize(("asked", "want"), [
    ((), ("sanctum", "sanctum plain", "mlx_lm.server", "mlx_lm.server draft", "bound")),
    (("mlx_lm.server", "bound"), ("sanctum", "sanctum plain", "mlx_lm.server", "bound")),
    (("bound",), ("sanctum", "sanctum plain", "bound")),
    (("sanctum",), ("sanctum", "sanctum plain")),  # our seats run whatever is asked
])
def test_the_arms_a_run_measures(asked: tuple[str, ...], want: tuple[str, ...]) -> None:
    from sanctum.bench.batching import kept_arms

    assert kept_arms(asked) == want


def test_an_unknown_arm_is_refused_before_any_server_starts() -> None:
    """By the command itself: a clear line and exit 2, before any server is started."""
    import subprocess
    import sys

    import psutil

    from sanctum.bench.batching import kept_arms

    with pytest.raises(ValueError, match="no such arm vllm"):
        kept_arms(("bound", "vllm"))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    done = subprocess.run([sys.executable, "-m", "sanctum.cli", "bench", "run", "batching",
                           "--arms", "bound,vllm"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2
    assert "no such arm vllm" in done.stderr and "Traceback" not in done.stderr
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_every_arm_reads_as_a_fraction_of_the_bound() -> None:
    """With a bound arm, the table gives each server's share of it, and the summary the
    plain seat's at 8 clients with its goal, and the default seat over the plain one."""
    from sanctum.bench.batching import PLAIN
    from sanctum.bench.bound import BOUND

    speeds = {OURS: 90.0, PLAIN: 100.0, MLX: 80.0, BOUND: 125.0}
    slots = make_schedule(list(speeds), ["c=1", "c=8"], 2, 0, seed=0)
    clock = itertools.count(0.0)
    samples = run_schedule(slots, {a: (lambda w, v=v: {"agg_tps": v}) for a, v in speeds.items()},
                           run_id="x", clock=lambda: next(clock))
    run = Run("x", "batching", "t", MLX, [ArmInfo(a, a) for a in speeds],
              {"c=1": "", "c=8": ""}, 2, 0, 0, {"date": "d", "cores": "2", "model": "m"},
              samples)
    text = render({"batching": run}, None, plot=lambda r, p: False)
    rows = [x for x in text.splitlines() if x.startswith("| 8 | sanctum plain | 100.0 |")]
    # over mlx_lm.server, then of the bound
    assert rows and rows[0].split("|")[4:6] == [" **1.25x** [1.25–1.25], n=2 ",
                                                " **0.80x** [0.80–0.80], n=2 "]
    bound = [x for x in text.splitlines() if " over the bound " in x]
    # In the summary, only at the levels with a goal, the plain seat's with it.
    assert bound and all("8 clients" in x for x in bound)
    assert any(f"{PLAIN} over the bound" in x and "**0.80x**" in x and "≥ 0.85x" in x
               for x in bound)
    line = next(x for x in text.splitlines()
                if x.startswith(f"| aggregate tokens/s, {OURS} over {PLAIN}, 1 client"))
    assert "**0.90x**" in line and "≥ 0.97x" in line


def test_the_bound_prompt_is_the_median_short_prompt_as_the_seats_get_it() -> None:
    from sanctum.bench.batching import bound_prompt
    from shared.builtin import resolve_model
    from shared.prompt import load_tokenizer

    tok = load_tokenizer(resolve_model("builtin:demo"))
    short = [Workload("a", "d", "completion", prompt="x = 1\n" * n) for n in (2, 30, 9)]
    chat = Workload("c", "d", "chat", messages=(("user", "y = 2\n" * 9),))
    assert bound_prompt(tok, short) == tok.encode("x = 1\n" * 9)
    # a chat goes through the template: its text, framed, the answer's turn opened
    ids = chat.token_ids(tok)
    assert len(ids) > len(tok.encode("y = 2\n" * 9)) and "y = 2" in tok.decode(ids)


def _rendered(figures: dict[str, dict[str, float]], level: str) -> str:
    """The batching report of two interleaved rounds at one level, each arm's slots
    giving the same figures."""
    slots = make_schedule(list(figures), [level], 2, 0, seed=0)
    clock = itertools.count(0.0)
    samples = run_schedule(slots, {a: (lambda w, f=f: dict(f)) for a, f in figures.items()},
                           run_id="x", clock=lambda: next(clock))
    run = Run("x", "batching", "t", MLX, [ArmInfo(a, a) for a in figures], {level: ""},
              2, 0, 0, {"date": "d", "cores": "2", "model": "m"}, samples)
    return render({"batching": run}, None, plot=lambda r, p: False)


def test_the_engine_table_splits_a_slot_by_part_and_rounds_by_drafter() -> None:
    """The second table: each seat's slot, its engine's parts (milliseconds, calls in
    brackets) and its rows' rounds by who drafted them, medians of the measured rounds."""
    figures = {OURS: {"agg_tps": 96.0, "completion_tokens": 96.0, "engine_ms": 900.0,
                      "plain_ms": 300.0, "plain_calls": 30.0, "verify_ms": 600.0,
                      "verify_calls": 20.0, "model_rounds": 5.0, "lookup_rounds": 15.0},
               MLX: {"agg_tps": 80.0}}
    text = _rendered(figures, "c=1")
    head = next(x for x in text.splitlines() if x.startswith("| clients | arm | slot ms"))
    assert head.rstrip(" |").endswith("rounds: model / lookup")
    row = next(x for x in text.splitlines() if x.startswith(f"| 1 | {OURS} | 1000.0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:] == ["900.0", "-", "-", "300.0 (30)", "600.0 (20)", "-", "5 / 15"]


def test_the_stage_table_gives_a_plain_step_by_stage_beside_the_bound() -> None:
    """The third table: a seat's plain step by stage, milliseconds a step (each stage's
    slot total over the slot's plain steps), beside the bound's step at the level."""
    from sanctum.bench.batching import PLAIN
    from sanctum.bench.bound import BOUND

    figures = {PLAIN: {"agg_tps": 96.0, "completion_tokens": 96.0, "plain_calls": 50.0,
                       "plain_ms": 150.0, "graph_ms": 40.0, "dispatch_ms": 60.0,
                       "wait_ms": 5.0, "take_ms": 10.0},
               BOUND: {"agg_tps": 200.0, "step_ms": 1.5}, MLX: {"agg_tps": 80.0}}
    text = _rendered(figures, "c=4")
    head = next(x for x in text.splitlines() if x.startswith("| clients | arm | graph |"))
    assert "bound's step" in head
    row = next(x for x in text.splitlines()
               if x.startswith(f"| 4 | {PLAIN} | ") and x.count("|") == 8)
    assert [c.strip() for c in row.strip("|").split("|")][2:] == \
        ["0.80", "1.20", "0.10", "0.20", "1.50"]


def test_the_memory_table_gives_what_mlx_held_in_each_process() -> None:
    """The fourth table: what MLX held in each arm's process that says (live, cached,
    peak, MiB), and the driver's figure where there was one; an arm with neither (the
    plain seat here) has no row."""
    from sanctum.bench.batching import PLAIN
    from sanctum.bench.bound import BOUND

    figures = {OURS: {"agg_tps": 96.0, "mlx_active_mb": 4330.0, "mlx_cache_mb": 512.0,
                      "mlx_peak_mb": 16010.4, "device_mb": 38370.0},
               BOUND: {"agg_tps": 200.0, "mlx_active_mb": 4400.0, "mlx_cache_mb": 9.0,
                       "mlx_peak_mb": 5100.0},
               MLX: {"agg_tps": 80.0, "device_mb": 8082.0}, PLAIN: {"agg_tps": 90.0}}
    text = _rendered(figures, "c=8")
    lines = text.splitlines()
    head = lines.index("| clients | arm | live | cached | peak | driver's |")
    rows = list(itertools.takewhile(lambda x: x.startswith("| "), lines[head + 2:]))
    assert sorted(rows) == sorted([f"| 8 | {OURS} | 4,330 | 512 | 16,010 | 38,370 |",
                                   f"| 8 | {BOUND} | 4,400 | 9 | 5,100 | - |",
                                   f"| 8 | {MLX} | - | - | - | 8,082 |"])


@pytest.mark.parametrize(("text", "want"), [
    ("3089, 38370 MiB\n3090, 15654 MiB\n", {3089: 38370.0, 3090: 15654.0}),
    ("12, [N/A]\n13, 2 GiB\n", {13: 2048.0}),  # one the driver cannot measure: left out
    ("", {}),
    ("No running processes found\n", {}),
])
def test_the_drivers_per_process_lines_as_mib(text: str, want: dict[int, float]) -> None:
    from sanctum.bench.device_memory import parse_apps

    assert parse_apps(text) == want


@pytest.mark.parametrize(("answer", "pids", "want"), [
    ("3089, 38370 MiB\n3090, 15654 MiB\n3053, 518 MiB\n", {3089, 3053}, 38888.0),
    ("3089, 38370 MiB\n", {4000}, None),  # none of them holds device memory
    (None, {3089}, None),  # no driver query on this machine, or it failed
])
def test_device_mib_sums_the_arms_processes(answer: str | None, pids: set[int],
                                            want: float | None) -> None:
    from sanctum.bench.device_memory import device_mib

    assert device_mib(pids, query=lambda: answer) == want


def test_an_arm_with_device_memory_adds_the_drivers_figure_to_measured_slots() -> None:
    from sanctum.bench.device_memory import WithDeviceMemory

    asked: list[set[int]] = []

    def mib(pids: object) -> float | None:
        asked.append(set(pids))  # type: ignore[call-overload]
        return 512.0 if asked[-1] else None

    arm = WithDeviceMemory(lambda name: {"agg_tps": 9.0} if name != "skip" else {},
                           lambda: {41}, mib)
    assert arm("c=1") == {"agg_tps": 9.0, "device_mb": 512.0}
    assert arm("skip") == {} and asked == [{41}]  # a slot it does not measure: not asked
    nobody = WithDeviceMemory(lambda name: {"agg_tps": 9.0}, lambda: set(), mib)
    assert nobody("c=1") == {"agg_tps": 9.0}  # no figure: nothing added

    def gone() -> set[int]:  # the seat's /health had no pid (a worker restarting)
        return {int(None)}  # type: ignore[call-overload]

    lost = WithDeviceMemory(lambda name: {"agg_tps": 9.0}, gone, mib)
    assert lost("c=1") == {"agg_tps": 9.0}  # the slot's figures stand without it


def test_listening_finds_the_child_serving_a_port_and_its_children() -> None:
    """A real child process serving a port, and one that is not: only the first, with
    its own child, is named; nothing is left running."""
    import subprocess
    import sys

    import psutil

    from sanctum.bench import servers
    from sanctum.bench.device_memory import listening

    port = servers.free_port()
    code = ("import http.server, subprocess, sys; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"s = http.server.HTTPServer(('127.0.0.1', {port}), "
            "http.server.BaseHTTPRequestHandler); print(c.pid, flush=True); "
            "s.serve_forever()")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = [psutil.Process(server.pid), psutil.Process(idle.pid)]
    try:
        assert server.stdout is not None
        started.append(psutil.Process(int(server.stdout.readline())))
        servers.wait_until(servers.Proc("s", server, Path("/dev/null"), {server.pid}),
                           lambda: bool(listening(port)), 30)
        assert listening(port) == {server.pid, started[2].pid}
        assert listening(servers.free_port()) == set()
    finally:
        for p in reversed(started):
            p.kill()
        server.wait()
        idle.wait()
    assert not psutil.wait_procs(started, timeout=30)[1]  # none left running


@pytest.mark.parametrize(("names", "rounds", "batch_rounds", "warmup", "refused"), [
    (["batching"], 6, 2, 1, None),
    (["batching"], 6, 1, 1, "batching"),  # the 8B-shape run's slip: refused at once
    (["spec"], 1, 3, 1, "spec"),
    (["spec"], 6, 1, 1, None),  # batching's rounds are not spec's
    (["flips", "rules"], 1, 1, 1, None),  # no interleaved rounds to count
    (["stack", "batching"], 6, 3, -1, "stack"),
])
def test_rounds_that_leave_no_measured_round_are_refused_before_anything_starts(
        names: list[str], rounds: int, batch_rounds: int, warmup: int,
        refused: str | None) -> None:
    from sanctum.bench.cli import rounds_refusal
    from sanctum.bench.options import Options

    why = rounds_refusal(names, Options(rounds=rounds, batch_rounds=batch_rounds,
                                        warmup=warmup))
    assert (why is None) if refused is None else (why or "").startswith(f"{refused}: ")


def test_the_command_refuses_rounds_without_a_measured_one_before_any_server() -> None:
    import subprocess
    import sys

    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    done = subprocess.run([sys.executable, "-m", "sanctum.cli", "bench", "run", "batching",
                           "--rounds", "1", "--warmup", "1"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "needs more rounds than --warmup (rounds 1, warm-up 1)" in done.stderr
    assert "Traceback" not in done.stderr
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
