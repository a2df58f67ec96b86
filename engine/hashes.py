"""The hashes a result carries: of its text, and of its token ids (little-endian int32)."""
from __future__ import annotations

import hashlib
import struct


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def token_ids_sha256(ids: list[int]) -> str:
    return sha256_hex(struct.pack(f"<{len(ids)}i", *ids))
