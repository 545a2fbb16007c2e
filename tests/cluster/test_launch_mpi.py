"""``pskv launch --launcher mpi`` with Debian's Open MPI ``mpirun`` on 127.0.0.1.

The hostfile is ``localhost slots=5``, or one as the tutorials write it (a host per line, no
``slots=``); :func:`~tests.cluster.daemons.mpi_env` lets mpirun run as root and keeps its
traffic on the loopback interface.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from .daemons import mpi_available, mpi_env
from .jobs import run
from .launch_checks import (
    check_formulas,
    env_args,
    formulas_args,
    marker,
    marker_args,
    pids_in,
    wait_gone,
    write_project,
)

pytestmark = pytest.mark.skipif(
    not mpi_available(), reason="Open MPI's mpirun not installed (run scripts/install-cluster-deps.sh mpi)"
)


def mpi_launch(tmp: Path, extra: list[str], hosts: str = "localhost slots=5   # every process on this machine\n") -> list[str]:
    hostfile = tmp / "hosts"
    hostfile.write_text(hosts)
    return [
        sys.executable, "-m", "pskv", "launch", "--launcher", "mpi", "-n", "3", "-s", "2",
        "-H", str(hostfile), "--python", sys.executable, *extra,
    ]  # fmt: skip


@pytest.mark.timeout(300)
def test_three_workers_two_servers_under_mpirun(tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    mark = marker()
    argv = mpi_launch(tmp_path, [*env_args(), *marker_args(mark), *formulas_args()])
    res = run(argv, timeout=240, cwd=project, env=mpi_env())
    check_formulas(res)
    assert wait_gone(mark) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hosts", ["localhost\nlocalhost\n", "127.0.0.1\nlocalhost\n"], ids=["repeated", "two-names"])
def test_a_plain_hostfile_places_servers_and_workers_over_its_hosts(tmp_path: Path, hosts: str) -> None:
    """Two slots for five processes, and mpirun's own oversubscription left off: the launcher
    places every process itself (round robin, as the ssh launcher does), so mpirun starts them
    all, where a hostfile handed to mpirun would leave it "already filled"."""
    project = write_project(tmp_path / "project")
    mark = marker()
    argv = mpi_launch(tmp_path, [*env_args(), *marker_args(mark), *formulas_args()], hosts)
    res = run(argv, timeout=240, cwd=project, env=mpi_env(oversubscribe=False))
    check_formulas(res)
    assert wait_gone(mark) == []


@pytest.mark.timeout(180)
def test_a_crashing_worker_ends_the_mpi_job(tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    mark = marker()
    res = run(mpi_launch(tmp_path, [*marker_args(mark), "--", sys.executable, "crash.py"]), timeout=120, cwd=project, env=mpi_env())
    assert res.code == 3, res
    assert "pskv launch: mpirun exited with status 3 ([worker 1] pskv guard: worker 1 failed: " in res.stderr, res
    assert "[worker 1] worker 1 gives up" in res.stderr, res
    pids = pids_in(res.stdout)
    assert len(pids) == 3, res
    assert wait_gone(mark, pids, cwd_under=project) == []


@pytest.mark.timeout(180)
def test_workers_that_never_make_a_store_end_the_mpi_job_at_once(tmp_path: Path) -> None:
    """As with the other launchers: the scheduler and mpirun (its servers) are stopped when the workers'
    guards say they finished, status 0. mpirun ends only with its servers, which waited PSKV_START_TIMEOUT
    (120 s) for workers that never came, and the job failed (status 1)."""
    (tmp_path / "nostore.py").write_text("print('no store here', flush=True)\n")
    argv = mpi_launch(tmp_path, ["--", sys.executable, str(tmp_path / "nostore.py")])
    res = run(argv, timeout=120, env=mpi_env({**os.environ, "PSKV_START_TIMEOUT": "60"}))
    assert res.code == 0 and res.stdout.count("no store here") == 3, res
    assert "the workers finished before the job started (none made a dist store); stopped scheduler, mpirun" in res.stderr, res
