"""The grammar benchmark's pure parts: what each arm sends, how answers are checked,
what a run says, and the in-process cost measurement."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from sanctum.bench import grammar as G
from sanctum.bench.results import ArmInfo, Run
from sanctum.bench.runner import run_schedule
from sanctum.bench.schedule import make_schedule
from sanctum.bench.workloads import Workload
from tests.fakes.fake_upstream import FakeUpstream


def test_example_answer_is_a_schema_answer() -> None:
    """The text the cost is measured along validates under the benchmark's schema."""
    jsonschema.validate(json.loads(G.example_answer()), G.BENCH_SCHEMA)


@pytest.mark.parametrize(("text", "want"), [
    (G.example_answer(), {"json": 1.0, "valid": 1.0}),
    (G.example_answer()[:-5], {"json": 0.0, "valid": 0.0}),  # cut short
    ('{"name": "f"}', {"json": 1.0, "valid": 0.0}),  # JSON, not the schema's
    ("def f(x):\n    return x", {"json": 0.0, "valid": 0.0}),
])
def test_answer_figures(text: str, want: dict[str, float]) -> None:
    """An answer is counted as JSON when it parses and valid when it validates."""
    assert G.answer_figures(text, G.BENCH_SCHEMA) == want


@pytest.mark.parametrize(("constrained", "speculation", "keys"), [
    (True, True, {"response_format"}),
    (True, False, {"response_format", "sanctum"}),
    (False, True, set()),
    (False, False, {"sanctum"}),
])
def test_request_body(constrained: bool, speculation: bool, keys: set[str]) -> None:
    """Schema arms send the json_schema response_format; plain arms turn speculation
    off by the request; nothing else differs."""
    body = G.request_body(constrained, speculation)
    assert set(body) == keys
    if constrained:
        assert body["response_format"]["json_schema"]["schema"] == G.BENCH_SCHEMA
    if not speculation:
        assert body["sanctum"] == {"speculation": False}


@pytest.fixture
def upstream() -> Iterator[FakeUpstream]:
    up = FakeUpstream(answer=G.example_answer())
    yield up
    up.stop()


def test_arm_sends_and_checks(upstream: FakeUpstream) -> None:
    """A schema arm's request carries the schema, a seed per request and its
    speculation option; its figures say whether the answer was valid JSON."""
    w = Workload("doc2body t=0", "a prompt", "chat", messages=(("user", "describe f"),),
                 temperature=0.0)
    url = f"http://127.0.0.1:{upstream.port}"
    arms = [G.GrammarArm(url, "grammar", 8, {w.name: w}, c, sp)
            for c, sp in ((True, False), (False, True))]
    for a in arms:
        a._counters = lambda: {}  # type: ignore[method-assign]  # the fake has no /counters
    schema_figs, free_figs = arms[0](w.name), arms[1](w.name)
    first, second = upstream.requests
    assert first["response_format"]["type"] == "json_schema"
    assert first["sanctum"] == {"speculation": False}
    assert "response_format" not in second and "sanctum" not in second
    assert first["seed"] == second["seed"] == 2  # the first request of a workload: 1 + 1
    assert schema_figs["json"] == schema_figs["valid"] == 1.0
    assert "json" not in free_figs
    assert schema_figs["answer_crc"] == free_figs["answer_crc"]  # the fake's one answer


TPS = {G.SCHEMA_SPEC: 30.0, G.SCHEMA_PLAIN: 18.0, G.FREE_SPEC: 40.0, G.FREE_PLAIN: 20.0}


def _run(schema_json: float = 1.0, error: str | None = None) -> Run:
    workloads = ["doc2body t=0", "doc2body t=0.7"]
    slots = make_schedule(list(G.ARMS), workloads, rounds=3, warmup=1, seed=0)
    clock = iter(range(10_000))

    def arm(name: str) -> Any:
        def measure(w: str) -> dict[str, float]:
            if error and name in (G.SCHEMA_SPEC, G.SCHEMA_PLAIN):
                raise RuntimeError(error)
            figs = {"decode_tps": TPS[name], "accept_len": 2.0 if "spec" in name else 0.0,
                    "answer_crc": 1.0 if name.startswith("schema") else float(len(name)),
                    "accelerated": 1.0 if "spec" in name else 0.0}
            if name.startswith("schema"):
                figs |= {"json": schema_json, "valid": schema_json}
            return figs
        return measure

    samples = run_schedule(slots, {a: arm(a) for a in G.ARMS}, run_id="r",
                           clock=lambda: float(next(clock)), loadavg=lambda: 1.0)
    return Run("r", "grammar", "t", G.FREE_PLAIN, [ArmInfo(a, a) for a in G.ARMS],
               {w: w for w in workloads}, 3, 1, 0, {}, samples)


def test_headline_ratios() -> None:
    """Per temperature: schema over free at each speculation setting, spec over plain
    with and without the schema, each a per-pair ratio of decode tokens/s."""
    got = {what: (s.median, s.n) for what, s, _ in G.headline(_run())}
    assert got["decode tokens/s, schema over free, speculation on, t=0"] == (0.75, 2)
    assert got["decode tokens/s, schema over free, speculation off, t=0.7"] == (0.9, 2)
    assert got["decode tokens/s, spec over plain, under the schema, t=0"] == (30 / 18, 2)
    assert got["decode tokens/s, spec over plain, free text, t=0.7"] == (2.0, 2)
    assert len(got) == 8


def test_table_and_summary() -> None:
    """The table gives each arm's median rate and, for schema arms, how many answers
    were JSON and valid (warm-up left out)."""
    lines = G.summary_lines(_run())
    row = next(line for line in lines if line.startswith(f"| {G.SCHEMA_SPEC} |"))
    assert row == f"| {G.SCHEMA_SPEC} | 30 | 2.00 | 4 of 4 | 4 of 4 |"
    free = next(line for line in lines if line.startswith(f"| {G.FREE_PLAIN} |"))
    assert free == f"| {G.FREE_PLAIN} | 20 | 0.00 | - | - |"
    assert (f"- {G.SCHEMA_SPEC}: 4 of 4 answers accelerated; the same answer as "
            f"{G.SCHEMA_PLAIN} (same seed) in 4 of 4 pairs") in lines
    assert any(line.startswith(f"- {G.FREE_SPEC}:") and "in 0 of 4 pairs" in line
               for line in lines)


@pytest.mark.parametrize(("schema_json", "error", "why"), [
    (1.0, None, None),
    (0.0, None, "its answers were not JSON"),
    (1.0, "BadRequestError: response_format is not supported", "BadRequestError"),
])
def test_not_constrained(schema_json: float, error: str | None, why: str | None) -> None:
    """A seat that answers free text or refuses the field makes the run not
    measurable, saying which; a constraining seat does not."""
    got = G.not_constrained(_run(schema_json, error).samples)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got


def test_mask_cost_with_the_demo_tokenizer() -> None:
    """The cost measurement drives the seat's grammar along the example answer and
    reports positive per-token microseconds."""
    from shared.builtin import resolve_model
    from shared.prompt import load_tokenizer

    tok = load_tokenizer(resolve_model("builtin:demo"))
    cost = G.mask_cost(tok, 8192, G.example_answer(), G.BENCH_SCHEMA, runs=2)
    assert cost["tokens"] == len(tok.encode(G.example_answer()))
    assert 0 < cost["mask_consume_us_p50"] <= cost["mask_consume_us_p99"]
    assert cost["vocab"] == 8192
    with pytest.raises(ValueError):
        G.mask_cost(tok, 8192, G.example_answer()[:-1], G.BENCH_SCHEMA, runs=1)
