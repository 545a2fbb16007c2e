"""Any ``torch.optim`` optimizer over the parameter servers (docs/PYTORCH.md): the servers sum the
gradients, and the user's optimizer, with its LR scheduler, runs unchanged on every worker (MXNet's
``update_on_kvstore=False``); :func:`broadcast_parameters` and :func:`broadcast_optimizer_state` make
every worker start from rank 0's weights and states."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Optional, Union

import torch
from torch import Tensor

from .errors import TrainerError
from .kv.base import KVStore
from .trainer import BROADCAST_KEYS, Trainer


class _Distributed:
    """What a :func:`DistributedOptimizer` adds to the class of the optimizer it wraps."""

    _pskv: Trainer
    _pskv_op: str
    _pskv_params: list[Tensor]
    _pskv_frozen: set[int]  # ids of the parameters frozen when wrapped (the Trainer leaves them out)
    _pskv_used: Any  # the store's key for how many workers had each parameter's gradient
    _pskv_skip = _pskv_synced = False
    _pskv_inner: Optional[Callable[..., Any]] = None  # the step an LR scheduler made before wrapping put on the optimizer

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """:meth:`synchronize` (unless inside :meth:`skip_synchronize`), then the wrapped optimizer's step (its
        scheduler's, made before wrapping, which counts it), with ``closure`` summed at each call (LBFGS makes several)."""
        def summed() -> Any:
            self._pskv_synced = False  # (its backward's gradients are new)
            with torch.enable_grad():
                loss = closure()  # type: ignore[misc]
            self.synchronize()
            return loss
        if closure is None and not self._pskv_skip:
            self.synchronize()
        loss = (self._pskv_inner or super().step)(summed if closure is not None else None)  # type: ignore[misc]
        self._pskv_synced = False
        return loss

    def synchronize(self) -> None:
        """Sum this step's gradients over the workers now (those sent during backward are waited for), and average them
        unless ``op="sum"``: every worker's ``.grad`` holds the same values; once per step (when and what else: docs/PYTORCH.md)."""
        if self._pskv_synced:
            return
        if late := [i for i, p in enumerate(self._pskv_params) if p.grad is not None and id(p) in self._pskv_frozen]:
            raise TrainerError(f"parameters {late} (in param_groups order) have gradients but were frozen when the optimizer "
                               "was wrapped, so they are not summed: wrap it after unfreezing them")
        params = self._pskv_params  # how many workers have each one's gradient, then how many a row-sparse one
        used = torch.tensor([p.grad is not None for p in params] + [p.grad is not None and p.grad.is_sparse for p in params], dtype=torch.float32)
        kv = self._pskv.kvstore
        counted = kv.pushpull(self._pskv_used, used, wait=False) if kv is not None else None  # beside the gradients
        self._pskv.allreduce_grads(ignore_stale_grad=True)
        if counted is not None:
            counted.wait()
        with torch.no_grad():
            for p, n, sparse in zip(params, used.tolist(), used[len(params) :].tolist()):
                if n == 0:
                    p.grad = None
                    continue
                if sparse and not p.grad.is_sparse:  # type: ignore[union-attr]  # (zeros pushed here: the others' layout)
                    p.grad = p.grad.to_sparse(1)  # type: ignore[union-attr]
                if self._pskv_op == "average" and kv is not None:
                    p.grad.div_(kv.num_workers)  # type: ignore[union-attr]
        self._pskv_synced = True

    def _pskv_backward_end(self) -> None:
        self._pskv_synced = False  # (a backward without a step since: its gradients are new)
        self.synchronize()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TrainerError("add_param_group on a DistributedOptimizer: its parameters would not be summed; add every "
                           "group before wrapping (or wrap the optimizer again)")

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step`` inside uses the gradients :meth:`synchronize` made (``torch.amp.GradScaler``:
        synchronize, ``scaler.unscale_(opt)``, then ``with opt.skip_synchronize(): scaler.step(opt)``)."""
        self._pskv_skip = True
        try:
            yield
        finally:
            self._pskv_skip = False

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate their gradients here; the next one outside sends the sums."""
        return self._pskv.no_sync()


def DistributedOptimizer(optimizer: torch.optim.Optimizer, kv: Union[str, KVStore], op: str = "average", overlap: Optional[bool] = None) -> Any:
    """``optimizer``, with its ``step`` summing the gradients over the workers through ``kv`` (a store
    or a type name) first: the mean (``op="average"``, as DDP and Horovod) or the sum (``"sum"``).
    The result is an instance of the optimizer's own class (``isinstance`` holds, so LR schedulers
    take it) that shares its state and ``param_groups``; making it sends worker 0's weights to every
    worker. When gradients leave (``overlap``) and what a missing one counts as: docs/PYTORCH.md."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TrainerError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if op not in ("average", "sum"):
        raise TrainerError(f"DistributedOptimizer op {op!r}: it must be 'average' or 'sum'")
    if getattr(kv, "type", kv) == "dist_async":  # (before a store is made; None or a wrong type: the Trainer says)
        raise TrainerError("DistributedOptimizer needs summed rounds; a dist_async store applies each push on its own, with the "
                           "servers' optimizer: use dist_sync, or pskv.Trainer (its optimizer then runs on the servers)")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    cls: Any = type(f"Distributed{type(optimizer).__name__}", (_Distributed, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__  # one dict: param_groups, state, defaults, and what load_state_dict sets
    wrapped._pskv_inner = optimizer.__dict__.get("_pskv_inner") or optimizer.__dict__.get("step")  # the step an LR
    if wrapped._pskv_inner is not None:  # scheduler put on it (wrapped before: kept) does not sum: ours goes in its place
        wrapped.step = lambda closure=None: _Distributed.step(wrapped, closure)
        wrapped.step._wrapped_by_lr_sched = True
    wrapped._pskv = Trainer(params, "sgd", kvstore=kv, update_on_kvstore=False, overlap=overlap if op == "average" else False)  # (its sgd is never used)
    wrapped._pskv_op, wrapped._pskv_params, store = op, params, wrapped._pskv.kvstore
    wrapped._pskv_frozen = {id(p) for p in params if not p.requires_grad}
    if op == "average":  # the means when backward ends, as DDP (a sum there would count an earlier backward W times)
        wrapped._pskv._after_backward = wrapped._pskv_backward_end
        if store is not None and not wrapped._pskv.overlap:
            wrapped._pskv._arm()  # (hooks to hear when backward ends)
    if store is not None:
        wrapped._pskv_used = _fresh_keys(store, 1)[0]
        store.init(wrapped._pskv_used, torch.zeros(2 * len(params)))
    return wrapped


def _fresh_keys(kv: KVStore, n: int) -> list[Any]:
    """``n`` keys this store has not seen, of its kind (int or str), above those a Trainer takes (0, 1, ...)."""
    used = list(kv._keys)
    if used and isinstance(used[0], str):
        return [f"pskv-broadcast-{len(used) + i}" for i in range(n)]
    start = max([BROADCAST_KEYS - 1, *(k for k in used if isinstance(k, int))]) + 1
    return list(range(start, start + n))


def broadcast_parameters(params: Union[Iterable[Any], Mapping[str, Tensor]], kv: KVStore, root_rank: int = 0) -> None:
    """Copy rank 0's values into every worker's ``params``: tensors, ``(name, tensor)`` pairs or a
    ``state_dict``. Worker 0's ``init`` value is what every worker pulls, so only ``root_rank=0`` exists."""
    if root_rank != 0:
        raise TrainerError(f"broadcast from rank {root_rank}: a store's init value is worker 0's, so root_rank must be 0")
    items = params.values() if isinstance(params, Mapping) else params
    tensors: list[Any] = [t[1] if isinstance(t, tuple) else t for t in items]
    if not tensors or not all(isinstance(t, Tensor) for t in tensors):
        raise TrainerError("broadcast_parameters takes tensors, (name, tensor) pairs or a state_dict, and at least one")
    with torch.no_grad():
        for key, t in zip(_fresh_keys(kv, len(tensors)), tensors):  # (into .data: a Trainer's weights, the same
            kv.broadcast(key, t.detach(), out=t.data)  # as the store's, are not changed for it, see Trainer.step)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, kv: KVStore, root_rank: int = 0) -> None:
    """Give every worker's ``optimizer`` rank 0's ``state_dict``: its states (also where only rank 0
    has any, as after a resume) and hyperparameters. The state travels as the bytes of ``torch.save``."""
    if root_rank != 0:
        raise TrainerError(f"broadcast from rank {root_rank}: a store's init value is worker 0's, so root_rank must be 0")
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    mine = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    size_key, data_key = _fresh_keys(kv, 2)
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    kv.broadcast(size_key, size.clone(), out=size)  # rank 0's length, then its bytes
    data = mine if kv.rank == 0 else torch.zeros(int(size), dtype=torch.uint8)
    kv.broadcast(data_key, data.clone(), out=data)
    optimizer.load_state_dict(torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True))
