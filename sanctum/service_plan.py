"""`sanctum service`: what installing Sanctum as system LaunchDaemons means, decided
without touching the machine (the shell, `sanctum.service`, runs it or prints it).

A Mac mini that serves a household reboots to the login window after an update or a
power cut; a LaunchAgent (`deploy/install.sh`) waits for its user to log in, a
LaunchDaemon does not.  The daemons run as a service account (never root, never an
admin: what a model's files or a request can make the process do stays that
account's), read the config, the models and the key files as that account, and own
its state directory.

    refuse_account(name, account) -> str | None      why it cannot be the account
    blocked(path, account, want, stat) -> str | None  the first part of a path the
                                                     account cannot pass or use
    install_plan(...) -> [Step]                      files, folders and commands, in
    uninstall_plan(purge) -> [Step]                  the order they are done
    newsyslog_conf(user, group) -> str               the log rotation entry
    power_advice(pmset_text) -> [str]                what keeps the Mac serving
    launchd_state(text) -> {state, pid, last exit}   from `launchctl print`

Permissions are judged by mode bits, owner and group, as the account: an ACL that
allows more is not seen (install then refuses a path the account could reach: the
message names it), one that denies more is not either (launchd's log says so).
"""

from __future__ import annotations

import os
import re
import stat as stat_mod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from launchd.plists import SERVICES, SYSTEM_LOG_DIR, daemon_logs, label
from shared.env_file import looseness

PLIST_DIR = "/Library/LaunchDaemons"
NEWSYSLOG = "/etc/newsyslog.d/com.sanctum.conf"
DOMAIN = "system"
ROOT_OWNER = "root:wheel"
# Groups whose members administer the machine (macOS: admin; Linux: sudo, wheel).
ADMIN_GROUPS = frozenset({"admin", "sudo", "wheel"})
LOG_KEEP = 7  # rotated files kept per log
LOG_ROTATE_KB = 10240  # a log is rotated past 10 MiB

Want = Literal["read", "list", "exec", "write"]
_BITS: dict[Want, int] = {"read": 4, "list": 5, "exec": 1, "write": 3}  # rwx as 4,2,1


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    group: str  # its primary group's name
    home: str
    groups: frozenset[str]  # every group it is in, by name
    gids: frozenset[int]


@dataclass(frozen=True)
class Write:
    path: str
    content: bytes
    mode: int
    owner: str  # "user:group"


@dataclass(frozen=True)
class MakeDir:
    path: str
    mode: int
    owner: str


@dataclass(frozen=True)
class Remove:
    path: str
    tree: bool = False  # a folder and all it holds


@dataclass(frozen=True)
class Run:
    argv: tuple[str, ...]
    may_fail: bool = False  # expected to fail when there is nothing to undo


Step = Write | MakeDir | Remove | Run


def make_account_hint(name: str) -> str:
    return (f"make it first (a standard account, not an admin): sudo sysadminctl -addUser "
            f"{name} -fullName 'Sanctum service' -password - -home /Users/{name} && "
            f"sudo createhomedir -c -u {name}")


def refuse_account(name: str, account: Account | None) -> str | None:
    """Why `account` (looked up by `name`) may not run the daemons, or None."""
    if account is None:
        return f"no account named {name!r}; {make_account_hint(name)}"
    if account.uid == 0:
        return (f"{name!r} is root: the daemons run as a service account of their own; "
                f"{make_account_hint('sanctum')}")
    admin = sorted(account.groups & ADMIN_GROUPS)
    if admin:
        return (f"{name!r} administers this machine (group {admin[0]}): the daemons run as "
                f"a standard account; {make_account_hint('sanctum')}")
    return None


def _allows(info: os.stat_result, account: Account, bits: int) -> bool:
    if info.st_uid == account.uid:
        have = (info.st_mode >> 6) & 7
    elif info.st_gid in account.gids:
        have = (info.st_mode >> 3) & 7
    else:
        have = info.st_mode & 7
    return have & bits == bits


def blocked(path: str, account: Account, want: Want,
            stat: Callable[[str], os.stat_result] = os.stat) -> str | None:
    """The first part of absolute `path` the account cannot pass (a folder it may not
    enter) or use as `want`, said with its mode and owner; None when it can."""
    parts = [p for p in path.split("/") if p]
    at = ""
    for i, part in enumerate(["", *parts]):
        at = f"{at}/{part}" if part else "/"
        at = at.replace("//", "/")
        try:
            info = stat(at)
        except FileNotFoundError:
            return f"{at} does not exist"
        except OSError as exc:
            return f"{at}: {exc.strerror}"
        last = i == len(parts)
        need = _BITS[want] if last else 1
        if last and want == "read" and stat_mod.S_ISDIR(info.st_mode):
            need = _BITS["list"]
        if not _allows(info, account, need):
            verb = ("enter" if not last else {"read": "read", "list": "read", "exec": "run",
                                              "write": "write to"}[want])
            return (f"{at}: {account.name} cannot {verb} it (mode "
                    f"{stat_mod.S_IMODE(info.st_mode):04o}, owner uid {info.st_uid} "
                    f"gid {info.st_gid})")
    return None


def secret_problem(path: str, account: Account,
                   stat: Callable[[str], os.stat_result] = os.stat) -> str | None:
    """A file of secrets must be the account's own and private."""
    try:
        info = stat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    why = looseness(info.st_mode)
    if why is not None:
        return f"{path}: {why}"
    if info.st_uid != account.uid:
        return (f"{path}: a secret the daemons read must be {account.name}'s own "
                f"(sudo chown {account.name} {path})")
    return None


def newsyslog_conf(user: str, group: str) -> str:
    """/etc/newsyslog.d's entry: each log rotated past LOG_ROTATE_KB, LOG_KEEP kept,
    compressed.  `N`: no signal; the daemons open their log again once it was renamed
    (`shared.logs.ReopeningFile`)."""
    lines = ["# Sanctum's logs (written by `sanctum service install`; removed by uninstall)",
             "# logfilename                          owner:group  mode count size(KB) when flags"]
    for service in SERVICES:
        for path in daemon_logs(service):
            lines.append(f"{path:40} {user}:{group}  640  {LOG_KEEP}  {LOG_ROTATE_KB}  *  JN")
    return "\n".join(lines) + "\n"


def plist_path(service: str) -> str:
    return f"{PLIST_DIR}/{label(service)}.plist"


def install_plan(account: Account, sanctum: str, plists: dict[str, bytes],
                 config: str | None, state_dir: str) -> list[Step]:
    """Every step of an install, in order: the logs' and the state's folders (the
    account's), the config checked as the account, the rotation entry, then per
    service (seatd first, so the seats load while proxyd starts) its plist, linted, and
    launchd told (an old instance booted out first)."""
    owner = f"{account.name}:{account.group}"
    steps: list[Step] = [MakeDir(SYSTEM_LOG_DIR, 0o750, owner),
                         MakeDir(state_dir, 0o700, owner)]
    if config is not None:
        steps.append(Run(("sudo", "-u", account.name, "-H", sanctum, "check", "--config",
                          config)))
    steps.append(Write(NEWSYSLOG, newsyslog_conf(account.name, account.group).encode(),
                       0o644, ROOT_OWNER))
    for service in SERVICES:
        path = plist_path(service)
        target = f"{DOMAIN}/{label(service)}"
        steps += [Write(path, plists[service], 0o644, ROOT_OWNER),
                  Run(("plutil", "-lint", path)),
                  Run(("launchctl", "bootout", target), may_fail=True),
                  Run(("launchctl", "enable", target)),
                  Run(("launchctl", "bootstrap", DOMAIN, path))]
    return steps


def uninstall_plan(purge_logs: bool = False) -> list[Step]:
    """proxyd first (no more requests), then seatd (it drains its seats); the plists
    and the rotation entry go.  Models, config and state stay; logs unless asked."""
    steps: list[Step] = []
    for service in reversed(SERVICES):
        steps += [Run(("launchctl", "bootout", f"{DOMAIN}/{label(service)}"), may_fail=True),
                  Remove(plist_path(service))]
    steps.append(Remove(NEWSYSLOG))
    if purge_logs:
        steps.append(Remove(SYSTEM_LOG_DIR, tree=True))
    return steps


def describe(step: Step) -> str:
    """One line per step, as --dry-run prints it."""
    match step:
        case Write():
            return f"write {step.path} (mode {step.mode:04o}, owner {step.owner})"
        case MakeDir():
            return f"mkdir -p {step.path} (mode {step.mode:04o}, owner {step.owner})"
        case Remove():
            return f"rm {'-rf' if step.tree else '-f'} {step.path}"
        case Run():
            return "+ " + " ".join(step.argv) + (" || true" if step.may_fail else "")


_SETTING = re.compile(r"^\s*([A-Za-z]+)\s+(\S+)")


def pmset_settings(text: str) -> dict[str, str]:
    """`pmset -g`'s settings by name (the first value on each line)."""
    out = {}
    for line in text.splitlines():
        m = _SETTING.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def power_advice(text: str) -> list[str]:
    """What keeps the Mac serving, from `pmset -g`: each setting that does not, with the
    command that changes it (install never changes them)."""
    got = pmset_settings(text)
    advice = []
    if got.get("sleep", "0") != "0":
        advice.append(f"the Mac sleeps after {got['sleep']} idle minutes and then serves "
                      "nothing: sudo pmset -a sleep 0")
    if got.get("autorestart") != "1":
        advice.append("it stays off after a power loss: sudo pmset -a autorestart 1")
    if got.get("womp") != "1":
        advice.append("it does not wake for network access: sudo pmset -a womp 1")
    return advice


_FIELD = re.compile(r"^\s*(state|pid|last exit code) = (.*)$")


def launchd_state(text: str) -> dict[str, str]:
    """`launchctl print system/LABEL`'s state, pid and last exit code, where given."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _FIELD.match(line)
        if m and m.group(1) not in out:
            out[m.group(1)] = m.group(2).strip()
    return out


def path_wants(home: str, programs: Sequence[str], config: str | None,
               models: Sequence[str], secrets: Sequence[str]) -> list[tuple[str, Want]]:
    """What the account must reach: its home (launchd starts the daemons there), run
    the sanctum script and its Python, read the config, each model folder and file,
    and each secret file."""
    wants: list[tuple[str, Want]] = [(home, "write")]
    wants += [(p, "exec") for p in programs]
    if config is not None:
        wants.append((config, "read"))
    wants += [(m, "read") for m in models]
    wants += [(s, "read") for s in secrets]
    return wants
