"""Client keys (proxyd/keys.py): the variable and the file parsed into named keys, every
bad line a clear error that never holds the key, a too-open file refused, and a key
found by comparing it with every key."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import pytest

from proxyd import keys as keys_mod
from proxyd.keys import ClientKey, KeyRing, cli_key, combine, load_keys, parse_env, parse_file
from shared.config import Config, ConfigError, parse_config

ROUTES = ("brain", "coder", "open")
SECRET = "sk-live-Qm9vYmFyYmF6cXV4"


def config(tmp: Path, env: str | None = "SANCTUM_TEST_KEYS", file: str | None = None) -> Config:
    proxy = "[proxy]\n"
    if env:
        proxy += f'api_keys_env = "{env}"\n'
    if file:
        proxy += f'api_keys_file = "{file}"\n'
    seats = "".join(f'[[seat]]\nname = "{r}"\nmodel = "m"\n[[route]]\nmodel = "{r}"\n'
                    f'ladder = ["{r}"]\n' for r in ROUTES)
    return parse_config(proxy + seats, base_dir=str(tmp))


def key_file(tmp: Path, text: str, mode: int = 0o600, name: str = "keys") -> Path:
    path = tmp / name
    path.write_text(text)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize(("raw", "expected"), [
    ("", []),
    ("a1", [ClientKey("env-1", "a1")]),
    (" a1 , b2,", [ClientKey("env-1", "a1"), ClientKey("env-2", "b2")]),
    (",,a1,,b2", [ClientKey("env-1", "a1"), ClientKey("env-2", "b2")]),
])
def test_env_keys_are_named_in_order(raw: str, expected: list[ClientKey]) -> None:
    """Comma-separated keys, each a key of its own that may use every route at any
    rate, named env-1, env-2, ... in order; empty parts are skipped."""
    assert parse_env(raw, "$V") == expected


def test_an_env_key_with_a_character_no_header_carries_is_refused_unnamed() -> None:
    """A key with a space or a non-ASCII character is an error naming its position."""
    with pytest.raises(ConfigError, match=r"\$V: key 2 has a character") as err:
        parse_env("good1,bad key\u00e9", "$V")
    assert "bad" not in str(err.value)


@pytest.mark.parametrize(("text", "expected"), [
    ("", []),
    ("# only a comment\n\n   \n", []),
    (f"{SECRET}\n", [ClientKey("file-1", SECRET)]),
    (f"\n# c\n{SECRET} name=laptop\n", [ClientKey("laptop", SECRET)]),
    (f"{SECRET} routes=brain,coder rpm=30 name=ci  # the CI runner\n",
     [ClientKey("ci", SECRET, ("brain", "coder"), 30)]),
    (f"  {SECRET}   rpm=1\n", [ClientKey("file-1", SECRET, (), 1)]),
    (f"{SECRET} routes=open,open,\n", [ClientKey("file-1", SECRET, ("open",))]),
    (f"{SECRET}#not-a-comment\n", [ClientKey("file-1", SECRET + "#not-a-comment")]),
    (f"a1 name=x\nb2\n{SECRET} rpm=10000\n",
     [ClientKey("x", "a1"), ClientKey("file-2", "b2"), ClientKey("file-3", SECRET, (), 10000)]),
])
def test_file_lines(text: str, expected: list[ClientKey]) -> None:
    """One key per line with optional name, routes and rpm in any order; comments (a
    whole line, or from a field that starts with #) and blank lines are ignored; an
    unnamed key is named after its line."""
    assert parse_file(text, ROUTES, "F") == expected


@pytest.mark.parametrize(("line", "message"), [
    (f"{SECRET} {SECRET[:8]}", "field 2 is not name=, routes= or rpm="),
    (f"{SECRET} name=a {SECRET[4:12]}=x", "field 3 is not name=, routes= or rpm="),
    (f"{SECRET} name=a name=b", "name= given twice"),
    (f"{SECRET} name=", "name='': a name is 1 to 64"),
    (f"{SECRET} name=a/b", "name='a/b': a name is 1 to 64"),
    (f"{SECRET} routes=", "routes= names no route"),
    (f"{SECRET} routes=brain,nope", "no route named 'nope'"),
    (f"{SECRET} rpm=0", "rpm='0': a whole number"),
    (f"{SECRET} rpm=-3", "rpm='-3': a whole number"),
    (f"{SECRET} rpm=2.5", "rpm='2.5': a whole number"),
    (f"{SECRET} rpm=10001", "rpm='10001': a whole number"),
    (f"{SECRET} rpm=\u00b2", "rpm='\u00b2': a whole number"),
    ("name=a " + SECRET, "the line starts with an option"),
    (SECRET + "\u00e9", "a character an HTTP header cannot carry"),
    (SECRET + ",x", "a character an HTTP header cannot carry"),
])
def test_a_bad_line_names_its_number_never_the_key(line: str, message: str) -> None:
    """Each malformed line is an error naming the file and the line number, and no part
    of the key (nor a stray field, which may be a piece of it) is in the message."""
    with pytest.raises(ConfigError) as err:
        parse_file(f"# keys\nok1\n{line}\n", ROUTES, "F")
    text = str(err.value)
    assert text.startswith("F: line 3: ") and message in text
    for piece in (SECRET, SECRET[:8], SECRET[4:12], SECRET[-8:]):
        assert piece not in text


def test_combine_refuses_a_name_or_a_key_given_twice() -> None:
    """The same name twice, or the same key under two names, is an error that names the
    keys by name only."""
    env = [ClientKey("env-1", SECRET)]
    with pytest.raises(ConfigError, match="the name 'env-1' is taken") as err:
        combine([("E", env), ("F", [ClientKey("env-1", "other")])])
    assert SECRET not in str(err.value)
    with pytest.raises(ConfigError, match="key 'laptop' is the same key as 'env-1'") as err:
        combine([("E", env), ("F", [ClientKey("laptop", SECRET)])])
    assert SECRET not in str(err.value)
    ring = combine([("E", env), ("F", [ClientKey("laptop", "other")])])
    assert [k.name for k in ring.keys] == ["env-1", "laptop"]


def test_find_compares_with_every_key_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The right key is found, a wrong one (a prefix, a longer one, empty) is not, and
    every lookup makes one comparison per key of equal-length digests: no early exit
    that depends on which key matched, nor on a key's length."""
    ring = KeyRing([ClientKey("a", "k-alpha-1"), ClientKey("b", "k-beta-22"),
                    ClientKey("c", "k-gamma-333")])
    seen: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(keys_mod.hmac, "compare_digest", counting)
    for presented, name in [("k-alpha-1", "a"), ("k-beta-22", "b"), ("k-gamma-333", "c"),
                            ("k-alpha-", None), ("k-alpha-1x", None), ("", None),
                            ("K-ALPHA-1", None)]:
        seen.clear()
        found = ring.find(presented)
        assert (found.name if found else None) == name
        assert seen == [(32, 32)] * 3
    assert "k-alpha-1" not in repr(ring.keys[0]) and "a" in repr(ring.keys[0])


def test_load_keys_joins_the_variable_and_the_file(tmp_path: Path) -> None:
    """Keys of the variable and of the file (relative to the config's folder) together."""
    key_file(tmp_path, f"{SECRET} name=ci routes=brain rpm=5\n")
    ring = load_keys(config(tmp_path, file="keys"), {"SANCTUM_TEST_KEYS": "e1,e2"})
    assert ring.keys == (ClientKey("env-1", "e1"), ClientKey("env-2", "e2"),
                         ClientKey("ci", SECRET, ("brain",), 5))


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666, 0o620])
def test_a_key_file_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    """A key file with any group or world permission is refused, saying which mode it
    has and which to set; 0600 and 0400 are accepted."""
    path = key_file(tmp_path, f"{SECRET}\n", mode)
    with pytest.raises(ConfigError) as err:
        load_keys(config(tmp_path, env=None, file="keys"), {})
    assert f"(mode {mode:04o})" in str(err.value) and f"chmod 600 {path}" in str(err.value)
    assert SECRET not in str(err.value)
    for ok in (0o600, 0o400):
        os.chmod(path, ok)
        assert len(load_keys(config(tmp_path, env=None, file="keys"), {})) == 1


def test_a_missing_or_empty_key_file_is_an_error(tmp_path: Path) -> None:
    """A configured key file that is not there, or that holds no key while the variable
    is empty too, stops the proxy from starting open."""
    with pytest.raises(ConfigError, match=r"cannot read .*keys"):
        load_keys(config(tmp_path, file="keys"), {})
    key_file(tmp_path, "# nobody yet\n")
    with pytest.raises(ConfigError, match=r"holds no key and \$SANCTUM_TEST_KEYS is empty"):
        load_keys(config(tmp_path, file="keys"), {})
    assert len(load_keys(config(tmp_path, file="keys"), {"SANCTUM_TEST_KEYS": "e1"})) == 1


def test_no_key_configured_is_no_authentication(tmp_path: Path) -> None:
    """No variable and no file, or a variable that is unset: an empty ring."""
    assert not load_keys(config(tmp_path, env=None), {})
    assert not load_keys(config(tmp_path), {})


def test_cli_key_is_the_first_key(tmp_path: Path) -> None:
    """The CLI sends the variable's first key, else the file's first; None without keys."""
    key_file(tmp_path, f"{SECRET} name=ops\nother\n")
    with_file = config(tmp_path, file="keys")
    assert cli_key(with_file, {"SANCTUM_TEST_KEYS": " e1 ,e2"}) == "e1"
    assert cli_key(with_file, {}) == SECRET
    assert cli_key(config(tmp_path), {}) is None
