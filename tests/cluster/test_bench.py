"""pskv bench: a real run against gloo, checked values, and the JSON fields the docs rely on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .jobs import run

pytestmark = pytest.mark.timeout(240)


def test_bench_compares_with_gloo_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    res = run([sys.executable, "-m", "pskv", "bench", "--size-mb", "3", "-n", "2", "-s", "2", "--rounds", "2",
               "--warmup", "1", "--compare", "gloo", "--json", str(out)], timeout=200)  # fmt: skip
    assert res.code == 0, res
    assert "ratio pskv / gloo:" in res.stdout and "shared memory" in res.stdout, res
    data = json.loads(out.read_text())
    assert (data["workers"], data["servers"], data["arrays"]) == (2, 2, 1)
    assert data["bytes"] == 750_000 * 4
    assert data["pskv_round_s"] > 0 and data["gloo_round_s"] > 0
    assert data["ratio"] == pytest.approx(data["pskv_round_s"] / data["gloo_round_s"])
    assert set(data["pskv_peak_rss_mb"]) == {"scheduler", "server 0", "server 1", "worker 0", "worker 1"}
    assert all(mb > 10 for mb in data["pskv_peak_rss_mb"].values())
    for system in ("pskv", "gloo"):  # 2 rounds: p10 the faster, p90 the slower (was the faster)
        assert data[f"{system}_round_p10_s"] <= data[f"{system}_round_s"] <= data[f"{system}_round_p90_s"], data


def test_bench_over_tcp_and_a_bad_size(tmp_path: Path) -> None:
    res = run([sys.executable, "-m", "pskv", "bench", "--model", "resnet18", "-n", "1", "-s", "1", "--rounds", "2", "--warmup", "1"],
              timeout=200, env={"PSKV_SHM": "0"})  # fmt: skip
    assert res.code == 0 and "(TCP)" in res.stdout and "44.7 MB" in res.stdout, res
    res = run([sys.executable, "-m", "pskv", "bench", "--size-mb", "-1"], timeout=60)
    assert res.code == 2 and "--size-mb must be positive" in res.stderr, res
    res = run([sys.executable, "-m", "pskv", "bench", "--rounds", "0"], timeout=60)
    assert res.code == 2 and "--rounds must be >= 1, --warmup >= 0; got 2, 2, 0, 3" in res.stderr, res


def test_bench_a_size_that_is_no_number_and_a_json_path_it_cannot_write_are_one_line_errors(tmp_path: Path) -> None:
    for size in ("nan", "inf"):
        res = run([sys.executable, "-m", "pskv", "bench", "--size-mb", size], timeout=60)
        assert res.code == 2 and res.stderr == f"pskv bench: --size-mb must be positive, got {size}\n", res
    res = run([sys.executable, "-m", "pskv", "bench", "--size-mb", "0.01", "-n", "1", "-s", "1", "--rounds", "1", "--warmup", "0",
               "--json", str(tmp_path)], timeout=200)  # fmt: skip
    assert res.code == 2 and res.stderr == f"pskv bench: [Errno 21] Is a directory: '{tmp_path}'\n", res
