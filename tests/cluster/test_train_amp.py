"""``pskv train --amp`` and ``--tensorboard`` with real processes (on the CPU here: bf16 and fp16
autocast both run there; the CUDA run is in benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from .jobs import run

pytestmark = pytest.mark.timeout(240)
TRAIN = ["--model", "small_cnn", "--dataset", "synthetic", "--image-size", "16", "--epochs", "2", "--no-progress"]


def test_fp16_with_tensorboard_started_by_hand(tmp_path: Path) -> None:
    """2 workers x 2 servers: an fp16 loss scale that every worker keeps alike, and the curves on disk."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report, board = tmp_path / "report.json", tmp_path / "tb"
    res = run([sys.executable, "-m", "pskv", "train", *TRAIN, "--amp", "fp16", "--tensorboard", str(board), "--report", str(report)], timeout=200)
    assert res.code == 0, res
    epochs = json.loads(report.read_text())["epochs"]
    assert epochs[1]["loss"] < epochs[0]["loss"] and epochs[1]["test_acc"] > 0.5, epochs
    scale = epochs[1]["loss_scale"]
    assert 1 <= scale <= 2.0**16 and math.log2(scale).is_integer(), epochs  # halved on overflow, or kept
    files = list(board.glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # worker 0 only
    events = EventAccumulator(str(files[0]))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("step/loss", "step/accuracy", "step/lr", "step/samples_per_s", "step/exchange_share", "epoch/test_acc", "epoch/loss_scale"):
        assert tag in tags, sorted(tags)
    steps = events.Scalars("step/loss")
    assert len(steps) == 2 * 64 and [s.step for s in steps] == list(range(128)), len(steps)  # 4096 images / 2 workers / 32
    assert [s.step for s in events.Scalars("epoch/test_acc")] == [1, 2]


def test_bf16_as_the_workers_program(tmp_path: Path) -> None:
    """bf16 autocast, gradients travelling as bf16, under ``pskv launch``."""
    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "pskv", "launch", "-n", "2", "-s", "1", "--", sys.executable, "-m", "pskv", "train",
            *TRAIN, "--amp", "bf16", "--report", str(report)]  # fmt: skip
    res = run(argv, timeout=200)
    assert res.code == 0, res
    epochs = json.loads(report.read_text())["epochs"]
    assert epochs[1]["loss"] < epochs[0]["loss"] and epochs[1]["test_acc"] > 0.5 and "loss_scale" not in epochs[1], epochs


def test_bad_amp_and_tensorboard_arguments_are_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    from pskv.app import train

    assert train.main([*TRAIN, "--amp", "fp16", "--kv-store", "dist_async"]) == 2
    assert "dist_async updates on the servers" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert train.main([*TRAIN, "--tensorboard", "tb"]) == 2
    assert "--tensorboard needs the tensorboard package: pip install tensorboard" in capsys.readouterr().err


def test_fp16_under_pskv_launch_trains_with_servers_that_were_not_told(tmp_path: Path) -> None:
    """The servers of a launched job keep PSKV_NONFINITE=error (here "": the default) unless told; the first
    overflowed fp16 step failed the job, though pskv train says allow. A worker's own setting now goes with
    its pushes, so the job trains, and skips the steps that overflow."""
    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "pskv", "launch", "-n", "2", "-s", "1", "--", sys.executable, "-m", "pskv", "train",
            *TRAIN, "--amp", "fp16", "--report", str(report)]  # fmt: skip
    res = run(argv, timeout=200, env={"PSKV_NONFINITE": ""})  # (whatever this shell has)
    assert res.code == 0, res
    epochs = json.loads(report.read_text())["epochs"]
    assert epochs[1]["loss"] < epochs[0]["loss"] and epochs[1]["loss_scale"] < 2.0**16, epochs  # (it overflowed, and went on)
