"""The training application's data, deterministic so that every worker loads the same data and split.

Data sets (scikit-learn's bundled digits: the demo's, no download; CIFAR-10 in either published
format; the d2l tutorial's Kaggle folder layout or class folders; synthetic) are image tensors. A
:class:`BatchTransform` augments and normalises whole batches, and :func:`batches` indexes the image
tensor directly (a ``DataLoader`` collates 32x32 images one by one, slower than a small CPU loads them).
The README's ``train.py`` shows them used together."""

from __future__ import annotations

import csv
import importlib.util
import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

Arrays = tuple["np.ndarray[Any, Any]", "np.ndarray[Any, Any]"]

DATASET_NAMES = ("digits", "cifar10", "folder", "synthetic")
#: Per-channel mean and standard deviation of CIFAR-10 (pixels scaled to [0, 1]), as d2l normalises.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
#: The same for the digits' training split at 32x32 (grey: equal in all channels); a test recomputes them.
DIGITS_MEAN = (0.3059, 0.3059, 0.3059)
DIGITS_STD = (0.3241, 0.3241, 0.3241)


@dataclass(repr=False)
class ArrayDataset:
    """``images``: uint8 ``N x H x W x C``; ``labels``: int64 ``N`` (-1 where unknown); ``classes``:
    the class names (index = label). Iterate with :func:`batches`."""

    images: Tensor
    labels: Tensor
    classes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.images)


def _to_images(pixels: Tensor, size: int) -> Tensor:
    """Float ``N x C x H x W`` pixels (0..255) as uint8 ``N x size x size x C`` (resized bilinearly)."""
    if pixels.shape[-2:] != (size, size):
        pixels = F.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False)
    return pixels.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def _split_indices(labels: Tensor, test_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Stratified split: per class, a seeded permutation whose first ``round(test_fraction * count)``
    go to test. Both come back shuffled, so that every part of a ``SplitSampler`` sees every class."""
    generator = torch.Generator().manual_seed(seed)
    train_parts, test_parts = [], []
    for c in torch.unique(labels).tolist():
        members = torch.nonzero(labels == c).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        n_test = round(test_fraction * len(members))
        test_parts.append(members[:n_test])
        train_parts.append(members[n_test:])
    train_idx, test_idx = torch.cat(train_parts), torch.cat(test_parts)
    train_idx = train_idx[torch.randperm(len(train_idx), generator=generator)]
    test_idx = test_idx[torch.randperm(len(test_idx), generator=generator)]
    return train_idx, test_idx


def _digits_arrays() -> Arrays:
    """The digits as (1797 x 64 pixels 0..16, 1797 labels), from the CSV that scikit-learn bundles, found
    without importing scikit-learn (``import sklearn.datasets`` costs seconds of CPU in every worker)."""
    spec = importlib.util.find_spec("sklearn")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder, "datasets", "data", "digits.csv.gz")
        if path.is_file():
            table = np.loadtxt(path, delimiter=",", dtype=np.float64)
            return table[:, :-1], table[:, -1].astype(np.int64)
    raise FileNotFoundError("scikit-learn's datasets/data/digits.csv.gz not found: pip install scikit-learn")


def load_digits(train: bool = True, image_size: int = 32) -> ArrayDataset:
    """scikit-learn's handwritten digits (8x8, 17 grey levels, 10 classes) upscaled bilinearly to
    ``image_size``, grey in 3 channels. The split is stratified (20% test, seed 0): 1438 / 359 images."""
    pixels, targets = _digits_arrays()
    labels = torch.as_tensor(targets, dtype=torch.int64)
    idx = _split_indices(labels, test_fraction=0.2, seed=0)[0 if train else 1]
    grey = torch.as_tensor(pixels, dtype=torch.float32)[idx].reshape(-1, 1, 8, 8) * (255.0 / 16.0)
    images = _to_images(grey.expand(-1, 3, -1, -1), image_size)
    return ArrayDataset(images, labels[idx], [str(i) for i in range(10)])


def synthetic(num_samples: int, num_classes: int = 10, image_size: int = 32, channels: int = 3, seed: int = 0) -> ArrayDataset:
    """Images a small CNN learns in an epoch or two: its class's fixed smooth pattern plus noise. Only
    labels and noise depend on ``seed``: ``synthetic(n, seed=0)``, ``synthetic(m, seed=1)`` are a
    training and a test set of the same task."""
    if min(num_samples, num_classes, image_size, channels) < 1:
        raise ValueError(f"synthetic needs sizes >= 1, got {(num_samples, num_classes, image_size, channels)}")
    pattern_gen = torch.Generator().manual_seed(1_000_003 * num_classes + 1_009 * image_size + channels)
    coarse = torch.rand(num_classes, channels, 4, 4, generator=pattern_gen)
    patterns = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear", align_corners=False)
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (num_samples,), generator=gen)
    noise = torch.rand(num_samples, channels, image_size, image_size, generator=gen)
    images = _to_images(255 * (0.6 * patterns[labels] + 0.4 * noise), image_size)
    return ArrayDataset(images, labels, [str(i) for i in range(num_classes)])


def _numpy_globals() -> dict[tuple[str, str], Any]:
    """The only globals a CIFAR-10 pickle needs, taken from numpy's own pickling (so no deprecated ``numpy.core``
    import happens) under the numpy 1 and 2 names, and Python 3's protocol 2 bytes (``_codecs.encode(str, "latin1")``)."""
    allowed: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype, ("_codecs", "encode"): str.encode}
    for core in ("numpy.core", "numpy._core"):
        allowed[(f"{core}.multiarray", "_reconstruct")] = np.zeros(1).__reduce__()[0]
        allowed[(f"{core}.multiarray", "scalar")] = np.uint8(0).__reduce__()[0]
        allowed[(f"{core}.numeric", "_frombuffer")] = np.zeros(1).__reduce_ex__(5)[0]
    return allowed


class _ArrayUnpickler(pickle.Unpickler):
    """Rebuilds numpy arrays, lists, dicts, strings and numbers only: ``find_class`` refuses every global
    outside a short numpy allow-list, so a hostile file cannot name a callable (``os.system``) to run."""

    _allowed = _numpy_globals()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._allowed:
            msg = f"refusing to load global {module}.{name}: CIFAR-10 batches contain only numpy arrays"
            raise pickle.UnpicklingError(msg)
        return self._allowed[(module, name)]


def _read_cifar_batch(path: Path) -> Arrays:
    """One batch file's (N x 3072 channel-planar RGB pixels, N labels)."""
    if path.suffix == ".bin":  # records of one label byte and 3072 pixel bytes
        raw = np.fromfile(path, dtype=np.uint8)
        if raw.size == 0 or raw.size % 3073 != 0:
            raise ValueError(f"{path}: size {raw.size} bytes is not a whole number of 3073-byte records")
        records = raw.reshape(-1, 3073)
        return records[:, 1:], records[:, 0].astype(np.int64)
    try:  # the published batches are Python 2 pickles: "bytes" keeps their str objects as bytes
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()
    except (EOFError, pickle.UnpicklingError) as exc:  # truncated, not a pickle, a global refused: pickle names no file
        raise type(exc)(f"{path}: {exc}") from None
    batch = batch if isinstance(batch, dict) else {}
    data = batch.get(b"data", batch.get("data"))
    labels = np.asarray(batch.get(b"labels", batch.get("labels", [])), dtype=np.int64)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != (labels.size, 3072):
        raise ValueError(f"{path}: expected a dict with b'data', a uint8 N x 3072 array, and N b'labels'")
    return data, labels.reshape(-1)


def load_cifar10(root: str | Path, train: bool = True) -> ArrayDataset:
    """CIFAR-10 (whichever of ``data_batch_1`` .. ``5`` are there, or ``test_batch``) from ``root``,
    ``root/cifar-10-batches-py`` or ``-bin``, in either format (pickles through :class:`_ArrayUnpickler`)."""
    base = Path(root).expanduser()
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    folders = (base, base / "cifar-10-batches-py", base / "cifar-10-batches-bin")
    for folder in folders:
        for suffix in ("", ".bin"):
            paths = [folder / (name + suffix) for name in names]
            loaded = [_read_cifar_batch(path) for path in paths if path.is_file()]
            if loaded:
                data, labels = (np.concatenate(parts) for parts in zip(*loaded))
                if labels.min() < 0 or labels.max() > 9:
                    raise ValueError(f"CIFAR-10 labels must be in 0..9, found {labels.min()}..{labels.max()}")
                # channel-planar RGB rows (R plane, G plane, B plane) -> N x 32 x 32 x 3
                images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
                return ArrayDataset(torch.from_numpy(images), torch.from_numpy(labels), list(CIFAR10_CLASSES))
    wanted = "data_batch_1..data_batch_5" if train else "test_batch"
    raise FileNotFoundError(f"no CIFAR-10 {wanted} (nor with .bin) in " + ", ".join(map(str, folders)))


_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".ppm")


def _images_in(folder: Path) -> list[Path]:
    """The image files of ``folder``: numeric ids in numeric order (1, 2, 10), others by name, ties by suffix."""
    files = [p for p in folder.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES]
    return sorted(files, key=lambda p: (0, int(p.stem), "", p.name) if p.stem.isdigit() else (1, 0, p.stem, p.name))


def _read_images(paths: list[Path]) -> Tensor:
    """The images as uint8 ``N x H x W x 3`` (grey repeated, alpha dropped); all must have one size."""
    from PIL import Image  # comes with matplotlib
    images: list[Tensor] = []
    for path in paths:
        try:
            with Image.open(path) as image:  # 16-bit grey (mode I;16) scaled to 8 bits: convert("RGB") clips it at 255
                rgb = (image.point(lambda v: v / 257 + 0.5) if image.mode[0] == "I" else image).convert("RGB")
                images.append(torch.from_numpy(np.array(rgb, dtype=np.uint8)))
        except OSError as exc:  # truncated or corrupt: PIL's message names no file
            raise OSError(f"{path}: {exc}") from None
        if images[-1].shape != images[0].shape:
            raise ValueError(f"{path} is {tuple(images[-1].shape)} but {paths[0]} is {tuple(images[0].shape)}; sizes must match")
    return torch.stack(images)


def load_image_folder(root: str | Path, train: bool = True) -> ArrayDataset:
    """The ``train`` or ``test`` images under ``root`` (one size, read as RGB), in a d2l tutorial layout:
    Kaggle's ``root/train/<id>.png`` with ``root/trainLabels.csv`` (a header, then ``id,label`` rows;
    test images have no published labels, so theirs are -1), or class folders ``root/train/<class>/``. ``classes``
    are the sorted label or train/ folder names (else -1); class folders' images come in a seeded shuffle."""
    base = Path(root).expanduser()
    folder = base / ("train" if train else "test")
    if not folder.is_dir():
        raise FileNotFoundError(f"no {folder.name} folder: expected {folder} with <id>.png or <class>/*.png")
    files = _images_in(folder)
    subdirs = sorted(p for p in folder.iterdir() if p.is_dir())
    if subdirs and not files:  # class folders, indexed by train/'s names in both splits (test/'s others, d2l's unknown/: -1)
        classes = sorted(p.name for p in (base / "train").glob("*") if p.is_dir())
        files = [path for subdir in subdirs for path in _images_in(subdir)]  # then mixed, so each worker's part has every class
        files = [files[i] for i in torch.randperm(len(files), generator=torch.Generator().manual_seed(0)).tolist()]
        labels = [classes.index(path.parent.name) if path.parent.name in classes else -1 for path in files]
    else:  # Kaggle
        csv_path = base / "trainLabels.csv"
        if train and not csv_path.is_file():
            raise FileNotFoundError(f"labels file {csv_path} not found (needed for the images in {folder})")
        rows = list(csv.reader(csv_path.read_text().splitlines()))[1:] if csv_path.is_file() else []
        names = {row[0].strip(): row[1].strip() for row in rows if len(row) >= 2}  # image id -> class name
        classes = sorted(set(names.values()))
        missing = [p.name for p in files if p.stem not in names]
        if train and missing:
            raise ValueError(f"{len(missing)} images in {folder} have no row in {csv_path}, e.g. {missing[0]}")
        labels = [classes.index(names[p.stem]) if train else -1 for p in files]
    if not files:
        raise FileNotFoundError(f"no images ({', '.join(_IMAGE_SUFFIXES)}) in {folder}")
    return ArrayDataset(_read_images(files), torch.tensor(labels, dtype=torch.int64), classes)


def get_dataset(name: str, data_dir: str | Path | None = None, train: bool = True, image_size: int = 32) -> ArrayDataset:
    """A data set by name (``DATASET_NAMES``; "cifar10" and "folder" read ``data_dir``, "synthetic" has
    4096 training and 1024 test images), resized bilinearly to ``image_size`` if need be."""
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown data set {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if name == "digits":
        return load_digits(train=train, image_size=image_size)
    if name == "synthetic":
        return synthetic(4096 if train else 1024, image_size=image_size, seed=0 if train else 1)
    if data_dir is None:
        raise ValueError(f"data set {name!r} reads files: pass data_dir")
    ds = load_cifar10(data_dir, train) if name == "cifar10" else load_image_folder(data_dir, train=train)
    if ds.images.shape[1:3] != (image_size, image_size):
        ds.images = _to_images(ds.images.permute(0, 3, 1, 2).float(), image_size)
    return ds


@dataclass(frozen=True)
class BatchTransform:
    """uint8 ``N x H x W x C`` images (float ones: in [0, 1]) to normalised float ``N x C x H x W``, on
    their device; optionally zero-padded by ``pad`` and cropped back at a random offset, and flipped
    left-right with probability 1/2, drawing from ``generator`` (torch's global one when None)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    pad: int = 0
    flip: bool = False

    def _augment(self, images: Tensor, generator: torch.Generator | None) -> Tensor:
        n, h, w, _ = images.shape
        p = self.pad
        if p:
            images = F.pad(images, (0, 0, p, p, p, p))  # zero border on H and W of NHWC
        # n x h and n x w, from random offsets (all 0 when p == 0)
        rows = torch.randint(0, 2 * p + 1, (n, 1), generator=generator) + torch.arange(h)
        cols = torch.randint(0, 2 * p + 1, (n, 1), generator=generator) + torch.arange(w)
        if self.flip:
            flipped = torch.rand(n, generator=generator) < 0.5
            cols = torch.where(flipped[:, None], cols.flip(1), cols)
        device = images.device
        batch_idx = torch.arange(n, device=device)[:, None, None]
        # One gather does crop and flip: out[i, y, x] = padded[i, rows[i, y], cols[i, x]].
        return images[batch_idx, rows.to(device)[:, :, None], cols.to(device)[:, None, :]]

    def __call__(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        if images.dim() != 4 or images.shape[-1] != len(self.mean):
            raise ValueError(f"expected N x H x W x {len(self.mean)} images, got shape {tuple(images.shape)}")
        if self.pad or self.flip:
            images = self._augment(images, generator)
        scale = 255.0 if images.dtype == torch.uint8 else 1.0
        x = images.permute(0, 3, 1, 2).to(torch.float32)
        mean = torch.tensor(self.mean, device=x.device).view(1, -1, 1, 1)
        inv = torch.tensor([1.0 / (scale * s) for s in self.std], device=x.device).view(1, -1, 1, 1)
        return ((x - mean * scale) * inv).contiguous()


def transforms_for(name: str, image_size: int = 32) -> tuple[BatchTransform, BatchTransform]:
    """The (train, test) transforms of a data set: normalised with its mean and std; for training, the
    CIFAR-10 recipe (zero-pad ``image_size // 8``, random crop, random flip), except for the digits."""
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown data set {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    if name == "digits":
        # Never flipped: mirrored digits are other glyphs. Nor padded and cropped: in a few epochs that
        # cost accuracy (ResNet-18 at 16x16, 5 epochs: 0.986 with it, 0.994 without).
        return BatchTransform(DIGITS_MEAN, DIGITS_STD), BatchTransform(DIGITS_MEAN, DIGITS_STD)
    train = BatchTransform(CIFAR10_MEAN, CIFAR10_STD, pad=max(1, image_size // 8), flip=True)
    return train, BatchTransform(CIFAR10_MEAN, CIFAR10_STD)


def batches(dataset: ArrayDataset, sampler: Iterable[int] | None, batch_size: int, transform: Callable[..., Tensor] | None = None,
            generator: torch.Generator | None = None) -> Iterator[tuple[Tensor, Tensor]]:  # fmt: skip
    """``(images, labels)`` batches in ``sampler``'s order (sequential when None; the last may be short),
    each uint8 batch through ``transform(images, generator)``. Iterating the sampler advances its epoch."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got batch_size={batch_size}")
    order = torch.as_tensor(list(sampler) if sampler is not None else range(len(dataset)), dtype=torch.int64)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        images = dataset.images[idx]
        if transform is not None:
            images = transform(images, generator)
        yield images, dataset.labels[idx]
