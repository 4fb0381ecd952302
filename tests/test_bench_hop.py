"""The hop benchmark's fake upstream frames its answers right, and its table reads the
added figures against direct from the same round."""

from __future__ import annotations

import json

from sanctum.bench.fake_openai import response
from sanctum.bench.hop import section
from sanctum.bench.results import ArmInfo, Run, Sample


def dechunk(raw: bytes) -> bytes:
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    out = b""
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n"
            return out
        out, rest = out + rest[:size], rest[size + 2:]


def test_stream_is_n_chunks_a_finish_with_usage_and_done() -> None:
    events = [e for e in dechunk(response(True, True, 3)).split(b"\n\n") if e]
    datas = [e.removeprefix(b"data: ") for e in events]
    assert datas[-1] == b"[DONE]"
    bodies = [json.loads(d) for d in datas[:-1]]
    assert [b["choices"][0]["delta"].get("content") for b in bodies] == ["x", "x", "x", None]
    assert bodies[-1]["choices"][0]["finish_reason"] == "length" and "usage" in bodies[-1]


def test_non_stream_body_has_its_content_length() -> None:
    head, _, body = response(False, False, 2).partition(b"\r\n\r\n")
    assert f"Content-Length: {len(body)}".encode() in head
    assert json.loads(body)["choices"][0]["text"] == "xx"


def sample(seq: int, rnd: int, workload: str, arm: str, **figures: float) -> Sample:
    return Sample("r", seq, rnd, workload, arm, False, float(seq), seq + 0.5, 0.5, 0.5, figures)


def test_section_takes_added_figures_per_round_and_says_which_goals_hold() -> None:
    samples = []
    for r in range(2):
        samples += [
            sample(8 * r, r, "latency", "direct", latency_p50_s=0.0001),
            sample(8 * r + 1, r, "latency", "proxyd-null", latency_p50_s=0.0006 + r * 1e-4),
            sample(8 * r + 2, r, "stream", "direct", per_chunk_s=2e-6),
            sample(8 * r + 3, r, "stream", "proxyd-null", per_chunk_s=32e-6),
            sample(8 * r + 4, r, "throughput", "direct", rps=6000.0),
            sample(8 * r + 5, r, "throughput", "proxyd-null", rps=2500.0,
                   proxy_cpu_per_request_s=0.0004),
        ]
    run = Run("r", "hop", "hop", "direct", [ArmInfo("direct", ""), ArmInfo("proxyd-null", "")],
              {"throughput": "16 concurrent clients"}, 2, 0, 0, {}, samples)
    text = "\n".join(section(run))
    assert "| added latency per request, p50 (c=1) | - | +0.55 ms |" in text
    assert "| requests/s at 16 concurrent | 6,000 | 2,500 |" in text
    assert "| added time per streamed chunk | - | 30.0 us |" in text
    assert "| proxy CPU per request | - | 0.40 ms |" in text
    assert ("proxyd-null: added p50 met (goal < 1 ms), requests/s met (goal >= 2,000), "
            "per chunk missed by 10.0 us (goal < 20 us)") in text
