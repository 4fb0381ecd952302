"""proxyd/http1.py: one HTTP/1.1 response read from bytes split anywhere."""

from __future__ import annotations

import gzip
import itertools
import zlib

import pytest

from proxyd.http1 import BadResponse, Cut, ResponseParser, parse_head

CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n"
           b"8;ext=1\r\ndata: a\n\r\n"
           b"A\r\ndata: bcd\n\r\n"
           b"0\r\nX-Trailer: t\r\n\r\n")
LENGTH = b"HTTP/1.1 429 Too Many\r\nretry-after: 2\r\nContent-Length: 5\r\n\r\nhello"


def read(raw: bytes, cuts: list[int], close: bool = False) -> tuple[ResponseParser, bytes]:
    """Feed `raw` split at `cuts`; the parser and every body byte taken."""
    p = ResponseParser()
    body = b""
    edges = [0, *cuts, len(raw)]
    for a, b in itertools.pairwise(edges):
        p.feed(raw[a:b])
        body += p.take()
    if close:
        p.end()
        body += p.take()
    return p, body


@pytest.mark.parametrize("raw, body, status, reusable", [
    (CHUNKED, b"data: a\ndata: bcd\n", 200, True),
    (LENGTH, b"hello", 429, True),
    (b"HTTP/1.1 204 No Content\r\n\r\n", b"", 204, True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", b"", 200, True),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", b"ok", 200, False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok", 200, False),
    (b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 2\r\n\r\nok", b"ok", 200,
     True),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok", 200,
     True),
    # bytes past the end: the connection is out of step and must not be reused
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA", b"ok", 200, False),
    (CHUNKED + b"X", b"data: a\ndata: bcd\n", 200, False),
])
def test_a_response_split_at_every_byte_reads_the_same(raw: bytes, body: bytes, status: int,
                                                        reusable: bool) -> None:
    """Wherever the bytes are split (one cut, or every byte alone), the same head and body."""
    splits = [[k] for k in range(1, len(raw))] + [list(range(1, len(raw)))]
    for cuts in splits:
        p, got = read(raw, cuts)
        assert p.head is not None and p.head.status == status, cuts
        assert got == body, cuts
        assert p.done and p.reusable == reusable, cuts


def test_a_body_without_length_runs_to_the_close() -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"a\": 1}"
    p, body = read(raw, [20, 60])
    assert not p.done and body == b'{"a": 1}'
    p.end()
    assert p.done and not p.reusable
    assert p.head is not None and p.head.content_type == "application/json"


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf",
    CHUNKED[:-12],  # within the last chunk's framing
    CHUNKED[:60],
    b"HTTP/1.1 200 OK\r\nContent-Len",  # within the head
    b"",
])
def test_a_close_before_the_promised_end_is_a_cut(raw: bytes) -> None:
    p = ResponseParser()
    p.feed(raw)
    with pytest.raises(Cut):
        p.end()
    assert not p.done


# Heads refused whole: no head is ever taken for an answer.
BAD_HEADS = [
    b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    b"HTTP/1.1 2xx OK\r\n\r\n",
    "HTTP/1.1 \u00b200 OK\r\n\r\n".encode("latin-1"),  # a digit, but not an ASCII one
    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n folded: value\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000,
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
    # heads whose body cannot be read
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 1\r\n\r\nx",
]
# Good heads over bodies that go wrong.
BAD_BODIES = [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x10\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 5000,
    b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabc",
]


@pytest.mark.parametrize(("raw", "head_taken"),
                         [(r, False) for r in BAD_HEADS] + [(r, True) for r in BAD_BODIES])
def test_what_is_not_http_is_a_bad_response(raw: bytes, head_taken: bool) -> None:
    """Refused; a head is taken for an answer only where its body's framing could be read
    (the fault is then inside the body), never for one whose body cannot be."""
    p = ResponseParser()
    with pytest.raises(BadResponse):
        p.feed(raw)
    assert not p.done and (p.head is not None) == head_taken


@pytest.mark.parametrize("compress", [gzip.compress, zlib.compress])
def test_a_compressed_body_is_decoded(compress: object) -> None:
    assert callable(compress)
    data = compress(b"data: {}\n\n" * 50)
    raw = (b"HTTP/1.1 200 OK\r\nContent-Encoding: %s\r\nContent-Length: %d\r\n\r\n"
           % (b"gzip" if compress is gzip.compress else b"deflate", len(data))) + data
    p, body = read(raw, list(range(40, len(raw), 7)))
    assert p.done and body == b"data: {}\n\n" * 50


def test_header_fields_lower_case_and_repeated_fields_join() -> None:
    head = parse_head(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 3\r\n"
                      b"Set-Cookie: a\r\nset-cookie: b\r\nContent-Type: Application/JSON; x=1")
    assert head.status == 503 and head.reason == "Service Unavailable"
    assert head.headers["retry-after"] == "3"
    assert head.headers["set-cookie"] == "a, b"
    assert head.content_type == "application/json"
    assert head.keep_alive
