"""Prefix-cache block hashes.

A full block's hash is H(parent hash, namespace, the block's token ids): equal hashes mean the same
namespace and the same tokens from position 0 to the end of the block. The gateway imports this
module to route a prompt to the node whose cache holds its longest prefix, so it must stay pure
(hashlib only, no torch).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int], namespace: str) -> bytes:
    """The 16-byte BLAKE2b hash of one full block chained to its parent's hash."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\x00" * 16)
    encoded_namespace = namespace.encode()
    h.update(len(encoded_namespace).to_bytes(4, "little"))
    h.update(encoded_namespace)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def compute_block_hashes(
    token_ids: Sequence[int], block_size: int, namespace: str = ""
) -> list[bytes]:
    """Hashes of every full block of `token_ids`, in order (a trailing partial block has none)."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], namespace)
        hashes.append(parent)
    return hashes
