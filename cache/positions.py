"""Named sparse-prefill position lists, kept by the cache process (never evicted).

A client stores a list once under a name and later submits jobs that refer to it by name. The
lists live in the cache process's own diskcache store, so they survive worker restarts. Calls
follow the client's soft-failure rule: None / False when the cache process is unavailable,
unless the store is `strict` (the daemon's socket thread): then `Unavailable` is raised, so an
absent list and an unreachable cache process can be told apart.
"""

from __future__ import annotations

from .client import CacheClient

MAX_NAME = 200


class Unavailable(RuntimeError):
    """The cache process did not answer (strict stores only)."""


class PositionStore:
    """put / get / list / delete of named position lists through a CacheClient."""

    def __init__(self, client: CacheClient, strict: bool = False):
        self.client = client
        self.strict = strict

    def _call(self, op: str, **fields) -> dict | None:
        reply = self.client.call(op, **fields)
        if reply is None and self.strict:
            raise Unavailable(f"the cache process at {self.client.endpoint} is not available")
        return reply

    def put(self, name: str, positions: list[int]) -> bool:
        """Store (or replace) `positions` under `name`; False if refused or unavailable."""
        _check_name(name)
        values = [int(p) for p in positions]
        if any(p < 0 for p in values):
            raise ValueError("positions must be >= 0")
        return self._call("pos_put", name=name, positions=values) is not None

    def get(self, name: str) -> list[int] | None:
        """The list stored under `name`; None when absent or the cache process is down."""
        _check_name(name)
        reply = self._call("pos_get", name=name)
        if reply is None or not reply.get("found"):
            return None
        return list(reply["positions"])

    def list(self) -> list[str] | None:
        reply = self._call("pos_list")
        return None if reply is None else list(reply["names"])

    def delete(self, name: str) -> bool:
        """True when a list was deleted."""
        _check_name(name)
        reply = self._call("pos_delete", name=name)
        return bool(reply and reply.get("deleted"))


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise ValueError(f"a position list name is a string of 1..{MAX_NAME} characters")
