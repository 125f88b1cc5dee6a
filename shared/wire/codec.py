"""One msgpack encoder/decoder pair per wire message type, built once."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


class Codec(Generic[T]):
    """msgpack encoder/decoder pair for one message type, built once."""

    _encoder = msgspec.msgpack.Encoder()

    def __init__(self, type_: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_)

    def encode(self, msg: T) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes) -> T:
        return self._decoder.decode(data)
