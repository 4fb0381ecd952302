"""Reading one HTTP/1.1 response from the bytes of a connection: pure, no I/O.

    p = ResponseParser()
    p.feed(data)            whatever arrived, split anywhere; raises BadResponse
    p.head                  the Head once its blank line arrived, else None
    p.take()                the body's bytes decoded so far (framing removed)
    p.done                  the body is complete (by length, by its last chunk)
    p.end()                 the peer closed: completes a body read to the close,
                            raises Cut for one that was promised longer
    p.reusable              done, keep-alive, and not one byte beyond the response

Framing (RFC 9112 section 6): no body for 1xx (skipped: a final response follows),
204 and 304; `Transfer-Encoding: chunked`; `Content-Length`; else the body runs
to the close.  A `Content-Encoding` of gzip or deflate is decoded (the client
never asks for one, but an upstream may send it anyway).  The shell that owns
the socket (proxyd/upstream_http.py) feeds it and reads from it.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

HEAD_MAX = 64 * 1024  # status line and headers together
CHUNK_LINE_MAX = 4096  # a chunk-size line, extensions included
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")


class BadResponse(ValueError):
    """Bytes that are not an HTTP/1.x response as this parser reads it."""


class Cut(ConnectionError):
    """The connection closed before the body it promised was complete."""


@dataclass(frozen=True)
class Head:
    status: int
    reason: str
    headers: dict[str, str]  # names in lower case; repeated fields joined by ", "
    keep_alive: bool

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()


def parse_head(raw: bytes) -> Head:
    """The status line and header fields, without the blank line that ends them."""
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isascii() \
            or not code.isdigit():
        raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise BadResponse(f"a malformed header line: {line[:80]!r}")
        name, value = name.lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    tokens = {t.strip() for t in headers.get("connection", "").lower().split(",")}
    keep_alive = "keep-alive" in tokens if version == "HTTP/1.0" else "close" not in tokens
    return Head(int(code), reason, headers, keep_alive)


# How the body ends.
_NONE, _LENGTH, _CHUNKED, _CLOSE = "none", "length", "chunked", "close"
# Where a chunked body's reader stands.
_SIZE, _DATA, _DATA_END, _TRAILER = "size", "data", "data_end", "trailer"


class ResponseParser:
    def __init__(self) -> None:
        self.head: Head | None = None
        self.done = False
        self._raw = bytearray()  # bytes not yet parsed (head, chunk framing)
        self._body = bytearray()  # decoded body bytes not yet taken
        self._framing = _NONE
        self._left = 0  # bytes still due: of the body (length) or of a chunk (chunked)
        self._chunk = _SIZE
        self._extra = False  # bytes arrived past the end of the response
        self._inflate: zlib._Decompress | None = None
        self._compressed = False  # a compressed byte arrived

    @property
    def reusable(self) -> bool:
        return (self.done and not self._extra and self._framing != _CLOSE
                and self.head is not None and self.head.keep_alive)

    @property
    def buffered(self) -> int:
        return len(self._body)

    def take(self) -> bytes:
        data = bytes(self._body)
        self._body.clear()
        return data

    def feed(self, data: bytes) -> None:
        if self.done:
            self._extra = self._extra or bool(data)
            return
        if self.head is None:
            self._raw += data
            self._read_head()
            if self.head is None or self.done:
                self._extra = self._extra or (bool(self._raw) and self.done)
                return
            data, self._raw = bytes(self._raw), bytearray()
        if self._framing == _LENGTH:
            body, rest = data[:self._left], data[self._left:]
            self._left -= len(body)
            self._add(body)
            if self._left == 0:
                self._finish()
                self._extra = bool(rest)
        elif self._framing == _CLOSE:
            self._add(data)
        else:
            self._raw += data
            self._read_chunks()

    def end(self) -> None:
        """The peer closed the connection."""
        if self.done:
            return
        if self.head is None:
            raise Cut("closed before the response's head")
        if self._framing != _CLOSE:
            raise Cut("closed before the end of the response's body")
        self._finish()

    # -- inside ---------------------------------------------------------------

    def _read_head(self) -> None:
        while self.head is None:
            at = self._raw.find(b"\r\n\r\n")
            if at < 0:
                if len(self._raw) > HEAD_MAX:
                    raise BadResponse(f"a response head over {HEAD_MAX} bytes")
                return
            if at > HEAD_MAX:
                raise BadResponse(f"a response head over {HEAD_MAX} bytes")
            head = parse_head(bytes(self._raw[:at]))
            del self._raw[:at + 4]
            if head.status == 101:
                raise BadResponse("a switch of protocols nobody asked for")
            if 100 <= head.status < 200:
                continue  # an interim response: the final one follows
            self._frame(head)  # raises before the head is taken for an answer
            self.head = head

    def _frame(self, head: Head) -> None:
        encoding = head.headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("gzip", "x-gzip", "deflate"):
            self._inflate = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header
        elif encoding not in ("", "identity"):
            raise BadResponse(f"a content-encoding this client cannot read: {encoding}")
        transfer = head.headers.get("transfer-encoding", "").strip().lower()
        length = head.headers.get("content-length")
        if head.status in (204, 304):
            self._finish()
        elif transfer:
            if transfer != "chunked":
                raise BadResponse(f"a transfer-encoding this client cannot read: {transfer}")
            self._framing = _CHUNKED
        elif length is not None:
            if not (length.strip().isascii() and length.strip().isdigit()):
                raise BadResponse(f"a bad content-length: {length[:40]!r}")
            self._framing, self._left = _LENGTH, int(length)
            if self._left == 0:
                self._finish()
        else:
            self._framing = _CLOSE

    def _read_chunks(self) -> None:
        # Parsed from an offset, the bytes consumed cut off once at the end: a response
        # of many small chunks costs no copy of the rest per chunk.
        raw = self._raw
        pos = 0
        try:
            while not self.done:
                if self._chunk == _DATA:
                    if pos == len(raw):
                        return
                    take = min(self._left, len(raw) - pos)
                    self._add(bytes(raw[pos:pos + take]))
                    pos += take
                    self._left -= take
                    if self._left:
                        return
                    self._chunk = _DATA_END
                    continue
                at = raw.find(b"\r\n", pos)
                if at < 0:
                    if len(raw) - pos > CHUNK_LINE_MAX:
                        raise BadResponse(f"a chunk line over {CHUNK_LINE_MAX} bytes")
                    return
                line = bytes(raw[pos:at])
                pos = at + 2
                if self._chunk == _DATA_END:
                    if line:
                        raise BadResponse("a chunk longer than its size")
                    self._chunk = _SIZE
                elif self._chunk == _SIZE:
                    size = line.split(b";", 1)[0].strip()
                    if not _HEX.fullmatch(size):
                        raise BadResponse(f"a bad chunk size: {line[:40]!r}")
                    self._left = int(size, 16)
                    self._chunk = _DATA if self._left else _TRAILER
                elif not line:  # _TRAILER: a blank line ends the trailer fields
                    self._finish()
                    self._extra = pos < len(raw)
        finally:
            del raw[:pos]

    def _add(self, data: bytes) -> None:
        if self._inflate is not None and data:
            self._compressed = True
            try:
                data = self._inflate.decompress(data)
            except zlib.error as exc:
                raise BadResponse(f"a body that does not decompress: {exc}") from None
        self._body += data

    def _finish(self) -> None:
        if self._inflate is not None:
            try:
                self._body += self._inflate.flush()
            except zlib.error as exc:
                raise BadResponse(f"a body that does not decompress: {exc}") from None
            if self._compressed and not self._inflate.eof:
                raise BadResponse("a compressed body cut short")
        self.done = True
