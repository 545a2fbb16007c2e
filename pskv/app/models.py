"""The networks the tutorials train (plain ``torch.nn`` modules) and the payloads ``pskv bench`` moves:
d2l's CIFAR ResNet-18 and the Gluon lab's small CNN, and as shapes only (a CPU demo does not train
them) the ImageNet ResNet-50 and VGG-16."""

from __future__ import annotations

import torch
from torch import nn

MODEL_NAMES = ("resnet18", "small_cnn")
Shape = tuple[int, ...]


class Residual(nn.Module):
    """d2l's residual block: conv1-bn1-relu-conv2-bn2 plus the shortcut (a strided 1x1 ``conv3`` when
    ``stride > 1``), then relu. Attributes are registered in the Gluon original's order, so that
    ``parameters()`` walks the arrays in the order of MXNet's ``collect_params()``."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, kernel_size=3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.conv3 = nn.Conv2d(in_channels, channels, kernel_size=1, stride=stride) if stride > 1 else None
        self.bn1 = nn.BatchNorm2d(channels)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.conv3 is not None:
            x = self.conv3(x)
        return torch.relu(y + x)


def resnet18(num_classes: int = 10, in_channels: int = 3) -> nn.Sequential:
    """ResNet-18 as the d2l CIFAR-10 tutorial builds it, for inputs of 8x8 and more: a 3x3 stem conv
    (stride 1, no max-pool, convs with biases as Gluon's), four stages of two residual blocks (stages
    2-4 halve the size), global average pool, ``Linear(512, num_classes)``."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 64, kernel_size=3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Sequential(Residual(64, 64), Residual(64, 64)),
        nn.Sequential(Residual(64, 128, stride=2), Residual(128, 128)),
        nn.Sequential(Residual(128, 256, stride=2), Residual(256, 256)),
        nn.Sequential(Residual(256, 512, stride=2), Residual(512, 512)),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes),
    )  # fmt: skip


def small_cnn(num_classes: int = 10, in_channels: int = 1, image_size: int = 28) -> nn.Sequential:
    """The multi-GPU lab's network for ``image_size`` x ``image_size`` inputs (14 or more)."""
    side = ((image_size - 2) // 2 - 4) // 2  # after the convs and pools: 4 at 28, 5 at 32
    if side < 1:
        raise ValueError(f"small_cnn needs image_size >= 14, got image_size={image_size}")
    return nn.Sequential(
        nn.Conv2d(in_channels, 20, kernel_size=3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(20, 50, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(50 * side * side, 128), nn.ReLU(),
        nn.Linear(128, num_classes),
    )  # fmt: skip


def get_model(name: str, num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> nn.Module:
    """A network by name, one of ``MODEL_NAMES``; ``image_size`` matters only to ``small_cnn``."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return resnet18(num_classes, in_channels) if name == "resnet18" else small_cnn(num_classes, in_channels, image_size)


def _resnet50_shapes() -> list[Shape]:
    """torchvision's ``resnet50()`` (v1.5, bias-free convs), in its ``parameters()`` order."""
    shapes: list[Shape] = [(64, 3, 7, 7), (64,), (64,)]  # stem conv, its BatchNorm's weight and bias
    channels = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            out = 4 * width
            for conv in ((width, channels, 1, 1), (width, width, 3, 3), (out, width, 1, 1)):
                shapes += [conv, conv[:1], conv[:1]]
            if block == 0:  # the first block of a stage changes the channel count: 1x1 shortcut conv
                shapes += [(out, channels, 1, 1), (out,), (out,)]
            channels = out
    return [*shapes, (1000, channels), (1000,)]


def _vgg16_shapes() -> list[Shape]:
    """torchvision's ``vgg16()`` (no BatchNorm): 13 3x3 convs, then 25088-4096-4096-1000."""
    widths = (3, 64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512)
    weights: list[Shape] = [(widths[i + 1], widths[i], 3, 3) for i in range(len(widths) - 1)]
    weights += [(n_out, n_in) for n_in, n_out in ((512 * 7 * 7, 4096), (4096, 4096), (4096, 1000))]
    return [shape for w in weights for shape in (w, w[:1])]  # each weight, then its bias


def parameter_shapes(name: str) -> list[Shape]:
    """The arrays of a benchmark payload (``MODEL_NAMES``, "resnet50", "vgg16"): "resnet18", the 10-class
    CIFAR net's conv and linear weights and biases (BatchNorm left out, as in the peers' figures: 42
    arrays, 11,169,162 numbers); "small_cnn", the 10-class, 1-channel, 28x28 net's; "resnet50", "vgg16",
    torchvision's 1000-class networks' (161 arrays, 25,557,032 numbers; 32, 138,357,544)."""
    if name == "resnet50":
        return _resnet50_shapes()
    if name == "vgg16":
        return _vgg16_shapes()
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of resnet18, small_cnn, resnet50, vgg16")
    with torch.device("meta"):  # shapes without allocating memory
        model = resnet18(10) if name == "resnet18" else small_cnn(10, 1, 28)
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    return [tuple(p.shape) for m in layers for p in m.parameters(recurse=False)]
