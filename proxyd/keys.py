"""Client keys: who may use the proxy's port, on which routes, and how often.

Keys never sit in the config body.  They come from two places, both optional:

    proxy.api_keys_env    the name of a variable holding comma-separated keys; each
                          is a key of its own, named env-1, env-2, ... in order, that
                          may use every route at any rate
    proxy.api_keys_file   a text file (mode 0600 or stricter), one key per line:

        SECRET [name=NAME] [routes=ROUTE,ROUTE] [rpm=N]

    `#` starts a comment (a whole line, or the rest of one after the key); blank
    lines are ignored.  NAME (default `file-LINE`) is what counters and logs show;
    routes empty = every route; rpm = at most N requests in any 60 s.

`parse_env` and `parse_file` are pure; `load_keys` reads the variable and the file.
Every error is a `ConfigError` that names the variable or the file's line, never the
key: not even a fragment of a line that failed to parse.  `KeyRing.find` compares a
presented key with every key in constant time.  `cli_key` is the one key the
operator's CLI sends.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import msgspec
import structlog

from shared.config import Config, ConfigError, resolve_path

log = structlog.get_logger()

NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# What an HTTP header can carry as one token: visible ASCII, no space, no comma.
SECRET = re.compile(r"^[\x21-\x2b\x2d-\x7e]+$")
MAX_RPM = 10_000  # the window holds one timestamp per request (proxyd/auth.py)
OPTIONS = ("name", "routes", "rpm")


class ClientKey(msgspec.Struct, frozen=True):
    name: str
    secret: str
    routes: tuple[str, ...] = ()  # the routes this key may use; empty = every route
    rpm: int | None = None  # requests per minute; None = no limit

    def __repr__(self) -> str:  # a key in a traceback or a log line shows its name only
        return f"ClientKey(name={self.name!r}, routes={self.routes!r}, rpm={self.rpm!r})"

    def may_use(self, route: str) -> bool:
        return not self.routes or route in self.routes


def _digest(secret: str) -> bytes:
    # Equal-length digests: the comparison takes as long whatever the key's length.
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


class KeyRing:
    """The keys the proxy accepts; empty = no authentication."""

    def __init__(self, keys: Sequence[ClientKey] = ()) -> None:
        self.keys = tuple(keys)
        self._digests = tuple(_digest(k.secret) for k in self.keys)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def find(self, presented: str) -> ClientKey | None:
        """The key equal to `presented`, compared with every key in constant time:
        every comparison runs, whichever key (if any) matches, and how long one takes
        depends on neither key's length nor on a common prefix."""
        given = _digest(presented)
        hits = [hmac.compare_digest(given, d) for d in self._digests]
        for key, hit in zip(self.keys, hits, strict=True):
            if hit:
                return key
        return None


def parse_env(raw: str, source: str) -> list[ClientKey]:
    """The keys of a comma-separated variable: env-1, env-2, ... (empty parts skipped)."""
    keys: list[ClientKey] = []
    for secret in (part.strip() for part in raw.split(",")):
        if not secret:
            continue
        n = len(keys) + 1
        if not SECRET.match(secret):
            raise ConfigError(f"{source}: key {n} has a character an HTTP header cannot "
                              "carry (keys are visible ASCII, without spaces or commas)")
        keys.append(ClientKey(f"env-{n}", secret))
    return keys


def _option(field: str, seen: dict[str, str], where: str, position: int) -> None:
    option, eq, value = field.partition("=")
    if not eq or option not in OPTIONS:
        # The field may be a piece of a key written with a space in it: never echo it.
        raise ConfigError(f"{where}: field {position} is not name=, routes= or rpm= "
                          "(a key is one word; options follow it)")
    if option in seen:
        raise ConfigError(f"{where}: {option}= given twice")
    seen[option] = value


def _key_of_line(fields: list[str], number: int, routes: Collection[str],
                 where: str) -> ClientKey:
    secret, *rest = fields
    if not SECRET.match(secret):
        raise ConfigError(f"{where}: the key has a character an HTTP header cannot carry "
                          "(keys are visible ASCII, without spaces or commas)")
    if "=" in secret and secret.partition("=")[0] in OPTIONS:
        raise ConfigError(f"{where}: the line starts with an option; the key comes first")
    seen: dict[str, str] = {}
    for i, field in enumerate(rest, start=2):
        _option(field, seen, where, i)
    name = seen.get("name", f"file-{number}")
    if not NAME.match(name):
        raise ConfigError(f"{where}: name={name!r}: a name is 1 to 64 letters, digits, "
                          "'.', '_' or '-'")
    allowed: tuple[str, ...] = ()
    if "routes" in seen:
        allowed = tuple(dict.fromkeys(r for r in seen["routes"].split(",") if r))
        if not allowed:
            raise ConfigError(f"{where}: routes= names no route (leave it out for every "
                              "route)")
        unknown = [r for r in allowed if r not in routes]
        if unknown:
            raise ConfigError(f"{where}: routes=: no route named {unknown[0]!r} (the config's "
                              f"routes: {', '.join(sorted(routes)) or 'none'})")
    rpm: int | None = None
    if "rpm" in seen:
        text = seen["rpm"]
        if not re.fullmatch(r"[0-9]{1,6}", text) or not 1 <= int(text) <= MAX_RPM:
            raise ConfigError(f"{where}: rpm={text!r}: a whole number of requests per "
                              f"minute from 1 to {MAX_RPM}")
        rpm = int(text)
    return ClientKey(name, secret, allowed, rpm)


def parse_file(text: str, routes: Collection[str], source: str) -> list[ClientKey]:
    """The keys of a key file's text; `routes` are the config's, which an allow-list
    must name.  `source` names the file in errors."""
    keys: list[ClientKey] = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields: list[str] = []
        for field in line.split():
            if field.startswith("#"):
                break
            fields.append(field)
        if fields:
            keys.append(_key_of_line(fields, number, routes, f"{source}: line {number}"))
    return keys


def combine(groups: Sequence[tuple[str, Sequence[ClientKey]]]) -> KeyRing:
    """One ring of every group's keys, refusing a name or a key given twice (the second
    place is named, by its name, never by the key)."""
    by_name: dict[str, str] = {}
    by_secret: dict[str, str] = {}
    out: list[ClientKey] = []
    for source, keys in groups:
        for key in keys:
            if key.name in by_name:
                raise ConfigError(f"{source}: the name {key.name!r} is taken "
                                  f"(by {by_name[key.name]})")
            if key.secret in by_secret:
                raise ConfigError(f"{source}: key {key.name!r} is the same key as "
                                  f"{by_secret[key.secret]!r}; give each client its own")
            by_name[key.name] = source
            by_secret[key.secret] = key.name
            out.append(key)
    return KeyRing(out)


def read_key_file(path: Path, source: str) -> str:
    """The text of the key file, refused unless only its owner may read it."""
    try:
        with open(path, "rb") as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
            if mode & 0o077:
                raise ConfigError(f"{source}: {path} may be read by others (mode "
                                  f"{mode:04o}); make it the owner's alone: "
                                  f"chmod 600 {path}")
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read {path}: {exc.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: {path} is not UTF-8 text") from None


def key_file_path(config: Config) -> Path | None:
    spec = config.proxy.api_keys_file
    return Path(resolve_path(config, spec)) if spec else None


def load_keys(config: Config, environ: Mapping[str, str], warn: bool = True) -> KeyRing:
    """Every client key of the config's variable and file; empty = no authentication.
    A configured file that is missing, unreadable, too open or malformed is an error,
    as is a file configured while no key is found anywhere (the port would be open).
    `warn`: log that a configured variable is empty and the port is open."""
    groups: list[tuple[str, Sequence[ClientKey]]] = []
    var = config.proxy.api_keys_env
    if var:
        groups.append((f"proxy.api_keys_env (${var})",
                       parse_env(environ.get(var, ""), f"proxy.api_keys_env (${var})")))
    path = key_file_path(config)
    if path is not None:
        source = "proxy.api_keys_file"
        text = read_key_file(path, source)
        groups.append((source, parse_file(text, [r.model for r in config.route],
                                          f"{source} ({path})")))
    ring = combine(groups)
    if not ring and path is not None:
        raise ConfigError(f"proxy.api_keys_file: {path} holds no key"
                          + (f" and ${var} is empty" if var else "")
                          + "; the port would be open to anyone")
    if not ring and var and warn:
        log.warning("auth_off", reason=f"${var} is unset or empty: no client authentication")
    return ring


def cli_key(config: Config, environ: Mapping[str, str]) -> str | None:
    """The key the operator's CLI sends (`sanctum counters`): the first key of the
    variable, else the first of the file; None when the proxy asks for none."""
    keys = load_keys(config, environ, warn=False).keys
    return keys[0].secret if keys else None
