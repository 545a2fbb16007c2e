"""``pskv launch --launcher sge`` on a private Grid Engine cell (sge_qmaster + sge_execd) that
the test configures and starts, unattended (tests/cluster/daemons.py ``gridengine``).

Servers and workers are two array jobs; the launcher follows the tasks' output and status files.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .daemons import GridEngine, gridengine, gridengine_available
from .jobs import run
from .launch_checks import (
    check_formulas,
    env_args,
    formulas_args,
    marker,
    marker_args,
    pids_in,
    read_pids,
    start_launcher,
    wait_gone,
    write_project,
)

pytestmark = pytest.mark.skipif(
    not (gridengine_available() and os.geteuid() == 0),
    reason="Grid Engine not installed (run scripts/install-cluster-deps.sh sge)"
    if not gridengine_available()
    else "sge_execd needs root",
)


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GridEngine]:
    with gridengine(tmp_path_factory.mktemp("sge")) as g:
        yield g


def launch_argv(g: GridEngine, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "pskv", "launch", "--launcher", "sge", "--python", sys.executable,
        f"--launcher-args=-q {g.queue}", *extra,
    ]  # fmt: skip


@pytest.mark.timeout(300)
def test_array_jobs_run_three_workers_two_servers(cell: GridEngine, tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    mark = marker()
    argv = launch_argv(cell, "-n", "3", "-s", "2", *env_args(), *marker_args(mark), *formulas_args())
    res = run(argv, timeout=240, cwd=project, env=cell.env())
    check_formulas(res)
    assert "pskv launch: submitted Grid Engine job(s) " in res.stderr, res
    assert not list(project.glob(".pskv-sge-*")), "scripts and output files are removed after success"
    assert wait_gone(mark) == []


@pytest.mark.timeout(180)
def test_a_crashing_task_deletes_the_jobs(cell: GridEngine, tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    mark = marker()
    res = run(launch_argv(cell, "-n", "3", "-s", "1", *marker_args(mark), "--", sys.executable, "crash.py"), timeout=120, cwd=project, env=cell.env())
    assert res.code == 3, res
    assert "pskv launch: worker 1 exited with status 3" in res.stderr, res
    assert "pskv launch: deleted Grid Engine job(s) " in res.stderr, res
    assert "[worker 1] worker 1 gives up" in res.stdout, res
    pids = pids_in(res.stdout)
    assert len(pids) == 3, res
    assert wait_gone(mark, pids, cwd_under=project) == []
    assert cell.job_ids() == []


@pytest.mark.timeout(180)
def test_ctrl_c_deletes_the_jobs(cell: GridEngine, tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    mark = marker()
    launcher = start_launcher(launch_argv(cell, "-n", "2", "-s", "1", *marker_args(mark), "--", sys.executable, "sleep.py"), project, cell.env())
    try:
        pids = read_pids(launcher, 2)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=90)
        assert launcher.returncode == 130, err
        assert "pskv launch: deleted Grid Engine job(s) " in err, err
        assert wait_gone(mark, pids, cwd_under=project) == []
        assert cell.job_ids() == []
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
