"""The key-value store: ``pskv.kv.create(name)`` and the types behind it (docs/SPEC.md, section 3;
MXNet's type names are aliases: "Type names" there)."""

from __future__ import annotations

from ..errors import KVStoreError
from .base import KeyMeta, KVStore

TYPES = ("local", "device", "dist_sync", "dist_device_sync", "dist_async")
ALIASES = {
    "dist": "dist_sync",
    "local_update_cpu": "local",
    "local_allreduce_cpu": "local",
    "local_allreduce_device": "device",
}


def create(name: str = "local") -> KVStore:
    """Create a store of type ``name`` (``TYPES`` or ``ALIASES``). A ``dist_*`` store joins the job
    that the ``DMLC_*`` environment describes (``pskv launch`` sets it); in a server or scheduler
    process it serves until the job ends, then exits the process."""
    if not isinstance(name, str):
        raise KVStoreError(f"store type must be a str, got {type(name).__name__}")
    canonical = ALIASES.get(name, name)
    if canonical not in TYPES:
        raise KVStoreError(f"unknown store type {name!r}; known: {', '.join([*TYPES, *ALIASES])}")
    if canonical.startswith("dist"):
        from .dist import create_dist
        return create_dist(canonical)
    return KVStore(canonical)


__all__ = ["ALIASES", "TYPES", "KVStore", "KeyMeta", "create"]
