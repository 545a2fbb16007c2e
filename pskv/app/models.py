"""The networks the tutorials train, as plain ``torch.nn`` modules.

- :func:`resnet18`: the CIFAR variant of ResNet-18 that the d2l multi-machine tutorial defines
  (3x3 stem, no max-pool, convolutions with biases as Gluon's ``Conv2D`` has by default).
- :func:`small_cnn`: the two-convolution network of the multi-GPU Gluon lab.
- :func:`resnet50`, :func:`vgg16`: the standard ImageNet networks (torchvision's layer shapes),
  used mainly for their parameter shapes by the bandwidth benchmark.

>>> from pskv.app.models import get_model, parameter_shapes
>>> net = get_model("resnet18", num_classes=10)
>>> net(torch.zeros(2, 3, 32, 32)).shape
torch.Size([2, 10])
>>> len(parameter_shapes("resnet18"))
42

This module imports nothing else from pskv. Building a model is not thread-safe only in the sense
that ``torch``'s default-device context is per thread; the modules themselves are ordinary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = [
    "MODEL_NAMES",
    "Bottleneck",
    "Residual",
    "get_model",
    "parameter_shapes",
    "resnet18",
    "resnet50",
    "small_cnn",
    "vgg16",
]

MODEL_NAMES = ("resnet18", "small_cnn", "resnet50", "vgg16")


# --------------------------------------------------------------------------- ResNet-18 (CIFAR, d2l)
class Residual(nn.Module):
    """d2l's residual block: conv1-bn1-relu-conv2-bn2, plus the shortcut (a strided 1x1 ``conv3``
    when the block changes shape), then relu.

    Attributes are registered in the order of the Gluon original (conv1, conv2, conv3, bn1, bn2) so
    that ``parameters()`` walks the arrays in the order MXNet's ``collect_params()`` did.
    """

    def __init__(self, in_channels: int, channels: int, use_1x1conv: bool = False, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, kernel_size=3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.conv3 = nn.Conv2d(in_channels, channels, kernel_size=1, stride=stride) if use_1x1conv else None
        self.bn1 = nn.BatchNorm2d(channels)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        if self.conv3 is not None:
            x = self.conv3(x)
        return torch.relu(y + x)


def _resnet_stage(in_channels: int, channels: int, num_residuals: int, first_stage: bool) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for i in range(num_residuals):
        if i == 0 and not first_stage:
            blocks.append(Residual(in_channels, channels, use_1x1conv=True, stride=2))
        else:
            blocks.append(Residual(channels, channels))
    return nn.Sequential(*blocks)


def resnet18(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """ResNet-18 as the d2l CIFAR-10 tutorial builds it (input 32x32 or any size >= 8).

    Stem: 3x3 conv (64, stride 1) + BatchNorm + ReLU, no max-pool; four stages of two residual
    blocks (64, 128, 256, 512 channels; stages 2-4 start with a stride-2 block and a 1x1 shortcut
    conv); global average pool; ``Linear(512, num_classes)``. Its conv and linear weights and biases
    are 42 arrays, 11.17 M numbers (44.7 MB in fp32), the payload the benchmarks move.

    >>> net = resnet18(10)
    >>> net(torch.zeros(4, 3, 32, 32)).shape
    torch.Size([4, 10])
    """
    return nn.Sequential(
        nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        _resnet_stage(64, 64, 2, first_stage=True),
        _resnet_stage(64, 128, 2, first_stage=False),
        _resnet_stage(128, 256, 2, first_stage=False),
        _resnet_stage(256, 512, 2, first_stage=False),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(512, num_classes),
    )


# --------------------------------------------------------------------------- the lab's small CNN
def small_cnn(num_classes: int = 10, in_channels: int = 1, image_size: int = 28) -> nn.Module:
    """The multi-GPU lab's network: conv(20, 3x3)+relu, maxpool 2, conv(50, 5x5)+relu, maxpool 2,
    flatten, dense(128)+relu, dense(num_classes). The flatten size follows from ``image_size``
    (28 -> 50*4*4 = 800, 32 -> 50*5*5 = 1250); images smaller than 14 pixels are refused.

    >>> small_cnn(10, in_channels=1, image_size=28)(torch.zeros(2, 1, 28, 28)).shape
    torch.Size([2, 10])
    """
    side = ((image_size - 2) // 2 - 4) // 2
    if side < 1:
        raise ValueError(f"small_cnn needs image_size >= 14, got image_size={image_size}")
    return nn.Sequential(
        nn.Conv2d(in_channels, 20, kernel_size=3),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=2, stride=2),
        nn.Conv2d(20, 50, kernel_size=5),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=2, stride=2),
        nn.Flatten(),
        nn.Linear(50 * side * side, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


# --------------------------------------------------------------------------- ResNet-50 (ImageNet)
class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck (the stride sits on the 3x3 conv), bias-free convs + BatchNorm."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity: torch.Tensor = x if self.downsample is None else self.downsample(x)
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + identity)


def resnet50(num_classes: int = 1000, in_channels: int = 3) -> nn.Module:
    """ResNet-50 for 224x224 ImageNet images, with torchvision's parameter shapes (25.56 M numbers,
    161 trainable arrays).

    >>> resnet50()(torch.zeros(1, 3, 64, 64)).shape
    torch.Size([1, 1000])
    """
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
    ]
    channels = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        stage: list[nn.Module] = []
        for i in range(blocks):
            stage.append(Bottleneck(channels, width, stride if i == 0 else 1))
            channels = width * Bottleneck.expansion
        layers.append(nn.Sequential(*stage))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------- VGG-16 (ImageNet)
_VGG16_CONFIG: Sequence[int | str] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)  # fmt: skip


def vgg16(num_classes: int = 1000, in_channels: int = 3) -> nn.Module:
    """VGG-16 without BatchNorm (torchvision's ``vgg16``): 13 3x3 convs, adaptive pool to 7x7, then
    25088-4096-4096-num_classes with dropout; 138.36 M numbers in 32 arrays.

    >>> vgg16()(torch.zeros(1, 3, 32, 32)).shape
    torch.Size([1, 1000])
    """
    layers: list[nn.Module] = []
    channels = in_channels
    for item in _VGG16_CONFIG:
        if item == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            assert isinstance(item, int)
            layers += [nn.Conv2d(channels, item, kernel_size=3, padding=1), nn.ReLU()]
            channels = item
    layers += [
        nn.AdaptiveAvgPool2d((7, 7)),
        nn.Flatten(),
        nn.Linear(512 * 7 * 7, 4096),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(4096, 4096),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(4096, num_classes),
    ]
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------- lookup
def get_model(name: str, num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> nn.Module:
    """Build a network by name: one of ``MODEL_NAMES`` ("resnet18", "small_cnn", "resnet50", "vgg16").

    ``image_size`` matters only to ``small_cnn`` (its dense layer's input size); the others adapt
    through global pooling.

    >>> get_model("small_cnn", num_classes=10, in_channels=3, image_size=32)(torch.zeros(1, 3, 32, 32)).shape
    torch.Size([1, 10])
    """
    if name == "resnet18":
        return resnet18(num_classes, in_channels)
    if name == "small_cnn":
        return small_cnn(num_classes, in_channels, image_size)
    if name == "resnet50":
        return resnet50(num_classes, in_channels)
    if name == "vgg16":
        return vgg16(num_classes, in_channels)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")


def parameter_shapes(name: str) -> list[tuple[int, ...]]:
    """Shapes of the arrays a parameter server carries for a network's benchmark payload.

    - "resnet18": the 42 conv and linear weights and biases of the 10-class CIFAR ResNet-18
      (BatchNorm excluded): 11,169,162 numbers, 44.7 MB in fp32, what the peers' figures used.
    - "resnet50", "vgg16": every trainable parameter of the 1000-class ImageNet network
      (161 arrays / 25,557,032 numbers; 32 arrays / 138,357,544 numbers).
    - "small_cnn": every trainable parameter of the 10-class, 1-channel, 28x28 network.

    The model is built on the ``meta`` device, so no memory is allocated.

    >>> shapes = parameter_shapes("resnet18")
    >>> len(shapes), sum(torch.Size(s).numel() for s in shapes) * 4 / 1e6
    (42, 44.676648)
    """
    with torch.device("meta"):
        if name == "resnet18":
            model = resnet18(10)
            return [
                tuple(p.shape)
                for m in model.modules()
                if isinstance(m, (nn.Conv2d, nn.Linear))
                for p in m.parameters(recurse=False)
            ]
        if name == "small_cnn":
            model = small_cnn(10, 1, 28)
        elif name in ("resnet50", "vgg16"):
            model = get_model(name, num_classes=1000)
        else:
            raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
        return [tuple(p.shape) for p in model.parameters() if p.requires_grad]
