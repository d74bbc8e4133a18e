"""Reads a Kubernetes list answer one item at a time, from the socket.

A list of this node's pods can be large (a tenant's pods may carry 1.4 MB of
environment each, and the API server accepts objects up to 1.5 MiB), and the daemon's
memory limit is 128 MiB. :class:`ListStream` reads the answer in chunks and decodes one
value at a time with the C decoder (``JSONDecoder.raw_decode``): at any moment the
buffer holds at most one item's text plus a chunk, and the caller reduces each parsed
item to what it keeps before the next one is read. The top-level fields other than
``items`` (``metadata``: ``resourceVersion``, ``continue``) are small and kept.

An item larger than :data:`MAX_VALUE_CHARS` or a malformed answer raises ``ValueError``.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

#: No value the API server sends is larger (it refuses objects over 1.5 MiB; their
#: JSON is a little larger than what etcd stores).
MAX_VALUE_CHARS = 8 << 20
CHUNK_BYTES = 1 << 16

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class ListStream:
    """Iterate :meth:`items`; afterwards :attr:`fields` holds the other top-level keys."""

    def __init__(
        self,
        read: Callable[[int], bytes],
        *,
        chunk: int = CHUNK_BYTES,
        max_value: int = MAX_VALUE_CHARS,
    ) -> None:
        self._read = read
        self._chunk = chunk
        self._max_value = max_value
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""
        self._pos = 0
        self._eof = False
        self.fields: dict[str, Any] = {}

    # -- the buffer ----------------------------------------------------------------
    def _more(self, size: int) -> None:
        if self._eof:
            raise ValueError("the list answer ended early")
        if self._pos:  # drop what was consumed before growing
            self._buffer = self._buffer[self._pos :]
            self._pos = 0
        data = self._read(size)
        if not data:
            self._eof = True
            self._buffer += self._utf8.decode(b"", final=True)
            return
        self._buffer += self._utf8.decode(data)

    def _skip_whitespace(self) -> None:
        while True:
            match = _WHITESPACE.match(self._buffer, self._pos)
            assert match is not None
            self._pos = match.end()
            if self._pos < len(self._buffer):
                return
            self._more(self._chunk)

    def _expect(self, *characters: str) -> str:
        self._skip_whitespace()
        found = self._buffer[self._pos]
        if found not in characters:
            raise ValueError(f"expected one of {characters!r} in the list answer, got {found!r}")
        self._pos += 1
        return found

    def _peek(self) -> str:
        self._skip_whitespace()
        return self._buffer[self._pos]

    def _value(self) -> Any:
        """The next JSON value, read in as many chunks as it takes (each read at least
        doubles what is buffered, so a value costs at most about twice its decoding)."""
        self._skip_whitespace()
        while True:
            try:
                value, end = _DECODER.raw_decode(self._buffer, self._pos)
            except json.JSONDecodeError:
                end = -1
            # A number at the very end of the buffer may go on in the next chunk.
            if end >= 0 and (end < len(self._buffer) or self._eof):
                self._pos = end
                return value
            pending = len(self._buffer) - self._pos
            if pending > self._max_value:
                raise ValueError(f"a value in the list answer is larger than {self._max_value}")
            if self._eof:
                raise ValueError("the list answer is not valid JSON")
            self._more(max(self._chunk, pending))

    # -- the list ------------------------------------------------------------------
    def items(self) -> Iterator[Any]:
        self._expect("{")
        if self._peek() == "}":
            self._pos += 1
            return
        while True:
            key = self._value()
            if not isinstance(key, str):
                raise ValueError("a key of the list answer is not a string")
            self._expect(":")
            if key == "items" and self._peek() == "[":
                self._pos += 1
                if self._peek() == "]":
                    self._pos += 1
                else:
                    while True:
                        yield self._value()
                        if self._expect(",", "]") == "]":
                            break
            else:
                self.fields[key] = self._value()
            if self._expect(",", "}") == "}":
                return
