"""The cost of the proxy hop: a fake OpenAI upstream reached directly, through nginx,
and through proxyd (a hosted seat in front of that upstream, and a null local seat).

    direct         client -> fake upstream (the floor of one HTTP hop on loopback)
    nginx          client -> nginx (proxy_pass, keep-alive, unbuffered) -> fake upstream;
                   an arm only where nginx is installed (`make bench` installs it)
    proxyd-hosted  client -> proxyd -> hosted seat -> fake upstream
    proxyd-null    client -> proxyd -> null local seat over ZeroMQ

Workloads, each figure from a lean client process (sanctum/bench/hop_client.py):
`latency` one-token requests one at a time (p50, p99); `stream` the time per
streamed chunk (the difference of a 64-chunk and a one-chunk request, over 63);
`throughput` requests per second from 16 concurrent clients, and the proxy's own
CPU time per request (psutil, the proxy process and its children).  Added figures
are an arm's figure less direct's from the same round.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psutil

from sanctum.bench import servers
from sanctum.bench.options import Options, interleaved, model_path
from sanctum.bench.results import Run
from sanctum.bench.runner import Measure
from sanctum.bench.stats import figure_values, pair_differences, summarize
from sanctum.bench.workloads import Workload

PATH = "/v1/chat/completions"
STREAM_TOKENS = 64
GOALS = {"added_p50_s": 1e-3, "rps": 2000.0, "per_chunk_s": 20e-6}

NGINX_CONF = """
{user}worker_processes 1;
daemon off;
error_log {wd}/nginx-error.log warn;
pid {wd}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    keepalive_requests 1000000000;
    client_body_temp_path {wd}/nginx-body;
    proxy_temp_path {wd}/nginx-proxy;
    fastcgi_temp_path {wd}/nginx-fastcgi;
    uwsgi_temp_path {wd}/nginx-uwsgi;
    scgi_temp_path {wd}/nginx-scgi;
    upstream fake {{
        server 127.0.0.1:{upstream};
        keepalive 64;
        keepalive_requests 1000000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://fake;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""

PROXY_CONFIG = """
[proxy]
listen = "127.0.0.1:{port}"

[[seat]]
name = "null"
model = "{model}"
max_prompt_tokens = 1024

[[seat]]
name = "hosted"
kind = "openai"
base_url = "http://127.0.0.1:{upstream}/v1"
upstream_model = "fake-model"

[[route]]
model = "null"
ladder = ["null"]

[[route]]
model = "hosted"
ladder = ["hosted"]
"""


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def hop_stack(model: str, with_nginx: bool) -> Iterator[dict[str, tuple[str, int | None]]]:
    """Start the fake upstream, nginx, a null seat and proxyd; yield arm -> (URL of the
    chat endpoint, pid of the proxy process to charge CPU to)."""
    with servers.workdir() as wd, ExitStack() as stack:
        env = dict(os.environ, SANCTUM_STATE_DIR=str(wd / "s"))
        (wd / "s").mkdir()
        upstream_port = servers.free_port()
        fake = servers.start("fake-openai", [sys.executable, "-m", "sanctum.bench.fake_openai",
                                             "--port", str(upstream_port)], wd, env)
        stack.callback(fake.stop)
        servers.wait_until(fake, lambda: _port_open(upstream_port), 30)
        arms: dict[str, tuple[str, int | None]] = {
            "direct": (f"http://127.0.0.1:{upstream_port}{PATH}", None)}
        nginx = shutil.which("nginx") or next(
            (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/opt/homebrew/bin/nginx")
             if Path(p).exists()), None)
        if with_nginx and nginx:
            port = servers.free_port()
            conf = wd / "nginx.conf"
            conf.write_text(NGINX_CONF.format(
                wd=wd, upstream=upstream_port, port=port,
                user="user root;\n" if os.geteuid() == 0 else ""))
            proc = servers.start("nginx", [nginx, "-c", str(conf), "-p", str(wd)], wd, env)
            stack.callback(proc.stop)
            servers.wait_until(proc, lambda: _port_open(port), 30)
            arms["nginx"] = (f"http://127.0.0.1:{port}{PATH}", proc.popen.pid)
        endpoint = f"ipc://{wd / 's' / 'seat-null.sock'}"
        seat = servers.start("null-seat", [sys.executable, "-m", "sanctum.bench.null_seat",
                                           "--endpoint", endpoint], wd, env)
        stack.callback(seat.stop)
        port = servers.free_port()
        config = wd / "sanctum.toml"
        config.write_text(PROXY_CONFIG.format(port=port, model=model, upstream=upstream_port))
        proxy = servers.start("proxyd", [sys.executable, "-m", "sanctum.cli", "proxyd",
                                         "--config", str(config)], wd, env)
        stack.callback(proxy.stop)

        def ready() -> bool:
            health = servers.get_health(f"http://127.0.0.1:{port}/health")
            return bool(health["seats"]["null"]["ready"])

        servers.wait_until(proxy, ready, 60)
        # A first answer from the null seat: the proxy has loaded the tokenizer it admits
        # with (in a thread, competing for the GIL with whatever it serves meanwhile).
        servers.first_answer(f"http://127.0.0.1:{port}", "null")
        arms["proxyd-hosted"] = (f"http://127.0.0.1:{port}{PATH}", proxy.popen.pid)
        arms["proxyd-null"] = (f"http://127.0.0.1:{port}{PATH}", proxy.popen.pid)
        yield arms


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children."""
    total = 0.0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def client(url: str, model: str, mode: str, opts: Options) -> dict[str, float]:
    argv = [sys.executable, "-m", "sanctum.bench.hop_client", url, model, mode,
            "--requests", str(opts.requests), "--tokens", str(STREAM_TOKENS),
            "--clients", str(opts.hop_clients), "--seconds", f"{opts.seconds:g}"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"hop client failed: {out.stderr[-500:]}")
    figures: dict[str, float] = json.loads(out.stdout)
    return figures


def arm(url: str, model: str, pid: int | None, opts: Options) -> Measure:
    def measure(workload: str) -> dict[str, float]:
        mode = {"latency": "latency", "stream": "stream", "throughput": "rps"}[workload]
        before = _cpu_s(pid) if pid else 0.0
        figures = client(url, model, mode, opts)
        if pid and mode == "rps" and figures["rps"] > 0:
            requests = figures["rps"] * opts.seconds
            figures["proxy_cpu_per_request_s"] = (_cpu_s(pid) - before) / requests
        return figures
    return measure


DESCRIPTIONS = {
    "direct": "lean client -> fake OpenAI upstream (one HTTP hop on loopback)",
    "nginx": "lean client -> nginx (proxy_pass, keep-alive, proxy_buffering off) -> upstream",
    "proxyd-hosted": "lean client -> proxyd -> hosted seat (proxyd/upstream_http.py) -> upstream",
    "proxyd-null": "lean client -> proxyd -> null local seat over ZeroMQ",
}


def hop(opts: Options) -> Run:

    path = model_path(opts.model)  # named in the config only (the null seat's tokenizer)
    with hop_stack(str(path), with_nginx=True) as urls:
        arms: dict[str, tuple[str, Measure]] = {}
        for name, (url, pid) in urls.items():
            model = {"proxyd-hosted": "hosted", "proxyd-null": "null"}.get(name, "fake")
            arms[name] = (DESCRIPTIONS[name], arm(url, model, pid, opts))
        workloads = [
            Workload("latency", f"{opts.requests} one-token chat requests, one at a time",
                     "chat"),
            Workload("stream", f"{opts.requests} pairs of streamed chat requests, "
                     f"{STREAM_TOKENS} chunks and one chunk", "chat"),
            Workload("throughput", f"{opts.hop_clients} concurrent clients for {opts.seconds:g} s, "
                     "one-token requests", "chat"),
        ]
        notes = ["Every process (client, upstream, nginx, proxyd, null seat) shares the "
                 f"machine's {os.cpu_count()} cores; the client is a separate process."]
        if "nginx" not in urls:
            notes.append("nginx is not installed here: its arm was left out "
                         "(`make bench` installs it).")
        return interleaved(opts, "hop", "The proxy hop: direct, nginx and proxyd", "direct", arms,
                    workloads, opts.model, notes)


# -- the report ---------------------------------------------------------------------------


def _fmt(x: float, unit: str) -> str:
    if unit == "ms":
        return f"{x * 1e3:.2f} ms"
    if unit == "us":
        return f"{x * 1e6:.1f} us"
    return f"{x:,.0f}"


def _verdict(arm: str, added: float, rps: float, chunk: float, cpu: float | None) -> str:
    """Each goal met or missed, and by how much."""
    def said(ok: bool, gap: str) -> str:
        return "met" if ok else f"missed by {gap}"
    short = f"{GOALS['rps'] / rps:.1f}x"
    parts = [f"added p50 {said(added < GOALS['added_p50_s'], _fmt(added - 1e-3, 'ms'))} "
             "(goal < 1 ms)",
             f"requests/s {said(rps >= GOALS['rps'], short)} "
             "(goal >= 2,000)",
             f"per chunk {said(chunk < GOALS['per_chunk_s'], _fmt(chunk - 20e-6, 'us'))} "
             "(goal < 20 us)"]
    line = f"{arm}: " + ", ".join(parts)
    if cpu:
        # proxyd is one event loop: its CPU per request (nearly all of it on the loop's
        # thread) bounds its requests/s on one core, whatever the machine has.
        line += (f"; at {_fmt(cpu, 'ms')} of proxy CPU per request, its one event loop "
                 f"caps it near {1 / cpu:,.0f} requests/s")
    return line


def _clients(run: Run) -> str:
    return run.workloads.get("throughput", "").split(" ", 1)[0] or "N"


def section(run: Run) -> list[str]:
    """The hop table: added latency, requests/s, added time per chunk, CPU per request."""
    arms = [a.name for a in run.arms]
    added: dict[str, str] = {"direct": "-"}
    chunk: dict[str, str] = {"direct": "-"}
    rps: dict[str, str] = {}
    cpu: dict[str, str] = {"direct": "-"}
    verdicts: list[str] = []
    for a in arms:
        r = figure_values(run.samples, "rps", a, "throughput")
        rps[a] = _fmt(summarize(r).median, "") if r else "-"
        c = figure_values(run.samples, "proxy_cpu_per_request_s", a, "throughput")
        if c:
            cpu[a] = _fmt(summarize(c).median, "ms")
        if a == run.baseline:
            continue
        d = pair_differences(run.samples, "latency_p50_s", a, run.baseline, "latency")
        if d:
            added[a] = "+" + _fmt(summarize(d).median, "ms")
        k = pair_differences(run.samples, "per_chunk_s", a, run.baseline, "stream")
        if k:
            chunk[a] = _fmt(summarize(k).median, "us")
        if a.startswith("proxyd") and d and r and k:
            verdicts.append(_verdict(a, summarize(d).median, summarize(r).median,
                                     summarize(k).median, summarize(c).median if c else None))
    rows = [("added latency per request, p50 (c=1)", added),
            (f"requests/s at {_clients(run)} concurrent", rps),
            ("added time per streamed chunk", chunk),
            ("proxy CPU per request", cpu)]
    lines = ["| | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for label, vals in rows:
        lines.append(f"| {label} | " + " | ".join(vals.get(a, "-") for a in arms) + " |")
    lines.append("")
    lines += [f"- goals, {v}" for v in verdicts]
    return lines
