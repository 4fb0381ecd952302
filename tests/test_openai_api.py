"""OpenAI request validation: bad input is a 400 naming the field."""

import json
from typing import Any

import pytest

from proxyd.doors import openai_api
from proxyd.doors.door import validation_param
from proxyd.doors.openai_api import DEFAULT_MAX_TOKENS
from shared.config import ProxyConfig
from shared.errors import BadRequest

DEFAULTS = ProxyConfig()


def parse_chat(body: bytes) -> tuple:
    return openai_api.parse_chat(body, DEFAULTS)


def parse_completion(body: bytes) -> tuple:
    return openai_api.parse_completion(body, DEFAULTS)


def chat(**kw) -> bytes:
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    body.update(kw)
    return json.dumps(body).encode()


def test_defaults_and_fields() -> None:
    """Sampling fields map onto SamplingParams; a string stop becomes a tuple."""
    _req, messages, p = parse_chat(chat(temperature=0, top_p=0.5, top_k=20, max_tokens=9,
                                       stop="\n", seed=4))
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop, p.seed) == \
        (0.0, 0.5, 20, 9, ("\n",), 4)
    assert messages[0].content == "hi"
    _, _, d = parse_chat(chat())
    assert d.max_tokens == DEFAULT_MAX_TOKENS and d.temperature == 1.0


def test_content_parts_are_joined() -> None:
    """Text content parts are accepted as one string."""
    body = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]}])
    assert parse_chat(body)[1][0].content == "ab"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"", "body"),
        (b"{not json", "body"),
        (b"[]", "body"),
        (b"[" * 100_000 + b"]" * 100_000, "body"),
        (chat()[:-1] + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
        (chat(temperature=2.5), "temperature"),
        (chat(temperature="hot"), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(max_tokens=-1), "max_tokens"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(top_k=-3), "top_k"),
        (chat(n=2), "n"),
        (chat(stop=["s"] * (DEFAULTS.max_stop + 1)), "stop"),
        (chat(stop=["a", ""]), "stop[1]"),
        (chat(stop=""), "stop"),
        (chat(seed=2**63), "seed"),
        (chat(seed=-(2**63) - 1), "seed"),
        (chat(messages=[]), "messages"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
         "messages[0].content[0].type"),
        (chat(messages=[{"role": "user", "content": [1]}]), "messages[0].content[0]"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "model"),
        (chat(messages=[{"role": "user"}, {"content": "x"}]), "messages[1].role"),
        (chat(tools=[1]), "tools[0]"),
        (chat(response_format="json"), "response_format"),
    ],
)
def test_bad_chat_requests(body: bytes, param: str | None) -> None:
    """Each malformed request is a 400 in the OpenAI error shape, naming its field."""
    with pytest.raises(BadRequest) as err:
        parse_chat(body)
    shape = err.value.body()["error"]
    assert err.value.status == 400
    assert shape["type"] == "invalid_request_error" and shape["message"]
    if param is not None:
        assert shape["param"] == param


def test_completion_prompt_forms() -> None:
    """A completion prompt may be a string or a one-element list."""
    assert parse_completion(b'{"model":"demo","prompt":"x"}')[1] == "x"
    assert parse_completion(b'{"model":"demo","prompt":["y"]}')[1] == "y"
    with pytest.raises(BadRequest):
        parse_completion(b'{"model":"demo","prompt":["a","b"]}')
    with pytest.raises(BadRequest):
        parse_completion(b'{"model":"demo","prompt":""}')


def test_sanctum_overrides_reach_the_generate_fields() -> None:
    """`sanctum.prompt_cache: false` (with kv, speculation, a pinned draft depth and a row
    of its own) becomes Generate fields; a depth out of 0..16 is a 400 naming it."""
    from proxyd.doors.openai_api import overrides

    body = (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}],'
            b' "sanctum": {"prompt_cache": false, "kv": "q8", "draft_depth": 4, "solo": true}}')
    req, _, _ = parse_chat(body)
    assert overrides(req) == {"kv": "q8", "speculation": None, "prompt_cache": False,
                              "draft_depth": 4, "solo": True,
                              "keep_alive_s": None}
    with pytest.raises(BadRequest) as unknown:
        parse_chat(body.replace(b"prompt_cache", b"prompt_cash"))
    assert unknown.value.param == "sanctum.prompt_cash"
    with pytest.raises(BadRequest) as bad:
        parse_chat(body.replace(b'"draft_depth": 4', b'"draft_depth": 17'))
    assert bad.value.param == "sanctum.draft_depth"


@pytest.mark.parametrize(("message", "param"), [
    ("Expected `int` >= 1 - at `$.max_tokens`", "max_tokens"),
    ("Invalid enum value 'wizard' - at `$.messages[0].role`", "messages[0].role"),
    ("Object missing required field `model`", "model"),
    ("Object missing required field `role` - at `$.messages[3]`", "messages[3].role"),
    ("Object contains unknown field `x` - at `$.sanctum`", "sanctum.x"),
    ("Expected `object`, got `array`", "body"),
    ("Expected `object`, got `int` - at `$`", "body"),
])
def test_validation_param_names_the_path(message: str, param: str) -> None:
    """msgspec's `$.a[0].b` path (and a missing field's name) becomes `param`."""
    assert validation_param(message) == param


def test_seed_takes_the_whole_int64_range() -> None:
    """A seed is any 64-bit signed integer, both ends included."""
    assert parse_chat(chat(seed=2**63 - 1))[2].seed == 2**63 - 1
    assert parse_chat(chat(seed=-(2**63)))[2].seed == -(2**63)


@pytest.mark.parametrize(("prompt", "want"), [
    ([5, 6, 7], ("", (5, 6, 7))), ([[5, 6]], ("", (5, 6))), (["hi"], ("hi", None)),
    ("hi", ("hi", None)),
])
def test_a_completion_prompt_may_be_token_ids(prompt: Any, want: tuple[str, Any]) -> None:
    from proxyd.doors.openai_api import read_completion

    done = read_completion(json.dumps({"model": "m", "prompt": prompt}).encode(), ProxyConfig())
    assert (done.prompt, done.prompt_ids) == want
    assert done.generate("r").prompt_ids == want[1]


@pytest.mark.parametrize(("prompt", "param"), [
    ([5, -1], "prompt[1]"), ([5, 2**40], "prompt[1]"), ([5, "x"], "prompt[1]"),
    ([5, True], "prompt[1]"), ([[5], [6]], "prompt"), ([], "prompt"), ([["a"]], "prompt[0]"),
])
def test_a_bad_prompt_of_token_ids_is_a_400_naming_it(prompt: Any, param: str) -> None:
    from proxyd.doors.openai_api import read_completion

    with pytest.raises(BadRequest) as exc:
        read_completion(json.dumps({"model": "m", "prompt": prompt}).encode(), ProxyConfig())
    assert exc.value.param == param, exc.value
