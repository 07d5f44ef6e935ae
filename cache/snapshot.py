"""The byte format of a prefix snapshot: a checked envelope around a msgpack body.

The worker encodes snapshots (engine/prefix.py turns MLX arrays into array records); the cache
process only stores and verifies bytes, so this module imports neither MLX nor numpy. No pickle:
arrays travel as {"dtype", "shape", "data"} records with raw little-endian bytes (bfloat16 as its
uint16 bit pattern).

Envelope layout (all little-endian):
    magic  b"DFSN"      4 bytes
    format version      u16
    reserved            u16 (0)
    body length         u64
    blake2b-256(body)   32 bytes
    body                msgpack map
A short, long or altered value fails `verify` and is never decoded.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import msgpack

FORMAT_VERSION = 1
MAGIC = b"DFSN"
_HEADER = struct.Struct("<4sHHQ32s")
HEADER_SIZE = _HEADER.size

# dtype names an array record may carry, with their item size in bytes.
DTYPE_SIZES = {
    "bool": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
}


class CorruptSnapshot(ValueError):
    """The bytes are not a complete, intact snapshot of the supported format version."""


def _digest(body: bytes | memoryview) -> bytes:
    return hashlib.blake2b(body, digest_size=32).digest()


def encode(body: dict[str, Any]) -> bytes:
    """Pack a snapshot body (plain msgpack types and array records) into a checked envelope."""
    packed = msgpack.packb(body, use_bin_type=True)
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(packed), _digest(packed))
    return header + packed


def verify(data: bytes | memoryview) -> str:
    """Return "" when `data` is an intact envelope of this format version, else the reason."""
    if len(data) < HEADER_SIZE:
        return "truncated header"
    magic, version, _, length, digest = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        return "bad magic"
    if version != FORMAT_VERSION:
        return f"format version {version} != {FORMAT_VERSION}"
    if len(data) - HEADER_SIZE != length:
        return f"body is {len(data) - HEADER_SIZE} bytes, header says {length}"
    if _digest(memoryview(data)[HEADER_SIZE:]) != digest:
        return "checksum mismatch"
    return ""


def decode(data: bytes | memoryview) -> dict[str, Any]:
    """Verify and unpack an envelope; raise CorruptSnapshot instead of returning bad data."""
    reason = verify(data)
    if reason:
        raise CorruptSnapshot(reason)
    try:
        body = msgpack.unpackb(memoryview(data)[HEADER_SIZE:], raw=False)
    except Exception as e:  # checksum passed, so this is a writer bug; still never load it
        raise CorruptSnapshot(f"undecodable body: {e}") from e
    if not isinstance(body, dict):
        raise CorruptSnapshot("body is not a map")
    return body


def array_record(dtype: str, shape: tuple[int, ...] | list[int], data: bytes) -> dict[str, Any]:
    """One array as a msgpack-able record; checks that the byte count matches the shape."""
    check_record({"dtype": dtype, "shape": list(shape), "data": data})
    return {"dtype": dtype, "shape": list(shape), "data": data}


def check_record(rec: Any) -> None:
    """Raise CorruptSnapshot unless `rec` is a well-formed array record."""
    if not isinstance(rec, dict) or set(rec) != {"dtype", "shape", "data"}:
        raise CorruptSnapshot("array record must have exactly dtype, shape, data")
    size = DTYPE_SIZES.get(rec["dtype"])
    if size is None:
        raise CorruptSnapshot(f"unsupported dtype {rec['dtype']!r}")
    shape = rec["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CorruptSnapshot(f"bad shape {shape!r}")
    n = size
    for d in shape:
        n *= d
    if not isinstance(rec["data"], (bytes, bytearray, memoryview)) or len(rec["data"]) != n:
        raise CorruptSnapshot(f"array data does not match dtype {rec['dtype']} shape {shape}")
