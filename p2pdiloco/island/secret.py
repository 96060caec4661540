"""An island's secret: 32 random bytes that seal its store (``island.sealed``), shown and
passed as 64 hex digits. No torch here: ``join`` reads the flag before anything heavy loads."""

from __future__ import annotations

import secrets

SECRET_BYTES = 32


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def parse_secret(text: str) -> bytes:
    """A secret from its hex form (``--island-secret``); ValueError (one line) if it is not."""
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raw = b""
    if len(raw) != SECRET_BYTES:
        raise ValueError(f"an island secret is {2 * SECRET_BYTES} hex digits")
    return raw
