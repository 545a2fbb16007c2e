"""Gradient compression: what a worker sends instead of a dense float gradient. The codecs are those
of docs/SPEC.md, section 5 (``2bit``, ``1bit``, ``fp16``, ``bf16``). Each keeps a *residual* per key
(and per device of a device list): the part of the gradient not sent yet, added to the next push.
``init`` values are never compressed; row-sparse pushes are sent as they are."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .errors import CompressionError, NonFiniteError

TYPES = ("1bit", "2bit", "bf16", "fp16")
_CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
_BITS = {"2bit": 2, "1bit": 1}


class Codec:
    """One compression type with its parameters; stateless (residuals are passed in)."""

    def __init__(self, kind: str, threshold: float = 0.0):
        self.type = kind
        self.threshold = threshold
        self.wire_dtype = _CASTS.get(kind, torch.int32)  # the dtype of what encode() returns
        # what each code of 2bit or 1bit stands for: 0, +t, -t, NaN (or Inf); or -1, +1
        self._levels = [0.0, threshold, -threshold, math.nan] if kind == "2bit" else [-1.0, 1.0]

    @staticmethod
    def create(params: Mapping[str, Any]) -> Codec:
        """Build from ``{"type": "2bit"|"1bit"|"fp16"|"bf16", "threshold": t}``."""
        if not isinstance(params, Mapping):
            raise CompressionError(f"compression parameters must be a dict, got {params!r}")
        kind = params.get("type")
        if extra := set(params) - {"type", "threshold"}:
            raise CompressionError(f"unknown compression parameter(s) {sorted(extra)}; known: type, threshold")
        if kind not in TYPES:
            raise CompressionError(f"unknown compression type {kind!r}; known: {', '.join(TYPES)}")
        if kind in _CASTS and "threshold" in params:
            raise CompressionError(f"{kind} compression takes no threshold")
        t = params.get("threshold", 0.5 if kind == "2bit" else 0.0)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t != t:
            raise CompressionError(f"{kind} threshold must be a number, got {t!r}")
        if kind == "2bit" and t <= 0:
            raise CompressionError(f"2bit threshold must be > 0, got {t}")
        return Codec(kind, float(t))

    def describe(self) -> dict[str, Any]:
        return {"type": self.type} if self.type in _CASTS else {"type": self.type, "threshold": self.threshold}

    def encode(self, grad: Tensor, residual: Tensor) -> Tensor:
        """Fold ``grad`` into ``residual`` (in place), take out what is sent, return the wire tensor. fp16 saturates
        (what is over its range waits in the residual); NaN and Inf are sent as such (2bit: as NaN, its code 3), so
        the receiver's rules for them apply, and never stay in the residual (``check`` keeps them from 1bit)."""
        r = residual.view(-1)
        r.add_(grad.reshape(-1).to(r.dtype))
        big = torch.finfo(self.wire_dtype).max if self.type in _CASTS else math.inf
        lo, hi = (float(x) for x in torch.aminmax(r)) if r.numel() and not r.is_cuda else (0.0, 0.0)  # (NaN if any is)
        odd = r.is_cuda or not (-big <= lo and hi <= big and math.isfinite(lo - hi))  # the masked steps (on a GPU: no sync)
        if self.type in _CASTS:
            sent = (r.clamp(-big, big).where(r.isfinite(), r) if odd else r).to(self.wire_dtype)
            r.sub_(sent.to(r.dtype))
        else:
            t = self.threshold
            codes = (r >= t).long() | ((r <= -t).long() << 1) if self.type == "2bit" else (r > t).long()
            codes = codes.where(r.isfinite(), 3) if odd and self.type == "2bit" else codes
            r.sub_(torch.tensor(self._levels, dtype=r.dtype, device=r.device)[codes])
            sent = _pack(codes, _BITS[self.type])
        if odd:
            r.nan_to_num_(0.0, 0.0, 0.0)
        return sent

    def check(self, values: list[Tensor], key: object) -> None:
        """1bit has no code for NaN or Inf: a push of them is an error before any residual changes (the
        stores call it for 1bit)."""
        if not all(bool(v.isfinite().all()) for v in values):
            raise NonFiniteError(f"{key}: a gradient with NaN or Inf cannot be sent with 1bit compression "
                                 "(2bit, fp16 and bf16 send them, and PSKV_NONFINITE decides)")

    def decode(self, wire: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
        """The dense 1-D gradient of ``numel`` elements that ``wire`` stands for."""
        if self.type in _CASTS:
            return wire.reshape(-1).to(dtype)
        return torch.tensor(self._levels, dtype=dtype, device=wire.device)[_unpack(wire, _BITS[self.type], numel)]

    def wire_numel(self, numel: int) -> int:
        """How many elements the wire tensor of a ``numel``-element gradient has."""
        return -(-numel // (32 // _BITS[self.type])) if self.type in _BITS else numel

    def roundtrip(self, grad: Tensor, residual: Tensor) -> Tensor:
        """``decode(encode(grad))`` shaped like ``grad``: what the receiver will see."""
        return self.decode(self.encode(grad, residual), grad.numel(), grad.dtype).view(grad.shape)


def _pack(codes: Tensor, bits: int) -> Tensor:
    """Pack small non-negative ints (``< 2**bits``) into int32 words, lowest bits first."""
    per = 32 // bits
    padded = torch.nn.functional.pad(codes.reshape(-1).to(torch.int64), (0, -codes.numel() % per))
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    words = (padded.view(-1, per) << shifts).sum(dim=1)
    # keep the low 32 bits and reinterpret them as a signed int32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack(words: Tensor, bits: int, n: int) -> Tensor:
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=words.device)
    return ((w.view(-1, 1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]


class Compressor:
    """A codec plus one store's residuals per ``(key, device index)``; the store's lock guards it."""

    def __init__(self, params: Mapping[str, Any]):
        self.codec = Codec.create(params)
        self._residuals: dict[tuple[int, int], Tensor] = {}

    def residual(self, key: int, index: int, like: Tensor) -> Tensor:
        """The residual of ``key``'s ``index``-th device value (zeros at first)."""
        r = self._residuals.get((key, index))
        if r is None:
            r = self._residuals[(key, index)] = torch.zeros(like.shape, dtype=torch.promote_types(like.dtype, torch.float32), device=like.device)
        return r
