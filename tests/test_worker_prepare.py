"""A burst of requests reaches a real seat worker's engine prepared together: one call on
the worker's preparing thread for the requests waiting at once, each answered on its own
(a prompt over the seat's cap refused with its 413, the others answered), in order.  The
seat as configured by default (its drafter, speculation on) but for its cap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shared import protocol
from tests.worker_rig import Recorder, demo_worker, drive, serving

CAP = 64  # the seat's max_prompt_tokens here


def test_a_burst_is_prepared_together_and_each_request_answered(tmp_path: Path) -> None:
    worker = demo_worker(tmp_path, f"max_prompt_tokens = {CAP}")
    params = protocol.SamplingParams(temperature=0.0, max_tokens=6)
    prompts = {"a": "def add(a, b):", "b": "class Stack:",
               "long": "word " * (4 * CAP), "c": "import os"}
    requests = [protocol.Generate(rid, True, params, prompt=p) for rid, p in prompts.items()]
    calls: list[list[str]] = []
    real = worker.prepare_all

    def prepare_all(jobs: list[Any]) -> list[Any]:
        calls.append([job.request.request_id for job in jobs])
        got: list[Any] = real(jobs)
        return got

    worker.prepare_all = prepare_all
    sock = Recorder()
    submitted: list[str] = []

    async def scenario() -> None:
        async with serving(worker) as served:
            real_submit = served.engine.submit

            def submit(work: Any) -> None:
                submitted.append(work.rid)
                real_submit(work)

            served.engine.submit = submit
            worker.sock = sock
            for request in requests:  # all waiting before the preparer takes any
                worker.handle(b"peer", request)
            served.prepare()
            await sock.finals(len(requests))

    drive(worker, scenario())

    assert calls == [list(prompts)], "the four waiting requests were prepared in one call"
    assert submitted == ["a", "b", "c"], "the answered ones reached the engine in order"
    refused = sock.final["long"].outcome
    assert isinstance(refused, protocol.Rejected)
    assert (refused.status, refused.code) == (413, "prompt_too_long")
    assert refused.extra["cap"] == CAP and int(refused.extra["prompt_tokens"]) > CAP
    for rid in ("a", "b", "c"):
        final = sock.final[rid]
        assert isinstance(final.outcome, protocol.Ok), (rid, final.outcome)
        assert final.usage.completion_tokens == 6
        text = "".join(f.text for f in sock.frames
                       if isinstance(f, protocol.Chunk) and f.request_id == rid)
        assert text, rid
