"""Config decoding: typed, strict, and errors that name the key."""

import pytest

from shared.config import ConfigError, load_config, parse_config, with_port

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
    assert c.seat[0].drafter is not None and c.seat[0].kv == "q8"
