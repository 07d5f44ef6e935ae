"""The byte format of a prefix snapshot: a checked envelope around a msgpack map plus raw blobs.

The worker encodes snapshots (engine/prefix.py turns MLX arrays into array records); the cache
process only stores and verifies bytes, so this module imports neither MLX nor numpy. No pickle:
arrays travel as {"dtype", "shape", "data"} records with raw little-endian bytes (bfloat16 as its
uint16 bit pattern).

Bulk bytes stay out of msgpack: every bytes value in the body is replaced by a reference
(msgpack ext type 1: offset, length) into a blob section that follows the map. Packing a 100 MB
KV cache through msgpack copied it twice and cost ~10x the memory bandwidth; this way encoding is
one copy, and decoding hands out memoryviews into the received buffer (no copy). A large
envelope is copied a few MB at a time so that the worker's socket thread, which needs the GIL to
send heartbeats, is never held off for the whole copy (`_assemble`).

Envelope layout (all little-endian):
    magic  b"DFSN"            4 bytes
    format version            u16
    key length                u16
    map length                u64
    blob length               u64
    crc32(key + map + blobs)  u32   (detects truncation and bit rot; the cache is local, not hostile)
    key                       utf-8 (the cache key the entry was stored under; may be empty)
    map                       msgpack
    blobs                     raw bytes
A short, long or altered value fails `verify` and is never decoded. The key travels inside the
checked bytes so that an entry read back under another key (swapped files, a damaged index) is
refused instead of restoring another prompt's state: `verify(data, key)`.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from typing import Any

import msgpack

FORMAT_VERSION = 3  # 3: the envelope carries its key
MAGIC = b"DFSN"
_HEADER = struct.Struct("<4sHHQQI")
HEADER_SIZE = _HEADER.size
_BLOB_REF = 1  # msgpack ext type code of a blob reference
_REF = struct.Struct("<QQ")
# Envelopes at least this large are assembled in pieces of COPY_CHUNK bytes (`_assemble`).
LARGE_ENVELOPE = 16 << 20
COPY_CHUNK = 4 << 20  # ~1-5 ms of copying a piece: the longest the GIL is held at a time

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


def encode(body: dict[str, Any], key: str = "") -> bytes | memoryview:
    """Pack a snapshot body (plain msgpack types and array records) into a checked envelope
    bound to `key` (the cache key it will be stored under): bytes, or from LARGE_ENVELOPE on a
    read-only memoryview (`_assemble`)."""
    kb = key.encode()
    if len(kb) > 0xFFFF:
        raise ValueError("key too long")
    blobs: list[bytes | memoryview] = []
    size = 0

    def out_of_line(obj: Any) -> Any:
        nonlocal size
        if isinstance(obj, (bytes, bytearray, memoryview)):
            ref = msgpack.ExtType(_BLOB_REF, _REF.pack(size, len(obj)))
            blobs.append(obj)
            size += len(obj)
            return ref
        if isinstance(obj, dict):
            return {k: out_of_line(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [out_of_line(v) for v in obj]
        return obj

    packed = msgpack.packb(out_of_line(body), use_bin_type=True)
    crc = zlib.crc32(packed, zlib.crc32(kb))
    for b in blobs:
        crc = zlib.crc32(b, crc)
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(kb), len(packed), size, crc)
    parts = [header, kb, packed, *blobs]
    total = HEADER_SIZE + len(kb) + len(packed) + size
    return b"".join(parts) if total < LARGE_ENVELOPE else _assemble(parts, total)


def _assemble(parts: list[bytes | memoryview], total: int) -> memoryview:
    """`parts` back to back in a new anonymous mapping, copied COPY_CHUNK bytes at a time.

    b"".join holds the GIL for its whole copy when a part is not exactly bytes (CPython's
    join.h; array blobs are memoryviews), and the worker encodes on its L2 writer thread: a
    372 MB envelope held the socket thread off for 1.3 s on a 2-core EPYC VM (its fresh pages'
    faults included), and longer beside other work, so clients waiting 1.5 s for a heartbeat
    declared a live worker gone. Between pieces the GIL changes hands. The mapping's pages come
    zeroed from the kernel when first written (a bytearray of that size is zeroed first, under
    the GIL), and are returned to it when the last view goes."""
    buf = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE)
    out = memoryview(buf)
    at = 0
    for part in parts:
        src = memoryview(part).cast("B")
        for start in range(0, len(src), COPY_CHUNK):
            piece = src[start : start + COPY_CHUNK]
            out[at : at + len(piece)] = piece
            at += len(piece)
    return out.toreadonly()


def verify(data: bytes | memoryview, key: str | None = None) -> str:
    """Return "" when `data` is an intact envelope of this format version (bound to `key`, when
    given), else the reason."""
    if len(data) < HEADER_SIZE:
        return "truncated header"
    magic, version, key_len, map_len, blob_len, crc = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        return "bad magic"
    if version != FORMAT_VERSION:
        return f"format version {version} != {FORMAT_VERSION}"
    if len(data) - HEADER_SIZE != key_len + map_len + blob_len:
        return f"body is {len(data) - HEADER_SIZE} bytes, header says {key_len + map_len + blob_len}"
    if key is not None and bytes(data[HEADER_SIZE : HEADER_SIZE + key_len]) != key.encode():
        return "entry belongs to another key"
    if zlib.crc32(memoryview(data)[HEADER_SIZE:]) != crc:
        return "checksum mismatch"
    return ""


def entry_key(data: bytes | memoryview) -> str:
    """The key an envelope says it belongs to (header only: `verify` checks the rest)."""
    if len(data) < HEADER_SIZE or bytes(data[:4]) != MAGIC:
        raise CorruptSnapshot("not a snapshot envelope")
    key_len = _HEADER.unpack_from(data, 0)[2]
    try:
        return bytes(data[HEADER_SIZE : HEADER_SIZE + key_len]).decode()
    except UnicodeDecodeError as e:
        raise CorruptSnapshot("key is not utf-8") from e


def decode(data: bytes | memoryview) -> dict[str, Any]:
    """Verify and unpack an envelope; raise CorruptSnapshot instead of returning bad data.

    Bytes values come back as memoryviews into `data` (keep `data` alive while using them).
    """
    reason = verify(data)
    if reason:
        raise CorruptSnapshot(reason)
    view = memoryview(data)
    _, _, key_len, map_len, _, _ = _HEADER.unpack_from(view, 0)
    start = HEADER_SIZE + key_len
    blobs = view[start + map_len :]

    def blob(code: int, raw: bytes) -> Any:
        if code != _BLOB_REF or len(raw) != _REF.size:
            raise ValueError(f"unknown ext type {code}")
        off, n = _REF.unpack(raw)
        if off + n > len(blobs):
            raise ValueError("blob reference out of range")
        return blobs[off : off + n]

    try:
        body = msgpack.unpackb(view[start : start + map_len], raw=False, ext_hook=blob)
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
