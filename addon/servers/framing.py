"""How an upstream response's body is framed, decoded in bulk: chunked, by its length, or
to the connection's close."""

from __future__ import annotations


class UpstreamError(Exception):
    """The upstream could not be reached or broke the HTTP exchange."""


class ChunkedBody:
    """Decodes a chunked body in bulk: one pass per read, not one Python event per chunk
    (llama-server sends every token as its own chunk)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._left = 0  # bytes of chunk data still to come
        self._crlf = False  # a chunk's closing CRLF still to come
        self.complete = False

    def feed(self, data: bytes) -> bytes:
        if not (self._buffer or self._left or self._crlf) and (whole := _one_chunk(data)):
            return whole  # a server writing each token as its own chunk, read as written
        buffer = self._buffer + data if self._buffer else data
        out: list[bytes] = []
        pos, end = 0, len(buffer)
        while pos < end and not self.complete:
            if self._left:
                take = min(self._left, end - pos)
                out.append(buffer[pos : pos + take])
                pos += take
                self._left -= take
                self._crlf = not self._left
            elif self._crlf:
                if end - pos < 2:
                    break
                if buffer[pos : pos + 2] != b"\r\n":
                    raise UpstreamError("broken HTTP from upstream: bad chunk terminator")
                pos += 2
                self._crlf = False
            else:
                eol = buffer.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > 1024:
                        raise UpstreamError("broken HTTP from upstream: chunk header too long")
                    break
                try:
                    size = int(buffer[pos:eol].split(b";", 1)[0], 16)
                except ValueError:
                    raise UpstreamError("broken HTTP from upstream: bad chunk size") from None
                pos = eol + 2
                if size == 0:
                    self.complete = True  # trailers, if any, are of no interest
                self._left = size
        self._buffer = buffer[pos:]
        return b"".join(out)


def _one_chunk(data: bytes) -> bytes | None:
    """The data of `data` when it is exactly one whole chunk with data, `<hex>\\r\\n` and
    its data and CRLF; None for anything else (for the general reading)."""
    eol = data.find(b"\r\n", 0, 18)
    if eol < 1 or not data.endswith(b"\r\n"):
        return None
    try:
        size = int(data[:eol], 16)
    except ValueError:
        return None
    return data[eol + 2 : -2] if size and len(data) == eol + 4 + size else None


class LengthBody:
    def __init__(self, length: int | None) -> None:
        self._left = length
        self.until_close = length is None
        self.complete = length == 0
        self.overrun = False  # more came than the length said (dropped)

    def feed(self, data: bytes) -> bytes:
        if self._left is None:  # the body ends when the connection does
            return data
        self.overrun |= len(data) > self._left
        data = data[: self._left]
        self._left -= len(data)
        self.complete = not self._left
        return data
