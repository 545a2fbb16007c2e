"""``device``: like ``local``, but sums on the device of the first pushed tensor.

Each key's value stays on the device it was initialised on, and the optimizer runs there, so
a list of CUDA tensors is reduced and updated without visiting the CPU. On a machine without
accelerators a list of CPU tensors stands in for several devices.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .local import LocalStore


class DeviceStore(LocalStore):
    """The ``device`` store; see :class:`~pskv.kv.local.LocalStore` for the calls."""

    def __init__(self, type_name: str = "device"):
        super().__init__(type_name)

    def _home(self, value: Tensor) -> torch.device:
        return value.device

    def _merge_device(self, values: list[Tensor]) -> torch.device:
        return values[0].device
