"""Config decoding: typed, strict, and errors that name the key."""

import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from shared.config import (
    Config,
    ConfigError,
    ProxyConfig,
    RouteConfig,
    SeatConfig,
    SeatdConfig,
    load_config,
    parse_config,
    with_port,
)

GOOD = """
[proxy]
listen = "127.0.0.1:8800"

[[seat]]
name = "brain"
model = "models/brain"

[[seat]]
name = "hosted"
kind = "openai"
base_url = "https://example.invalid/v1"
api_key_env = "HOSTED_API_KEY"
upstream_model = "x"
offbox = true

[[route]]
model = "brain"
ladder = ["brain", "hosted"]
offbox = "header"
"""


def test_good_config_decodes_with_defaults() -> None:
    """A valid file decodes into typed structs with documented defaults."""
    c = parse_config(GOOD, base_dir="/etc/sanctum")
    assert c.seat[0].kv == "fp16"
    assert c.seat[0].max_prompt_tokens is None  # derived from the model: shared/caps.py
    assert c.proxy.tokenizer_margin == 64
    assert c.route[0].offbox == "header"
    assert [s.name for s in c.local_seats] == ["brain"]


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (("[proxy]", "[proxy]\nbogus = 1"), "bogus"),
        (('model = "models/brain"', 'model = "models/brain"\nkv = "q4"'), "$.seat[0].kv"),
        (('model = "models/brain"', 'model = "models/brain"\nmax_prompt_tokens = -5'),
         "$.seat[0].max_prompt_tokens"),
        (('ladder = ["brain", "hosted"]', 'ladder = ["brain", "nope"]'), "nope"),
        (('ladder = ["brain", "hosted"]', "ladder = []"), "$.route[0].ladder"),
        (('offbox = "header"', 'offbox = "maybe"'), "$.route[0].offbox"),
        (('listen = "127.0.0.1:8800"', 'listen = "localhost"'), "proxy.listen"),
        (('name = "hosted"', 'name = "brain"'), "duplicate seat name"),
        (('model = "models/brain"', ""), "seat[0] (brain).model"),
        (("[[route]]", "[[route]]\n[[route]]"), "route"),
        # limits past what a seat accepts on the wire (shared/protocol.py)
        (("[proxy]", "[proxy]\nmax_stop = 65"), "$.proxy.max_stop"),
        (("[proxy]", "[proxy]\nmax_stop_chars = 1025"), "$.proxy.max_stop_chars"),
        (("[proxy]", "[proxy]\nmax_completion_tokens = 2147483648"),
         "$.proxy.max_completion_tokens"),
        # a hosted seat's URL is read at start-up, not at its first request
        (('base_url = "https://example.invalid/v1"', 'base_url = "example.invalid/v1"'),
         "seat[1] (hosted).base_url"),
        (('base_url = "https://example.invalid/v1"', 'base_url = "ftp://example.invalid"'),
         "seat[1] (hosted).base_url"),
        (('base_url = "https://example.invalid/v1"', 'base_url = "http://host:port/v1"'),
         "seat[1] (hosted).base_url"),
        (('base_url = "https://example.invalid/v1"', f'base_url = "http://{"a" * 64}.b/v1"'),
         "seat[1] (hosted).base_url"),
    ],
)
def test_bad_config_names_the_key(edit: tuple[str, str], needle: str) -> None:
    """Unknown keys and bad values fail with a message that names the key."""
    text = GOOD.replace(*edit, 1)
    with pytest.raises(ConfigError) as err:
        parse_config(text)
    assert needle in str(err.value)


def test_not_toml() -> None:
    """A file that is not TOML says so."""
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_config("[[seat]\nname=")


def test_packaged_default_config_loads() -> None:
    """`sanctum up` with no config has a valid packaged config with a demo route."""
    c = load_config(None)
    assert any(r.model == "demo" for r in c.route)
    assert c.seat[0].model == "builtin:demo"


def test_port_override() -> None:
    """--port replaces only the port of proxy.listen."""
    c = with_port(parse_config(GOOD), 9123)
    assert c.proxy.listen == "127.0.0.1:9123"


def test_example_config_loads() -> None:
    """deploy/example.toml, which documents every option, is itself valid."""
    from pathlib import Path

    example = Path(__file__).parent.parent / "deploy" / "example.toml"
    c = load_config(example)
    assert c.seat[0].drafter is not None and c.seat[0].kv == "fp16"


EXAMPLE = Path(__file__).parent.parent / "deploy" / "example.toml"
# Options of one seat kind only (the rest apply to both).
HOSTED_ONLY = {"base_url", "api_key_env", "upstream_model", "offbox", "connect_timeout_s",
               "total_timeout_s", "max_attempts", "backoff_initial_s", "backoff_max_s",
               "retry_after_max_s", "upstream_fields", "prefill"}
LOCAL_ONLY = {"model", "drafter", "kv", "compute_dtype", "speculation", "draft_depth",
              "memory_budget_mb", "prompt_cache_mb", "max_batch", "kv_budget_mb",
              "max_queued", "queue_timeout_s", "trust_remote_code", "endpoint", "remote",
              "curve_cert", "curve_clients", "load", "keep_alive_s"}
# Values the example sets on purpose, not being the default: its hosted rung is off the
# box, and its route shows the opt-in header.
CHOSEN = {("seat", "offbox"): True, ("route", "offbox"): "header"}


def _sections(text: str) -> list[tuple[str, set[str]]]:
    """(table, keys named in a comment as `# key = ...`) for each table, in order."""
    out: list[tuple[str, set[str]]] = []
    for line in text.splitlines():
        head = re.match(r"^\[\[?(\w+)\]\]?", line)
        if head:
            out.append((head.group(1), set()))
            continue
        named = re.match(r"^#\s*(\w+)\s*=", line)
        if named and out:
            out[-1][1].add(named.group(1))
    return out


def _defaults(kind: type[msgspec.Struct]) -> dict[str, Any]:
    """Every field that has a default, with it."""
    info = msgspec.inspect.type_info(kind)
    assert isinstance(info, msgspec.inspect.StructType)
    return {f.name: f.default for f in info.fields
            if f.default is not msgspec.inspect.NODEFAULT}


def test_example_states_every_default_exactly() -> None:
    """deploy/example.toml names every option that has a default, in the table it belongs
    to (a seat's in a seat of a kind it applies to), and every value it states is the
    code's default (a seat's timeouts: its kind's); an option whose default is unset
    appears as a commented line.  So the example cannot drift from the code."""
    text = EXAMPLE.read_text()
    raw = tomllib.loads(text)
    load_config(EXAMPLE)
    comments = _sections(text)
    named: dict[str, set[str]] = {}
    seat_i = route_i = 0
    for table, commented in comments:
        if table == "seat":
            seat = raw["seat"][seat_i]
            kind = seat.get("kind", "mlx")
            named.setdefault(f"seat:{kind}", set()).update(seat, commented)
            for key, value in seat.items():
                default = _defaults(SeatConfig).get(key)
                if key in ("first_token_timeout_s", "stall_timeout_s"):
                    default = _kind_default(kind, key)
                if key == "kind" or default is None or CHOSEN.get(("seat", key)) == value:
                    continue  # the kind picks the defaults; None: no default to state
                assert value == default, f"seat {seat['name']}.{key} = {value!r}, code {default!r}"
            seat_i += 1
        elif table == "route":
            route = raw["route"][route_i]
            named.setdefault("route", set()).update(route, commented)
            for key, value in route.items():
                default = _defaults(RouteConfig).get(key)
                if default is None or CHOSEN.get(("route", key)) == value:
                    continue
                assert value == default, f"route.{key} = {value!r}, code {default!r}"
            route_i += 1
        else:
            named.setdefault(table, set()).update(raw[table], commented)
            struct = {"proxy": ProxyConfig, "seatd": SeatdConfig}[table]
            for key, value in raw[table].items():
                default = _defaults(struct)[key]
                assert value == default, f"{table}.{key} = {value!r}, code {default!r}"
    for table, struct in (("proxy", ProxyConfig), ("seatd", SeatdConfig),
                          ("route", RouteConfig)):
        missing = set(_defaults(struct)) - named[table]
        assert not missing, f"[{table}] does not name {sorted(missing)}"
    seat_fields = set(_defaults(SeatConfig))
    for kind, only_other in (("mlx", HOSTED_ONLY), ("openai", LOCAL_ONLY)):
        missing = seat_fields - only_other - named[f"seat:{kind}"] - {"kind"}
        assert not missing, f"no {kind} seat names {sorted(missing)}"
    assert set(_defaults(Config)) - {"base_dir"} == {"proxy", "seatd"}


def _kind_default(kind: str, key: str) -> float:
    """A seat timeout's default for its kind, read through the config itself."""
    seat = SeatConfig(name="x", kind=kind, model="m" if kind == "mlx" else None)  # type: ignore[arg-type]
    return seat.first_token_s if key == "first_token_timeout_s" else seat.stall_s


@pytest.mark.parametrize(("kind", "first_token", "stall"), [("mlx", 120.0, 30.0),
                                                           ("openai", 10.0, 15.0)])
def test_seat_timeouts_default_by_kind(kind: str, first_token: float, stall: float) -> None:
    """A hosted rung fails over a silent provider within 10 s (a fallback then still
    lands inside a client's 15 s) and a stalled one within 15 s; a local seat
    gives a long prompt's prefill two minutes.  A configured value wins either way."""
    seat = SeatConfig(name="x", kind=kind)  # type: ignore[arg-type]
    assert (seat.first_token_s, seat.stall_s) == (first_token, stall)
    set_ = SeatConfig(name="x", kind=kind, first_token_timeout_s=3.0,  # type: ignore[arg-type]
                      stall_timeout_s=2.0)
    assert (set_.first_token_s, set_.stall_s) == (3.0, 2.0)
