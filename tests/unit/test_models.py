"""Shapes, payload sizes and structure of the tutorials' networks (pskv.app.models)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pskv.app import models
from pskv.app.models import get_model, parameter_shapes, resnet18, small_cnn

RESNET18_PAYLOAD_NUMBERS = 11_169_162  # 42 conv/linear weights and biases of the 10-class CIFAR ResNet-18


def _conv_linear_params(model: nn.Module) -> list[torch.Tensor]:
    return [
        p
        for m in model.modules()
        if isinstance(m, (nn.Conv2d, nn.Linear))
        for p in m.parameters(recurse=False)
    ]


def test_resnet18_payload_is_42_arrays_44_7_mb() -> None:
    params = _conv_linear_params(resnet18(10))
    assert len(params) == 42
    numbers = sum(p.numel() for p in params)
    assert numbers == RESNET18_PAYLOAD_NUMBERS
    assert round(numbers * 4 / 1e6, 1) == 44.7
    # all parameters, BatchNorm included: 17 BatchNorm layers add a weight and a bias each
    all_params = list(resnet18(10).parameters())
    assert len(all_params) == 42 + 2 * 17
    assert sum(p.numel() for p in all_params) == 11_176_970


def test_resnet18_structure_matches_d2l() -> None:
    net = resnet18(10)
    stem = net[0]
    assert isinstance(stem, nn.Conv2d)
    assert (stem.kernel_size, stem.stride, stem.padding, stem.out_channels) == ((3, 3), (1, 1), (1, 1), 64)
    assert stem.bias is not None  # Gluon's Conv2D keeps its bias
    assert not any(isinstance(m, nn.MaxPool2d) for m in net.modules())
    blocks = [m for m in net.modules() if isinstance(m, models.Residual)]
    assert len(blocks) == 8
    shortcut = [b.conv3 for b in blocks if b.conv3 is not None]
    assert [(c.out_channels, c.stride, c.kernel_size) for c in shortcut] == [
        (128, (2, 2), (1, 1)),
        (256, (2, 2), (1, 1)),
        (512, (2, 2), (1, 1)),
    ]
    assert net[-1].in_features == 512 and net[-1].out_features == 10


@pytest.mark.parametrize("size", [32, 16])
def test_resnet18_forward_and_backward(size: int) -> None:
    torch.manual_seed(0)
    net = resnet18(10)
    x = torch.randn(2, 3, size, size)
    out = net(x)
    assert out.shape == (2, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_resnet18_one_channel_and_classes() -> None:
    net = resnet18(num_classes=7, in_channels=1).eval()
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 7)


@pytest.mark.parametrize(("channels", "size", "flat"), [(1, 28, 800), (3, 32, 1250), (3, 16, 50)])
def test_small_cnn_flatten_size_and_forward(channels: int, size: int, flat: int) -> None:
    net = small_cnn(10, in_channels=channels, image_size=size)
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(flat, 128), (128, 10)]
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(20, (3, 3)), (50, (5, 5))]
    assert net(torch.zeros(3, channels, size, size)).shape == (3, 10)


def test_small_cnn_refuses_too_small_images() -> None:
    with pytest.raises(ValueError, match="image_size=12"):
        small_cnn(image_size=12)


def test_get_model_names_and_error() -> None:
    assert isinstance(get_model("small_cnn", in_channels=3, image_size=32), nn.Sequential)
    assert get_model("resnet18", num_classes=5)(torch.zeros(1, 3, 32, 32)).shape == (1, 5)
    with pytest.raises(ValueError, match=r"unknown model 'alexnet'; choose one of resnet18, small_cnn$"):
        get_model("alexnet")
    with pytest.raises(ValueError, match="unknown model 'resnet50'"):
        get_model("resnet50")  # a benchmark payload only


@pytest.mark.parametrize(
    ("name", "arrays", "numbers"),
    [
        ("resnet18", 42, RESNET18_PAYLOAD_NUMBERS),
        ("resnet50", 161, 25_557_032),
        ("vgg16", 32, 138_357_544),
        ("small_cnn", 8, 129_068),
    ],
)
def test_parameter_shapes(name: str, arrays: int, numbers: int) -> None:
    shapes = parameter_shapes(name)
    assert len(shapes) == arrays
    assert sum(math.prod(s) for s in shapes) == numbers
    assert all(isinstance(s, tuple) and all(isinstance(d, int) for d in s) for s in shapes)


def test_parameter_shapes_details() -> None:
    r18 = parameter_shapes("resnet18")
    assert r18[:2] == [(64, 3, 3, 3), (64,)]
    assert r18[-2:] == [(10, 512), (10,)]
    # the shapes equal those of a real (non-meta) model
    assert r18 == [tuple(p.shape) for p in _conv_linear_params(resnet18(10))]
    assert parameter_shapes("small_cnn") == [tuple(p.shape) for p in small_cnn(10, 1, 28).parameters()]
    with pytest.raises(ValueError, match=r"'lenet'; choose one of resnet18, small_cnn, resnet50, vgg16$"):
        parameter_shapes("lenet")


def test_vgg16_shapes_are_torchvisions() -> None:
    vgg = parameter_shapes("vgg16")
    convs, linears = vgg[:26], vgg[26:]
    widths = [w[0] for w in convs[::2]]
    assert widths == [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]
    assert [w[1:] for w in convs[::2]] == [(c, 3, 3) for c in [3, *widths[:-1]]]  # each reads the one before
    assert all(bias == (w[0],) for w, bias in zip(vgg[::2], vgg[1::2]))  # every layer has a bias
    assert linears == [(4096, 25088), (4096,), (4096, 4096), (4096,), (1000, 4096), (1000,)]


def test_resnet50_shapes_are_torchvisions() -> None:
    r50 = parameter_shapes("resnet50")
    assert r50[:3] == [(64, 3, 7, 7), (64,), (64,)] and r50[-2:] == [(1000, 2048), (1000,)]
    # the first bottleneck: 1x1 (64), 3x3 (64), 1x1 (256), each with BatchNorm, then the 1x1 shortcut
    assert r50[3:15] == [
        (64, 64, 1, 1), (64,), (64,), (64, 64, 3, 3), (64,), (64,),
        (256, 64, 1, 1), (256,), (256,), (256, 64, 1, 1), (256,), (256,),
    ]  # fmt: skip
    convs = [s for s in r50 if len(s) == 4]
    assert len(convs) == 1 + 16 * 3 + 4  # stem, 16 bottlenecks of three, four shortcuts; no conv biases
    assert sum(s == (2048, 512, 1, 1) for s in convs) == 3
    assert (512, 512, 3, 3) in convs and (2048, 1024, 1, 1) in convs


def test_parameter_shapes_allocates_nothing() -> None:
    parameter_shapes("resnet18")  # built on the meta device
    assert torch.empty(1).device.type == "cpu"  # the default device is restored afterwards
