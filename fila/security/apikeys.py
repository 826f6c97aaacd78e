"""API key material: generation, digests, and the record persisted for each key.

A key is `fila_` followed by 32 random bytes (256 bits) in URL-safe base64. The
broker keeps only its SHA-256 digest: with that much entropy a guess is hopeless,
so a salt or a slow hash (which exist to protect low-entropy passwords) would add
cost to every authenticated call and no security. The plaintext leaves the broker
once, in the `CreateApiKey` answer, and is never logged; logs name a failing key
by `fingerprint`, the first 8 hex digits of its digest.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Final

from fila.core.errors import InvalidArgument, clip

KEY_PREFIX: Final = "fila_"
KEY_BYTES: Final = 32
KEY_ID_BYTES: Final = 8
MAX_NAME: Final = 255


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def new_key_id() -> str:
    return secrets.token_hex(KEY_ID_BYTES)


def digest(presented: str) -> bytes:
    return hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()


def fingerprint(presented: str) -> str:
    """Names a presented key in logs without revealing it."""
    return digest(presented).hex()[:8]


def validate_name(name: str) -> None:
    if not name:
        raise InvalidArgument("API key name must not be empty")
    if len(name) > MAX_NAME:
        raise InvalidArgument(f"API key name is {len(name)} characters, the limit is {MAX_NAME}")
    if not name.isprintable():
        raise InvalidArgument(f"API key name {clip(name)!r} contains control characters")


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    """What is stored about a key; `expires_at_ms == 0` means it never expires."""

    key_id: str
    name: str
    digest: bytes
    created_at_ms: int
    expires_at_ms: int
    is_superadmin: bool

    def expired(self, now_ms: int) -> bool:
        return self.expires_at_ms != 0 and now_ms >= self.expires_at_ms

    def encode(self) -> bytes:
        return json.dumps(
            {
                "name": self.name,
                "sha256": self.digest.hex(),
                "created_at_ms": self.created_at_ms,
                "expires_at_ms": self.expires_at_ms,
                "is_superadmin": self.is_superadmin,
            }
        ).encode()

    @classmethod
    def decode(cls, key_id: str, raw: bytes) -> ApiKeyRecord:
        doc = json.loads(raw)
        return cls(
            key_id=key_id,
            name=str(doc["name"]),
            digest=bytes.fromhex(doc["sha256"]),
            created_at_ms=int(doc["created_at_ms"]),
            expires_at_ms=int(doc["expires_at_ms"]),
            is_superadmin=bool(doc["is_superadmin"]),
        )
