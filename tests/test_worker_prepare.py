"""A burst of requests reaches a real seat worker's engine prepared together: one call on
the worker's preparing thread for the requests waiting at once, each answered on its own
(a prompt over the seat's cap refused with its 413, the others answered), in order."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from shared import protocol

CAP = 64  # the seat's max_prompt_tokens here


class Recorder:
    """The worker's ROUTER socket: the frames it is given, and each request's Final."""

    def __init__(self, expected: int) -> None:
        self.frames: list[Any] = []
        self.finals: dict[str, protocol.Final] = {}
        self.expected = expected
        self.done = asyncio.Event()

    def send_multipart(self, parts: list[bytes]) -> None:
        frame = protocol.reply_decoder.decode(parts[1])
        self.frames.append(frame)
        if isinstance(frame, protocol.Final):
            self.finals[frame.request_id] = frame
            if len(self.finals) == self.expected:
                self.done.set()


def test_a_burst_is_prepared_together_and_each_request_answered(tmp_path: Path) -> None:
    from seatd.worker import SeatWorker
    from shared.config import parse_config

    config = parse_config(
        f'[seatd]\nstate_dir = "{tmp_path}"\n[[seat]]\nname = "demo"\n'
        f'model = "builtin:demo"\nkv = "fp16"\nmax_prompt_tokens = {CAP}\n'
        'speculation = false\n'
        '[[route]]\nmodel = "demo"\nladder = ["demo"]\n')
    worker = SeatWorker(config, config.seat_by_name("demo"))
    params = protocol.SamplingParams(temperature=0.0, max_tokens=6)
    prompts = {"a": "def add(a, b):", "b": "class Stack:",
               "long": "word " * (4 * CAP), "c": "import os"}
    requests = [protocol.Generate(rid, True, params, prompt=p) for rid, p in prompts.items()]
    calls: list[list[str]] = []
    real = worker.prepare_all

    def prepare_all(jobs: list[Any]) -> list[Any]:
        calls.append([job.request.request_id for job in jobs])
        return real(jobs)

    worker.prepare_all = prepare_all  # type: ignore[method-assign]
    sock = Recorder(len(requests))
    submitted: list[str] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        worker.loop = loop
        worker.loaded = await loop.run_in_executor(worker.mlx, worker.load)
        engine = worker.loaded.engine
        assert engine is not None
        real_submit = engine.submit

        def submit(work: Any) -> None:
            submitted.append(work.rid)
            real_submit(work)

        engine.submit = submit  # type: ignore[method-assign]
        server = loop.run_in_executor(worker.mlx, engine.run)
        worker.sock = sock  # type: ignore[assignment]
        for request in requests:  # all waiting before the preparer takes any
            worker.handle(b"peer", request)
        preparer = loop.create_task(worker.prepared())
        try:
            await asyncio.wait_for(sock.done.wait(), 120)
        finally:
            preparer.cancel()
            engine.stop()
            await server

    try:
        asyncio.run(scenario())
    finally:
        worker.mlx.shutdown(wait=True)
        worker.prep.shutdown(wait=True)

    assert calls == [list(prompts)], "the four waiting requests were prepared in one call"
    assert submitted == ["a", "b", "c"], "the answered ones reached the engine in order"
    refused = sock.finals["long"].outcome
    assert isinstance(refused, protocol.Rejected)
    assert (refused.status, refused.code) == (413, "prompt_too_long")
    assert refused.extra["cap"] == CAP and int(refused.extra["prompt_tokens"]) > CAP
    for rid in ("a", "b", "c"):
        final = sock.finals[rid]
        assert isinstance(final.outcome, protocol.Ok), (rid, final.outcome)
        assert final.usage.completion_tokens == 6
        text = "".join(f.text for f in sock.frames
                       if isinstance(f, protocol.Chunk) and f.request_id == rid)
        assert text, rid
