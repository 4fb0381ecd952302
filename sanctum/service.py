"""`sanctum service`: Sanctum as system LaunchDaemons, serving after a reboot with
nobody logged in (what each step is and why: `sanctum.service_plan`).

    sanctum service install --user NAME [--config FILE] [--env-file FILE] [--dry-run]
    sanctum service status [--config FILE]
    sanctum service logs [--service seatd|proxyd] [--lines N] [--follow]
    sanctum service restart
    sanctum service uninstall [--purge-logs] [--dry-run]

`install` checks before it writes anything: the account (it exists, is not root, is not
an admin), every path the daemons need as that account (the sanctum script, the config,
each local seat's model and drafter folders and their files, the key and secrets files,
which must be its own and private), and says what the power settings do to serving
(`pmset -g`; it changes none).  Then it writes the folders, the rotation entry and the
plists, and tells launchd.  `--dry-run` prints every file (with its content) and every
command instead, on any platform.  Everything else needs macOS and root.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launchd.plists import SERVICES, SYSTEM_LOG_DIR, Install, daemon_logs, label, render
from sanctum import service_plan as plan
from shared.config import Config, listen_address, load_config, state_dir

MAX_MODEL_FILES = 200  # files checked per model folder
STAT = os.stat  # how paths are looked at (a test sees them as another account would)


def lookup_account(name: str) -> plan.Account | None:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    gids = set(os.getgrouplist(name, entry.pw_gid))
    names = set()
    for gid in gids:
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    try:
        group = grp.getgrgid(entry.pw_gid).gr_name
    except KeyError:
        group = str(entry.pw_gid)
    return plan.Account(name, entry.pw_uid, entry.pw_gid, group, entry.pw_dir,
                        frozenset(names), frozenset(gids))


def _files(folder: Path) -> Iterator[Path]:
    for i, path in enumerate(sorted(folder.rglob("*"))):
        if i >= MAX_MODEL_FILES:
            return
        if path.is_file():
            yield path


def needed_paths(config: Config, config_path: str | None, env_file: str | None
                 ) -> tuple[list[str], list[str]]:
    """(model files and folders, secret files) the daemons read."""
    from shared.builtin import resolve_model

    models: list[str] = []
    for seat in config.seat:
        if seat.kind != "mlx" or seat.remote:
            continue
        specs = [seat.model or ""]
        if seat.drafter is not None and seat.drafter.path:
            specs.append(seat.drafter.path)
        for spec in specs:
            folder = resolve_model(spec).resolve()
            if folder.is_dir():
                models.append(str(folder))
                models += [str(f) for f in _files(folder)]
    base = Path(config_path).parent if config_path else Path.cwd()
    secrets = [config.proxy.api_keys_file, config.proxy.curve_cert,
               *(s.curve_cert for s in config.seat if s.kind == "mlx" and not s.remote),
               env_file]
    return models, [str((base / s).expanduser().resolve()) for s in secrets if s]


def power_lines() -> list[str]:
    if shutil.which("pmset") is None:
        return ["power: pmset not found (not macOS), so the power settings were not read"]
    out = subprocess.run(["pmset", "-g"], capture_output=True, text=True, check=False)
    advice = plan.power_advice(out.stdout)
    if not advice:
        return ["power: sleep off, restarts after a power loss, wakes for network access"]
    return [f"power: {line}" for line in advice]


def _sanctum_script() -> str:
    script = Path(sys.executable).parent / "sanctum"
    return str(script if script.exists() else Path(sys.argv[0]).resolve())


def cmd_install(args: argparse.Namespace) -> int:
    if not args.dry_run and (sys.platform != "darwin" or os.geteuid() != 0):
        print("sanctum service install: needs macOS and root (sudo); --dry-run shows "
              "what it would do", file=sys.stderr)
        return 1
    account = lookup_account(args.user)
    why = plan.refuse_account(args.user, account)
    if why is not None or account is None:
        print(f"sanctum service install: {why}", file=sys.stderr)
        return 1
    config_path = str(Path(args.config).expanduser().resolve()) if args.config else None
    env_file = str(Path(args.env_file).expanduser().resolve()) if args.env_file else None
    config = load_config(config_path)
    sanctum = _sanctum_script()
    models, secrets = needed_paths(config, config_path, env_file)
    programs = [sanctum, str(Path(sys.executable).resolve())]
    wants = plan.path_wants(account.home, programs, config_path, models, secrets)
    problems = [p for path, want in wants if (p := plan.blocked(path, account, want, STAT))]
    problems += [p for s in secrets if (p := plan.secret_problem(s, account, STAT))]
    if problems:
        for problem in problems:
            print(f"sanctum service install: {problem}", file=sys.stderr)
        return 1
    plists = {s: render(s, Install(sanctum, account.home, config_path, config.seatd.drain_s,
                                   user=account.name, group=account.group,
                                   env_file=env_file))
              for s in SERVICES}
    steps = plan.install_plan(account, sanctum, plists, config_path,
                              str(state_dir(config, account.home)))
    for line in power_lines():
        print(line)
    done = perform(steps, args.dry_run)
    if done == 0 and not args.dry_run:
        print(f"sanctum service: seatd and proxyd run as {account.name} under launchd's "
              f"system domain; logs in {SYSTEM_LOG_DIR}; 'sanctum service status' shows them")
    return done


def cmd_uninstall(args: argparse.Namespace) -> int:
    if not args.dry_run and (sys.platform != "darwin" or os.geteuid() != 0):
        print("sanctum service uninstall: needs macOS and root (sudo)", file=sys.stderr)
        return 1
    return perform(plan.uninstall_plan(args.purge_logs), args.dry_run)


def perform(steps: list[plan.Step], dry_run: bool) -> int:
    """Each step in order (or, dry, its line and a file's content); 1 at the first
    command that fails unexpectedly."""
    for step in steps:
        print(plan.describe(step))
        if dry_run:
            if isinstance(step, plan.Write):
                print(step.content.decode().rstrip("\n"))
            continue
        if isinstance(step, plan.Run) and step.argv[0] == "plutil" \
                and shutil.which("plutil") is None:
            continue
        if not _do(step):
            return 1
    return 0


def _owner(owner: str) -> tuple[str, str]:
    user, _, group = owner.partition(":")
    return user, group


def _do(step: plan.Step) -> bool:
    match step:
        case plan.Write(path=path, content=content, mode=mode, owner=owner):
            folder = os.path.dirname(path)
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".sanctum-")
            with os.fdopen(fd, "wb") as f:
                f.write(content)
            os.chmod(tmp, mode)
            shutil.chown(tmp, *_owner(owner))
            os.replace(tmp, path)
        case plan.MakeDir(path=path, mode=mode, owner=owner):
            os.makedirs(path, exist_ok=True)
            os.chmod(path, mode)
            shutil.chown(path, *_owner(owner))
        case plan.Remove(path=path, tree=tree):
            if tree:
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                os.remove(path)
        case plan.Run(argv=argv, may_fail=may_fail):
            result = subprocess.run(list(argv), check=False,
                                    capture_output=may_fail)
            if result.returncode != 0 and not may_fail:
                print(f"sanctum service: {' '.join(argv)} failed ({result.returncode})",
                      file=sys.stderr)
                return False
    return True


def cmd_status(args: argparse.Namespace) -> int:
    if shutil.which("launchctl") is None:
        print("sanctum service status: launchd exists only on macOS", file=sys.stderr)
        return 1
    for service in SERVICES:
        out = subprocess.run(["launchctl", "print", f"{plan.DOMAIN}/{label(service)}"],
                             capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(f"{service}: not loaded (sanctum service install)")
            continue
        got = plan.launchd_state(out.stdout)
        print(f"{service}: {got.get('state', '?')}, pid {got.get('pid', '-')}, last exit "
              f"{got.get('last exit code', '-')}")
    config = load_config(args.config)
    host, port = listen_address(config)
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=5) as r:
            health: dict[str, Any] = json.load(r)
    except OSError as exc:
        print(f"health: no answer at {host}:{port} ({exc})")
        return 1
    seats = health.get("seats", {})
    ready = sorted(n for n, s in seats.items() if s.get("ready"))
    print(f"health: {health.get('status', '?')}; seats ready: {', '.join(ready) or 'none'} "
          f"of {len(seats)}")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    if sys.platform != "darwin" or os.geteuid() != 0:
        print("sanctum service restart: needs macOS and root (sudo)", file=sys.stderr)
        return 1
    for service in SERVICES:  # seatd first: proxyd waits for its seats as at start
        subprocess.run(["launchctl", "kickstart", "-k", f"{plan.DOMAIN}/{label(service)}"],
                       check=False)
    return 0


def tail(path: Path, lines: int) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:] if lines > 0 else []


def follow(paths: list[Path], sleep: Any = time.sleep, rounds: int | None = None) -> None:
    """Print what is appended to each file, going on in a new file once one was rotated
    (renamed away): `rounds` polls, or forever."""
    at: dict[Path, tuple[int, int]] = {}  # (inode, offset)
    for path in paths:
        try:
            info = path.stat()
            at[path] = (info.st_ino, info.st_size)
        except OSError:
            at[path] = (0, 0)
    n = 0
    while rounds is None or n < rounds:
        n += 1
        for path in paths:
            try:
                info = path.stat()
            except OSError:
                continue
            inode, offset = at[path]
            if info.st_ino != inode or info.st_size < offset:
                offset = 0  # rotated: the new file from its start
            if info.st_size > offset:
                with path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                sys.stdout.write(chunk.decode("utf-8", errors="replace"))
                sys.stdout.flush()
                offset += len(chunk)
            at[path] = (info.st_ino, offset)
        sleep(0.5)


def cmd_logs(args: argparse.Namespace) -> int:
    folder = Path(args.log_dir)
    services = SERVICES if args.service == "all" else (args.service,)
    paths = [folder / Path(p).name for s in services for p in daemon_logs(s)]
    if not any(p.exists() for p in paths):
        print(f"sanctum service logs: no logs in {folder} (is the service installed?)",
              file=sys.stderr)
        return 1
    for path in paths:
        for line in tail(path, args.lines):
            print(line)
    if args.follow:
        try:
            follow(paths)
        except KeyboardInterrupt:
            return 0
    return 0


def add_service(sub: Any) -> None:
    """`sanctum service ...` on the main parser."""
    sp = sub.add_parser("service", help="Sanctum as system LaunchDaemons (serves with "
                                        "nobody logged in)")
    verbs = sp.add_subparsers(dest="verb", required=True)
    i = verbs.add_parser("install", help="install the daemons to run as a service account")
    i.add_argument("--user", required=True, help="the service account (standard, not admin)")
    i.add_argument("--config", default=None, help="TOML config (default: packaged demo)")
    i.add_argument("--env-file", default=None,
                   help="NAME=VALUE secrets for the daemons, mode 0600, the account's own")
    i.add_argument("--dry-run", action="store_true", help="print every file and command")
    i.set_defaults(fn=cmd_install)
    s = verbs.add_parser("status", help="the daemons' launchd state and /health")
    s.add_argument("--config", default=None)
    s.set_defaults(fn=cmd_status)
    lg = verbs.add_parser("logs", help=f"the daemons' logs ({SYSTEM_LOG_DIR})")
    lg.add_argument("--service", choices=(*SERVICES, "all"), default="all")
    lg.add_argument("--lines", type=int, default=50)
    lg.add_argument("--follow", action="store_true")
    lg.add_argument("--log-dir", default=SYSTEM_LOG_DIR, help=argparse.SUPPRESS)
    lg.set_defaults(fn=cmd_logs)
    verbs.add_parser("restart", help="restart both daemons").set_defaults(fn=cmd_restart)
    u = verbs.add_parser("uninstall", help="boot the daemons out and remove their files")
    u.add_argument("--purge-logs", action="store_true", help=f"remove {SYSTEM_LOG_DIR} too")
    u.add_argument("--dry-run", action="store_true")
    u.set_defaults(fn=cmd_uninstall)
