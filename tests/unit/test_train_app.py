"""pskv train in this process (--kv-store local): a resumed run with augmentation, a short last batch over
several devices, data-set errors, and class folders (one index per class name, every class in each part)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pskv import checkpoint
from pskv.app import train
from pskv.app.datasets import load_image_folder
from pskv.data import SplitSampler


def _class_folders(root: Path, train_classes: tuple[str, ...], test_classes: tuple[str, ...], per_class: int) -> Path:
    import matplotlib.image as mpimg

    rng = np.random.default_rng(0)
    for split, names, count in (("train", train_classes, per_class), ("test", test_classes, 2)):
        for name in names:
            (root / split / name).mkdir(parents=True)
            for k in range(count):
                mpimg.imsave(root / split / name / f"{k}.png", rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    return root


def _args(data: Path, *more: str) -> list[str]:
    return ["--kv-store", "local", "--model", "small_cnn", "--image-size", "16", "--dataset", "folder",
            "--data-dir", str(data), "--no-progress", "--lr-schedule", "none", *more]  # fmt: skip


def test_class_folders_index_test_by_the_same_names_and_mix_the_classes(tmp_path: Path) -> None:
    root = _class_folders(tmp_path, ("cat", "dog", "frog"), ("cat", "frog", "unknown"), per_class=6)
    train_set, test_set = load_image_folder(root, train=True), load_image_folder(root, train=False)
    assert train_set.classes == test_set.classes == ["cat", "dog", "frog"]
    assert sorted(test_set.labels.tolist()) == [-1, -1, 0, 0, 2, 2]  # frog is 2 in both (it was 1 in test); d2l's unknown/: no label
    for part in range(2):  # each worker's part of the training set has every class (was cat+dog, dog+frog)
        assert {int(train_set.labels[i]) for i in SplitSampler(len(train_set), 2, part)} == {0, 1, 2}


# fp16: epoch 1 skips steps that overflow and ends with a scale of 4096 (the resumed run began at 65536 again,
# and its update count, short of the skipped steps, was scaled up to 1 epoch's steps)
@pytest.mark.parametrize("more", [[], ["--amp", "fp16", "--dataset", "digits", "--batch-size", "32", "--lr-schedule", "cosine"]])
def test_resumed_run_with_augmentation_ends_with_the_weights_of_a_whole_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, more: list[str]) -> None:
    monkeypatch.setenv("PSKV_NONFINITE", "allow")  # as --amp fp16 sets it (train.main would leave it set for later tests)
    data = _class_folders(tmp_path / "data", ("a", "b"), ("a", "b"), per_class=8)
    args = _args(data, "--epochs", "2", "--batch-size", "4", *more)
    assert train.main([*args, "--checkpoint-dir", str(tmp_path / "whole")]) == 0

    save = checkpoint.save

    def stopped_after_epoch_1(directory: Path, epoch: int, *rest: object, **kw: object) -> None:
        save(directory, epoch, *rest, **kw)  # type: ignore[arg-type]
        raise KeyboardInterrupt  # the job stopped after its first checkpoint

    monkeypatch.setattr(checkpoint, "save", stopped_after_epoch_1)
    with pytest.raises(KeyboardInterrupt):
        train.main([*args, "--checkpoint-dir", str(tmp_path / "cut")])
    monkeypatch.setattr(checkpoint, "save", save)
    assert train.main([*args, "--checkpoint-dir", str(tmp_path / "cut"), "--resume"]) == 0
    whole, resumed = (torch.load(tmp_path / run / "epoch-2" / "model.pt") for run in ("whole", "cut"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole), [k for k in whole if not torch.equal(whole[k], resumed[k])]


def test_a_last_batch_smaller_than_the_devices_trains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _class_folders(tmp_path, ("a", "b"), ("a", "b"), per_class=5)  # 10 images: batches of 3, 3, 3, 1
    assert train.main(_args(data, "--epochs", "1", "--batch-size", "3", "--devices", "cpu,cpu")) == 0
    assert "epoch 1, loss" in capsys.readouterr().out


def test_the_model_has_an_output_for_every_class_even_one_without_training_images(tmp_path: Path) -> None:
    """The outputs were counted from the largest training label: a last class without images (a CIFAR-10
    subset without trucks, an empty folder) had none, so the model could never predict it."""
    data = _class_folders(tmp_path / "data", ("a", "b", "c"), ("a", "c"), per_class=4)
    for image in (data / "train" / "c").iterdir():
        image.unlink()
    assert train.main(_args(data, "--epochs", "1", "--batch-size", "4", "--checkpoint-dir", str(tmp_path / "ck"))) == 0
    weights = torch.load(tmp_path / "ck" / "epoch-1" / "model.pt")
    assert list(weights.values())[-1].shape == (3,), [(k, tuple(w.shape)) for k, w in weights.items()][-2:]


def test_a_data_dir_under_home_written_with_a_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--data-dir=~/data` (zsh leaves the ~ there) was refused as "not a folder", which the loader would have read."""
    monkeypatch.setenv("HOME", str(tmp_path))
    _class_folders(tmp_path / "data", ("a", "b"), ("a", "b"), per_class=2)
    assert train.main([*_args(Path("~/data"), "--epochs", "1")]) == 0


def test_a_data_set_that_cannot_be_read_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad" / "cifar-10-batches-bin").mkdir(parents=True)
    (tmp_path / "bad" / "cifar-10-batches-bin" / "data_batch_1.bin").write_bytes(b"\0" * 3000)
    for data_set, folder, said in (
        ("cifar10", "empty", "pskv train: --dataset cifar10: no CIFAR-10 data_batch_1..data_batch_5"),
        ("cifar10", "bad", "data_batch_1.bin: size 3000 bytes is not a whole number of 3073-byte records"),
        ("folder", "empty", f"pskv train: --dataset folder: no train folder: expected {tmp_path / 'empty' / 'train'}"),
    ):
        assert train.main(["--kv-store", "local", "--dataset", data_set, "--data-dir", str(tmp_path / folder)]) == 2
        assert said in capsys.readouterr().err


def test_a_test_set_without_labels_reports_no_accuracy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Kaggle's layout: the test images have no labels (-1); they were counted as wrong (test acc 0.0000).
    The report says null (NaN, which Python's json writes, is not JSON: jq and JSON.parse refuse it)."""
    import json

    import matplotlib.image as mpimg

    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("test", 4)):
        (tmp_path / split).mkdir()
        for i in range(1, count + 1):
            mpimg.imsave(tmp_path / split / f"{i}.png", rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    (tmp_path / "trainLabels.csv").write_text("id,label\n" + "".join(f"{i},{'ab'[i % 2]}\n" for i in range(1, 9)))
    assert train.main(_args(tmp_path, "--epochs", "1", "--batch-size", "4", "--report", str(tmp_path / "r.json"))) == 0
    assert "test acc nan" in capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert report["final"]["test_acc"] is None and report["epochs"][0]["test_acc"] is None  # JSON's null


def test_the_done_line_and_report_give_the_time_of_every_epoch_a_resumed_run_has(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The "done:" line and the report's final seconds were the wall time of this process only: a resumed run of
    3 epochs said "after 3 epochs in 5.0 s" (its epochs took 7.9, 1.2 and 4.9 s), one with nothing left "in 0.0 s"
    and, with --epochs 2, "after 2 epochs"; the samples/s beside it were every epoch's. Now: the epochs' time summed."""
    import json

    data = _class_folders(tmp_path / "data", ("a", "b"), ("a", "b"), per_class=8)  # 16 images
    args = _args(data, "--batch-size", "4", "--checkpoint-dir", str(tmp_path / "ck"), "--report", str(tmp_path / "r.json"))
    assert train.main([*args, "--epochs", "2"]) == 0
    for epochs in ("3", "2"):  # one more epoch, then none left
        capsys.readouterr()
        assert train.main([*args, "--epochs", epochs, "--resume"]) == 0
        report = json.loads((tmp_path / "r.json").read_text())
        rows, final = report["epochs"], report["final"]
        assert [r["epoch"] for r in rows] == [1, 2, 3]
        assert final["seconds"] == pytest.approx(sum(r["seconds"] for r in rows), rel=1e-9), report
        assert final["samples_per_sec"] * final["seconds"] == pytest.approx(3 * 16, rel=1e-9), report  # samples trained / time
        assert f"done: test acc {rows[-1]['test_acc']:.4f} after 3 epochs in {final['seconds']:.1f} s" in capsys.readouterr().out


def test_an_epoch_that_lost_a_worker_measures_the_whole_test_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each worker measures its share of the test set; a worker lost in an epoch (pskv launch --min-workers)
    sent no share, and that epoch's test accuracy was over the others' shares alone (2 of 3 workers: 682 of
    1024 images), said nowhere. Here worker 1 of 2 is lost in epoch 1: the allgather answers worker 0 alone."""
    from pskv.app import datasets

    create = train.create

    def lost_one(name: str) -> object:
        kv = create(name)
        kv.__class__ = type("LostOne", (type(kv),), {"num_workers": property(lambda self: 2)})
        return kv

    measured: list[int] = []
    batches = datasets.batches

    def recorded(dataset: object, sampler: object, batch_size: int, *rest: object) -> object:
        measured.extend(sampler if isinstance(sampler, range) else ())  # the test pass reads ranges; training a sampler
        return batches(dataset, sampler, batch_size, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(train, "create", lost_one)
    monkeypatch.setattr(datasets, "batches", recorded)
    data = _class_folders(tmp_path / "data", ("a", "b"), ("a", "b"), per_class=4)  # 4 test images
    assert train.main(_args(data, "--epochs", "1", "--batch-size", "4")) == 0
    assert sorted(set(measured)) == [0, 1, 2, 3], measured


def test_tensorboard_steps_go_on_after_a_resume_with_more_workers_and_a_lost_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step of a batch's curves was epoch * steps_per_epoch + i, steps_per_epoch as the job began: resumed with
    2 workers after an epoch by 1 (2 batches an epoch, not 4), and 2 epochs after worker 1 was lost (4 batches an
    epoch again), steps 2, 3, 6 and 7 came twice. Now each is this worker's count of batches before it."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = _class_folders(tmp_path / "data", ("a", "b"), ("a", "b"), per_class=8)  # 16 images, batches of 4
    args = _args(data, "--batch-size", "4", "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "--tensorboard", str(tmp_path / "tb"))
    assert train.main([*args, "--epochs", "1"]) == 0
    create = train.create

    def lost_one(name: str) -> object:  # 2 workers; the allgather answers worker 0 alone: worker 1 lost in epoch 2
        kv = create(name)
        kv.__class__ = type("LostOne", (type(kv),), {"num_workers": property(lambda self: 2)})
        return kv

    monkeypatch.setattr(train, "create", lost_one)
    assert train.main([*args, "--epochs", "4"]) == 0
    steps = []
    for path in (tmp_path / "tb").glob("events.out.tfevents.*"):
        (events := EventAccumulator(str(path))).Reload()
        steps += [s.step for s in events.Scalars("step/loss")]
    assert sorted(steps) == list(range(4 + 2 + 4 + 4)), steps


def test_the_plot_title_of_a_local_store_names_no_servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--kv-store local --plot: the title said "1 workers, 0 servers (local)"; now as the first line: the store."""
    titles: list[str] = []
    monkeypatch.setattr(train, "plot", lambda history, path, title: titles.append(title))
    data = _class_folders(tmp_path / "data", ("a", "b"), ("a", "b"), per_class=2)
    assert train.main(_args(data, "--epochs", "1", "--batch-size", "4", "--plot", str(tmp_path / "p.png"))) == 0
    assert titles == ["small_cnn on folder: 1 worker(s), store local"], titles
