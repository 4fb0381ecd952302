"""shared.logs: human lines for a person at a terminal, JSON lines for everything else."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest

from shared.logs import choose_format, processors, under_launchd, use_colour
from tests.procs import assert_gone, free_port

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.parametrize(("env", "isatty", "expected"), [
    ({}, True, "human"),
    ({}, False, "json"),  # piped or redirected to a file
    ({"XPC_SERVICE_NAME": "com.sanctum.seatd"}, True, "json"),  # a launchd job
    ({"XPC_SERVICE_NAME": "com.sanctum.seatd"}, False, "json"),
    ({"XPC_SERVICE_NAME": "0"}, True, "human"),  # an interactive macOS shell
    ({"XPC_SERVICE_NAME": "application.com.apple.Terminal.123"}, True, "human"),
    ({"SANCTUM_LOG_FORMAT": "json"}, True, "json"),
    ({"SANCTUM_LOG_FORMAT": "human"}, False, "human"),
    ({"SANCTUM_LOG_FORMAT": "HUMAN", "XPC_SERVICE_NAME": "com.sanctum.proxyd"}, False, "human"),
    ({"SANCTUM_LOG_FORMAT": "xml"}, True, "human"),  # unknown: chosen as if unset
    ({"SANCTUM_LOG_FORMAT": "xml"}, False, "json"),
])
def test_format_choice(env: dict[str, str], isatty: bool, expected: str) -> None:
    """The override decides; else a terminal outside launchd gets human lines."""
    assert choose_format(env, isatty) == expected


@pytest.mark.parametrize(("env", "isatty", "expected"), [
    ({}, True, True), ({}, False, False), ({"NO_COLOR": "1"}, True, False),
    ({"NO_COLOR": ""}, True, True),  # no-color.org: present and not empty
])
def test_colour_choice(env: dict[str, str], isatty: bool, expected: bool) -> None:
    """Colour only on a terminal, and never with NO_COLOR set."""
    assert use_colour(env, isatty) is expected


def test_launchd_is_its_label_only() -> None:
    """XPC_SERVICE_NAME counts as launchd only when it is a job label."""
    assert under_launchd({"XPC_SERVICE_NAME": "com.sanctum.seatd"})
    assert not under_launchd({}) and not under_launchd({"XPC_SERVICE_NAME": "0"})


def render(fmt: str, colours: bool, **event: Any) -> str:
    out: Any = {"event": "model_loaded", "process": "worker:demo", "pid": 4242, **event}
    for step in processors(fmt, colours):
        out = step(None, "info", out)
    assert isinstance(out, str)
    return out


def test_human_line_without_colour() -> None:
    """Time, level, process, event, key=values; no JSON, no escape codes."""
    line = render("human", False, seconds=1.5, path="/m")
    assert re.match(r"^\d\d:\d\d:\d\d \[info\s*\] worker:demo model_loaded\s+path=/m "
                    r"seconds=1.5$", line), line
    assert "{" not in line and "\x1b" not in line and "4242" not in line


def test_human_line_with_colour() -> None:
    """With colour the same words are there, wrapped in escape codes."""
    line = render("human", True, seconds=1.5)
    assert ANSI.search(line)
    assert "worker:demo model_loaded" in ANSI.sub("", line)


def test_json_line_parses() -> None:
    """A JSON line is one object with level, event, process, pid and a UTC timestamp."""
    got = json.loads(render("json", False, seconds=1.5))
    assert got["event"] == "model_loaded" and got["level"] == "info"
    assert got["process"] == "worker:demo" and got["pid"] == 4242 and got["seconds"] == 1.5
    assert got["timestamp"].endswith("Z")


def _read_until(fd: int, pattern: str, proc: subprocess.Popen[bytes],
                timeout: float = 60) -> str:
    seen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and re.search(pattern, seen.decode(errors="replace")) is None:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the pty's other end is closed: everyone exited
                break
            if not chunk:  # the pipe's writers are all gone
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    return seen.decode(errors="replace")


HOSTED_ONLY = """
[proxy]
listen = "127.0.0.1:{port}"

[[seat]]
name = "hosted"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
upstream_model = "m"
offbox = true

[[route]]
model = "hosted"
ladder = ["hosted"]
offbox = "allow"
"""


@pytest.mark.parametrize("on_tty", [True, False], ids=["tty", "pipe"])
def test_sanctum_up_logs_for_its_reader(tmp_path: Any, on_tty: bool) -> None:
    """`sanctum up` on a terminal: seatd and proxyd write human lines; piped, JSON lines."""
    config = tmp_path / "sanctum.toml"
    config.write_text(HOSTED_ONLY.format(port=free_port()))  # no model: quick to start
    env = {k: v for k, v in os.environ.items()
           if k not in ("SANCTUM_LOG_FORMAT", "XPC_SERVICE_NAME", "NO_COLOR")}
    env["SANCTUM_STATE_DIR"] = str(tmp_path / "s")
    if on_tty:
        reader, writer = pty.openpty()
    else:
        reader, writer = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "sanctum.cli", "up", "--config", str(config)],
                            env=env, stdin=subprocess.DEVNULL, stdout=writer, stderr=writer)
    os.close(writer)
    try:
        text = _read_until(reader, r"(?s)(?=.*seatd_started)(?=.*proxyd_listening)", proc)
        tree = {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        proc.send_signal(signal.SIGTERM)
        text += _read_until(reader, r"proxyd_stopping", proc, timeout=30)
        assert proc.wait(timeout=60) == 0, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(reader)
    assert_gone(tree, timeout=10)
    assert len(tree) >= 3, "sanctum up, seatd and proxyd were all seen"
    lines = [ANSI.sub("", x).strip() for x in text.splitlines() if "seatd_started" in x
             or "proxyd_listening" in x]
    assert len(lines) == 2, text[-3000:]
    if on_tty:
        human = r"^\d\d:\d\d:\d\d \[info\s*\] (seatd|proxyd) "
        assert all(re.match(human, x) for x in lines), lines
        assert ANSI.search(text), "colour on a terminal"
        assert not any(x.startswith("{") for x in lines)
    else:
        got = [json.loads(x) for x in lines]
        assert {g["process"] for g in got} == {"seatd", "proxyd"}
        assert "\x1b" not in text


def test_lines_wait_for_their_loop_s_next_turn_and_survive_a_loop_that_closed() -> None:
    """A line written on a loop goes out at the loop's next turn, in order with lines
    from other threads; a loop that closed before its turn leaves its lines to the next
    loop that writes, never holding them back for good."""
    import asyncio
    import io
    import threading

    from shared.logs import LineSink

    stream = io.StringIO()
    sink = LineSink(stream)

    async def write_then_leave() -> None:
        sink.line("a")
        assert stream.getvalue() == ""  # not yet: at the loop's next turn

    loop = asyncio.new_event_loop()
    loop.run_until_complete(write_then_leave())
    loop.close()  # its flush may never have run
    sink.line("b")  # no loop in this thread: at once, after what waits
    assert stream.getvalue() == "a\nb\n"

    async def write_and_turn() -> None:
        sink.line("c")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert stream.getvalue().endswith("b\nx\nc\n")  # the new loop's turn wrote both
        sink.line("c2")
        other = threading.Thread(target=sink.line, args=("d",))
        other.start()
        other.join()
        sink.line("e")
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    first = asyncio.new_event_loop()
    first.call_soon(sink.line, "x")  # a flush due on a loop that stops before it runs
    first.call_soon(first.stop)
    first.run_forever()
    first.close()
    assert stream.getvalue().endswith("b\n")  # "x" waits for someone to write
    asyncio.run(write_and_turn())
    assert stream.getvalue() == "a\nb\nx\nc\nc2\nd\ne\n"
