"""A hosted rung that is a real mlx_lm.server, as on a second Mac on the LAN.

The test starts `python -m mlx_lm server` on loopback with the demo model
(`SANCTUM_TEST_MODEL` overrides it with a model directory or builtin:NAME),
puts proxyd in front of it as a `kind = "openai"` rung, and checks that the
answer, its usage and the stream come through as mlx_lm.server gave them.
Then it stops the server, proves it is gone, and sees the proxy report it down.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

import shared
from tests.procs import assert_gone, free_port, http

pytestmark = pytest.mark.slow

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
MSG = [{"role": "user", "content": "def fibonacci(n):"}]

CONFIG = """
[proxy]
listen = "127.0.0.1:{port}"

[[seat]]
name = "lan"
kind = "openai"
base_url = "http://127.0.0.1:{lan_port}/v1"
upstream_model = "default_model"
max_prompt_tokens = 8192               # declared; the proxy holds back hosted_margin
first_token_timeout_s = 60
stall_timeout_s = 30
connect_timeout_s = 2

[[seat]]
name = "gone"
kind = "openai"
base_url = "http://127.0.0.1:{gone_port}/v1"
upstream_model = "nothing-listens-here"
connect_timeout_s = 2

[[route]]
model = "lan"
ladder = ["lan"]

[[route]]
model = "gone-then-lan"
ladder = ["gone", "lan"]
"""


def demo_model() -> Path | None:
    spec = os.environ.get("SANCTUM_TEST_MODEL", "builtin:demo")
    if spec.startswith("builtin:"):
        try:
            from shared.builtin import resolve_model
        except ImportError:
            path = Path(shared.__file__).parent / "models" / spec.split(":", 1)[1]
        else:
            try:
                path = resolve_model(spec)
            except ValueError:
                return None
    else:
        path = Path(spec).expanduser()
    return path if (path / "config.json").exists() else None


class LanServer:
    """mlx_lm.server and proxyd, started here and proven stopped."""

    def __init__(self, model: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="lan-", dir="/tmp"))
        self.lan_port, self.port = free_port(), free_port()
        env = dict(os.environ)
        if sys.platform == "linux" and OPENBLAS.exists():
            env["LD_PRELOAD"] = str(OPENBLAS)  # MLX's CPU backend is ~25x faster with it
        self.mlx = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
             "--host", "127.0.0.1", "--port", str(self.lan_port), "--log-level", "WARNING"],
            env=env, stdout=open(self.dir / "mlx.log", "wb"), stderr=subprocess.STDOUT)
        (self.dir / "c.toml").write_text(CONFIG.format(
            port=self.port, lan_port=self.lan_port, gone_port=free_port()))
        self.proxy = subprocess.Popen(
            [sys.executable, "-m", "sanctum.cli", "proxyd", "--config", str(self.dir / "c.toml")],
            env=dict(os.environ, SANCTUM_STATE_DIR=str(self.dir / "s")),
            stdout=open(self.dir / "proxy.log", "wb"), stderr=subprocess.STDOUT)
        self.pids = {self.mlx.pid, self.proxy.pid}
        self._wait(self.lan_url + "/v1/models", self.mlx, "mlx.log", 180)
        self._wait(self.url + "/health", self.proxy, "proxy.log", 30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def lan_url(self) -> str:
        return f"http://127.0.0.1:{self.lan_port}"

    def _wait(self, url: str, proc: subprocess.Popen[bytes], log: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError((self.dir / log).read_text(errors="replace")[-4000:])
            try:
                if http("GET", url, timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{url} not up in {timeout}s")

    def chat(self, route: str, **extra: Any) -> tuple[int, dict[str, str], dict[str, Any]]:
        code, headers, raw = http("POST", self.url + "/v1/chat/completions",
                                  body={"model": route, "messages": MSG, **extra}, timeout=120)
        return code, headers, json.loads(raw)

    def stop_mlx(self) -> None:
        if self.mlx.poll() is None:
            self.mlx.send_signal(signal.SIGTERM)
        try:
            self.mlx.wait(20)
        except subprocess.TimeoutExpired:
            self.mlx.kill()
            self.mlx.wait()
        assert_gone({self.mlx.pid}, timeout=10)

    def stop(self) -> None:
        self.stop_mlx()
        if self.proxy.poll() is None:
            self.proxy.send_signal(signal.SIGTERM)
        try:
            self.proxy.wait(15)
        except subprocess.TimeoutExpired:
            self.proxy.kill()
            self.proxy.wait()
        assert_gone(self.pids, timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def lan() -> Iterator[LanServer]:
    model = demo_model()
    if model is None:
        pytest.skip("no demo model: build builtin:demo or set SANCTUM_TEST_MODEL")
    server = LanServer(model)
    try:
        yield server
    finally:
        server.stop()


SAMPLING = {"temperature": 0, "max_tokens": 12, "seed": 1}


def test_answer_and_usage_come_through_from_mlx_lm_server(lan: LanServer) -> None:
    """Through the proxy, the rung's answer and usage equal mlx_lm.server's own, named `lan`."""
    code, headers, body = lan.chat("lan", **SAMPLING)
    assert code == 200, body
    direct_code, _, raw = http("POST", lan.lan_url + "/v1/chat/completions", timeout=120,
                               body={"model": "default_model", "messages": MSG, **SAMPLING})
    direct = json.loads(raw)
    assert direct_code == 200
    assert headers["X-Sanctum-Seat"] == "lan" and headers["X-Sanctum-Attempts"] == "lan=ok"
    assert body["model"] == "lan"
    assert body["sanctum"]["upstream_model"] == "default_model"
    assert body["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]
    for key in ("prompt_tokens", "completion_tokens"):
        assert body["usage"][key] == direct["usage"][key] > 0


def test_stream_through_the_openai_client_equals_the_sync_answer(lan: LanServer) -> None:
    """Streamed via the openai SDK, the text and usage equal the sync answer's, ending cleanly."""
    _, _, sync = lan.chat("lan", **SAMPLING)
    client = openai.OpenAI(base_url=lan.url + "/v1", api_key="x", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(
        model="lan", messages=MSG, stream=True, stream_options={"include_usage": True},
        **SAMPLING))  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == sync["choices"][0]["message"]["content"]
    assert {c.model for c in chunks} == {"lan"}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == sync["usage"]["completion_tokens"]


def test_a_dead_rung_falls_back_to_the_lan_server(lan: LanServer) -> None:
    """A rung with nothing listening fails to connect; the LAN server answers instead."""
    code, headers, body = lan.chat("gone-then-lan", **SAMPLING)
    assert code == 200, body
    assert headers["X-Sanctum-Attempts"] == "gone=failed:connect_failed; lan=ok"
    assert body["model"] == "lan"


def test_stopped_server_is_gone_and_reported_down(lan: LanServer) -> None:
    """mlx_lm.server stopped and proven gone; the proxy answers 503 naming the failed rung."""
    lan.stop_mlx()
    code, _, body = lan.chat("lan", **SAMPLING)
    assert code == 503
    assert body["error"]["attempts"] == "lan=failed:connect_failed"
