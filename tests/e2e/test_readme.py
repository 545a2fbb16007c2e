"""The README's commands, as a new user types them (with fewer epochs)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.jobs import REPO, run

pytestmark = pytest.mark.timeout(400)


def test_main_job_command_writes_report_and_plot(tmp_path: Path) -> None:
    """`make demo` with one epoch, report and plot redirected to tmp_path."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    report, plot = tmp_path / "report.json", tmp_path / "training.png"
    args = f"--epochs 1 --no-progress --report {report} --plot {plot}"
    res = run(["make", "-s", "demo", f"DEMO_ARGS={args}"], timeout=360, cwd=REPO)
    assert res.code == 0, res
    assert re.search(r"epoch 1, loss [\d.]+, train acc [\d.]+, test acc [\d.]+, time [\d.]+ s", res.stdout), res
    data = json.loads(report.read_text())
    assert data["workers"] == 2 and data["servers"] == 2 and data["kv_store"] == "dist_sync"
    assert len(data["epochs"]) == 1
    final = data["final"]
    for field in ("test_acc", "train_acc", "loss", "seconds", "samples_per_sec"):
        assert isinstance(final[field], float), field
    assert 0.3 < final["test_acc"] <= 1.0, final  # one epoch of digits is far above chance (0.1)
    assert final["samples_per_sec"] > 0 and final["seconds"] > 0
    epoch = data["epochs"][0]  # "per worker" is the workers' mean (it was worker 0's own rate)
    assert epoch["samples_per_sec_per_worker"] == pytest.approx(epoch["samples_per_sec"] / 2, rel=1e-12), epoch
    png = plot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(str(plot)).shape[:2] == (400, 1000)


def test_readme_training_snippet_runs_under_pskv_launch(tmp_path: Path) -> None:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```python\n(# train\.py.*?)```", text, re.S)
    assert block, "the README's train.py example is gone"
    script = tmp_path / "train.py"
    script.write_text(block.group(1) + "\nprint('trained rank', kv.rank, 'of', kv.num_workers)\nkv.close()\n")
    res = run([sys.executable, "-m", "pskv", "launch", "-n", "2", "-s", "2", "--", sys.executable, str(script)], timeout=300)
    assert res.code == 0, res
    assert "[worker 0] trained rank 0 of 2" in res.stdout and "[worker 1] trained rank 1 of 2" in res.stdout, res


def test_readme_store_snippet_runs() -> None:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```python\n(import torch, pskv\n\nkv = pskv\.kv\.create\(\"local\"\).*?)```", text, re.S)
    assert block, "the README's store example is gone"
    code = block.group(1) + "\nassert torch.equal(out, out) and rows.coalesce().indices()[0].tolist() == [3, 7]\nprint('ok')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_readme_checkpoint_snippet_goes_on_where_it_stopped(tmp_path: Path) -> None:
    """The README's train_ckpt.py (with a small network, and 1 then 2 epochs): the second run takes
    epoch 1 from the first's checkpoint and trains only epoch 2, and ends with the weights of a run of
    2 epochs never stopped (the same initial weights; each epoch's data order: it drew epoch 0's again)."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"```python\n(# train_ckpt\.py.*?)```", text, re.S)
    assert block, "the README's train_ckpt.py example is gone"
    code = block.group(1).replace("net = models.resnet18(num_classes=10)", "torch.manual_seed(0)\nnet = models.small_cnn(10, 3, 16)")
    assert "range(done, 3)" in code
    for epochs in (1, 2):
        script = tmp_path / f"train_ckpt_{epochs}.py"
        script.write_text(code.replace("range(done, 3)", f"range(done, {epochs})") + "\nprint('from epoch', done)\nkv.close()\n")
        res = run([sys.executable, "-m", "pskv", "launch", "-n", "2", "-s", "2", "--", sys.executable, str(script)], timeout=300, cwd=tmp_path)
        assert res.code == 0, res
        assert res.stdout.count(f"from epoch {epochs - 1}") == 2, res
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [f"epoch-{epochs}"], res
    (tmp_path / "whole").mkdir()
    res = run([sys.executable, "-m", "pskv", "launch", "-n", "2", "-s", "2", "--", sys.executable, str(script)], timeout=300, cwd=tmp_path / "whole")
    assert res.code == 0 and res.stdout.count("from epoch 0") == 2, res
    import torch

    cut, whole = (torch.load(d / "ckpt" / "epoch-2" / "model.pt") for d in (tmp_path, tmp_path / "whole"))
    assert all(torch.equal(cut[k], whole[k]) for k in whole), [k for k in whole if not torch.equal(cut[k], whole[k])]
