"""`sanctum`: one console script for the daemons and the operator.

    sanctum up [--config FILE] [--port N]     seatd and proxyd in the foreground
    sanctum seatd|proxyd [--config FILE]      one daemon (the launchd services)
    sanctum check [--config FILE]             validate and print every layer's caps
    sanctum status | counters [--json] | restart SEAT
    sanctum models                            the models packaged with Sanctum
    sanctum service install|status|logs|restart|uninstall
                                              system LaunchDaemons (`sanctum.service`)
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from shared.capcheck import Report


def _load(args: argparse.Namespace) -> Config:
    config = load_config(args.config)
    if getattr(args, "port", None):
        config = with_port(config, args.port)
    return config


def service_env() -> None:
    """The secrets file of a service (`shared.env_file`), before its config is read."""
    from shared import env_file

    path = os.environ.get(env_file.ENV)
    if not path:
        return
    try:
        env_file.load(path, os.environ)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{env_file.ENV}: {exc}") from None


def cmd_seatd(args: argparse.Namespace) -> int:
    from seatd.supervisor import Supervisor
    from shared.lifecycle import die_with_parent
    from shared.logs import setup_logging

    setup_logging("seatd")
    die_with_parent()
    service_env()
    config = _load(args)
    preflight(config)
    return asyncio.run(Supervisor(config, args.config).run())


def cmd_proxyd(args: argparse.Namespace) -> int:
    from proxyd.main import run_proxy
    from shared.lifecycle import die_with_parent
    from shared.logs import setup_logging

    setup_logging("proxyd")
    die_with_parent()
    service_env()
    config = _load(args)
    preflight(config)
    return loops.run(run_proxy(config))


@dataclass(frozen=True)
class UpVerdict:
    """What `sanctum up` says while it starts: `wait`, `ready` (serving `models`), or
    `hopeless` (no route can ever be served: stop)."""

    step: str
    models: tuple[str, ...] = ()


def up_verdict(routes: dict[str, str], fatal_routes: frozenset[str],
               fatal_retried: bool) -> UpVerdict:
    """From /health's route states (None: no answer yet) and the routes whose every
    usable rung is a FATAL seat: ready once every route is ready or FATAL (with one
    ready at least); hopeless when every route is FATAL and FATAL is final."""
    if routes and all(m in fatal_routes for m in routes) and not fatal_retried:
        return UpVerdict("hopeless")
    ready = tuple(m for m, state in routes.items() if state == "ready")
    if ready and all(m in ready or m in fatal_routes for m in routes):
        return UpVerdict("ready", ready)
    return UpVerdict("wait")


def fatal_route_names(config: Config, fatal: set[str]) -> frozenset[str]:
    """Routes whose every rung a request without the off-box header may use is a
    FATAL seat (a hosted rung is never FATAL)."""
    seats = {s.name: s for s in config.seat}
    out = set()
    for route in config.route:
        usable = [n for n in route.ladder if route.offbox == "allow" or not seats[n].offbox]
        if usable and all(n in fatal for n in usable):
            out.add(route.model)
    return frozenset(out)


class UpWatch:
    """`sanctum up`'s look at its children while they start: /health's route states
    and seatd's FATAL seats; it prints the one ready line, and each seat that goes
    FATAL (once per time it does)."""

    def __init__(self, config: Config) -> None:
        import zmq

        self.config = config
        host, port = listen_address(config)
        self.base = f"http://{host}:{port}"
        self.ctx = zmq.Context()
        self.fatal: set[str] = set()
        self.announced = False

    def routes(self) -> dict[str, str]:
        """Every route's state from /health (200 or 503 both carry it); {} if none yet."""
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=1) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                body = json.loads(e.read())
            except ValueError:
                return {}
        except (urllib.error.URLError, OSError, ValueError):
            return {}
        routes = body.get("routes") if isinstance(body, dict) else None
        if not isinstance(routes, dict):
            return {}
        return {m: str(r.get("state")) for m, r in routes.items() if isinstance(r, dict)}

    def seat_states(self) -> dict[str, protocol.SeatStatus]:
        """seatd's own view of its seats; {} while it does not answer."""
        import zmq

        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 500)
        sock.connect(control_endpoint(self.config))
        try:
            sock.send(protocol.encode(protocol.StatusQuery()))
            reply = protocol.control_reply_decoder.decode(sock.recv())
        except (zmq.ZMQError, msgspec.DecodeError, msgspec.ValidationError):
            return {}
        finally:
            sock.close(linger=0)
        if not isinstance(reply, protocol.StatusReply):
            return {}
        return {s.name: s for s in reply.seats}

    def look(self) -> bool:
        """One look; False: nothing can be served, stop."""
        seats = self.seat_states()
        fatal = {n for n, s in seats.items() if s.state == "FATAL"}
        for name in sorted(fatal - self.fatal):
            why = seats[name].last_exit or "it could not start"
            print(f"sanctum up: seat {name} is FATAL ({why}); serving what is ready",
                  file=sys.stderr, flush=True)
        self.fatal = fatal
        if self.announced:
            return True
        verdict = up_verdict(self.routes(), fatal_route_names(self.config, fatal),
                             self.config.seatd.fatal_cooldown_s is not None)
        if verdict.step == "hopeless":
            print("sanctum up: no route can be served (every seat is FATAL); stopping",
                  file=sys.stderr, flush=True)
            return False
        if verdict.step == "ready":
            self.announced = True
            print(f"sanctum: ready at {self.base}/v1 (models: {', '.join(verdict.models)})",
                  flush=True)
        return True

    def close(self) -> None:
        self.ctx.term()


def cmd_up(args: argparse.Namespace) -> int:
    """Run seatd and proxyd as children; a signal to us stops both, in order.  Once
    every route is ready (or its seats FATAL), one line on stdout says where and what."""
    config = _load(args)
    preflight(config)  # fail here, before any child starts, on a bad config
    base = [sys.executable, "-m", "sanctum.cli"]
    extra = ["--config", args.config] if args.config else []
    env = dict(os.environ, SANCTUM_PARENT_PID=str(os.getpid()))
    # The children get no signal from the terminal (Ctrl-C, or a hang-up when it
    # closes, goes to its whole foreground group): we stop them, proxyd first, so that
    # every one drains and removes its sockets.  If we die, they follow (lifecycle).
    seatd = subprocess.Popen([*base, "seatd", *extra], env=env, start_new_session=True)
    proxy_args = [*extra, "--port", str(args.port)] if args.port else extra
    proxyd = subprocess.Popen([*base, "proxyd", *proxy_args], env=env,
                              start_new_session=True)
    children = {"proxyd": proxyd, "seatd": seatd}
    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    code = 0
    watch = UpWatch(config)
    next_look = 0.0
    while not stopping:
        dead = [n for n, p in children.items() if p.poll() is not None]
        if dead:
            print(f"sanctum up: {', '.join(dead)} exited; stopping", file=sys.stderr)
            code = 1
            break
        if time.monotonic() >= next_look:
            # Every 0.2 s until the ready line, then every second for FATAL seats.
            next_look = time.monotonic() + (1.0 if watch.announced else 0.2)
            if not watch.look():
                code = 1
                break
        time.sleep(0.2)
    watch.close()
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
    print(f"{'seat':<16}{'state':<10}{'load':<10}{'pid':>8}{'est. MB':>9}{'rss MB':>9}"
          f"{'uptime':>9}{'idle':>8}{'restarts':>9}{'incarn.':>8}  {'last exit':<12}device")
    for s in reply.seats:
        rss = f"{s.rss_bytes / 2**20:.0f}" if s.rss_bytes else "-"
        est = f"{s.estimated_bytes / 2**20:.0f}" if s.estimated_bytes else "-"
        up = f"{s.uptime_s:.0f}s" if s.uptime_s is not None else "-"
        idle = f"{s.idle_s:.0f}s" if s.idle_s is not None else "-"
        load = "demand" if s.load == "on_demand" else s.load
        print(f"{s.name:<16}{s.state:<10}{load:<10}{s.pid or '-':>8}{est:>9}{rss:>9}{up:>9}"
              f"{idle:>8}{s.restarts:>9}{s.incarnation:>8}  {s.last_exit or '-':<12}"
              f"{s.device or '-'}")
    budget = f"memory budget {reply.memory_budget_bytes / 2**20:.0f} MB"
    print(budget + (f", at most {reply.max_loaded} loaded" if reply.max_loaded else ""))
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
    from proxyd.keys import cli_key

    headers = {}
    key = cli_key(config, os.environ)  # the variable's first key, else the key file's
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
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

    config = _load(args)
    report = check_path(config)
    _check_keys(config, report)
    lines, errors = _check_room(config)
    report.errors.extend(errors)
    if lines:  # each seat's estimated size against the budget, then the verdict
        print("\n".join(lines))
    print(render(report))
    return 1 if report.errors or report.fatal else 0


def _check_room(config: Config) -> tuple[list[str], list[str]]:
    """Each local seat's estimated size against seatd's memory budget (seatd/room.py)."""
    if not config.supervised_seats:
        return [], []
    from seatd import room

    return room.check(config, room.physical_memory())


def _check_keys(config: Config, report: Report) -> None:
    """The client keys as proxyd will load them (the variable as this shell has it): a
    missing, too open or malformed key file is an error; a port open to the network
    without keys, a warning.  Never a key in either."""
    from proxyd.keys import load_keys

    try:
        keys = load_keys(config, os.environ, warn=False)
    except ConfigError as exc:
        report.errors.append(f"client keys: {exc}")
        return
    if keys and "*" in config.proxy.cors_origins:
        report.warnings.append(
            'proxy.cors_origins has "*" and client keys are set: any page may call the '
            "port, and a key in a page's code is readable by whoever loads it (list the "
            "pages' origins instead)")
    if not keys and _open_listen(config):
        report.warnings.append(
            f"proxy.listen {config.proxy.listen} is reachable from the network and no "
            "client key is set: anyone there may use every route (set api_keys_file or "
            "api_keys_env)")


def _open_listen(config: Config) -> bool:
    from shared.endpoints import is_loopback

    return not is_loopback(listen_address(config)[0])


def preflight(config: Config) -> None:
    """Both daemons refuse to start on a config whose caps disagree."""
    from shared.capcheck import check_path

    report = check_path(config)
    if report.errors:
        for error in report.errors:
            print(f"sanctum: {error}", file=sys.stderr)
        raise SystemExit(2)


KEYS_HELP = """\
wrote {public} (public) and {secret} (secret, mode 0600)

As a seat's key pair.  Where seatd runs the seat, in its [[seat]]:
    endpoint = "tcp://HOST:PORT"        # this machine's address
    curve_cert = "{secret}"
    curve_clients = "FOLDER"            # the proxies' public .key files
On the proxy's machine, in the same seat's [[seat]] (copy only the public file):
    remote = true
    endpoint = "tcp://HOST:PORT"        # the same string
    curve_cert = "{public}"
As a proxy's own key pair, in its [proxy]:
    curve_cert = "{secret}"
and copy {public} into each remote seat's curve_clients folder.
The secret file never leaves the machine that uses it."""


def cmd_keys(args: argparse.Namespace) -> int:
    """Make a CURVE key pair (zmq.auth certificate files); the secret is never printed."""
    import tempfile
    from pathlib import Path

    import zmq.auth

    from shared.config import SeatName
    from shared.private_files import make_private_dir

    try:
        msgspec.convert(args.name, SeatName)
    except msgspec.ValidationError:
        print(f"sanctum: --name {args.name!r}: letters, digits, '_', '.', '-'", file=sys.stderr)
        return 2
    folder = Path(args.dir).expanduser()
    public, secret = folder / f"{args.name}.key", folder / f"{args.name}.key_secret"
    if public.exists() or secret.exists():
        print(f"sanctum: {public} or {secret} exists already; not replaced", file=sys.stderr)
        return 1
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Made in a private folder, the secret tightened, then moved in: never readable.
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        made_public, made_secret = zmq.auth.create_certificates(make_private_dir(Path(tmp)),
                                                                args.name)
        os.chmod(made_secret, 0o600)
        os.chmod(made_public, 0o644)
        os.replace(made_secret, secret)
        os.replace(made_public, public)
    print(KEYS_HELP.format(public=public.resolve(), secret=secret.resolve()))
    return 0


def _keys_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("dir", help="folder for NAME.key and NAME.key_secret")
    sp.add_argument("--name", default="sanctum", help="file name of the pair (default sanctum)")


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
    _keys_args(add("keys", cmd_keys, "make a CURVE key pair for a seat on another machine"))
    from sanctum.bench.cli import add_bench
    from sanctum.service import add_service

    add_bench(sub)
    add_service(sub)
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
