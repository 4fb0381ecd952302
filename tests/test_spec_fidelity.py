"""The fidelity gate through real processes: on every lane, with speculation on and off,
at temperatures 0 and 0.7, a streamed answer equals the sync answer byte for byte.
Seats: the demo target with the model drafter and with the lookup drafter, and the
hybrid demo target (gated-delta layers, rolled back by `seatd.recurrent`) with the
same model drafter."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import openai
import pytest

from tests.procs import Sanctum, free_port

pytestmark = pytest.mark.slow

CONFIG = """
[proxy]
listen = "127.0.0.1:{port}"

[seatd]
heartbeat_s = 0.5

[[seat]]
name = "model"
model = "builtin:demo"
drafter = {{ kind = "model", path = "builtin:demo-drafter" }}
draft_depth = 3
max_prompt_tokens = 1536

[[seat]]
name = "lookup"
model = "builtin:demo"
drafter = {{ kind = "lookup" }}
draft_depth = 3
max_prompt_tokens = 1536

[[seat]]
name = "hybrid"
model = "builtin:demo-hybrid"
drafter = {{ kind = "model", path = "builtin:demo-drafter" }}
draft_depth = 3
max_prompt_tokens = 1536

[[route]]
model = "model"
ladder = ["model"]

[[route]]
model = "hybrid"
ladder = ["hybrid"]

[[route]]
model = "lookup"
ladder = ["lookup"]
"""

PROMPT = [{"role": "user",
           "content": "def parse_args(argv):\n    \"\"\"Parse argv into a dict.\"\"\""}]


@pytest.fixture(scope="module")
def up() -> Iterator[Sanctum]:
    port = free_port()
    s = Sanctum(CONFIG.format(port=port), port=port)
    try:
        s.wait_ready(("model", "lookup", "hybrid"))
        yield s
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop() == 0


LANES = list(itertools.product(["model", "lookup", "hybrid"], ["fp16", "q8"], [True, False],
                               [0.0, 0.7]))


@pytest.mark.parametrize(("seat", "kv", "speculate", "temperature"), LANES)
def test_stream_equals_sync(up: Sanctum, seat: str, kv: str, speculate: bool,
                            temperature: float) -> None:
    """Same request, same seed: the streamed text is the sync text, on this lane."""
    client = openai.OpenAI(base_url=up.url + "/v1", api_key="x", max_retries=0, timeout=300)
    args = dict(model=seat, messages=PROMPT, max_tokens=48, temperature=temperature, seed=7,
                extra_body={"sanctum": {"kv": kv, "speculation": speculate}})
    raw = client.chat.completions.with_raw_response.create(**args)
    sync = raw.parse().choices[0].message.content
    expected = "accelerated" if speculate else "declined:disabled_by_request"
    assert raw.headers["x-sanctum-speculation"] == expected
    raw_stream = client.chat.completions.with_raw_response.create(stream=True, **args)
    # The header leaves at the commit point: it says what the seat was doing then.
    at_commit = raw_stream.headers["x-sanctum-speculation"]
    if speculate and seat == "lookup":
        assert at_commit in (expected, "declined:no_proposal")
    else:
        assert at_commit == expected
    chunks = list(raw_stream.parse())
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert sync and streamed == sync
