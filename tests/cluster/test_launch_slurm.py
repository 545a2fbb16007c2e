"""``pskv launch --launcher slurm`` on a one-node Slurm (slurmctld + slurmd) the test starts.

Inside an allocation (``salloc ... pskv launch``) the launcher runs one ``srun`` step per role;
outside it submits a batch script with ``sbatch --wait`` that runs the same launcher inside the
job. This machine has fewer CPUs than the job has processes, hence ``--overcommit``.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .daemons import Slurm, slurm, slurm_available
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
    not (slurm_available() and os.geteuid() == 0),
    reason="Slurm not installed (run scripts/install-cluster-deps.sh slurm)" if not slurm_available() else "slurmd needs root",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    with slurm(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def launch_argv(*extra: str) -> list[str]:
    return [sys.executable, "-m", "pskv", "launch", "--launcher", "slurm", "--python", sys.executable, *extra]


@pytest.mark.timeout(300)
def test_srun_steps_inside_salloc(cluster: Slurm, tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    mark = marker()
    argv = ["salloc", "--overcommit", "-N1", "-n5", *launch_argv("-n", "3", "-s", "2", *env_args(), *marker_args(mark), *formulas_args())]
    res = run(argv, timeout=240, cwd=project, env=cluster.env())
    check_formulas(res)
    assert wait_gone(mark) == []
    assert cluster.jobs_left() == []


@pytest.mark.timeout(300)
def test_sbatch_submission_streams_the_job_output(cluster: Slurm, tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    mark = marker()
    argv = launch_argv("-n", "3", "-s", "2", "--launcher-args=--overcommit", *env_args(), *marker_args(mark), *formulas_args())
    res = run(argv, timeout=240, cwd=project, env=cluster.env())
    check_formulas(res)
    assert "pskv launch: submitted Slurm job " in res.stderr, res
    assert not list(project.glob(".pskv-slurm-*")), "the batch script and output are removed after success"
    assert wait_gone(mark) == []


@pytest.mark.timeout(180)
def test_a_crashing_worker_ends_the_steps(cluster: Slurm, tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    mark = marker()
    argv = ["salloc", "--overcommit", "-N1", "-n4", *launch_argv("-n", "3", "-s", "1", *marker_args(mark), "--", sys.executable, "crash.py")]
    res = run(argv, timeout=120, cwd=project, env=cluster.env())
    assert res.code == 3, res
    assert "pskv launch: srun workers exited with status " in res.stderr, res
    assert "([worker 1] pskv guard: worker 1 failed: " in res.stderr, res
    pids = pids_in(res.stdout)
    assert len(pids) == 3, res
    assert wait_gone(mark, pids, cwd_under=project) == []


@pytest.mark.timeout(180)
def test_ctrl_c_cancels_the_submitted_job(cluster: Slurm, tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    mark = marker()
    launcher = start_launcher(launch_argv("-n", "2", "-s", "1", "--launcher-args=--overcommit", *marker_args(mark), "--", sys.executable, "sleep.py"), project, cluster.env())
    try:
        pids = read_pids(launcher, 2)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 130, err
        assert "pskv launch: cancelled Slurm job " in err, err
        assert wait_gone(mark, pids, cwd_under=project) == []
        assert cluster.jobs_left() == []
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()


@pytest.mark.timeout(120)
def test_a_rejected_submission_says_so(cluster: Slurm, tmp_path: Path) -> None:
    """sbatch refusing the job (an unknown partition) is reported with sbatch's reason; no job was
    made, so none is said to be cancelled (it said "cancelled Slurm job NAME")."""
    project = write_project(tmp_path / "project")
    res = run(launch_argv("-n", "1", "-s", "1", "--launcher-args=--partition=nosuchpartition", "--", sys.executable, "sleep.py"), timeout=100, cwd=project, env=cluster.env())
    assert res.code != 0, res
    assert "nosuchpartition" in res.stderr or "partition" in res.stderr.lower(), res
    assert "cancelled Slurm job" not in res.stderr, res
