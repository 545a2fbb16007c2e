"""``local`` and ``device``: the whole store in this process.

``local`` sums and updates on the CPU. ``device`` makes the sum on the device of the first pushed
tensor and keeps each value (and runs the optimizer) on the device it was initialised on, so a
list of CUDA tensors is reduced and updated without visiting the CPU. On a machine without
accelerators a list of CPU tensors stands in for several devices.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .. import errors
from ..ops import reduce_values, write_rows
from ..optim import Optimizer, apply_push
from .base import KeyMeta, KVStore


class LocalStore(KVStore):
    """A store that lives in one process. Calls are synchronous: each returns when done.

    >>> kv = pskv.kv.create("local")
    >>> kv.init(0, torch.zeros(3)); kv.set_optimizer(pskv.optim.create("sgd", learning_rate=0.5))
    >>> kv.push(0, torch.ones(3)); out = torch.empty(3); kv.pull(0, out)   # out: -0.5
    """

    def __init__(self, type_name: str = "local"):
        super().__init__(type_name)
        self._values: dict[int, Tensor] = {}
        self._on_device = type_name == "device"

    def _home(self, value: Tensor) -> torch.device:
        """Where a key's value is kept."""
        return value.device if self._on_device else torch.device("cpu")

    def _merge_device(self, values: list[Tensor]) -> torch.device:
        """Where a push's values are summed."""
        return values[0].device if self._on_device else torch.device("cpu")

    def _init_impl(self, items: list[tuple[KeyMeta, Tensor]]) -> None:
        for meta, v in items:
            stored = v.detach().to(self._home(v), copy=True)
            self._values[meta.id] = stored.to_dense() if stored.is_sparse else stored

    def _push_impl(self, items: list[tuple[KeyMeta, list[Tensor]]], priority: int, wait: bool, held: bool) -> None:
        for meta, values in items:
            comp = self._compressor
            if comp is not None:
                values = [
                    v if v.is_sparse else comp.codec.roundtrip(v, comp.residual(meta.id, i, v)).to(v.dtype)
                    for i, v in enumerate(values)
                ]
            merged = reduce_values(values, self._merge_device(values)).to(self._values[meta.id].device)
            stored = self._values[meta.id]
            apply_push(self._optimizer, meta.id, merged, stored, merged_is_scratch=True)  # merged is ours

    def _pull_impl(self, items: list[tuple[KeyMeta, list[Tensor]]], priority: int, wait: bool, rescale: Optional[float]) -> None:
        for meta, outs in items:
            stored = self._values[meta.id]
            for out in outs:
                out.copy_(stored.to_sparse(1) if out.is_sparse else stored)

    def _row_sparse_pull_impl(self, items: list[tuple[KeyMeta, list[Tensor], list[Tensor]]], priority: int) -> None:
        for meta, outs, rows in items:
            stored = self._values[meta.id]
            for out, r in zip(outs, rows):
                write_rows(out, r, stored.index_select(0, r.to(stored.device)))

    def _set_optimizer_impl(self, optimizer: Optimizer) -> None:
        self._optimizer = optimizer

    def _optimizer_state(self) -> dict[str, Any]:
        if self._optimizer is None:
            raise errors.OptimizerError("no optimizer is set on this store; call set_optimizer first")
        return self._optimizer.state_dict()

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        if self._optimizer is None:
            self._optimizer = Optimizer.from_description(state["optimizer"])
        elif state["optimizer"]["name"] != self._optimizer.name:
            raise errors.OptimizerError(
                f"the file holds {state['optimizer']['name']!r} states but the store's optimizer is {self._optimizer.name!r}"
            )
        self._optimizer.load_state_dict(state, weights=self._values)
