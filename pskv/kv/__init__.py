"""The key-value store: ``pskv.kv.create(name)`` and the types behind it.

=================== ===================================================================
type                what it is
=================== ===================================================================
``local``           in this process; sums and updates on the CPU
``device``          in this process; sums on the first tensor's device, updates there
``dist_sync``       parameter servers; one update per round of pushes from every worker
``dist_device_sync`` as ``dist_sync``, with device lists summed on the device first
``dist_async``      parameter servers; every push applied on arrival (needs an optimizer)
=================== ===================================================================

``dist`` is another name for ``dist_sync``; MXNet's ``local_update_cpu`` and
``local_allreduce_cpu`` mean ``local`` and ``local_allreduce_device`` means ``device``.
"""

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
    """Create a store of type ``name`` (see the table above).

    A ``dist_*`` store joins the job described by the ``DMLC_*`` environment (as set by
    ``pskv launch``); in a process whose ``DMLC_ROLE`` is ``server`` or ``scheduler`` it serves
    until the job ends and then exits the process.

    >>> kv = pskv.kv.create()            # "local"
    >>> kv = pskv.kv.create("dist_sync")  # inside a job started by `pskv launch`
    """
    if not isinstance(name, str):
        raise KVStoreError(f"store type must be a str, got {type(name).__name__}")
    canonical = ALIASES.get(name, name)
    if canonical not in TYPES:
        raise KVStoreError(f"unknown store type {name!r}; known: {', '.join([*TYPES, *ALIASES])}")
    if canonical.startswith("dist"):
        from .dist import create_dist

        return create_dist(canonical)
    from .local import LocalStore

    return LocalStore(canonical)


__all__ = ["ALIASES", "TYPES", "KVStore", "KeyMeta", "create"]
