"""The Trainer: gradients summed over devices and workers, then one optimizer step.

It works with any store. ``trainer.step(batch_size)`` after ``loss.backward()``:

1. multiplies the optimizer's ``rescale_grad`` by ``1 / batch_size`` (``batch_size`` is this
   worker's batch; with W workers the gradients of W batches are summed, as MXNet did);
2. with ``update_on_kvstore`` (the default for dist stores): pushes every gradient (a list, one
   per device replica) and pulls the updated weights into every replica: the optimizer runs on
   the store (on the servers for dist types);
3. otherwise: push + pull of the gradients (``allreduce_grads``), then the optimizer updates the
   first replica's weights here and the others receive a copy (``update``).

Parameters come from ``model.parameters()`` (keys 0, 1, ...) or ``model.named_parameters()``
(keys are the names); a parameter shared by two modules is trained once; frozen parameters
(``requires_grad=False``) are left alone. For several devices in one process pass one such
iterable per replica: ``Trainer([m.parameters() for m in replicas], ...)``. Every replica and
every worker starts from the same weights (worker 0's first replica's).

BatchNorm running statistics are buffers, not parameters: they stay per worker and per replica,
as in the tutorials.

>>> trainer = pskv.Trainer(net.parameters(), "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore="dist_sync")
>>> loss(net(x), y).backward(); trainer.step(batch_size=x.shape[0])
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor

from . import optim
from .errors import OptimizerError, TrainerError
from .kv import KVStore, create
from .kv.base import Key

ParamsArg = Union[Iterable[Tensor], Iterable[tuple[str, Tensor]], Mapping[str, Tensor], Sequence[Any]]


def _one_replica(params: Any) -> tuple[list[Key], list[Tensor]]:
    """Keys and tensors of one replica's parameters (shared and frozen ones dropped)."""
    if isinstance(params, Tensor):
        raise TrainerError("params must be an iterable of tensors (model.parameters()), not one tensor")
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    named = bool(items) and all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in items)
    pairs: list[tuple[Optional[str], Any]]
    if named:
        pairs = [(str(n), t) for n, t in items]
    elif all(isinstance(i, Tensor) for i in items):
        pairs = [(None, t) for t in items]
    else:
        raise TrainerError("params must be tensors, (name, tensor) pairs, a dict, or one of those per device replica")
    keys: list[Key] = []
    tensors: list[Tensor] = []
    seen: set[int] = set()
    for name, t in pairs:
        if not isinstance(t, Tensor):
            raise TrainerError(f"parameter {name!r} is a {type(t).__name__}, not a tensor")
        if id(t) in seen or not t.requires_grad:
            continue
        seen.add(id(t))
        keys.append(name if name is not None else len(keys))
        tensors.append(t)
    return keys, tensors


def _replicas(params: ParamsArg) -> tuple[list[Key], list[list[Tensor]]]:
    """Keys and, per device replica, the tensors (one replica unless a list of them is given)."""
    if isinstance(params, Mapping):
        groups: list[Any] = [params]
    else:
        items = list(params)
        if not items:
            raise TrainerError("the Trainer got no parameters")
        one = all(isinstance(i, Tensor) for i in items) or all(
            isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in items
        )
        groups = [items] if one else items
    keys, first = _one_replica(groups[0])
    if not first:
        raise TrainerError("every parameter is frozen (requires_grad=False): nothing to train")
    replicas = [first]
    for g in groups[1:]:
        k, ts = _one_replica(g)
        if k != keys or [t.shape for t in ts] != [t.shape for t in first]:
            raise TrainerError("every device replica must have the same parameters, in the same order and shapes")
        replicas.append(ts)
    return keys, replicas


class Trainer:
    """Applies an optimizer to parameters through a store. Not thread-safe.

    ``kvstore``: a store type name (``"device"`` by default, as in MXNet), a store, or ``None``.
    A ``local``/``device`` store with a single replica is skipped (the optimizer runs here).
    ``update_on_kvstore=None`` picks: True for dist types and for several replicas; ``dist_async``
    requires it; False runs the optimizer here and uses the store only to sum gradients.
    """

    def __init__(
        self,
        params: ParamsArg,
        optimizer: Union[str, optim.Optimizer],
        optimizer_params: Optional[dict[str, Any]] = None,
        kvstore: Union[str, KVStore, None] = "device",
        compression_params: Optional[dict[str, Any]] = None,
        update_on_kvstore: Optional[bool] = None,
    ):
        self._keys, self._reps = _replicas(params)
        if isinstance(optimizer, optim.Optimizer):
            if optimizer_params:
                raise OptimizerError("give optimizer_params only with an optimizer name")
            self._optimizer = optimizer
        else:
            self._optimizer = optim.create(optimizer, **(optimizer_params or {}))
        self._scale = self._optimizer.rescale_grad
        self._sent_scale: Optional[float] = None
        self._steps = 0
        self._kv = self._make_store(kvstore, update_on_kvstore)
        self._update_on_kvstore = self._pick_update_on_kvstore(update_on_kvstore)
        if self._kv is not None:
            if compression_params:
                self._kv.set_gradient_compression(compression_params)
            self._kv.init(self._keys, [t.detach() for t in self._reps[0]])
            self._kv.pull(self._keys, self._per_key(lambda t: t))  # every replica, every worker: worker 0's weights
            if self._update_on_kvstore:
                self._kv.set_optimizer(self._optimizer)
                self._sent_scale = self._optimizer.rescale_grad
        elif compression_params:
            raise TrainerError("compression_params need a store; this Trainer runs without one (local, one device)")

    # -- setup ------------------------------------------------------------------------------------

    def _make_store(self, kvstore: Union[str, KVStore, None], update_on_kvstore: Optional[bool]) -> Optional[KVStore]:
        if kvstore is None or isinstance(kvstore, KVStore):
            return kvstore
        if not isinstance(kvstore, str):
            raise TrainerError(f"kvstore must be a store type name, a KVStore or None, not {type(kvstore).__name__}")
        if not kvstore.startswith("dist") and len(self._reps) == 1 and not update_on_kvstore:
            return None  # one device in one process: nothing to sum
        return create(kvstore)

    def _pick_update_on_kvstore(self, asked: Optional[bool]) -> bool:
        kv = self._kv
        if kv is None:
            if asked:
                raise TrainerError("update_on_kvstore=True needs a store, but kvstore is None")
            return False
        if kv.type == "dist_async":
            if asked is False:
                raise TrainerError("dist_async applies updates on the servers: update_on_kvstore=False is not possible")
            return True
        return True if asked is None else bool(asked)

    @property
    def kvstore(self) -> Optional[KVStore]:
        """The store the Trainer uses (None when it needs none)."""
        return self._kv

    @property
    def optimizer(self) -> optim.Optimizer:
        return self._optimizer

    @property
    def update_on_kvstore(self) -> bool:
        return self._update_on_kvstore

    def _per_key(self, pick: Any) -> list[list[Tensor]]:
        return [[pick(rep[i]) for rep in self._reps] for i in range(len(self._keys))]

    # -- learning rate ------------------------------------------------------------------------

    @property
    def learning_rate(self) -> float:
        """The learning rate the next step uses (a schedule applied)."""
        return self._optimizer.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        """Set the base learning rate, on the servers too when they run the optimizer."""
        self._optimizer.set_learning_rate(lr)
        if self._update_on_kvstore and self._kv is not None:
            self._kv.set_optimizer(self._optimizer)  # the same object: states are kept

    # -- the step -------------------------------------------------------------------------------

    def _set_scale(self, batch_size: float) -> None:
        if not isinstance(batch_size, (int, float)) or isinstance(batch_size, bool) or batch_size <= 0:
            raise TrainerError(f"batch_size must be a positive number, got {batch_size!r}")
        scale = self._scale / batch_size
        self._optimizer.set_rescale_grad(scale)
        if self._update_on_kvstore and self._kv is not None and scale != self._sent_scale:
            self._kv.set_optimizer(self._optimizer)
            self._sent_scale = scale

    def _grads(self, ignore_stale_grad: bool) -> list[list[Tensor]]:
        out = []
        for i, key in enumerate(self._keys):
            grads = []
            for d, rep in enumerate(self._reps):
                g = rep[i].grad
                if g is None:
                    if not ignore_stale_grad:
                        raise TrainerError(
                            f"parameter {key!r} (replica {d}) has no gradient: it was not used in the forward pass "
                            "since the last step; pass ignore_stale_grad=True to push zeros for it"
                        )
                    g = torch.zeros_like(rep[i])
                grads.append(g)
            out.append(grads)
        return out

    def step(self, batch_size: float, ignore_stale_grad: bool = False) -> None:
        """Sum the gradients over devices and workers, scale by ``1/batch_size``, update.

        Blocks until every replica holds the new weights. Parameters without a gradient are an
        error unless ``ignore_stale_grad`` (then they count as zero gradients, so dist rounds
        stay complete).
        """
        self._set_scale(batch_size)
        if self._update_on_kvstore:
            assert self._kv is not None
            with torch.no_grad():
                self._kv.push(self._keys, self._grads(ignore_stale_grad))
                self._kv.pull(self._keys, self._per_key(lambda t: t))
            self._optimizer.num_update = max(self._optimizer.num_update, self._steps + 1)
        else:
            self._allreduce(ignore_stale_grad)
            self._update_here()
        self._steps += 1

    def allreduce_grads(self, ignore_stale_grad: bool = False) -> None:
        """Replace every replica's gradient by the sum over devices and workers."""
        if self._update_on_kvstore:
            raise TrainerError("allreduce_grads() needs update_on_kvstore=False (the store runs the optimizer otherwise)")
        self._allreduce(ignore_stale_grad)

    def update(self, batch_size: float) -> None:
        """Apply the optimizer to the (already summed) gradients, scaled by ``1/batch_size``."""
        if self._update_on_kvstore:
            raise TrainerError("update() needs update_on_kvstore=False (the store runs the optimizer otherwise)")
        self._set_scale(batch_size)
        self._update_here()
        self._steps += 1

    def _allreduce(self, ignore_stale_grad: bool) -> None:
        grads = self._grads(ignore_stale_grad)
        if self._kv is None:
            return
        with torch.no_grad():
            self._kv.push(self._keys, grads)
            self._kv.pull(self._keys, grads, ignore_sparse=False)
        for i in range(len(self._keys)):  # a pushed stand-in for a missing grad becomes the grad
            for rep, g in zip(self._reps, grads[i]):
                if rep[i].grad is None:
                    rep[i].grad = g

    def _update_here(self) -> None:
        with torch.no_grad():
            for i in range(len(self._keys)):
                first = self._reps[0][i]
                grad = first.grad
                if grad is None:
                    continue
                self._optimizer.update(i, grad, first)
                for rep in self._reps[1:]:
                    rep[i].copy_(first)

    # -- states ---------------------------------------------------------------------------------

    def save_states(self, path: Union[str, Path]) -> None:
        """Write the optimizer's states (from the servers when they run it) to ``path``."""
        if self._update_on_kvstore and self._kv is not None:
            self._kv.save_optimizer_states(path)
        else:
            optim.save_states(path, self._optimizer.state_dict(), dict(enumerate(self._keys)))

    def load_states(self, path: Union[str, Path]) -> None:
        """Restore states written by :meth:`save_states` (to the servers when they run the optimizer)."""
        if self._update_on_kvstore and self._kv is not None:
            self._kv.load_optimizer_states(path)
            self._optimizer.num_update = int(optim.load_states(path).get("num_update", 0))
        else:
            self._optimizer.load_state_dict(optim.load_states(path), weights=dict(enumerate(self._reps[0])))
