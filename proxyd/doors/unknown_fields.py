"""Unknown keys anywhere in a request body, with their paths: `messages[0].frobnicate`,
`tools[1].function.strict_mode`, `stream_options.foo`.

A door's body is read leniently (an API's clients send fields it does not know), and
every key it ignores is named in X-Sanctum-Ignored and counted, never dropped without a
word.  The top-level ones are found at no cost (`proxyd.doors.door.decode_body`); this
walks the body's JSON beside its Struct's type to find the ones inside it:

    unknown_paths(value, Kind, opaque) -> [path]

A key is unknown where the type at its place is a Struct that lacks it (a tagged
union's tag excepted); maps (`logit_bias`, `metadata`, a schema) hold data, not fields,
and are not walked, nor are raw values, nor an object `opaque(path, object)` says the
door passes over whole (a tool OpenAI's servers run, a block of a type it drops: their
fields are their type's, and the door names or refuses them as one).  Pure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import inspect as mi

_SEQUENCES = (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)


@functools.cache
def _info(kind: type[msgspec.Struct]) -> mi.Type:
    return mi.type_info(kind)


Opaque = Callable[[str, dict[str, Any]], bool]


def unknown_paths(value: Any, kind: type[msgspec.Struct],
                  opaque: Opaque = lambda path, value: False) -> list[str]:
    """The paths of the keys inside `value` (below its top level) that `kind` does not
    know."""
    out: list[str] = []
    info = _info(kind)
    if isinstance(info, mi.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f for f in info.fields}
        for key, item in value.items():
            if key in fields:
                _walk(item, fields[key].type, key, out, opaque)
    return out


def _walk(value: Any, t: mi.Type, path: str, out: list[str], opaque: Opaque) -> None:
    if isinstance(t, mi.StructType):
        if not isinstance(value, dict) or opaque(path, value):
            return
        fields = {f.encode_name: f for f in t.fields}
        for key, item in value.items():
            where = f"{path}.{key}"
            if key in fields:
                _walk(item, fields[key].type, where, out, opaque)
            elif key != t.tag_field:
                out.append(where)
    elif isinstance(t, _SEQUENCES):
        if isinstance(value, list):
            for i, item in enumerate(value):
                _walk(item, t.item_type, f"{path}[{i}]", out, opaque)
    elif isinstance(t, mi.UnionType):
        member = _member(value, t)
        if member is not None:
            _walk(value, member, path, out, opaque)


def _member(value: Any, t: mi.UnionType) -> mi.Type | None:
    """The union's member a value of this shape was read as (a tagged Struct by its tag)."""
    for member in t.types:
        if isinstance(value, dict) and isinstance(member, mi.StructType):
            if member.tag_field is None or value.get(member.tag_field) == member.tag:
                return member
        if isinstance(value, list) and isinstance(member, _SEQUENCES):
            return member
    return None
