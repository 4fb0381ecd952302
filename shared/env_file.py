"""Secrets for the services, from a private file: never in argv or a plist.

    SANCTUM_ENV_FILE=/path    read by `sanctum seatd` and `sanctum proxyd` as they start
                              (the system LaunchDaemons name it; `sanctum service
                              install --env-file`), before the config is read

The file holds one `NAME=VALUE` per line (the values of `api_keys_env` and of hosted
seats' `api_key_env`); blank lines and lines starting with `#` are skipped, and a value
is taken as written (no quotes are removed, no variables expanded).  A name already in
the environment keeps its value.  The file must be the running account's own and
private (no group or other bits): a looser one is refused, as ssh refuses a loose key.

    parse(text) -> dict[str, str]                  pure; ValueError naming the line
    looseness(mode) -> str | None                  pure: why a mode is too open
    load(path, environ) -> list[str]               the names it set
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import MutableMapping

ENV = "SANCTUM_ENV_FILE"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not _NAME.fullmatch(name):
            raise ValueError(f"line {n}: expected NAME=VALUE")
        out[name] = value.strip()
    return out


def looseness(mode: int) -> str | None:
    """Why a file of this mode may not hold secrets, or None."""
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if mode & 0o077:
        return f"mode {stat.S_IMODE(mode):04o} lets others read it (chmod 600)"
    return None


def load(path: str, environ: MutableMapping[str, str]) -> list[str]:
    """Set the file's names that the environment lacks; the names set.  OSError or
    ValueError (naming the file) when it cannot be used."""
    info = os.stat(path)
    why = looseness(info.st_mode)
    if why is not None:
        raise ValueError(f"{path}: {why}")
    if info.st_uid != os.geteuid():
        raise ValueError(f"{path}: owned by uid {info.st_uid}, not this account "
                         f"({os.geteuid()})")
    with open(path, encoding="utf-8") as f:
        try:
            values = parse(f.read())
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    taken = [name for name in values if name not in environ]
    for name in taken:
        environ[name] = values[name]
    return taken
