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


NAN, INF = float("nan"), float("inf")


def test_2bit_sends_nan_and_inf_as_nan_and_keeps_neither() -> None:
    """A NaN or Inf goes out as code 3 (NaN to the receiver, whose PSKV_NONFINITE rules apply); the
    residual drops it, so the next push follows the formula again (it stayed NaN: zeros sent for good)."""
    codec = Codec.create({"type": "2bit", "threshold": 0.5})
    r = torch.tensor([0.25, 0.25, 0.25, 0.25])
    sent = codec.decode(codec.encode(torch.tensor([NAN, INF, -INF, 0.5]), r), 4, torch.float32)
    assert sent[:3].isnan().all() and sent[3].item() == 0.5
    assert r.tolist() == [0.0, 0.0, 0.0, 0.25]
    sent = codec.decode(codec.encode(torch.tensor([0.5, 0.5, -0.5, 0.0]), r), 4, torch.float32)
    assert sent.tolist() == [0.5, 0.5, -0.5, 0.0] and r.tolist() == [0.0, 0.0, 0.0, 0.25]


def test_fp16_saturates_and_keeps_what_is_over_its_range() -> None:
    """1e6 is a finite fp32 gradient: fp16 sends its largest value, 65504, and the rest waits in the
    residual (it was sent as Inf, and the residual became -Inf for good)."""
    codec = Codec.create({"type": "fp16"})
    r = torch.zeros(3)
    wire = codec.encode(torch.tensor([1e6, -1e6, NAN]), r)
    assert wire[:2].tolist() == [65504.0, -65504.0] and wire[2].isnan()
    assert r.tolist() == [1e6 - 65504, -1e6 + 65504, 0.0]
    total = wire.float()
    for _ in range(20):
        total += codec.encode(torch.zeros(3), r).float()
    assert total[:2].tolist() == [1e6, -1e6] and r.tolist() == [0.0, 0.0, 0.0]  # all of it arrives, in time


def test_1bit_refuses_nan_and_inf_before_the_residual_changes() -> None:
    kv = pskv.kv.create("local")
    kv.set_gradient_compression({"type": "1bit", "threshold": 0.0})
    kv.init("w", torch.zeros(3))
    with pytest.raises(pskv.NonFiniteError, match="key 'w': a gradient with NaN or Inf cannot be sent with 1bit"):
        kv.push("w", torch.tensor([INF, 1.0, 1.0]))
    out = torch.empty(3)
    kv.pushpull("w", torch.tensor([0.5, -0.5, 0.5]), out)
    assert out.tolist() == [1.0, -1.0, 1.0]  # the residual was zeros: the refused push left no trace


def test_a_float64_key_keeps_a_float64_residual() -> None:
    comp = Compressor({"type": "fp16"})
    g = torch.tensor([1.0 + 1e-12], dtype=torch.float64)
    r = comp.residual(0, 0, g)
    assert r.dtype == torch.float64
    assert comp.codec.encode(g, r).double() + r == g  # float32 lost the 1e-12


def test_the_same_codec_set_again_keeps_the_residuals() -> None:
    """As set_optimizer: the same settings again change nothing (they dropped every residual), others start afresh."""
    kv = pskv.kv.create("local")
    kv.init("w", torch.zeros(3))
    out = torch.empty(3)
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    for codec, grad, want in (({"type": "2bit", "threshold": 0.5}, 0.3, 0.0),  # 0.3 < 0.5: kept back
                              ({"type": "2bit", "threshold": 0.5}, 0.3, 0.5),  # 0.6: 0.5 sent, 0.1 kept
                              ({"type": "2bit", "threshold": 0.25}, 0.2, 0.0)):  # afresh: 0.2 < 0.25 (0.3 with the old 0.1)
        kv.set_gradient_compression(codec)
        kv.push("w", torch.full((3,), grad))
        kv.pull("w", out=out)
        assert out.tolist() == [want] * 3, (codec, grad, out)
