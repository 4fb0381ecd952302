"""proxyd as a real process in front of two hosted rungs (fake upstreams on loopback).

The route `m` has the ladder ["primary", "backup"], both `kind = "openai"`,
with short timeouts so that every fault plays out in about a second.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shared.clock import ManualClock
from tests.fakes.fake_upstream import FakeUpstream
from tests.procs import assert_gone, free_port, http
from tests.proxy_thread import ProxyThread

KEY_ENV = "SANCTUM_TEST_HOSTED_KEY"
KEY = "sk-test-9f8e7d6c5b4a39281706f5e4d3c2b1a0"
MSG = [{"role": "user", "content": "hello"}]

SEAT = """
[[seat]]
name = "{name}"
kind = "openai"
base_url = "{url}"
api_key_env = "{key_env}"
upstream_model = "{name}-model"
max_prompt_tokens = {cap}
first_token_timeout_s = {first_token}
stall_timeout_s = {stall}
connect_timeout_s = 1.0
total_timeout_s = 20.0
max_attempts = 3
backoff_initial_s = 0.05
backoff_max_s = 0.2
retry_after_max_s = 3.0
prefill = {prefill}
"""

CONFIG = """
[proxy]
listen = "127.0.0.1:{port}"
breaker_threshold = 3
breaker_cooldown_s = {cooldown}
keepalive_s = {keepalive}
{proxy_extra}
{seats}
[[route]]
model = "m"
ladder = ["primary", "backup"]
"""


class HostedRig:
    def __init__(self, primary: list[str] | None = None, backup: list[str] | None = None,
                 cooldown: float = 30.0, first_token: float = 1.0, stall: float = 0.8,
                 extra_seats: str = "", clock: ManualClock | None = None,
                 answer: str | None = None, backup_cap: int = 100000,
                 keepalive: float = 10.0, backup_prefill: bool = True,
                 proxy_extra: str = "", env: dict[str, str] | None = None) -> None:
        """`clock`: run proxyd in this process on that clock (tests/proxy_thread.py).
        `answer`: both upstreams know this one answer (as two providers of one model), so
        that an answer one begins the other can finish."""
        self.dir = Path(tempfile.mkdtemp(prefix="hrig-", dir="/tmp"))
        self.primary = FakeUpstream(primary, answer=answer or "primary says hi",
                                    model="primary-v2")
        self.backup = FakeUpstream(backup, answer=answer or "backup answers here",
                                   model="backup-v7")
        # After the upstreams have bound theirs: a port picked first and released could
        # be the one the system gives an upstream, and proxyd would not bind it.
        self.port = free_port()
        seats = "".join(
            SEAT.format(name=n, url=u.url, key_env=KEY_ENV, cap=cap,
                        first_token=first_token, stall=stall,
                        prefill="true" if prefill else "false")
            for n, u, cap, prefill in (("primary", self.primary, 100000, True),
                                       ("backup", self.backup, backup_cap, backup_prefill)))
        self.config = self.dir / "c.toml"
        self.config.write_text(CONFIG.format(port=self.port, cooldown=cooldown,
                                             keepalive=keepalive, proxy_extra=proxy_extra,
                                             seats=seats + extra_seats))
        self.env = dict(os.environ, SANCTUM_STATE_DIR=str(self.dir / "s"), **{KEY_ENV: KEY},
                        **(env or {}))
        self.log = self.dir / "proxy.log"
        self.proxy: subprocess.Popen[bytes] | ProxyThread
        self.pids: set[int] = set()
        if clock is not None:
            self.proxy = ProxyThread(self.config, {"SANCTUM_STATE_DIR": str(self.dir / "s"),
                                                   KEY_ENV: KEY}, self.log, clock)
        else:
            self.proxy = subprocess.Popen(
                [sys.executable, "-m", "sanctum.cli", "proxyd", "--config", str(self.config)],
                env=self.env, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
            self.pids.add(self.proxy.pid)
        deadline = time.monotonic() + 30
        while True:
            try:
                # Up: /health answers (200, or 503 with its body while a route is
                # not ready: an open circuit, a local seat of `extra_seats` loading).
                if http("GET", self.url + "/health", timeout=2)[0] in (200, 503):
                    break
            except OSError:
                pass
            if self.proxy.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(self.log.read_text())
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def chat(self, stream: bool = False, timeout: float = 60,
             **extra: Any) -> tuple[int, dict[str, str], bytes]:
        """One chat request; a reply slower than `timeout` raises (it guards a hang)."""
        return http("POST", self.url + "/v1/chat/completions",
                    body={"model": "m", "messages": MSG, "stream": stream, **extra},
                    timeout=timeout)

    def messages(self, stream: bool = False, timeout: float = 60,
                 **extra: Any) -> tuple[int, dict[str, str], bytes]:
        """One Anthropic Messages request to the route."""
        return http("POST", self.url + "/v1/messages",
                    body={"model": "m", "messages": MSG, "stream": stream,
                          "max_tokens": 100, **extra}, timeout=timeout)

    def counters(self) -> dict[str, Any]:
        return json.loads(http("GET", self.url + "/counters")[2])

    def tries(self) -> tuple[int, int]:
        """How many requests each upstream has seen: (primary, backup)."""
        return len(self.primary.requests), len(self.backup.requests)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proxy.poll() is None:
            self.proxy.send_signal(signal.SIGTERM)
        try:
            self.proxy.wait(15)
        except subprocess.TimeoutExpired:
            self.proxy.kill()
            self.proxy.wait()
        self.primary.stop()
        self.backup.stop()
        assert_gone(self.pids, timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def body_of(raw: bytes) -> dict[str, Any]:
    return json.loads(raw)


def text_of(raw: bytes) -> str:
    return str(body_of(raw)["choices"][0]["message"]["content"])


def sse_data(raw: bytes) -> tuple[list[dict[str, Any]], list[str]]:
    """(the JSON of every `data:` event, the names of non-default events); [DONE] is kept
    as the string '[DONE]' in the names list.  A named event's JSON is in the list too
    (an `error`, or the `sanctum` trailer of a continued stream)."""
    datas: list[dict[str, Any]] = []
    names: list[str] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name = "message"
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                data = line.split(":", 1)[1].strip()
                if data == "[DONE]":
                    names.append("[DONE]")
                else:
                    datas.append(json.loads(data))
                    if name != "message":
                        names.append(name)
    return datas, names


def streamed_text(datas: list[dict[str, Any]]) -> str:
    return "".join((c.get("delta") or {}).get("content") or ""
                   for d in datas for c in d.get("choices", []))
