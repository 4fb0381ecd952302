"""Real Sanctum processes for integration tests, started and proven stopped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

DEMO_CONFIG = """
[proxy]
listen = "127.0.0.1:{port}"
tokenizer_margin = 64
heartbeat_s = 0.5

[seatd]
heartbeat_s = 0.5
drain_s = {drain_s}
backoff_initial_s = 0.2

{seats}
{routes}
"""

DEMO_SEAT = """
[[seat]]
name = "{name}"
model = "{model}"
kv = "{kv}"
max_prompt_tokens = {cap}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
         raw: bytes | None = None, timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


class Sanctum:
    """`sanctum up` (or one daemon) in a private state directory."""

    def __init__(self, config_text: str | None = None, port: int | None = None,
                 command: str = "up", packaged: bool = False,
                 env: dict[str, str] | None = None, split_stdout: bool = False) -> None:
        """`split_stdout`: the command's stdout goes to its own file (`stdout()`), apart
        from its stderr and logs."""
        self.port = port or free_port()
        # ipc paths are limited to ~100 bytes: keep the state directory short.
        self.dir = Path(tempfile.mkdtemp(prefix="sct-", dir="/tmp"))
        self.state = self.dir / "s"
        self.config = self.dir / "sanctum.toml"
        self.config.write_text(config_text or demo_config(self.port))
        self.env = dict(os.environ, SANCTUM_STATE_DIR=str(self.state), **(env or {}))
        self.log = open(self.dir / "log", "wb")
        self.out = open(self.dir / "out", "wb") if split_stdout else self.log
        # packaged: no --config at all, the embedded default (only the port is moved).
        args = ["--port", str(self.port)] if packaged else ["--config", str(self.config)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sanctum.cli", command, *args],
            env=self.env, stdout=self.out, stderr=self.log,
            start_new_session=True)  # its own group, as in a terminal: a test may signal it
        self.tree: set[int] = {self.proc.pid}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        self.log.flush()
        return (self.dir / "log").read_text(errors="replace")

    def stdout(self) -> str:
        """What the command wrote to stdout so far (split_stdout only)."""
        return (self.dir / "out").read_text(errors="replace")

    def remember_tree(self) -> set[int]:
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        self.tree |= {k.pid for k in kids}
        return self.tree

    def health(self) -> dict[str, Any]:
        """/health's body, whether it says 200 (every route ready) or 503."""
        return json.loads(http("GET", self.url + "/health", timeout=5)[2])

    def health_status(self) -> tuple[int, dict[str, Any]]:
        code, _, body = http("GET", self.url + "/health", timeout=5)
        return code, json.loads(body)

    def wait_ready(self, seats: tuple[str, ...] = ("demo",), timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"sanctum exited {self.proc.returncode}:\n{self.logs()}")
            try:
                h = self.health()
                if all(h["seats"].get(s, {}).get("ready") for s in seats):
                    self.remember_tree()
                    return
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"not ready in {timeout}s:\n{self.logs()[-4000:]}")

    def worker_pid(self, seat: str = "demo") -> int:
        return int(self.health()["seats"][seat]["pid"])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the top process, wait for it, and prove its whole tree is gone."""
        self.remember_tree()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.log.close()
            self.out.close()
        assert_gone(self.tree, timeout=10)
        leftovers = list(self.state.glob("*.sock")) if self.state.exists() else []
        assert not leftovers, f"socket files left behind: {leftovers}"
        shutil.rmtree(self.dir, ignore_errors=True)
        return code

    def kill_everything(self) -> None:
        """Last-resort cleanup after a failed test."""
        for pid in self.remember_tree():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.log.close()
        self.out.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def running(config: Callable[[int], str] | None = None, seats: tuple[str, ...] = ("demo",),
            *, env: dict[str, str] | None = None, timeout: float = 180) -> Iterator[Sanctum]:
    """`sanctum up` on a free port with `config(port)` (the demo config when None), ready
    once every seat in `seats` is; stopped on leaving, proven clean (exit 0, its whole
    tree gone, no socket files left). An error inside kills everything and is raised."""
    port = free_port()
    s = Sanctum(config(port) if config is not None else None, port=port, env=env)
    try:
        s.wait_ready(seats, timeout=timeout)
        yield s
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop() == 0


def wait_for(what: str, cond: Callable[[], Any], timeout: float = 60,
             logs: Callable[[], str] | None = None) -> Any:
    """`cond()`'s first truthy value within `timeout` (an OSError, ValueError or KeyError
    while the thing starts counts as not yet); else an AssertionError naming `what`,
    with the tail of `logs()` when given."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = cond()
        except (OSError, ValueError, KeyError):
            got = None
        if got:
            return got
        time.sleep(0.05)
    tail = f"\n{logs()[-4000:]}" if logs is not None else ""
    raise AssertionError(f"{what}: not within {timeout}s{tail}")


def assert_gone(pids: set[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    alive: list[int] = []
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes still running: {alive}")


def demo_config(port: int, *, seats: tuple[tuple[str, str, str, int], ...] | None = None,
                routes: str | None = None, drain_s: float = 20.0) -> str:
    model = os.environ.get("SANCTUM_TEST_MODEL", "builtin:demo")
    seats = seats or (("demo", model, "fp16", 1536),)
    seat_text = "".join(DEMO_SEAT.format(name=n, model=m, kv=kv, cap=cap)
                        for n, m, kv, cap in seats)
    routes = routes or "".join(
        f'\n[[route]]\nmodel = "{n}"\nladder = ["{n}"]\n' for n, *_ in seats)
    return DEMO_CONFIG.format(port=port, seats=seat_text, routes=routes, drain_s=drain_s)


def packaged_config(port: int) -> str:
    """The packaged default config of `sanctum up`, listening on `port`."""
    import shared

    default = (Path(shared.__file__).parent / "default_config.toml").read_text()
    return default.replace('listen = "127.0.0.1:8800"', f'listen = "127.0.0.1:{port}"')
