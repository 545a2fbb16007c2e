"""Data helpers for data-parallel training: which samples a worker reads, and splitting a batch
over devices. Both are deterministic given their arguments, so every worker computes the same
split of the data without talking to the others (data sets and models are in ``pskv.app``)."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterator, Sequence
from typing import Union

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Sampler

__all__ = ["SplitSampler", "split_and_load"]


class SplitSampler(Sampler[int]):
    """Indices of one worker's part of a data set, reshuffled each epoch (docs/SPEC.md, section 7
    and "SplitSampler epochs"): part ``i`` is ``[i*L, (i+1)*L)`` with ``L = length // num_parts``,
    permuted by a generator seeded with ``seed + epoch``."""

    def __init__(self, length: int, num_parts: int = 1, part_index: int = 0, shuffle: bool = True, seed: int = 0) -> None:
        if not all(isinstance(n, numbers.Integral) for n in (length, num_parts, part_index, seed)) or num_parts < 1:  # (numpy's too)
            raise ValueError(f"length, num_parts, part_index and seed are whole numbers, num_parts >= 1; got length={length!r}, "
                             f"num_parts={num_parts!r}, part_index={part_index!r}, seed={seed!r}")
        if not 0 <= part_index < num_parts:
            raise ValueError(f"part_index must be in [0, num_parts) = [0, {num_parts}), got part_index={part_index}")
        if length < num_parts:
            raise ValueError(f"length must be >= num_parts ({num_parts}) so that every part has a sample, got length={length}")
        self.length, self.num_parts, self.part_index = length, num_parts, part_index
        self.shuffle, self.seed, self.epoch = shuffle, int(seed), 0
        self.part_len = length // num_parts
        self.start, self.end = self.part_len * part_index, self.part_len * (part_index + 1)

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` produce epoch ``epoch``'s order (as ``DistributedSampler``)."""
        self.epoch = operator.index(epoch)  # numpy's ints are ints (iter() raised a TypeError); 2.0 is no epoch

    def indices(self, epoch: int) -> list[int]:
        """This part's indices in epoch ``epoch``'s order (does not change :attr:`epoch`)."""
        if not self.shuffle:
            return list(range(self.start, self.end))
        generator = torch.Generator().manual_seed(self.seed + operator.index(epoch))  # (numpy's ints too)
        return (torch.randperm(self.part_len, generator=generator) + self.start).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.indices(self.epoch)
        self.epoch += 1
        return iter(order)

    def __len__(self) -> int:
        return self.part_len


def split_and_load(batch: Tensor, devices: Union[Sequence[Union[torch.device, str]], torch.device, str], batch_axis: int = 0,
                   even_split: bool = True) -> list[Tensor]:
    """Split ``batch`` along ``batch_axis`` into one part per device (docs/SPEC.md, section 7; one
    device alone is a list of one); fewer rows than devices is a ``ValueError`` either way, as in MXNet."""
    devices = [devices] if isinstance(devices, (str, torch.device)) else devices  # ("cpu" is no list of "c", "p", "u")
    batch = batch if isinstance(batch, Tensor) else torch.as_tensor(np.array(batch, order="C") if hasattr(batch, "__array__") or isinstance(batch, memoryview) else batch)  # numpy, memoryview: copied as MXNet's nd.array did (x[:, ::-1] too), dtype and shape kept
    if not -batch.dim() <= batch_axis < batch.dim():
        raise ValueError(f"batch_axis {batch_axis} is not an axis of a batch of shape {tuple(batch.shape)}")
    n = len(devices)
    if n == 0:
        raise ValueError("split_and_load needs at least one device, got an empty list")
    if n == 1:
        return [batch.to(devices[0])]
    size = batch.shape[batch_axis]
    if size < n:
        raise ValueError(f"cannot split a batch of size {size} (axis {batch_axis}) over {n} devices: "
                         "at least one row per device is needed")
    if even_split and size % n != 0:
        raise ValueError(f"batch size {size} (axis {batch_axis}) is not divisible by the number of devices "
                         f"{n}; use a multiple of {n} or even_split=False")
    return [part.to(device) for part, device in zip(torch.tensor_split(batch, n, dim=batch_axis), devices)]
