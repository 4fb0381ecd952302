"""Processes a benchmark starts, waits for, and proves stopped.

Each is a context manager: on the way out it signals the top process, waits,
and checks with psutil that no process of its tree is left.  State (config,
sockets, logs) lives in a private temporary directory that is removed after.
"""

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
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from seatd.blas import worker_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 5) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def get_health(url: str, timeout: float = 5) -> dict[str, Any]:
    """proxyd's /health body: 200 when every route is ready, 503 (same body) while
    some route loads or is down; a waiter reads the seats it needs either way."""
    try:
        got = get_json(url, timeout)
    except urllib.error.HTTPError as e:
        if e.code != 503:
            raise
        got = json.loads(e.read())
    if not isinstance(got, dict):
        raise ValueError(f"{url} answered {got!r}")
    return got


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    tree: set[int]

    def remember_tree(self) -> None:
        try:
            kids = psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        self.tree |= {k.pid for k in kids}

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 60) -> None:
        """TERM, wait, KILL if need be; then prove the whole tree is gone."""
        self.remember_tree()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        deadline = time.monotonic() + 10
        alive = list(self.tree)
        while alive and time.monotonic() < deadline:
            alive = [p for p in self.tree if _running(p)]
            if alive:
                time.sleep(0.1)
        for pid in alive:  # our own children only; never anything by name
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if alive:
            raise RuntimeError(f"{self.name}: processes outlived their stop: {alive}")


def _running(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def start(name: str, argv: list[str], workdir: Path, env: dict[str, str]) -> Proc:
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Proc(name, popen, log, {popen.pid})


def wait_until(proc: Proc, ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited {proc.popen.returncode}:\n{proc.tail()}")
        try:
            if ready():
                proc.remember_tree()
                return
        except (OSError, ValueError, KeyError, urllib.error.URLError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not ready in {timeout:g}s:\n{proc.tail()}")


@contextmanager
def workdir() -> Iterator[Path]:
    # ipc socket paths are limited to ~100 bytes: keep the directory short.
    path = Path(tempfile.mkdtemp(prefix="sbench-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


SEAT = """
[[seat]]
name = "{name}"
model = "{model}"
max_prompt_tokens = {cap}
{extra}
[[route]]
model = "{name}"
ladder = ["{name}"]
"""


def sanctum_config(port: int, seats: list[tuple[str, str, int, str]]) -> str:
    """A config for `sanctum up`: (name, model, cap, extra TOML lines) per seat."""
    text = f'[proxy]\nlisten = "127.0.0.1:{port}"\n'
    for name, model, cap, extra in seats:
        text += SEAT.format(name=name, model=model, cap=cap, extra=extra)
    return text


@contextmanager
def sanctum_up(config_text: str, seats: tuple[str, ...], port: int,
               timeout: float = 300) -> Iterator[str]:
    """`sanctum up` in a private state directory; yields its base URL."""
    with workdir() as wd:
        config = wd / "sanctum.toml"
        config.write_text(config_text)
        env = dict(os.environ, SANCTUM_STATE_DIR=str(wd / "s"))
        proc = start("sanctum-up", [sys.executable, "-m", "sanctum.cli", "up", "--config",
                                    str(config)], wd, env)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:  # and done compiling its shapes: measure what it serves after
            health = get_health(url + "/health")
            return all(health["seats"].get(s, {}).get("ready")
                       and not health["seats"][s].get("warming") for s in seats)

        try:
            wait_until(proc, ready, timeout)
            yield url
        finally:
            proc.stop()


@contextmanager
def mlx_lm_server(model_dir: str, port: int, draft: str | None = None,
                  num_draft: int | None = None, timeout: float = 300) -> Iterator[str]:
    """mlx-lm's own server on the same model, with the same BLAS as our workers."""
    with workdir() as wd:
        argv = [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir,
                "--port", str(port), "--log-level", "WARNING"]
        if draft:
            argv += ["--draft-model", draft]
        if num_draft:
            argv += ["--num-draft-tokens", str(num_draft)]
        proc = start("mlx_lm.server", argv, wd, worker_env(dict(os.environ)))
        url = f"http://127.0.0.1:{port}"
        try:
            # /health, not /v1/models: the latter scans a Hugging Face cache that may not exist.
            wait_until(proc, lambda: bool(get_json(url + "/health")), timeout)
            yield url
        finally:
            proc.stop()


def first_answer(url: str, model: str, timeout_s: float = 120) -> None:
    """One chat answered by route `model` of the proxy at `url`: the proxy then holds the
    tokenizer it admits with (it loads it in a thread, which would otherwise compete for
    the GIL with the first measured requests)."""
    body = json.dumps({"model": model, "max_tokens": 1,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        r.read()


@contextmanager
def null_stack(model: str, port: int, timeout: float = 60) -> Iterator[tuple[str, str]]:
    """A null seat and `sanctum proxyd` in front of it: yields (proxy URL, seat endpoint)."""
    with workdir() as wd:
        state = wd / "s"
        state.mkdir()
        endpoint = f"ipc://{state / 'seat-null.sock'}"
        config = wd / "sanctum.toml"
        # The config names a real model (the proxy reads its tokenizer and context
        # length); the null seat itself loads nothing.  The cap stays below the context.
        config.write_text(sanctum_config(port, [("null", model, 1024, "")]))
        env = dict(os.environ, SANCTUM_STATE_DIR=str(state))
        seat = start("null-seat", [sys.executable, "-m", "sanctum.bench.null_seat",
                                   "--endpoint", endpoint], wd, env)
        proxy = start("proxyd", [sys.executable, "-m", "sanctum.cli", "proxyd", "--config",
                                 str(config)], wd, env)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            health = get_health(url + "/health")
            return bool(health["seats"]["null"]["ready"])

        try:
            wait_until(proxy, ready, timeout)
            first_answer(url, "null")
            yield url, endpoint
        finally:
            proxy.stop()
            seat.stop()
