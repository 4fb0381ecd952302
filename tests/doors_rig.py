"""`sanctum up` behind every front door: two local demo seats, one seat that is down,
and an off-box rung that is a fake OpenAI-compatible upstream recording what reached it.

    private   ["brain", "coder"]   offbox deny   brain: the packaged default's seat
                                                 (builtin:demo with its drafter,
                                                 adaptive depth); coder: the same
                                                 model, q8 KV, no drafter
    sealed    ["ghost", "cloud"]   offbox deny   ghost's model folder does not exist,
                                                 so the seat never starts: a private
                                                 request must get a 503 (`loading`
                                                 within the proxy's spawn grace of a
                                                 seat it never heard from, 30 s;
                                                 `no_private_seat` after), and `cloud`
                                                 must never see it
    open      ["cloud"]            offbox allow  the fake upstream answers

Caps: 1536 prompt tokens on both local seats (the default's), 64 tokens of margin.

    with start_doors() as rig:       # ready on brain and coder; proven stopped after
        rig.url, rig.upstream.requests, rig.kill_seat("brain"), rig.counters()
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.fakes.fake_upstream import FakeUpstream
from tests.procs import Sanctum, assert_gone, http, running, wait_for

KEY_ENV = "SANCTUM_TEST_DOORS_KEY"

CONFIG = """
[proxy]
listen = "127.0.0.1:{port}"
tokenizer_margin = 64
heartbeat_s = 0.5
# The proxy reads a seat's state from its pongs, not from seatd: `ghost`, which never
# answers one, looks like a seat that loads, and a request on `sealed` waits this long
# for it before it is refused.
load_wait_s = 2

[seatd]
heartbeat_s = 0.5
drain_s = 20
backoff_initial_s = 0.2

[[seat]]
name = "brain"
model = "builtin:demo"
drafter = {{ kind = "model", path = "builtin:demo-drafter" }}
kv = "fp16"
max_prompt_tokens = 1536

[[seat]]
name = "coder"
model = "builtin:demo"
kv = "q8"
max_prompt_tokens = 1536

[[seat]]
name = "ghost"
model = "./no-such-model"
max_prompt_tokens = 1536

[[seat]]
name = "cloud"
kind = "openai"
base_url = "{upstream}"
api_key_env = "{key_env}"
upstream_model = "cloud-model"
max_prompt_tokens = 8192
offbox = true
first_token_timeout_s = 5
connect_timeout_s = 1
total_timeout_s = 20
max_attempts = 1

[[route]]
model = "private"
ladder = ["brain", "coder"]

[[route]]
model = "sealed"
ladder = ["ghost", "cloud"]

[[route]]
model = "open"
ladder = ["cloud"]
offbox = "allow"
"""


class DoorsRig:
    def __init__(self, sanctum: Sanctum, upstream: FakeUpstream) -> None:
        self.sanctum = sanctum
        self.upstream = upstream

    @property
    def url(self) -> str:
        return self.sanctum.url

    def counters(self) -> dict[str, Any]:
        return dict(json.loads(http("GET", self.url + "/counters")[2]))

    def kill_seat(self, name: str) -> int:
        """SIGKILL the seat's worker; its old pid (seatd starts a new one)."""
        pid = self.sanctum.worker_pid(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_seat_back(self, name: str, old_pid: int) -> None:
        """The killed worker is gone and a new one is ready."""
        assert_gone({old_pid}, timeout=10)

        def back() -> bool:
            seat = self.sanctum.health()["seats"][name]
            return bool(seat["ready"] and seat["pid"] != old_pid)

        wait_for(f"{name} ready again", back, timeout=120)
        self.sanctum.remember_tree()


@contextmanager
def start_doors() -> Iterator[DoorsRig]:
    upstream = FakeUpstream(answer="the cloud answers")
    try:
        with running(lambda port: CONFIG.format(port=port, upstream=upstream.url,
                                                key_env=KEY_ENV),
                     ("brain", "coder"), env={KEY_ENV: "sk-doors-test"}) as sanctum:
            yield DoorsRig(sanctum, upstream)
    finally:
        upstream.stop()
