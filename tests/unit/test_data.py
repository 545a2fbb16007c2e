"""pskv.data and pskv.app.datasets: partitioning, split_and_load, the data set loaders and the batch transforms."""

from __future__ import annotations

import array
import csv
import os
import pickle
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pskv
from pskv.app import datasets as data
from pskv.app.datasets import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    DIGITS_MEAN,
    DIGITS_STD,
    ArrayDataset,
    BatchTransform,
    batches,
    get_dataset,
    load_cifar10,
    load_digits,
    load_image_folder,
    synthetic,
    transforms_for,
)
from pskv.data import SplitSampler, split_and_load


# =========================================================================== SplitSampler
def test_split_sampler_parts_are_disjoint_contiguous_and_drop_the_remainder() -> None:
    parts = [SplitSampler(103, num_parts=4, part_index=i, seed=3) for i in range(4)]
    assert [len(p) for p in parts] == [25] * 4
    seen: set[int] = set()
    for i, p in enumerate(parts):
        got = list(p)
        assert sorted(got) == list(range(25 * i, 25 * (i + 1)))
        assert seen.isdisjoint(got)
        seen.update(got)
    assert seen == set(range(100))  # 100, 101, 102 are dropped


def test_split_sampler_without_shuffle_is_sequential() -> None:
    assert list(SplitSampler(10, 3, 1, shuffle=False)) == [3, 4, 5]
    assert list(SplitSampler(10, 1, 0, shuffle=False)) == list(range(10))


def test_split_sampler_order_depends_only_on_seed_and_epoch() -> None:
    a, b = SplitSampler(1000, 2, 1, seed=7), SplitSampler(1000, 2, 1, seed=7)
    a.set_epoch(3)
    b.set_epoch(3)
    order3 = list(a)
    assert order3 == list(b)
    assert order3 != sorted(order3)  # shuffled
    expected = (torch.randperm(500, generator=torch.Generator().manual_seed(7 + 3)) + 500).tolist()
    assert order3 == expected
    a.set_epoch(4)
    assert list(a) != order3
    assert list(SplitSampler(1000, 2, 1, seed=8)) != list(SplitSampler(1000, 2, 1, seed=7))
    # all workers share the seed, so they permute their parts the same way
    w0, w1 = SplitSampler(1000, 2, 0, seed=7), SplitSampler(1000, 2, 1, seed=7)
    assert [i + 500 for i in w0] == list(w1)


def test_split_sampler_iteration_advances_the_epoch() -> None:
    s = SplitSampler(64, 2, 0, seed=1)
    first, second = list(s), list(s)
    assert first != second and sorted(first) == sorted(second)
    assert s.epoch == 2
    s.set_epoch(0)
    assert list(s) == first
    assert s.indices(1) == second and s.epoch == 1  # indices() does not advance


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"length": 10, "num_parts": 0}, "num_parts=0"),
        ({"length": 10, "num_parts": 2, "part_index": 2}, "part_index=2"),
        ({"length": 10, "num_parts": 2, "part_index": -1}, "part_index=-1"),
        ({"length": 3, "num_parts": 4, "part_index": 0}, "length=3"),
        ({"length": 10.0, "num_parts": 2}, "are whole numbers.*length=10.0"),  # (was randperm's TypeError)
        ({"length": 10, "seed": 1.5}, "are whole numbers.*seed=1.5"),  # (was a TypeError at iter())
    ],
)
def test_split_sampler_argument_errors(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SplitSampler(**kwargs)


def test_numpy_numbers_are_numbers() -> None:
    """A seed or a batch size from numpy (np.int64) is taken as the int it is (iter() raised a TypeError; step()
    said "batch_size must be a positive number")."""
    import numpy as np

    assert list(SplitSampler(10, 2, 1, seed=np.int64(3))) == list(SplitSampler(10, 2, 1, seed=3))
    sampler = SplitSampler(10, 2, 1, seed=3)
    for epoch in np.arange(2):  # set_epoch(np.int64(e)): iter() raised "TypeError: an integer is required"
        sampler.set_epoch(epoch)
        assert list(sampler) == SplitSampler(10, 2, 1, seed=3).indices(epoch)  # (indices(np.int64(e)) raised it too)
    assert sampler.epoch == 2 and type(sampler.epoch) is int
    with pytest.raises(TypeError):
        sampler.set_epoch(1.0)  # (a RuntimeError from torch.Generator at the next iter())
    p = torch.nn.Parameter(torch.ones(2))
    trainer = pskv.Trainer([p], "sgd", {"learning_rate": 1.0}, kvstore=None)
    p.grad = torch.full((2,), 8.0)
    trainer.step(np.int64(8))
    assert p.tolist() == [0.0, 0.0]


def test_split_sampler_with_dataloader() -> None:
    ds = TensorDataset(torch.zeros(20, 2, 2, 1, dtype=torch.uint8), torch.arange(20))
    sampler = SplitSampler(len(ds), 2, 1, seed=0)
    labels = torch.cat([y for _, y in DataLoader(ds, batch_size=4, sampler=sampler)])
    assert sorted(labels.tolist()) == list(range(10, 20))


# =========================================================================== split_and_load
def test_split_and_load_even() -> None:
    batch = torch.arange(24).reshape(12, 2)
    parts = split_and_load(batch, [torch.device("cpu"), "cpu", "cpu"])
    assert [p.shape[0] for p in parts] == [4, 4, 4]
    assert all(p.device.type == "cpu" for p in parts)
    assert torch.equal(torch.cat(parts), batch)
    assert torch.equal(parts[1], batch[4:8])


def test_split_and_load_uneven() -> None:
    batch = torch.arange(10)
    parts = split_and_load(batch, ["cpu"] * 4, even_split=False)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    with pytest.raises(ValueError, match=r"batch size 10 .* number of devices 4"):
        split_and_load(batch, ["cpu"] * 4)


def test_split_and_load_other_axis_and_single_device() -> None:
    batch = torch.arange(12).reshape(2, 6)
    parts = split_and_load(batch, ["cpu", "cpu"], batch_axis=1)
    assert [tuple(p.shape) for p in parts] == [(2, 3), (2, 3)]
    assert torch.equal(parts[1], batch[:, 3:])
    only = split_and_load(batch, [torch.device("cpu")])
    assert len(only) == 1 and only[0] is batch  # already there: no copy, like as_in_context
    assert len(split_and_load(torch.arange(3), ["cpu"], even_split=True)) == 1
    for one in ("cpu", torch.device("cpu")):  # a device alone, not in a list ("cpu" was split as "c", "p", "u")
        alone = split_and_load(batch, one)
        assert len(alone) == 1 and alone[0] is batch


def test_split_and_load_too_small_or_no_devices() -> None:
    with pytest.raises(ValueError, match=r"size 2 .* over 3 devices"):
        split_and_load(torch.arange(2), ["cpu"] * 3, even_split=False)
    with pytest.raises(ValueError, match="at least one device"):
        split_and_load(torch.arange(2), [])
    with pytest.raises(ValueError, match=r"batch_axis 2 is not an axis of a batch of shape \(4, 2\)"):
        split_and_load(torch.zeros(4, 2), ["cpu"] * 2, batch_axis=2)  # (was torch's IndexError)


def test_split_and_load_takes_a_numpy_batch() -> None:
    parts = split_and_load(np.arange(6).reshape(3, 2), ["cpu"] * 3)  # as MXNet's did (a TypeError from torch)
    assert [p.tolist() for p in parts] == [[[0, 1]], [[2, 3]], [[4, 5]]]
    flipped = np.arange(8).reshape(2, 4)[:, ::-1]  # negative strides (a numpy flip): torch.as_tensor refused it
    assert [p.tolist() for p in split_and_load(flipped, ["cpu"] * 2)] == [[[3, 2, 1, 0]], [[7, 6, 5, 4]]]
    view = memoryview(array.array("f", [1, 2, 3, 4]))  # has strides, no .copy(): an AttributeError from the numpy test
    assert [p.tolist() for p in split_and_load(view, ["cpu"] * 2)] == [[1.0, 2.0], [3.0, 4.0]]


def test_split_and_load_keeps_a_memoryviews_shape_and_dtype() -> None:
    """A 2-D memoryview failed ("could not determine the shape of object type 'memoryview'"), a float64 one
    became float32 and bytes int64 (torch.as_tensor read them as Python numbers); now as numpy's: copied."""
    a = np.arange(8, dtype=np.float64).reshape(4, 2)
    parts = split_and_load(memoryview(a), ["cpu"] * 2)
    a[0, 0] = 100
    assert [(p.dtype, p.tolist()) for p in parts] == [(torch.float64, [[0, 1], [2, 3]]), (torch.float64, [[4, 5], [6, 7]])]
    assert split_and_load(memoryview(b"\x01\x02"), ["cpu"])[0].dtype == torch.uint8


# =========================================================================== CIFAR-10
def _cifar_planes(n: int, seed: int) -> np.ndarray:
    """n images as channel-planar uint8 n x 3 x 32 x 32 with random but known pixels."""
    return np.random.default_rng(seed).integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)


def _write_python_batch(path: Path, planes: np.ndarray, labels: list[int], protocol: int = 4) -> None:
    batch = {
        b"batch_label": b"training batch",
        b"labels": labels,
        b"data": planes.reshape(len(planes), 3072),
        b"filenames": [f"img_{i}.png".encode() for i in range(len(planes))],
    }
    blob = pickle.dumps(batch, protocol=protocol)
    if protocol == 3:
        # the numpy-1 spelling the published (Python 2) files use; GLOBAL opcodes are plain text
        blob = blob.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        assert b"numpy.core.multiarray\n_reconstruct" in blob
    path.write_bytes(blob)


def test_load_cifar10_python_format(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    p1, p2, pt = _cifar_planes(3, 1), _cifar_planes(2, 2), _cifar_planes(4, 3)
    _write_python_batch(folder / "data_batch_1", p1, [0, 9, 4], protocol=3)  # legacy numpy names
    _write_python_batch(folder / "data_batch_2", p2, [1, 2], protocol=4)
    _write_python_batch(folder / "test_batch", pt, [5, 6, 7, 8], protocol=5)  # numpy's _frombuffer path
    train = load_cifar10(tmp_path, train=True)
    assert train.images.shape == (5, 32, 32, 3) and train.images.dtype == torch.uint8
    assert train.labels.tolist() == [0, 9, 4, 1, 2] and train.labels.dtype == torch.int64
    expected = np.concatenate([p1, p2]).transpose(0, 2, 3, 1)
    assert np.array_equal(train.images.numpy(), expected)
    # channel-planar -> HWC: pixel (row 5, col 7) of image 1 is (R, G, B) from the three planes
    row = p1[1].reshape(3072)
    assert train.images[1, 5, 7].tolist() == [row[5 * 32 + 7], row[1024 + 5 * 32 + 7], row[2048 + 5 * 32 + 7]]
    assert train.classes[9] == "truck"
    test = load_cifar10(folder, train=False)  # the batches folder itself works too
    assert test.labels.tolist() == [5, 6, 7, 8]
    assert np.array_equal(test.images.numpy(), pt.transpose(0, 2, 3, 1))


def test_load_cifar10_protocol_2_pickle_from_python_3(tmp_path: Path) -> None:
    """pickle.dump(batch, f, protocol=2) in Python 3 (a Python 2 compatible batch) writes its bytes as
    _codecs.encode(str, "latin1"): the batch was refused ("refusing to load global _codecs.encode")."""
    planes = _cifar_planes(3, 7)
    _write_python_batch(tmp_path / "test_batch", planes, [4, 0, 9], protocol=2)
    assert b"_codecs\nencode" in (tmp_path / "test_batch").read_bytes()
    test = load_cifar10(tmp_path, train=False)
    assert test.labels.tolist() == [4, 0, 9] and np.array_equal(test.images.numpy(), planes.transpose(0, 2, 3, 1))


def test_load_cifar10_binary_format(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    planes = {
        name: _cifar_planes(n, seed) for name, n, seed in [("data_batch_1", 2, 4), ("test_batch", 3, 5)]
    }
    labels = {"data_batch_1": [3, 8], "test_batch": [0, 1, 9]}
    for name, p in planes.items():
        records = np.concatenate(
            [np.array(labels[name], dtype=np.uint8)[:, None], p.reshape(len(p), 3072)], 1
        )
        (folder / f"{name}.bin").write_bytes(records.tobytes())
    train, test = load_cifar10(tmp_path, train=True), load_cifar10(tmp_path, train=False)
    assert train.labels.tolist() == [3, 8] and test.labels.tolist() == [0, 1, 9]
    assert np.array_equal(train.images.numpy(), planes["data_batch_1"].transpose(0, 2, 3, 1))
    assert np.array_equal(test.images.numpy(), planes["test_batch"].transpose(0, 2, 3, 1))
    # a known pixel: the first pixel byte of a record is red at (0, 0); byte 1024 is green at (0, 0)
    raw = (folder / "test_batch.bin").read_bytes()
    assert test.images[0, 0, 0].tolist() == [raw[1], raw[1 + 1024], raw[1 + 2048]]
    assert test.images[2, 31, 31, 2].item() == raw[2 * 3073 + 3072]


def test_load_cifar10_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data_batch_1") as info:
        load_cifar10(tmp_path, train=True)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(FileNotFoundError, match="test_batch"):
        load_cifar10(tmp_path, train=False)
    (tmp_path / "test_batch.bin").write_bytes(bytes(3073 + 5))
    with pytest.raises(ValueError, match="3073-byte records"):
        load_cifar10(tmp_path, train=False)


def test_corrupt_files_are_named(tmp_path: Path) -> None:
    """A truncated or corrupt CIFAR-10 pickle or image said "pickle data was truncated", "Ran out of input",
    "image file is truncated": not which of the files (5 batches, thousands of images) it was."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    _write_python_batch(folder / "data_batch_1", _cifar_planes(2, 1), [0, 1])
    _write_python_batch(folder / "data_batch_2", _cifar_planes(2, 2), [2, 3])
    whole = (folder / "data_batch_2").read_bytes()
    for broken in (whole[: len(whole) // 2], b"", b"\x80\x04K", b"not a pickle"):
        (folder / "data_batch_2").write_bytes(broken)
        with pytest.raises((EOFError, pickle.UnpicklingError), match=r"data_batch_2: "):
            load_cifar10(tmp_path, train=True)
    for k in range(3):
        _png(tmp_path / "train" / "cat" / f"{k}.png", _pixels(k))
    whole = (tmp_path / "train" / "cat" / "1.png").read_bytes()
    corrupt = whole[:60] + bytes(b ^ 0x5A for b in whole[60:80]) + whole[80:]
    for broken in (whole[: len(whole) // 2], whole[:30], corrupt):
        (tmp_path / "train" / "cat" / "1.png").write_bytes(broken)
        with pytest.raises(OSError, match=r"cat/1\.png"):
            load_image_folder(tmp_path)


class _RunsShell:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (self.command,))


class _CallsEval:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (eval, ("__import__('os').getcwd()",))


def test_hostile_pickle_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for payload in (
        {b"data": _RunsShell(f"touch {marker}"), b"labels": [0]},
        {b"data": _CallsEval(), b"labels": [0]},
    ):
        (tmp_path / "data_batch_1").write_bytes(pickle.dumps(payload))
        with pytest.raises(pickle.UnpicklingError, match="refusing to load global"):
            load_cifar10(tmp_path, train=True)
    assert not marker.exists()


def test_pickle_of_wrong_shape_is_refused(tmp_path: Path) -> None:
    (tmp_path / "test_batch").write_bytes(
        pickle.dumps({b"data": np.zeros((2, 10), np.uint8), b"labels": [0, 1]})
    )
    with pytest.raises(ValueError, match="N x 3072"):
        load_cifar10(tmp_path, train=False)


# =========================================================================== image folders
def _png(path: Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    mpimg.imsave(path, pixels)  # what matplotlib.pyplot.imsave calls


def _pixels(seed: int, size: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)


def test_load_image_folder_kaggle_layout(tmp_path: Path) -> None:
    names = {1: "frog", 2: "truck", 3: "automobile", 10: "frog", 11: "cat"}
    for i in names:
        _png(tmp_path / "train" / f"{i}.png", _pixels(i))
    for i in (1, 2):
        _png(tmp_path / "test" / f"{i}.png", _pixels(100 + i))
    with open(tmp_path / "trainLabels.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "label"])
        for i, name in {**names, 12: "ship"}.items():  # a row without an image is fine
            writer.writerow([i, name])
    train = load_image_folder(tmp_path, train=True)
    assert train.classes == ["automobile", "cat", "frog", "ship", "truck"]
    # files in numeric id order: 1, 2, 3, 10, 11
    assert train.labels.tolist() == [2, 4, 0, 2, 1]
    assert train.images.shape == (5, 8, 8, 3) and train.images.dtype == torch.uint8
    assert np.array_equal(train.images[3].numpy(), _pixels(10))  # PNG round trip is exact
    test = load_image_folder(tmp_path, train=False)
    assert test.labels.tolist() == [-1, -1]
    assert np.array_equal(test.images[1].numpy(), _pixels(102))
    assert test.classes == train.classes


def test_load_image_folder_class_folders(tmp_path: Path) -> None:
    for split, count in (("train", 3), ("test", 1)):
        for c, seed in (("dog", 10), ("cat", 20)):
            for k in range(count):
                _png(tmp_path / split / c / f"{k}.png", _pixels(seed + k))
    train = load_image_folder(tmp_path, train=True)
    assert train.classes == ["cat", "dog"]
    assert sorted(train.labels.tolist()) == [0, 0, 0, 1, 1, 1]  # in a seeded shuffle: each worker's part has every class
    pairs = {(bytes(image.numpy()), int(label)) for image, label in zip(train.images, train.labels)}
    assert pairs == {(bytes(_pixels(seed + k)), c) for c, seed in ((0, 20), (1, 10)) for k in range(3)}
    test = load_image_folder(tmp_path, train=False)
    assert sorted(test.labels.tolist()) == [0, 1] and test.classes == train.classes


def test_load_image_folder_order_does_not_depend_on_the_listing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files of one stem (a.png, a.jpg) came in the directory's listing order, which differs between copies
    of a folder (each host's own): workers' parts then overlapped. The same files give the same data set."""
    for c, seed in (("cat", 0), ("dog", 10)):
        for k, name in enumerate(("a.png", "a.bmp", "1.png", "1.bmp", "b.png")):
            _png(tmp_path / "train" / c / name, _pixels(seed + k))
    listing = Path.iterdir
    loaded = []
    for order in (sorted, lambda paths: sorted(paths, reverse=True)):
        monkeypatch.setattr(Path, "iterdir", lambda self, order=order: iter(order(listing(self))))
        loaded.append(load_image_folder(tmp_path))
    assert torch.equal(loaded[0].images, loaded[1].images) and torch.equal(loaded[0].labels, loaded[1].labels)


def test_load_image_folder_16_bit_grey_is_scaled_not_clipped(tmp_path: Path) -> None:
    """A 16-bit grey PNG (PIL mode I;16) came out as min(value, 255): nearly all white."""
    from PIL import Image

    grey = np.array([[0, 257, 1000, 32767], [40000, 65535, 128, 129]], dtype=np.uint16)
    (tmp_path / "train" / "x").mkdir(parents=True)
    Image.fromarray(grey).save(tmp_path / "train" / "x" / "0.png")
    _png(tmp_path / "train" / "x" / "1.png", np.full((2, 4, 3), 7, np.uint8))  # 8-bit ones as they were
    ds = load_image_folder(tmp_path)
    by_mean = sorted(ds.images, key=lambda image: float(image.float().mean()))
    assert torch.equal(by_mean[0], torch.full((2, 4, 3), 7, dtype=torch.uint8))
    expected = np.floor(grey / 257 + 0.5).astype(np.uint8)  # [[0, 1, 4, 127], [156, 255, 0, 1]]
    assert np.array_equal(by_mean[1].numpy(), np.repeat(expected[..., None], 3, axis=2))


def test_load_image_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="train"):
        load_image_folder(tmp_path)
    _png(tmp_path / "train" / "1.png", _pixels(0))
    with pytest.raises(FileNotFoundError, match=r"trainLabels\.csv"):
        load_image_folder(tmp_path)
    (tmp_path / "trainLabels.csv").write_text("id,label\n2,cat\n")
    with pytest.raises(ValueError, match=r"1\.png"):
        load_image_folder(tmp_path)
    _png(tmp_path / "train" / "2.png", _pixels(1, size=9))
    (tmp_path / "trainLabels.csv").write_text("id,label\n1,cat\n2,dog\n")
    with pytest.raises(ValueError, match="sizes must match"):
        load_image_folder(tmp_path)


# =========================================================================== digits, synthetic
def test_digits_shapes_values_and_split() -> None:
    train, test = load_digits(train=True), load_digits(train=False)
    assert train.images.shape == (1438, 32, 32, 3) and test.images.shape == (359, 32, 32, 3)
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64
    assert train.classes == [str(i) for i in range(10)]
    assert int(train.images.max()) == 255 and int(train.images.min()) == 0
    assert torch.equal(train.images[..., 0], train.images[..., 2])  # grey in three channels
    # stratified: every class is about 20% test
    for c in range(10):
        n_test, n_all = (
            int((test.labels == c).sum()),
            int((test.labels == c).sum() + (train.labels == c).sum()),
        )
        assert abs(n_test - 0.2 * n_all) <= 0.5
    # the same split in every process (and every call)
    again = load_digits(train=True)
    assert torch.equal(again.images, train.images) and torch.equal(again.labels, train.labels)
    # shuffled, so contiguous SplitSampler parts both see all classes
    assert set(train.labels[:719].tolist()) == set(range(10)) == set(train.labels[719:].tolist())


def test_digits_split_indices_disjoint_and_seeded() -> None:
    labels = torch.as_tensor(data._digits_arrays()[1])
    tr, te = data._split_indices(labels, 0.2, seed=0)
    assert len(tr) + len(te) == 1797 and set(tr.tolist()).isdisjoint(te.tolist())
    tr2, te2 = data._split_indices(labels, 0.2, seed=0)
    assert torch.equal(tr, tr2) and torch.equal(te, te2)
    assert not torch.equal(data._split_indices(labels, 0.2, seed=1)[1], te)


def test_digits_native_size_matches_scikit_learn() -> None:
    from sklearn.datasets import load_digits as sklearn_load_digits

    pixels, targets = data._digits_arrays()  # read from the CSV without importing scikit-learn
    via_sklearn = sklearn_load_digits()
    assert np.array_equal(pixels, via_sklearn.data) and np.array_equal(targets, via_sklearn.target)
    small = load_digits(train=False, image_size=8)
    _, te = data._split_indices(torch.as_tensor(targets), 0.2, seed=0)
    expected = np.rint(pixels[te.numpy()].reshape(-1, 8, 8) * 255 / 16).astype(np.uint8)
    assert np.array_equal(small.images[..., 1].numpy(), expected)
    assert load_digits(train=True, image_size=16).images.shape == (1438, 16, 16, 3)


def test_digits_mean_std_constants() -> None:
    pixels = load_digits(train=True).images.reshape(-1, 3).to(torch.float64) / 255.0
    assert pixels.mean(0).tolist() == pytest.approx(DIGITS_MEAN, abs=1e-4)
    assert pixels.std(0).tolist() == pytest.approx(DIGITS_STD, abs=1e-4)


def test_synthetic_is_deterministic_and_learnable() -> None:
    a, b = synthetic(300, seed=0), synthetic(300, seed=0)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert a.images.shape == (300, 32, 32, 3) and a.images.dtype == torch.uint8
    other = synthetic(200, seed=1)
    assert not torch.equal(other.images[:10], a.images[:10])
    # same class patterns for every seed: nearest class mean (from seed 0) classifies seed 1
    x = a.images.float().flatten(1)
    means = torch.stack([x[a.labels == c].mean(0) for c in range(10)])
    pred = torch.cdist(other.images.float().flatten(1), means).argmin(1)
    assert (pred == other.labels).float().mean() > 0.9
    assert synthetic(5, num_classes=3, image_size=8, channels=1).images.shape == (5, 8, 8, 1)


def test_get_dataset(tmp_path: Path) -> None:
    assert len(get_dataset("digits", train=False, image_size=16)) == 359
    assert get_dataset("synthetic", train=False).images.shape == (1024, 32, 32, 3)
    with pytest.raises(ValueError, match=r"unknown data set 'mnist'.*digits, cifar10, folder, synthetic"):
        get_dataset("mnist")
    with pytest.raises(ValueError, match="data_dir"):
        get_dataset("cifar10")
    planes = _cifar_planes(2, 0)
    records = np.concatenate([np.array([[1], [2]], dtype=np.uint8), planes.reshape(2, 3072)], 1)
    (tmp_path / "test_batch.bin").write_bytes(records.tobytes())
    ds = get_dataset("cifar10", data_dir=tmp_path, train=False, image_size=16)
    assert ds.images.shape == (2, 16, 16, 3) and ds.labels.tolist() == [1, 2]


# =========================================================================== transforms, batches
def test_test_transform_converts_and_normalizes() -> None:
    tf = BatchTransform(CIFAR10_MEAN, CIFAR10_STD)
    images = torch.zeros(2, 4, 4, 3, dtype=torch.uint8)
    images[1] = 255
    images[0, 1, 2] = torch.tensor([51, 102, 204], dtype=torch.uint8)
    out = tf(images)
    assert out.shape == (2, 3, 4, 4) and out.dtype == torch.float32 and out.is_contiguous()
    mean, std = torch.tensor(CIFAR10_MEAN), torch.tensor(CIFAR10_STD)
    assert torch.allclose(out[0, :, 0, 0], -mean / std)
    assert torch.allclose(out[1, :, 3, 3], (1 - mean) / std)
    assert torch.allclose(out[0, :, 1, 2], (torch.tensor([0.2, 0.4, 0.8]) - mean) / std)
    with pytest.raises(ValueError, match="N x H x W x 3"):
        tf(images[0])
    with pytest.raises(ValueError, match="N x H x W x 3"):
        tf(torch.zeros(2, 4, 4, 1, dtype=torch.uint8))


def test_train_transform_flip_only() -> None:
    images = torch.randint(
        0, 256, (64, 6, 6, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8
    )
    tf = BatchTransform((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), pad=0, flip=True)
    out = tf(images, torch.Generator().manual_seed(1))
    plain = images.permute(0, 3, 1, 2).float() / 255
    same = torch.isclose(out, plain).flatten(1).all(1)
    mirrored = torch.isclose(out, plain.flip(3)).flatten(1).all(1)
    assert bool((same | mirrored).all())
    assert 16 < int(mirrored.sum()) < 48  # about half are flipped
    assert torch.equal(out, tf(images, torch.Generator().manual_seed(1)))  # reproducible
    assert not torch.equal(out, tf(images, torch.Generator().manual_seed(2)))


def test_train_transform_pad_and_crop() -> None:
    # float images with distinct positive values, identity normalisation: out is a window of the
    # zero-padded image at some offset (dy, dx) in [0, 2*pad]
    n, h, w, pad = 32, 8, 8, 4
    images = torch.arange(1, h * w + 1, dtype=torch.float32).view(1, h, w, 1) + 100 * torch.arange(n).view(
        n, 1, 1, 1
    )
    tf = BatchTransform((0.0,), (1.0,), pad=pad, flip=False)
    out = tf(images, torch.Generator().manual_seed(0))
    assert out.shape == (n, 1, h, w)
    padded = torch.nn.functional.pad(images[..., 0], (pad, pad, pad, pad))
    offsets = set()
    for i in range(n):
        found = [
            (dy, dx)
            for dy in range(2 * pad + 1)
            for dx in range(2 * pad + 1)
            if torch.equal(out[i, 0], padded[i, dy : dy + h, dx : dx + w])
        ]
        assert len(found) == 1
        offsets.add(found[0])
    assert len(offsets) > 10  # offsets vary per sample


def test_transforms_for() -> None:
    train_tf, test_tf = transforms_for("digits")  # digits: no augmentation
    assert train_tf == test_tf == BatchTransform(DIGITS_MEAN, DIGITS_STD, pad=0, flip=False)
    cifar_train, cifar_test = transforms_for("cifar10", image_size=16)
    assert cifar_train == BatchTransform(CIFAR10_MEAN, CIFAR10_STD, pad=2, flip=True)
    assert cifar_test == BatchTransform(CIFAR10_MEAN, CIFAR10_STD, pad=0, flip=False)
    assert transforms_for("synthetic", image_size=32)[0].pad == 4
    assert transforms_for("folder", image_size=4)[0].pad == 1  # at least one pixel
    with pytest.raises(ValueError, match="unknown data set"):
        transforms_for("nope")


def test_batches_follow_the_sampler() -> None:
    ds = ArrayDataset(torch.arange(20, dtype=torch.uint8).view(20, 1, 1, 1), torch.arange(20) * 10)
    sampler = SplitSampler(20, 2, 1, shuffle=False)
    got = list(batches(ds, sampler, 4))
    assert [len(y) for _, y in got] == [4, 4, 2]
    assert torch.cat([y for _, y in got]).tolist() == [100, 110, 120, 130, 140, 150, 160, 170, 180, 190]
    assert got[0][0].dtype == torch.uint8 and got[0][0].view(-1).tolist() == [10, 11, 12, 13]
    tf = BatchTransform((0.0,), (1.0,))
    x, y = next(batches(ds, None, 5, tf))
    assert y.tolist() == [0, 10, 20, 30, 40]
    assert x.shape == (5, 1, 1, 1) and torch.allclose(x.view(-1), torch.arange(5) / 255.0)
    shuffled = SplitSampler(20, 2, 0, seed=0)
    labels = torch.cat([y for _, y in batches(ds, shuffled, 3)])
    assert labels.tolist() == [10 * i for i in shuffled.indices(0)]
    with pytest.raises(ValueError, match="batch_size"):
        next(batches(ds, None, 0))
