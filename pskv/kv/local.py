"""``local`` and ``device``: the whole store in this process. ``device`` sums on the device of the
first pushed tensor and keeps each value (and runs the optimizer) on the device it was initialised
on, so CUDA tensors are reduced and updated without visiting the CPU; ``local`` uses the CPU."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .. import errors
from ..ops import reduce_values, write_rows
from ..optim import Optimizer, apply_push
from .base import Group, KeyMeta, KVStore


class LocalStore(KVStore):
    """A store that lives in one process. Calls are synchronous: each returns when done."""

    def __init__(self, type_name: str = "local"):
        super().__init__(type_name)
        self._values: dict[int, Tensor] = {}
        self._on_device = type_name == "device"

    def _device(self, value: Tensor) -> torch.device:
        """Where a key's initial value is kept, or a push whose first tensor is ``value`` is summed."""
        return value.device if self._on_device else torch.device("cpu")

    def _init_impl(self, items: list[tuple[KeyMeta, Tensor]]) -> None:
        for meta, v in items:
            stored = v.detach().to(self._device(v), copy=True)
            self._values[meta.id] = stored.to_dense() if stored.is_sparse else stored

    def _push_impl(self, items: list[Group], priority: int, wait: bool, held: bool) -> None:
        for meta, values in items:
            comp = self._compressor
            if comp is not None:
                values = [
                    v if v.is_sparse else comp.codec.roundtrip(v, comp.residual(meta.id, i, v))
                    for i, v in enumerate(values)
                ]
            stored = self._values[meta.id]
            merged = reduce_values(values, self._device(values[0])).to(stored.device)
            apply_push(self._optimizer, meta.id, merged, stored, merged_is_scratch=True)  # merged is ours

    def _pull_impl(self, items: list[Group], priority: int, wait: bool, rescale: Optional[float]) -> None:
        for meta, outs in items:
            stored = self._values[meta.id]
            for out in outs:
                out.copy_(stored.to_sparse(1) if out.is_sparse else stored)

    def _row_sparse_pull_impl(self, items: list[tuple[KeyMeta, list[Tensor], list[Tensor]]], priority: int) -> None:
        for meta, outs, rows in items:
            stored = self._values[meta.id]
            for out, r in zip(outs, rows):
                write_rows(out, r, stored.index_select(0, r.to(stored.device)))

    def _optimizer_state(self) -> dict[str, Any]:
        if self._optimizer is None:
            raise errors.OptimizerError("no optimizer is set on this store; call set_optimizer first")
        return self._optimizer.state_dict()

    def _load_optimizer_state(self, state: dict[str, Any], optimizer: Optimizer) -> None:
        optimizer.load_state_dict(state, weights=self._values)
