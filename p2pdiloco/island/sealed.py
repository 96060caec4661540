"""The island's store, sealed with the island's secret: only its own processes speak on it.

Rank 0's ``TCPStore`` is reachable by anyone who can reach its port (every host of the LAN for
``join --lan-island``), and a ``TCPStore`` checks nobody. So every value the island writes, the
plan, each command, each member's registration and beat, and what gloo's rendezvous exchanges
to connect the ranks, carries an HMAC-SHA256 over (key, value) with a 32-byte secret that
rank 0 makes and hands to its members (its own children through a pipe; other hosts through
``--island-secret``). A value that fails the check is refused with ``IslandAuthError`` naming
its key: a process without the secret can neither register, nor take a rank in a generation's
process group, nor post a command; what it can still do is spoil keys (costing a re-form) or
bump counters, which the island treats as hints it checks against sealed records.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac

import torch.distributed as dist

from p2pdiloco.island.secret import SECRET_BYTES

_MAC_BYTES = hashlib.sha256().digest_size


class IslandAuthError(ValueError):
    """A value in the island's store is not sealed with the island's secret."""


class SealedStore(dist.Store):
    """``inner`` with every value sealed (set) and checked (get). Counters (``add``) pass
    through unsealed: callers treat them as hints. Keep a reference to this object while a
    process group uses it (a ``PrefixStore`` over it holds only its C++ half)."""

    def __init__(self, inner: dist.Store, secret: bytes) -> None:
        super().__init__()
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"an island secret is {SECRET_BYTES} bytes")
        self.inner, self._secret = inner, secret
        self._clones: list[SealedStore] = []  # alive as long as C++ may call into them

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def seal(self, key: str, value: bytes) -> bytes:
        """``value`` as it is stored under ``key``: its MAC, then the value."""
        return self._mac(key, value) + value

    def unseal(self, key: str, raw: bytes) -> bytes:
        """The value ``raw`` holds under ``key``; IslandAuthError if its MAC does not verify."""
        mac, value = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
        if len(mac) < _MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, value)):
            raise IslandAuthError(
                f"island store value {key!r} is not sealed with this island's secret"
            )
        return value

    def set(self, key: str, value: bytes | str) -> None:  # type: ignore[override]
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, self.seal(key, data))  # type: ignore[arg-type]

    def get(self, key: str) -> bytes:
        return self.unseal(key, bytes(self.inner.get(key)))

    def push(self, key: str, value: bytes) -> None:
        """Append a sealed ``value`` to the queue ``key`` (``pop_all`` reads it)."""
        self.inner.queue_push(key, self.seal(key, value))  # type: ignore[attr-defined]

    def pop_all(self, key: str, limit: int) -> list[bytes | IslandAuthError]:
        """Up to ``limit`` entries of the queue ``key``, oldest first: each value, or the
        IslandAuthError of one that is not sealed."""
        out: list[bytes | IslandAuthError] = []
        while len(out) < limit and self.inner.queue_len(key) > 0:  # type: ignore[attr-defined]
            raw = bytes(self.inner.queue_pop(key, block=False))  # type: ignore[attr-defined]
            try:
                out.append(self.unseal(key, raw))
            except IslandAuthError as e:
                out.append(e)
        return out

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:  # type: ignore[override]
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    def clone(self) -> SealedStore:
        twin = SealedStore(self.inner.clone(), self._secret)  # type: ignore[attr-defined]
        self._clones.append(twin)
        return twin
