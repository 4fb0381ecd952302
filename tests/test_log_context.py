"""Every line a seat writes names its seat, and every line written for a request names
it, on the MLX thread too: there the batch engine serves many requests' rows at once,
so it names each row's request itself (`seatd.batch`), and the thread starts bound to
the seat (`shared.threads.bound_pool`)."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from seatd.adaptive import DepthStats
from seatd.batch import Engine
from seatd.drafters import Draft, ModelDrafter
from seatd.engine_io import Admitted, Transcript, Work
from seatd.engine_types import Speculation, output_width
from seatd.kv_budget import KVBudget
from seatd.sampling import Draws
from seatd.shaping import Shaper
from shared import protocol
from shared.protocol import Generate, SamplingParams
from shared.threads import bound_pool
from tests.procs import wait_for

log = structlog.get_logger()
Lines = list[MutableMapping[str, Any]]  # as capture_logs has them
MERGED = [structlog.contextvars.merge_contextvars]


def thread_bindings(pool: ThreadPoolExecutor) -> dict[str, Any]:
    """What a line written in the pool's thread, in its own context, is bound to."""
    return pool.submit(structlog.contextvars.get_contextvars).result()


def test_a_bound_pool_starts_its_thread_bound_as_its_maker_and_to_its_own() -> None:
    """The pool's thread has the maker's bindings (read when the pool was made) and its
    own; a bare pool's thread has none, which is what the seat's MLX thread had."""
    with structlog.contextvars.bound_contextvars(process="worker:demo", pid=7):
        pool = bound_pool("mlx", seat="demo")
        bare = ThreadPoolExecutor(1)
    try:
        with structlog.contextvars.bound_contextvars(request_id="later"):
            assert thread_bindings(pool) == {"process": "worker:demo", "pid": 7,
                                             "seat": "demo"}
            assert thread_bindings(bare) == {}
        with capture_logs(processors=MERGED) as lines:
            pool.submit(log.info, "model_loaded").result()
        assert lines == [{"event": "model_loaded", "log_level": "info",
                          "process": "worker:demo", "pid": 7, "seat": "demo"}]
    finally:
        pool.shutdown()
        bare.shutdown()


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any, Any]:
    from seatd.model_load import load_for_compute
    from shared.builtin import resolve_model

    target = load_for_compute(resolve_model("builtin:demo"), None)
    drafter = load_for_compute(resolve_model("builtin:demo-drafter"), None)
    return target.model, target.tokenizer, drafter.model


class FailingDrafter(ModelDrafter):
    """A model drafter whose every proposal raises: its row declines, with a line."""

    def propose(self, k: int, params: SamplingParams, draws: Draws, position: int,
                shaper: Shaper | None = None) -> Draft:
        raise RuntimeError("drafter fault")


class StepFault(Exception):
    pass


class Logged:
    """A seat's admission that writes a line naming nothing itself as each row is
    admitted and as it ends (as the prompt cache does), and refuses `d`."""

    def admit(self, work: Work) -> Admitted:
        log.info("begun")
        if work.rid == "d":
            raise ValueError("refused before any work")
        return Admitted(spec=work.spec, finish=lambda ok: log.info("row_ended", ok=ok))


def ended(seen: Transcript, engine: Engine) -> int:
    """Requests ended so far, the engine's new events read."""
    seen.read(engine.outbox)
    return len(seen.ended)


def engine_lines(pair: tuple[Any, Any, Any]) -> tuple[Lines,
                                                       dict[str, BaseException | None]]:
    """Four requests through the engine running on a seat's bound MLX thread: `a` and
    `b` share a lane whose step fails (an injected fault in the step over b), `c`
    decodes beside them with a drafter that fails, `d` is refused at its admission."""
    model, tok, drafter = pair
    engine = Engine(model, tok, 2048, output_width(model), 8, KVBudget(1 << 30), Logged())
    real = engine._plain_step

    def plain_step(lane: Any) -> None:
        if any(r.rid == "b" for r in lane.rows):
            raise StepFault("a forward over b failed")
        real(lane)

    setattr(engine, "_plain_step", plain_step)  # noqa: B010  # this engine's own
    params = SamplingParams(max_tokens=12, temperature=0)
    for rid, kv in (("a", "fp16"), ("b", "fp16"), ("c", "q8"), ("d", "fp16")):
        prompt = f"def {rid}_function(n):"
        spec = Speculation(FailingDrafter(drafter), 3, DepthStats()) if rid == "c" else None
        engine.submit(Work(Generate(rid, True, params, prompt=prompt), tok.encode(prompt), kv,
                           spec=spec))
    seen = Transcript()
    pool = bound_pool("mlx", seat="demo")
    with capture_logs(processors=MERGED) as lines:
        try:
            pool.submit(engine.run)
            wait_for("every row ended", lambda: ended(seen, engine) == 4)
        finally:
            engine.stop()
            pool.shutdown(wait=True)
    return lines, {rid: seen.error(rid) for rid in seen.ended}


def test_engine_lines_on_the_mlx_thread_name_their_rows_and_the_seat(
        pair: tuple[Any, Any, Any]) -> None:
    """Lines the engine writes for a row name its request, a failed step over a lane
    names every request in it, and what the seat's admission writes for a row, as it is
    admitted and as it ends, is bound to its request; every line names the seat."""
    lines, ended = engine_lines(pair)
    assert isinstance(ended["a"], StepFault) and isinstance(ended["b"], StepFault)
    assert ended["c"] is None and isinstance(ended["d"], ValueError)
    assert lines and all(line.get("seat") == "demo" for line in lines), lines

    def named(event: str) -> list[Any]:
        return [line.get("request_id") for line in lines if line["event"] == event]

    assert sorted(named("begun"), key=str) == ["a", "b", "c", "d"]
    assert named("row_begin_failed") == ["d"]
    assert sorted(named("row_ended"), key=str) == ["a", "b", "c"]  # d never started
    assert named("drafter_failed") == ["c"]
    [step] = [line for line in lines if line["event"] == "batch_step_failed"]
    assert sorted(step["request_ids"]) == ["a", "b"] and "request_id" not in step
    assert not [line for line in lines if line["event"] == "engine_step_failed"]


@pytest.fixture
def worker_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                 ) -> Iterator[tuple[Lines, dict[str, list[Any]]]]:
    """A real seat worker in-process (the demo model on its own MLX thread) serves one
    request, then one whose grammar cannot be built."""
    from seatd.grammar import SeatGrammar
    from tests.test_tool_parsers import answer

    built = SeatGrammar.for_request

    def for_request(self: SeatGrammar, request: Generate, prefix_ids: Sequence[int] = ()
                    ) -> Any:
        if request.request_id == "no-grammar":
            raise RuntimeError("the grammar compiler broke")
        return built(self, request, prefix_ids)

    monkeypatch.setattr(SeatGrammar, "for_request", for_request)
    params = SamplingParams(max_tokens=4, temperature=0)
    requests = [Generate(rid, False, params, prompt="def main():")
                for rid in ("served", "no-grammar")]
    with capture_logs(processors=MERGED) as lines:
        frames, _ = answer(tmp_path, requests)
    yield lines, frames


def test_a_seat_workers_lines_name_the_seat_and_their_request(
        worker_lines: tuple[Lines, dict[str, list[Any]]]) -> None:
    """The model loading (on the MLX thread, outside any request), a request's grammar
    failing (on the MLX thread) and each request's end name the seat; those for a request
    name it."""
    lines, frames = worker_lines
    assert isinstance(frames["served"][-1].outcome, protocol.Ok)
    assert isinstance(frames["no-grammar"][-1].outcome, protocol.Rejected)
    assert lines and all(line.get("seat") == "demo" for line in lines), lines
    events = {line["event"] for line in lines}
    assert {"model_loading", "model_loaded", "grammar_build_failed", "request_done"} <= events
    [failed] = [line for line in lines if line["event"] == "grammar_build_failed"]
    assert failed["request_id"] == "no-grammar"
    done = {line["request_id"]: line["outcome"] for line in lines
            if line["event"] == "request_done"}
    assert done == {"served": "ok", "no-grammar": "rejected"}
