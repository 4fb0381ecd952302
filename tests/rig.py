"""proxyd as a real process in front of fake seats and a fake upstream."""

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

RIG_CONFIG = """
[proxy]
listen = "127.0.0.1:{port}"
heartbeat_s = 0.2
liveness = {liveness}
breaker_threshold = 3
breaker_cooldown_s = {cooldown}
# A request whose seats all load answers at once (503 loading) unless a test waits.
load_wait_s = {load_wait}

[[seat]]
name = "brain"
model = "unused"
first_token_timeout_s = 1.5
queue_timeout_s = 1.0
# Well past the liveness window (0.6 s), so a seat that dies mid-stream is always
# found lost by its heartbeat before its stream counts as stalled.
stall_timeout_s = 2.0

[[seat]]
name = "coder"
model = "unused"
first_token_timeout_s = 1.5
queue_timeout_s = 1.0
stall_timeout_s = 1.0

[[seat]]
name = "hosted"
kind = "openai"
base_url = "{upstream}"
upstream_model = "big-model"
offbox = true
first_token_timeout_s = 3
stall_timeout_s = 2

[[route]]
model = "private"
ladder = ["brain", "coder", "hosted"]

[[route]]
model = "open"
ladder = ["brain", "coder", "hosted"]
offbox = "allow"

[[route]]
model = "optin"
ladder = ["brain", "coder", "hosted"]
offbox = "header"
"""


class Rig:
    def __init__(self, modes: dict[str, str], tokens: int = 8, cooldown: float = 30.0,
                 upstream_script: list[str] | None = None,
                 clock: ManualClock | None = None, load_wait: float = 0.0,
                 liveness: int = 3) -> None:
        """`clock`: run proxyd in this process on that clock (tests/proxy_thread.py).
        `liveness`: heartbeats a seat may miss; a test that moves `clock` by more than
        liveness x 0.2 s at once raises it, or every seat would look lost."""
        self.dir = Path(tempfile.mkdtemp(prefix="rig-", dir="/tmp"))
        self.state = self.dir / "s"
        self.state.mkdir()
        self.port = free_port()
        self.upstream = FakeUpstream(upstream_script)
        (self.dir / "c.toml").write_text(RIG_CONFIG.format(
            port=self.port, upstream=self.upstream.url, cooldown=cooldown,
            load_wait=load_wait, liveness=liveness))
        self.env = dict(os.environ, SANCTUM_STATE_DIR=str(self.state))
        self.tokens = tokens
        self.fakes: dict[str, subprocess.Popen[bytes]] = {}
        self.pids: set[int] = set()
        for name, mode in modes.items():
            self.start_fake(name, mode)
        self.proxy: subprocess.Popen[bytes] | ProxyThread
        if clock is not None:
            self.proxy = ProxyThread(self.dir / "c.toml", {"SANCTUM_STATE_DIR": str(self.state)},
                                     self.dir / "proxy.log", clock)
        else:
            self.proxy = subprocess.Popen(
                [sys.executable, "-m", "sanctum.cli", "proxyd", "--config",
                 str(self.dir / "c.toml")],
                env=self.env, stdout=open(self.dir / "proxy.log", "wb"), stderr=subprocess.STDOUT)
            self.pids.add(self.proxy.pid)
        self.wait_health(lambda h: all(h["seats"][n]["alive"] for n in modes))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_fake(self, name: str, mode: str) -> None:
        old = self.fakes.get(name)
        if old is not None and old.poll() is None:
            old.kill()
            old.wait()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fakes.fake_seat", "--endpoint",
             f"ipc://{self.state / f'seat-{name}.sock'}", "--name", name, "--mode", mode,
             "--tokens", str(self.tokens), "--log", str(self.dir / f"{name}.jsonl")],
            env=self.env)
        self.fakes[name] = proc
        self.pids.add(proc.pid)
        if getattr(self, "proxy", None) is not None and mode != "not_ready":
            # Until the new process answers a ping, health still shows the old one's pong.
            self.wait_health(lambda h: h["seats"][name]["pid"] == proc.pid
                             and h["seats"][name]["ready"])

    def events(self, name: str, kind: str | None = None) -> list[dict[str, Any]]:
        path = self.dir / f"{name}.jsonl"
        if not path.exists():
            return []
        out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [e for e in out if kind is None or e["event"] == kind]

    def health(self) -> dict[str, Any]:
        """/health's body, whether it says 200 (every route ready) or 503."""
        return json.loads(http("GET", self.url + "/health", timeout=5)[2])

    def wait_health(self, ok: Any, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ok(self.health()):
                    return
            except (OSError, ValueError, KeyError):
                pass
            if self.proxy.poll() is not None:
                raise AssertionError((self.dir / "proxy.log").read_text())
            time.sleep(0.05)
        raise AssertionError(f"health never matched: {self.health()}")

    def counters(self) -> dict[str, Any]:
        return json.loads(http("GET", self.url + "/counters")[2])

    def stop(self) -> None:
        procs = [self.proxy, *self.fakes.values()]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                # A fake leaves its loop within 0.1 s of SIGTERM unless it plays a hung
                # worker, which only SIGKILL ends.
                p.wait(15 if p is self.proxy else 3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.upstream.stop()
        assert_gone(self.pids, timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)
