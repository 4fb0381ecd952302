"""The launchd plists for seatd and proxyd, built and checked in code (plistlib).

launchd restarts a crashed job forever, every `ThrottleInterval` seconds, and
has no "give up" state.  So launchd only keeps the two daemons up; seatd owns
each seat's health (back-off, FATAL, restarts).  The keys that matter:

- `KeepAlive`: restart on a crash or a non-zero exit; a clean exit (SIGTERM
  from `launchctl bootout`) stays down.
- `ExitTimeOut`: how long launchd waits after SIGTERM before SIGKILL.  It must
  outlast seatd's own drain (`seatd.drain_s`, then TERM, then KILL of the
  workers), or launchd kills seatd mid-drain.
- `ProcessType` Interactive: under the default (Background) macOS throttles the
  job; decode has been reported at 11 tok/s there against 87 under Interactive.
- `EnvironmentVariables`: launchd gives jobs a bare PATH, so it is explicit,
  and the kill switches are there for an operator to flip with one edit.

Two flavours.  A user agent (`~/Library/LaunchAgents`, the user's `gui` domain) starts
when its user logs in; its logs go to `~/Library/Logs/Sanctum`.  A system daemon
(`/Library/LaunchDaemons`, the `system` domain: `Install.user` set) starts at boot with
nobody logged in, as that service account: `UserName`, `GroupName`, an explicit `HOME`,
`Umask` 027 (what it writes is not world-readable), logs in `/Library/Logs/Sanctum`:
its lines in `SERVICE.log` (the process appends there itself, `SANCTUM_LOG_FILE`, so
that newsyslog can rotate it), whatever else reaches stdout or stderr (a traceback
before logging starts) in `SERVICE.err.log`.  Its secrets come from a private file
named in `SANCTUM_ENV_FILE` (`shared.env_file`), never from the plist.

    python -m launchd.plists render SERVICE --sanctum BIN --home DIR [--config FILE]
                                            [--set KEY=VALUE]...
    python -m launchd.plists templates DIR      the committed templates, placeholders in
    python -m launchd.plists check FILE...      exit 1 naming every problem
"""

from __future__ import annotations

import argparse
import math
import plistlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVICES = ("seatd", "proxyd")
LABEL_PREFIX = "com.sanctum."
THROTTLE_S = 10
# launchd's wait beyond the drain and the kill grace, for logging and exit.
EXIT_MARGIN_S = 8
DEFAULT_DRAIN_S = 20.0
# Homebrew on Apple silicon first, then the system.
DEFAULT_PATH = "/opt/homebrew/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
# Switches an operator flips in the plist (then `launchctl kickstart -k`) to turn
# an acceleration path off without a new config; "off" disables, "on" is normal.
KILL_SWITCHES = {"SANCTUM_SPECULATION": "on", "SANCTUM_PROMPT_CACHE": "on"}
LOG_DIR = "Library/Logs/Sanctum"
SYSTEM_LOG_DIR = "/" + LOG_DIR
UMASK = 0o027  # a daemon's files: group-readable at most, never world-readable
# Log files are read by tools: JSON lines, whatever launchd's environment says
# (shared/logs.py would choose JSON there anyway; this makes it explicit).
LOG_ENV = {"SANCTUM_LOG_FORMAT": "json"}
PLACEHOLDERS = {"sanctum": "__SANCTUM__", "config": "__CONFIG__", "home": "__HOME__"}


@dataclass(frozen=True)
class Install:
    """Where things are on the Mac this is installed on."""

    sanctum: str
    home: str
    config: str | None = None
    drain_s: float = DEFAULT_DRAIN_S
    path: str = DEFAULT_PATH
    env: dict[str, str] = field(default_factory=dict)
    # A system daemon: the service account it runs as, and its primary group.
    user: str | None = None
    group: str | None = None
    env_file: str | None = None  # the daemon's secrets (`shared.env_file`)


def label(service: str) -> str:
    return LABEL_PREFIX + service


def exit_timeout(drain_s: float) -> int:
    """ExitTimeOut: the drain, seatd's TERM-to-KILL grace, and a margin, in whole seconds."""
    from seatd.states import stop_deadline

    return math.ceil(stop_deadline(drain_s)) + EXIT_MARGIN_S


def log_paths(service: str, home: str) -> tuple[str, str]:
    base = f"{home.rstrip('/')}/{LOG_DIR}"
    return f"{base}/{service}.log", f"{base}/{service}.err.log"


def daemon_logs(service: str) -> tuple[str, str]:
    """A system daemon's log (its own lines) and its stdout/stderr file."""
    return f"{SYSTEM_LOG_DIR}/{service}.log", f"{SYSTEM_LOG_DIR}/{service}.err.log"


def build(service: str, install: Install) -> dict[str, Any]:
    """The plist of one service, as a dict for plistlib."""
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; known: {', '.join(SERVICES)}")
    args = [install.sanctum, service]
    if install.config:
        args += ["--config", install.config]
    out, err = log_paths(service, install.home)
    env = {"PATH": install.path, **KILL_SWITCHES, **LOG_ENV, **install.env}
    daemon: dict[str, Any] = {}
    if install.user is not None:
        log, out = daemon_logs(service)
        err = out
        env = {**env, "HOME": install.home, "SANCTUM_LOG_FILE": log}
        if install.env_file:
            env["SANCTUM_ENV_FILE"] = install.env_file
        daemon = {"UserName": install.user, "Umask": UMASK}
        if install.group:
            daemon["GroupName"] = install.group
    return {**daemon,
        "Label": label(service),
        "ProgramArguments": args,
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False, "Crashed": True},
        "ThrottleInterval": THROTTLE_S,
        "ExitTimeOut": exit_timeout(install.drain_s),
        "ProcessType": "Interactive",
        "EnvironmentVariables": env,
        "StandardOutPath": out,
        "StandardErrorPath": err,
        "WorkingDirectory": install.home,
    }


def render(service: str, install: Install) -> bytes:
    data = build(service, install)
    problems = check(service, data, install.drain_s)
    if problems:
        raise ValueError("; ".join(problems))
    return plistlib.dumps(data, sort_keys=True)


def check(service: str, data: dict[str, Any], drain_s: float = DEFAULT_DRAIN_S) -> list[str]:
    """Every way `data` falls short of what Sanctum needs from launchd; empty when fine."""
    problems: list[str] = []

    def want(ok: bool, text: str) -> None:
        if not ok:
            problems.append(text)

    want(data.get("Label") == label(service), f"Label must be {label(service)}")
    args = data.get("ProgramArguments")
    want(isinstance(args, list) and len(args) >= 2 and args[1] == service
         and (str(args[0]).startswith("/") or args[0] == PLACEHOLDERS["sanctum"]),
         f"ProgramArguments must be [absolute sanctum path, {service!r}, ...]")
    keep = data.get("KeepAlive")
    want(isinstance(keep, dict) and keep.get("SuccessfulExit") is False,
         "KeepAlive must restart on a failed exit ({SuccessfulExit: false})")
    want(isinstance(data.get("ThrottleInterval"), int) and data["ThrottleInterval"] >= 1,
         "ThrottleInterval must be a positive integer")
    floor = exit_timeout(drain_s) - EXIT_MARGIN_S
    timeout = data.get("ExitTimeOut")
    want(isinstance(timeout, int) and timeout > floor,
         f"ExitTimeOut must be longer than the drain and kill grace ({floor}s)")
    want(data.get("ProcessType") == "Interactive",
         "ProcessType must be Interactive (Background throttles decode)")
    env = data.get("EnvironmentVariables")
    want(isinstance(env, dict) and bool(env.get("PATH")),
         "EnvironmentVariables must set PATH explicitly")
    if isinstance(env, dict):
        for name in KILL_SWITCHES:
            want(env.get(name) in ("on", "off"), f"EnvironmentVariables.{name} must be on/off")
    for key in ("StandardOutPath", "StandardErrorPath"):
        want(f"/{LOG_DIR}/" in str(data.get(key, "")), f"{key} must be under ~/{LOG_DIR}")
    if "UserName" in data:
        problems += _daemon_problems(data)
    return problems


def _daemon_problems(data: dict[str, Any]) -> list[str]:
    """What a system daemon's plist needs beyond an agent's."""
    problems = []
    env = data.get("EnvironmentVariables")
    env = env if isinstance(env, dict) else {}
    if data.get("UserName") in ("root", "", None):
        problems.append("UserName must be a service account, not root")
    if data.get("Umask") != UMASK:
        problems.append(f"Umask must be {UMASK:03o} (decimal {UMASK})")
    if not str(env.get("HOME", "")).startswith("/"):
        problems.append("EnvironmentVariables.HOME must be the account's home")
    for key in ("StandardOutPath", "StandardErrorPath"):
        if not str(data.get(key, "")).startswith(SYSTEM_LOG_DIR + "/"):
            problems.append(f"{key} must be under {SYSTEM_LOG_DIR}")
    if not str(env.get("SANCTUM_LOG_FILE", "")).startswith(SYSTEM_LOG_DIR + "/"):
        problems.append(f"EnvironmentVariables.SANCTUM_LOG_FILE must be under {SYSTEM_LOG_DIR}")
    secret = [k for k in env if any(w in k.upper() for w in ("KEY", "TOKEN", "SECRET",
                                                            "PASSWORD"))]
    if secret:
        problems.append(f"EnvironmentVariables must hold no secret ({', '.join(secret)}): "
                        "put it in the SANCTUM_ENV_FILE file")
    return problems


def template(service: str) -> bytes:
    """The committed template: the real plist with placeholder paths."""
    p = PLACEHOLDERS
    return render(service, Install(sanctum=p["sanctum"], home=p["home"], config=p["config"]))


def drain_from_config(config: str | None) -> float:
    if config is None:
        return DEFAULT_DRAIN_S
    from shared.config import load_config

    return float(load_config(config).seatd.drain_s)


def _pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launchd.plists")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="print one service's plist")
    r.add_argument("service", choices=SERVICES)
    r.add_argument("--sanctum", required=True, help="absolute path of the sanctum script")
    r.add_argument("--home", required=True, help="the user's home (logs go under it)")
    r.add_argument("--config", default=None, help="absolute path of the TOML config")
    r.add_argument("--path", default=DEFAULT_PATH, help="PATH for the service")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable, e.g. SANCTUM_SPECULATION=off")
    t = sub.add_parser("templates", help="write the placeholder templates into DIR")
    t.add_argument("dir")
    c = sub.add_parser("check", help="check plist files; exit 1 naming every problem")
    c.add_argument("files", nargs="+")
    c.add_argument("--config", default=None, help="the config whose drain_s applies")
    args = parser.parse_args(argv)

    if args.command == "render":
        install = Install(args.sanctum, args.home, args.config, drain_from_config(args.config),
                          args.path, _pairs(args.set))
        sys.stdout.write(render(args.service, install).decode())
        return 0
    if args.command == "templates":
        for service in SERVICES:
            (Path(args.dir) / f"{label(service)}.plist").write_bytes(template(service))
        return 0
    bad = 0
    drain = drain_from_config(args.config)
    for name in args.files:
        try:
            data = plistlib.loads(Path(name).read_bytes())
        except (OSError, plistlib.InvalidFileException, ValueError) as exc:
            print(f"{name}: not a readable plist: {exc}", file=sys.stderr)
            bad += 1
            continue
        service = str(data.get("Label", "")).removeprefix(LABEL_PREFIX)
        for problem in check(service, data, drain):
            print(f"{name}: {problem}", file=sys.stderr)
            bad += 1
    if not bad:
        print(f"{len(args.files)} plist(s) ok")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
