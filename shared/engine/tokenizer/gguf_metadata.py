"""The key/value metadata of a GGUF file, without its tensors.

`gguf.GGUFReader` builds a numpy view for every element of every array (≈100k views for a 49k-token
vocabulary plus its merges), which takes seconds; a tokenizer needs only the KV section, read here
in one sequential pass over a memory map.

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
        | n_kv × (string key, u32 type, value) | ...
    string = u64 byte length + UTF-8 bytes;  array = u32 element type + u64 count + elements
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

# GGUFValueType → struct format of one scalar (little endian). 8 = string, 9 = array.
_SCALAR_FORMATS: dict[int, str] = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


class _Cursor:
    __slots__ = ("buf", "endian", "pos")

    def __init__(self, buf: mmap.mmap | bytes, endian: str) -> None:
        self.buf = buf
        self.pos = 0
        self.endian = endian

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.endian + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        raw = self.buf[self.pos : self.pos + length]
        self.pos += length
        # llama.cpp writes token texts as raw bytes; a few vocabularies hold invalid UTF-8 there.
        return bytes(raw).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            element_type = self.unpack("I")
            count = self.unpack("Q")
            if element_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[element_type]
                size = struct.calcsize(fmt)
                values = list(struct.unpack_from(f"{self.endian}{count}{fmt}", self.buf, self.pos))
                self.pos += size * count
                return values
            return [self.value(element_type) for _ in range(count)]
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])
        raise GGUFFormatError(f"unknown GGUF value type {value_type} at byte {self.pos}")


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """All KV pairs of a GGUF file: scalars as Python scalars, arrays as lists."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise GGUFFormatError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})")
        # A big-endian file stores its version byte-swapped; versions are small numbers.
        endian = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"
        cursor = _Cursor(buf, endian)
        cursor.pos = 4
        version = cursor.unpack("I")
        if version < 2:
            raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (need >= 2)")
        cursor.unpack("Q")  # tensor count: not needed here
        num_kv = cursor.unpack("Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.unpack("I"))
        return metadata


def metadata_from_reader(reader: Any) -> dict[str, Any]:
    """The same dict from an already open `gguf.GGUFReader` (the model loader has one)."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's pseudo-fields for the header
            continue
        value = field.contents()
        if isinstance(value, list):
            value = [
                bytes(v).decode("utf-8", errors="replace")
                if isinstance(v, (bytes, bytearray))
                else v
                for v in value
            ]
        metadata[key] = value
    return metadata
