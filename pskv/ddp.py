"""A DistributedDataParallel communication hook that exchanges DDP's gradient buckets through a store
instead of an all-reduce among the workers: ``ddp_model.register_comm_hook(None, pskv.ddp_hook(kv))`` (docs/PYTORCH.md)."""

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .errors import KVStoreError
from .kv.base import KVStore

Hook = Callable[[Any, "dist.GradBucket"], "torch.futures.Future[Tensor]"]  # type: ignore[name-defined]


def ddp_hook(kv: KVStore, op: str = "average") -> Hook:
    """A hook for ``DistributedDataParallel.register_comm_hook(state, hook)`` (``state`` is unused):
    a bucket's gradients become their sum over the workers (``op="sum"``) or its mean (``"average"``,
    DDP's own), put in DDP's future by a thread of the store (DDP waits for them when backward ends); a
    ``KVStoreError`` if the store runs an optimizer or is ``dist_async``. Its keys: docs/PYTORCH.md."""
    if op not in ("average", "sum"):
        raise KVStoreError(f"ddp_hook op {op!r}: it must be 'average' or 'sum'")
    if kv.type == "dist_async":
        raise KVStoreError("ddp_hook needs summed rounds; a dist_async store applies each push on its own")
    _no_optimizer(kv)
    # one thread per store completes its hooks' futures, in the order DDP handed the buckets over; it waits for
    # the next one until the process ends (a thread that ended once its hook was dropped, before the exit, was
    # followed by a SIGABRT at every worker's exit on an H100: "terminate called without an active exception")
    if (waiting := kv.__dict__.get("_ddp_waiting")) is None:
        waiting = kv.__dict__["_ddp_waiting"] = queue.SimpleQueue()
        threading.Thread(target=_complete, args=(kv, waiting), name="pskv-ddp-hook", daemon=True).start()
    known: set[str] = set()
    mine = kv.__dict__.setdefault("_ddp_hooks", 0)  # (this store's hooks before this one)
    kv.__dict__["_ddp_hooks"] = mine + 1

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:  # type: ignore[name-defined]  # (DDP checks them)
        _no_optimizer(kv)  # (one set since the hook was made: a Trainer's on this store?)
        buffer = bucket.buffer()
        key = f"ddp-bucket-{bucket.index()}-{buffer.numel()}-{str(buffer.dtype)[6:]}" + (f"#{mine}" if mine else "")
        if key not in known:  # every worker meets the same buckets in the same order: their inits agree
            kv.init(key, torch.zeros_like(buffer))
            known.add(key)
        future: torch.futures.Future[Tensor] = torch.futures.Future()
        waiting.put((kv.pushpull(key, buffer, wait=False), future, buffer, op == "average"))
        return future.then(torch.futures.Future.wait)  # (DDP took an exception set in `future` for its value, "Unable to cast ... to Tensor"; a callback's is an error)

    return hook


def _complete(kv: KVStore, waiting: queue.SimpleQueue[tuple[Any, torch.futures.Future[Tensor], Tensor, bool]]) -> None:
    while True:
        handle, future, buffer, average = waiting.get()
        try:
            handle.wait()
            future.set_result(buffer.div_(kv.num_workers) if average else buffer)
        except BaseException as exc:  # DDP raises it from backward
            future.set_exception(exc)  # type: ignore[arg-type]


def _no_optimizer(kv: KVStore) -> None:
    if kv._optimizer is not None:
        raise KVStoreError("ddp_hook: the store runs an optimizer, so a pull would return weights, not the summed gradients")
