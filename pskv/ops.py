"""Tensor helpers shared by the stores and the servers: sums of device values, row writes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def outside(rows: Tensor, n: int) -> bool:
    """Whether any of the row ids ``rows`` falls outside ``[0, n)``."""
    return bool(rows.numel()) and (int(rows.min()) < 0 or int(rows.max()) >= n)


def reduce_values(values: Sequence[Tensor], device: torch.device) -> Tensor:
    """The sum of ``values`` on ``device``, never aliasing an input; row-sparse (coalesced) if all are."""
    dense = [v for v in values if not v.is_sparse]
    sparse = [v for v in values if v.is_sparse]
    if not dense:
        idx = torch.cat([s.coalesce().indices().to(device) for s in sparse], dim=1)
        val = torch.cat([s.coalesce().values().to(device) for s in sparse], dim=0)
        return torch.sparse_coo_tensor(idx, val, sparse[0].shape, check_invariants=False).coalesce()
    out = dense[0].detach().to(device, copy=True)
    for v in [*dense[1:], *sparse]:
        out.add_(v.detach().to(device))
    return out


def write_rows(out: Tensor, rows: Tensor, data: Tensor) -> None:
    """Make ``out`` hold exactly ``rows`` (sorted, unique) with ``data``; other rows absent/zero."""
    if out.is_sparse:
        ids, values = rows.unsqueeze(0).to(out.device), data.to(out.device, out.dtype)
        out.copy_(torch.sparse_coo_tensor(ids, values, out.shape, check_invariants=False).coalesce())
    else:
        out.zero_()
        out.index_copy_(0, rows.to(out.device), data.to(out.device, out.dtype))
