"""`sanctum`: one console script for the daemons and the operator.

    sanctum up [--config FILE] [--port N]     seatd and proxyd in the foreground
    sanctum seatd|proxyd [--config FILE]      one daemon (the launchd services)
    sanctum check [--config FILE]             validate and print every layer's caps
    sanctum status | counters [--json] | restart SEAT
    sanctum models                            the models packaged with Sanctum
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import msgspec

from shared import loops, protocol
from shared.config import (
    Config,
    ConfigError,
    control_endpoint,
    listen_address,
    load_config,
    with_port,
)


def _load(args: argparse.Namespace) -> Config:
    config = load_config(args.config)
    if getattr(args, "port", None):
        config = with_port(config, args.port)
    return config


def cmd_seatd(args: argparse.Namespace) -> int:
    from seatd.supervisor import Supervisor
    from shared.lifecycle import die_with_parent
    from shared.logs import setup_logging

    setup_logging("seatd")
    die_with_parent()
    config = _load(args)
    preflight(config)
    return asyncio.run(Supervisor(config, args.config).run())


def cmd_proxyd(args: argparse.Namespace) -> int:
    from proxyd.main import run_proxy
    from shared.lifecycle import die_with_parent
    from shared.logs import setup_logging

    setup_logging("proxyd")
    die_with_parent()
    config = _load(args)
    preflight(config)
    return loops.run(run_proxy(config))


def cmd_up(args: argparse.Namespace) -> int:
    """Run seatd and proxyd as children; a signal to us stops both, in order."""
    preflight(_load(args))  # fail here, before any child starts, on a bad config
    base = [sys.executable, "-m", "sanctum.cli"]
    extra = ["--config", args.config] if args.config else []
    env = dict(os.environ, SANCTUM_PARENT_PID=str(os.getpid()))
    seatd = subprocess.Popen([*base, "seatd", *extra], env=env)
    proxy_args = [*extra, "--port", str(args.port)] if args.port else extra
    proxyd = subprocess.Popen([*base, "proxyd", *proxy_args], env=env)
    children = {"proxyd": proxyd, "seatd": seatd}
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while not stopping:
        dead = [n for n, p in children.items() if p.poll() is not None]
        if dead:
            print(f"sanctum up: {', '.join(dead)} exited; stopping", file=sys.stderr)
            code = 1
            break
        time.sleep(0.2)
    # Stop taking requests first, then drain the seats.
    for name in ("proxyd", "seatd"):
        proc = children[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return code


def _control(config: Config, message: msgspec.Struct, timeout_ms: int = 3000) -> Any:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(control_endpoint(config))
    try:
        sock.send(protocol.encode(message))
        return protocol.control_reply_decoder.decode(sock.recv())
    except zmq.Again:
        raise SystemExit("sanctum: seatd does not answer (is it running?)") from None
    finally:
        sock.close(linger=0)
        ctx.term()


def cmd_status(args: argparse.Namespace) -> int:
    reply = _control(_load(args), protocol.StatusQuery())
    if args.json:
        print(json.dumps(msgspec.to_builtins(reply), indent=2))
        return 0
    print(f"{'seat':<16}{'state':<10}{'pid':>8}{'rss MB':>9}{'uptime':>9}{'restarts':>9}"
          f"{'incarn.':>8}  last exit")
    for s in reply.seats:
        rss = f"{s.rss_bytes / 2**20:.0f}" if s.rss_bytes else "-"
        up = f"{s.uptime_s:.0f}s" if s.uptime_s is not None else "-"
        print(f"{s.name:<16}{s.state:<10}{s.pid or '-':>8}{rss:>9}{up:>9}{s.restarts:>9}"
              f"{s.incarnation:>8}  {s.last_exit or '-'}")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    reply = _control(_load(args), protocol.RestartSeat(args.seat))
    if isinstance(reply, protocol.ControlError):
        print(f"sanctum: {reply.error}", file=sys.stderr)
        return 1
    print(reply.message)
    return 0


def _fetch_counters(config: Config) -> dict[str, Any]:
    host, port = listen_address(config)
    url = f"http://{host}:{port}/counters"
    headers = {}
    keys_env = config.proxy.api_keys_env
    if keys_env and os.environ.get(keys_env):
        headers["Authorization"] = f"Bearer {os.environ[keys_env].split(',')[0].strip()}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            got: dict[str, Any] = json.loads(r.read())
            return got
    except (urllib.error.URLError, OSError):
        reply = _control(config, protocol.GetCounters())
        return {"proxy": None, "seats": reply.seats}


def _table(title: str, values: dict[str, Any], indent: str = "  ") -> list[str]:
    lines = [title]
    for key, value in values.items():
        if isinstance(value, dict):
            if not value:
                continue
            inner = ", ".join(f"{k}={v}" for k, v in value.items()
                              if not isinstance(v, dict)) or json.dumps(value)
            lines.append(f"{indent}{key:<28}{inner}")
        else:
            lines.append(f"{indent}{key:<28}{value}")
    return lines


def cmd_counters(args: argparse.Namespace) -> int:
    data = _fetch_counters(_load(args))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    lines: list[str] = []
    if data.get("proxy"):
        lines += _table("proxy", data["proxy"])
    for seat, counters in (data.get("seats") or {}).items():
        if counters is None:
            lines.append(f"seat {seat}: not answering")
            continue
        lanes = counters.pop("lanes", {})
        lines += _table(f"seat {seat}", counters)
        for lane, per in lanes.items():
            lines += _table(f"  lane {lane}", per, indent="    ")
    print("\n".join(lines))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from shared.capcheck import check_path, render

    report = check_path(_load(args))
    print(render(report))
    return 1 if report.errors else 0


def preflight(config: Config) -> None:
    """Both daemons refuse to start on a config whose caps disagree."""
    from shared.capcheck import check_path

    report = check_path(config)
    if report.errors:
        for error in report.errors:
            print(f"sanctum: {error}", file=sys.stderr)
        raise SystemExit(2)


def cmd_models(args: argparse.Namespace) -> int:
    from shared.builtin import builtin_names, resolve_model

    for name in builtin_names():
        print(f"builtin:{name}\t{resolve_model('builtin:' + name)}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sanctum", description="Local models on one Mac, one port.")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Any, help: str, port: bool = False) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.add_argument("--config", default=None, help="TOML config (default: packaged demo)")
        if port:
            sp.add_argument("--port", type=int, default=None, help="override proxy.listen's port")
        sp.set_defaults(fn=fn)
        return sp

    add("up", cmd_up, "seatd and proxyd together in the foreground", port=True)
    add("seatd", cmd_seatd, "the seat supervisor")
    add("proxyd", cmd_proxyd, "the HTTP proxy", port=True)
    add("check", cmd_check, "validate a config and print the caps of every layer")
    add("status", cmd_status, "state of every seat").add_argument("--json", action="store_true")
    add("counters", cmd_counters, "proxy and seat counters").add_argument(
        "--json", action="store_true")
    add("restart", cmd_restart, "restart one seat").add_argument("seat")
    add("models", cmd_models, "models packaged with Sanctum")
    from sanctum.bench.cli import add_bench

    add_bench(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except ConfigError as exc:
        print(f"sanctum: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
