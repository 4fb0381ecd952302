"""A seed fixes the answer through `sanctum up`, whatever the seat does to go fast.

One seeded request, chat and completion, at temperatures 0.4, 0.7 and 1.0 with top_p 0.9
and top_k 20, gives the same bytes across: stream and sync; speculation adaptive (the
packaged default seat, as `sanctum up` runs it), the depth pinned 1 to 5, the lookup
drafter, speculation off by request, the kill switch (a seat with `speculation = false`);
the prompt cache warm and cold; before and after a seat restart; the fp16 and q8 lanes,
each against itself.  On the demo target and on the hybrid demo target.  Each variant is
sent twice, once streamed and once sync, the second pass in reverse order, so that the
adaptive seat's statistics differ between the two sends.  The seats answer side by side
(one client thread per seat), each seat its own requests in that order.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.procs import Sanctum, packaged_config, running, wait_for
from tests.spec_models import snippet

pytestmark = pytest.mark.slow

EXTRA_SEATS = """
[[seat]]
name = "lookup"
model = "builtin:demo"
drafter = { kind = "lookup" }
max_prompt_tokens = 1536

[[seat]]
name = "nospec"
model = "builtin:demo"
drafter = { kind = "model", path = "builtin:demo-drafter" }
speculation = false
max_prompt_tokens = 1536

[[seat]]
name = "hybrid"
model = "builtin:demo-hybrid"
drafter = { kind = "model", path = "builtin:demo-drafter" }
max_prompt_tokens = 1536

[[route]]
model = "lookup"
ladder = ["lookup"]

[[route]]
model = "nospec"
ladder = ["nospec"]

[[route]]
model = "hybrid"
ladder = ["hybrid"]
"""

Variant = tuple[str, dict[str, Any]]  # (route, the request's `sanctum` options)

# The demo target's fp16 lane: every way a seat can serve it.  The first is the
# packaged default seat with no option at all.
DEMO: list[Variant] = [
    ("demo", {}),
    *[("demo", {"draft_depth": d}) for d in range(1, 6)],
    ("demo", {"speculation": False}),
    ("demo", {"prompt_cache": False}),
    ("lookup", {}),
    ("nospec", {}),
]
# A pinned depth in every family, so that each has an answer that really speculated.
DEMO_Q8: list[Variant] = [("demo", {"kv": "q8"}), ("demo", {"kv": "q8", "draft_depth": 2}),
                          ("demo", {"kv": "q8", "speculation": False})]
HYBRID: list[Variant] = [("hybrid", {}), ("hybrid", {"draft_depth": 3}),
                         ("hybrid", {"speculation": False}), ("hybrid", {"prompt_cache": False})]
HYBRID_Q8: list[Variant] = [("hybrid", {"kv": "q8", "draft_depth": 2}),
                            ("hybrid", {"kv": "q8", "speculation": False})]
FAMILIES = {"demo/fp16": DEMO, "demo/q8": DEMO_Q8, "hybrid/fp16": HYBRID,
            "hybrid/q8": HYBRID_Q8}

TEMPERATURES = [0.4, 0.7, 1.0]
# Longer than one 512-token prefill chunk, so that a repeated request resumes warm.
PROMPT = snippet(2200)
SEED = 7
# Two verify rounds or more at every pinned depth (1 to 5): a position the rounds key
# differently from the plain path shows up in the bytes.
TOKENS = 8


@pytest.fixture(scope="module")
def up() -> Iterator[Sanctum]:
    with running(lambda port: packaged_config(port) + EXTRA_SEATS,
                 ("demo", "lookup", "nospec", "hybrid")) as s:
        yield s


@pytest.fixture(scope="module")
def client(up: Sanctum) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key="x", max_retries=0, timeout=300)


class Answer:
    def __init__(self, text: str, fingerprint: str | None, sanctum: dict[str, Any],
                 cached: int) -> None:
        self.text, self.fingerprint, self.sanctum, self.cached = text, fingerprint, sanctum, cached


def ask(client: openai.OpenAI, endpoint: str, temperature: float, variant: Variant,
        stream: bool) -> Answer:
    route, options = variant
    args: dict[str, Any] = dict(model=route, max_tokens=TOKENS, temperature=temperature, top_p=0.9,
                                seed=SEED, extra_body={"top_k": 20, "sanctum": options})
    if endpoint == "chat":
        messages = [{"role": "user", "content": PROMPT}]
        if not stream:
            r = client.chat.completions.create(messages=messages, **args)  # type: ignore[arg-type]
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            return Answer(r.choices[0].message.content or "", r.system_fingerprint,
                          r.model_extra["sanctum"],  # type: ignore[index]
                          r.usage.prompt_tokens_details.cached_tokens or 0)
        chunks = list(client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True},
            **args))  # type: ignore[arg-type]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        if not stream:
            c = client.completions.create(prompt=PROMPT, **args)
            assert c.usage is not None
            details = c.usage.model_extra.get("prompt_tokens_details") or {}  # type: ignore[union-attr]
            return Answer(c.choices[0].text, c.system_fingerprint,
                          c.model_extra["sanctum"],  # type: ignore[index]
                          int(details.get("cached_tokens") or 0))
        chunks = list(client.completions.create(
            prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **args))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    prints = {c.system_fingerprint for c in chunks}
    assert len(prints) == 1, prints  # every chunk names the same fingerprint
    last = chunks[-1]
    usage = last.usage
    assert usage is not None
    details = getattr(usage, "prompt_tokens_details", None) or (
        usage.model_extra or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else (
        details.cached_tokens or 0)
    return Answer(text, prints.pop(), last.model_extra["sanctum"],  # type: ignore[index]
                  int(cached or 0))


def both_passes(client: openai.OpenAI, endpoint: str, temperature: float,
                variants: list[Variant]) -> list[tuple[Variant, bool, Answer]]:
    """Every variant twice: in order (stream, sync, stream, ...), then in reverse order
    with the other mode, so each variant is sent streamed once and sync once."""
    out = []
    for i, v in enumerate(variants):
        out.append((v, i % 2 == 0, ask(client, endpoint, temperature, v, i % 2 == 0)))
    for i, v in reversed(list(enumerate(variants))):
        out.append((v, i % 2 == 1, ask(client, endpoint, temperature, v, i % 2 == 1)))
    return out


def every_family(client: openai.OpenAI, endpoint: str,
                 temperature: float) -> dict[str, list[tuple[Variant, bool, Answer]]]:
    """Both passes of every family, one thread per seat: the seats answer side by side,
    and each seat gets its requests in the order it would alone (family after family)."""
    routes = list(dict.fromkeys(v[0] for variants in FAMILIES.values() for v in variants))

    def one_seat(route: str) -> dict[str, list[tuple[Variant, bool, Answer]]]:
        return {family: both_passes(client, endpoint, temperature,
                                    [v for v in variants if v[0] == route])
                for family, variants in FAMILIES.items()}

    with ThreadPoolExecutor(len(routes)) as pool:
        seats = list(pool.map(one_seat, routes))
    return {family: [a for seat in seats for a in seat[family]] for family in FAMILIES}


def _expected_speculation(variant: Variant) -> set[str]:
    route, options = variant
    if options.get("speculation") is False:
        return {"declined:disabled_by_request"}
    if route == "nospec":
        return {"declined:kill_switch"}
    if options.get("draft_depth"):
        return {"accelerated"}
    # Adaptive may park; lookup may find nothing to copy in so few tokens.
    return {"accelerated", "declined:not_profitable", "declined:no_proposal"}


# Each temperature once, both doors (each case is some 30 s of real decoding).
@pytest.mark.parametrize(("endpoint", "temperature"),
                         list(zip(["chat", "completion", "chat"], TEMPERATURES, strict=True)))
def test_a_seeded_answer_is_the_same_on_every_path(client: openai.OpenAI, endpoint: str,
                                                   temperature: float) -> None:
    """Same bytes on every variant of a family (a target and a KV lane), streamed or sync,
    in either order; the fingerprint is one per family, and differs between families."""
    prints: dict[str, str | None] = {}
    for family, answers in every_family(client, endpoint, temperature).items():
        assert len(answers) == 2 * len(FAMILIES[family]), family
        texts = {(v[0], str(v[1]), stream): a.text for v, stream, a in answers}
        assert answers[0][2].text, family
        assert len(set(texts.values())) == 1, (family, texts)
        for v, _, a in answers:
            assert a.sanctum["speculation"] in _expected_speculation(v), (v, a.sanctum)
        assert any(a.sanctum["speculation"] == "accelerated" for _, _, a in answers)
        # The first send of the default seat is cold, later ones resume warm; a request
        # that opts out of the cache never does.
        assert any(a.cached > 0 for _, _, a in answers), family
        assert all(a.cached == 0 for v, _, a in answers if v[1].get("prompt_cache") is False)
        family_prints = {a.fingerprint for _, _, a in answers}
        assert len(family_prints) == 1 and None not in family_prints, family_prints
        prints[family] = family_prints.pop()
    assert len(set(prints.values())) == len(prints), prints


def test_a_seat_restart_changes_no_seeded_answer(up: Sanctum, client: openai.OpenAI) -> None:
    """After `sanctum restart`, the same seeded requests give the same bytes and the same
    fingerprint (the new worker has no statistics, no cache)."""
    cases = [(e, t, v) for e in ("chat", "completion") for t in (0.7,)
             for v in (DEMO[0], HYBRID[0])]

    def sends(streams: tuple[bool, ...]) -> list[Answer]:
        """Every case sent each way in `streams`, the two seats side by side."""
        def one_seat(route: str) -> dict[int, list[Answer]]:
            return {i: [ask(client, e, t, v, stream=s) for s in streams]
                    for i, (e, t, v) in enumerate(cases) if v[0] == route}

        with ThreadPoolExecutor(2) as pool:
            seats = list(pool.map(one_seat, ("demo", "hybrid")))
        return [a for i in range(len(cases)) for seat in seats for a in seat.get(i, [])]

    before = sends((False,))
    pids = {seat: up.worker_pid(seat) for seat in ("demo", "hybrid")}
    for seat in pids:  # both restart at once: their new workers load side by side
        done = subprocess.run([sys.executable, "-m", "sanctum.cli", "restart", seat,
                               "--config", str(up.config)], env=up.env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    wait_for("both seats back with new workers",
             lambda: all(_restarted(up.health()["seats"][seat], pid)
                         for seat, pid in pids.items()), timeout=120, logs=up.logs)
    up.remember_tree()
    after = sends((True, False))
    for i, b in enumerate(before):
        for a in after[2 * i : 2 * i + 2]:
            assert (a.text, a.fingerprint) == (b.text, b.fingerprint), cases[i]


def _restarted(health: dict[str, Any], pid: int) -> bool:
    """A seat's /health entry says it is ready on a worker other than `pid`."""
    return bool(health["ready"]) and health["pid"] != pid
