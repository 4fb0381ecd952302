"""The null seat: a real process that speaks the seat protocol and answers at once."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sanctum.bench.arms import DirectSeat
from sanctum.bench.null_seat import answer
from sanctum.bench.servers import Proc
from shared import protocol
from shared.protocol import Chunk, Final, Generate, Ok, Ping, Pong, SamplingParams, Started


def test_answer_is_n_chunks_then_a_final_naming_the_served_count() -> None:
    """A Generate is started, gets max_tokens one-token chunks and Final(ok) with
    served + 1."""
    gen = Generate("r1", True, SamplingParams(max_tokens=3), prompt="hi")
    frames, served = answer(gen, "null", served=4)
    decoded = [protocol.reply_decoder.decode(f) for f in frames]
    assert [type(d) for d in decoded] == [Started, Chunk, Chunk, Chunk, Final]
    assert [d.completion_tokens for d in decoded[1:4]] == [1, 2, 3]
    final = decoded[-1]
    assert isinstance(final, Final) and final.outcome == Ok() and final.served == 5
    assert served == 5 and final.usage.completion_tokens == 3


def test_ping_is_a_ready_pong() -> None:
    frames, served = answer(Ping(sent_at=1.5), "null", 0)
    pong = protocol.reply_decoder.decode(frames[0])
    assert isinstance(pong, Pong) and pong.ready and pong.sent_at == 1.5 and served == 0


def test_null_seat_process_serves_over_zeromq_and_stops() -> None:
    """Started as a process, it streams a request over ipc, then stops and removes its socket."""
    d = Path(tempfile.mkdtemp(prefix="nst-", dir="/tmp"))
    endpoint = f"ipc://{d / 'seat.sock'}"
    with open(d / "log", "wb") as log:
        popen = subprocess.Popen([sys.executable, "-m", "sanctum.bench.null_seat",
                                  "--endpoint", endpoint], stdout=log, stderr=subprocess.STDOUT)
    proc = Proc("null-seat", popen, d / "log", {popen.pid})
    client = DirectSeat(endpoint)
    try:
        times = client.request(5)
        assert len(times) == 6  # five chunks and the final
    finally:
        client.close()
        proc.stop(timeout=10)
    assert popen.returncode == 0
    assert not (d / "seat.sock").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(popen.pid, 0)
