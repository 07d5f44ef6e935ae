"""The one msgpack encoder/decoder of the wire (no pickle anywhere): bytes <-> typed structs."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from . import protocol as P

DEFAULT_MAX_FRAME = 1 << 20  # 1 MiB: a prompt of ~250k tokens as ids, far beyond any context here
# The worker's socket drops a frame over DROP_FACTOR x its max_frame_bytes with the connection,
# unread and unanswered (ZeroMQ's MAXMSGSIZE: it never holds such a frame in memory); frames in
# between are read and refused `too_large`.
DROP_FACTOR = 16


def check_sendable(frame: bytes, max_frame_bytes: int) -> None:
    """Raise ProtocolError(TOO_LARGE) for a frame the worker (of this max_frame_bytes) would drop
    without a word. A client sent it anyway, re-sent it every retry_interval (the whole frame each
    time), and after its whole timeout said "no dflash worker answered ... is `dflashd start`
    running?" about a worker that was up: the error the worker gives a smaller oversize frame,
    at once, instead."""
    if len(frame) > DROP_FACTOR * max_frame_bytes:
        raise P.ProtocolError(P.TOO_LARGE, f"frame of {len(frame)} bytes exceeds the cap of {max_frame_bytes}")


def encode(msg: Any) -> bytes:
    """One frame for a protocol struct (or an already-built map)."""
    m = msg if isinstance(msg, dict) else P.to_map(msg)
    return msgpack.packb(m, use_bin_type=True)


def check_encodable(msg: Any) -> None:
    """Raise ProtocolError(BAD_REQUEST, param=the field) for a field the wire cannot carry: a string
    that is not valid Unicode (a lone surrogate, e.g. from surrogateescape'd bytes) or an integer
    outside msgpack's 64 bits. Checked per field, so the message names the field."""
    for f in dataclasses.fields(msg):
        try:
            msgpack.packb(getattr(msg, f.name), use_bin_type=True)
        except UnicodeEncodeError as e:
            raise P.ProtocolError(P.BAD_REQUEST, f"field {f.name!r} is not valid Unicode text: it holds the lone "
                                  f"surrogate {e.object[e.start]!r} (undecodable bytes?)", param=f.name) from None
        except (OverflowError, ValueError, TypeError) as e:
            raise P.ProtocolError(P.BAD_REQUEST, f"field {f.name!r} cannot be sent: {e}", param=f.name) from None


def decode_map(frame: bytes, max_bytes: int = DEFAULT_MAX_FRAME) -> Any:
    """The msgpack value in a frame; ProtocolError when oversized or not valid msgpack."""
    if len(frame) > max_bytes:
        raise P.ProtocolError(P.TOO_LARGE, f"frame of {len(frame)} bytes exceeds the cap of {max_bytes}")
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
        )
    except Exception as e:  # msgpack raises several unrelated types on bad bytes
        # msgpack's own words say what is wrong ("int is not allowed for map key ...": a map key
        # that is not a string, which a client could not tell from the type name alone)
        why = "map keys must be strings" if "map key" in str(e) else " ".join(str(e).split())[:200]
        raise P.ProtocolError(P.BAD_FRAME, f"not a valid msgpack message: {type(e).__name__}"
                              + (f": {why}" if why else "")) from None


def decode_request(frame: bytes, max_bytes: int = DEFAULT_MAX_FRAME) -> P.Request:
    return P.parse_request(decode_map(frame, max_bytes))


def decode_reply(frame: bytes, max_bytes: int = 64 << 20) -> P.Reply:
    return P.parse_reply(decode_map(frame, max_bytes))


def peek_rid(frame: bytes) -> int:
    """Best-effort request id of a frame that failed to parse, so the error names its request."""
    try:
        # strict_map_key off: a frame refused for a non-string key still names its request
        m = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        rid = m.get("rid", 0) if isinstance(m, dict) else 0
        return rid if isinstance(rid, int) and not isinstance(rid, bool) and -(2**63) <= rid < 2**64 else 0
    except Exception:
        return 0
