"""Gradient compression codecs against the formulas of SPEC.md section 5."""

from __future__ import annotations

import pytest
import torch

import pskv
from pskv.compression import Codec, Compressor, _pack, _unpack


def _reference_2bit(grads: list[torch.Tensor], t: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    r = torch.zeros_like(grads[0])
    sent = []
    for g in grads:
        r = r + g
        s = torch.zeros_like(g)
        for i in range(g.numel()):
            if r[i] >= t:
                s[i], r[i] = t, r[i] - t
            elif r[i] <= -t:
                s[i], r[i] = -t, r[i] + t
        sent.append(s)
    return sent, r


def _reference_1bit(grads: list[torch.Tensor], t: float) -> tuple[list[torch.Tensor], torch.Tensor]:
    r = torch.zeros_like(grads[0])
    sent = []
    for g in grads:
        r = r + g
        s = torch.where(r > t, torch.ones_like(g), -torch.ones_like(g))
        r = r - s
        sent.append(s)
    return sent, r


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
def test_2bit_follows_the_formula_with_residuals(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    grads = [torch.randn(n, generator=gen) * 0.6 for _ in range(5)]
    codec = Codec.create({"type": "2bit", "threshold": 0.5})
    residual = torch.zeros(n)
    want, want_r = _reference_2bit(grads, 0.5)
    for g, w in zip(grads, want):
        wire = codec.encode(g, residual)
        assert wire.dtype == torch.int32 and wire.numel() == -(-n // 16)  # 16 values per word
        assert torch.equal(codec.decode(wire, n, torch.float32), w)
    torch.testing.assert_close(residual, want_r)


def test_2bit_small_example() -> None:
    codec = Codec.create({"type": "2bit", "threshold": 0.5})
    r = torch.zeros(4)
    sent = codec.roundtrip(torch.tensor([0.6, -0.2, -0.7, 0.1]), r)
    assert sent.tolist() == pytest.approx([0.5, 0.0, -0.5, 0.0])
    assert r.tolist() == pytest.approx([0.1, -0.2, -0.2, 0.1])
    sent = codec.roundtrip(torch.tensor([0.4, -0.3, 0.0, 0.0]), r)  # residual carries over
    assert sent.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])


@pytest.mark.parametrize("n", [3, 32, 33, 70])
def test_1bit_follows_the_formula(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    grads = [torch.randn(n, generator=gen) for _ in range(4)]
    codec = Codec.create({"type": "1bit", "threshold": 0.2})
    residual = torch.zeros(n)
    want, want_r = _reference_1bit(grads, 0.2)
    for g, w in zip(grads, want):
        wire = codec.encode(g, residual)
        assert wire.numel() == -(-n // 32)  # 32 values per word
        assert torch.equal(codec.decode(wire, n, torch.float32), w)
    torch.testing.assert_close(residual, want_r)


@pytest.mark.parametrize(("kind", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_casts_keep_the_rounding_error_as_residual(kind: str, dtype: torch.dtype) -> None:
    codec = Codec.create({"type": kind})
    g = torch.tensor([1.0 + 1e-4, 3.14159265, -2.7182818])
    r = torch.zeros(3)
    wire = codec.encode(g, r)
    assert wire.dtype == dtype
    torch.testing.assert_close(wire.float() + r, g, rtol=0, atol=1e-7)  # nothing lost overall


def test_pack_unpack_roundtrip() -> None:
    codes = torch.randint(0, 4, (1001,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_unpack(_pack(codes, 2), 2, 1001), codes)
    bits = torch.randint(0, 2, (65,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_unpack(_pack(bits, 1), 1, 65), bits)


def test_residuals_are_per_key_and_device() -> None:
    comp = Compressor({"type": "2bit", "threshold": 1.0})
    like = torch.zeros(3)
    assert comp.residual(0, 0, like) is comp.residual(0, 0, like)
    assert comp.residual(0, 0, like) is not comp.residual(0, 1, like)
    assert comp.residual(0, 0, like) is not comp.residual(1, 0, like)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"type": "3bit"}, "unknown compression type '3bit'"),
        ({"type": "2bit", "threshold": 0}, "threshold must be > 0"),
        ({"type": "2bit", "threshold": "x"}, "must be a number"),
        ({"type": "fp16", "threshold": 1}, "takes no threshold"),
        ({"type": "2bit", "thresh": 1}, "unknown compression parameter"),
        ("2bit", "must be a dict"),
    ],
)
def test_bad_parameters(params: object, match: str) -> None:
    with pytest.raises(pskv.CompressionError, match=match):
        Codec.create(params)  # type: ignore[arg-type]
