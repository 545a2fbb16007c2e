"""``pskv launch --launcher ssh`` against a real sshd that the test starts on 127.0.0.1.

The hostfile lists ``pskv-a`` and ``pskv-b``: two names (in the generated ssh client config)
for the same sshd, so the job really goes through ssh twice over, and both names resolve to one
destination (``--sync-dst-dir`` copies once). The remote interpreter is this venv's python.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .daemons import Sshd, rsync_available, sshd, sshd_available
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

pytestmark = [
    pytest.mark.skipif(
        not sshd_available(), reason="OpenSSH server/client not installed (run scripts/install-cluster-deps.sh ssh)"
    ),
    pytest.mark.skipif(not rsync_available(), reason="rsync not installed (run scripts/install-cluster-deps.sh ssh)"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    with sshd(tmp_path_factory.mktemp("sshd")) as s:
        yield s


def ssh_launch(s: Sshd, tmp: Path, hosts: list[str], extra: list[str], dst: Path) -> list[str]:
    hostfile = tmp / "hosts"
    hostfile.write_text("# two names of the same sshd\n" + "".join(f"{h}\n" for h in hosts))
    return [
        sys.executable,
        "-m",
        "pskv",
        "launch",
        "--launcher",
        "ssh",
        "-n",
        "3",
        "-s",
        "2",
        "-H",
        str(hostfile),
        "--ssh-command",
        s.rsync_rsh(),
        "--sync-dst-dir",
        str(dst),
        "--python",
        sys.executable,
        *extra,
    ]


@pytest.mark.timeout(300)
def test_three_workers_two_servers_through_sshd_with_sync(server: Sshd, tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    dst = tmp_path / "remote" / "job"
    mark = marker()
    trace = tmp_path / "t.json"  # (the hosts share this folder: the launcher merges every process's file)
    argv = ssh_launch(server, tmp_path, ["pskv-a", "pskv-b"], [*env_args(), "--env", f"PSKV_TIMELINE:{trace}", *marker_args(mark), *formulas_args()], dst)
    res = run(argv, timeout=240, cwd=project)
    # round robin over the hostfile: workers a, b, a; servers a, b
    check_formulas(res, host=["pskv-a", "pskv-b", "pskv-a"], server_host=["pskv-a", "pskv-b"])
    # ran from the synced copy on the "remote" hosts
    assert (dst / "formulas.py").read_text() == (project / "formulas.py").read_text()
    for w, host in enumerate(["pskv-a", "pskv-b", "pskv-a"]):
        assert f"[worker {w}@{host}] env {w} {dst} " in res.stdout, res
    assert wait_gone(mark) == []
    names = {e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["name"] == "process_name"}
    assert names == {"worker 0", "worker 1", "worker 2", "server 0", "server 1"} and "timeline:" not in res.stderr, (names, res)


@pytest.mark.timeout(120)
def test_a_host_that_refuses_connections_is_named_and_nothing_starts(server: Sshd, tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    dst = tmp_path / "remote"
    mark = marker()
    argv = ssh_launch(server, tmp_path, ["pskv-a", server.down_alias], [*marker_args(mark), "--", sys.executable, "sleep.py"], dst)
    res = run(argv, timeout=60, cwd=project)
    assert res.code == 2, res
    assert f"cannot reach {server.down_alias}; nothing was started" in res.stderr, res
    assert "Connection refused" in res.stderr, res
    assert "pskv-a" not in res.stderr.split("nothing was started")[0], res  # only the bad one is named
    assert res.stdout == "" and not dst.exists(), res  # no scheduler, no copy, no process
    assert res.seconds < 30, res
    assert wait_gone(mark, timeout=1) == []


@pytest.mark.timeout(180)
def test_a_worker_that_crashes_on_a_remote_host_stops_everything(server: Sshd, tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    dst = tmp_path / "remote"
    mark = marker()
    argv = ssh_launch(server, tmp_path, ["pskv-a", "pskv-b"], [*marker_args(mark), "--", sys.executable, "crash.py"], dst)
    res = run(argv, timeout=120, cwd=project)
    assert res.code == 3, res
    assert "pskv launch: worker 1@pskv-b exited with status 3 (pskv guard: worker 1 failed: " in res.stderr, res
    assert "; stopped the other processes of the job" in res.stderr, res
    assert "[worker 1@pskv-b] worker 1 gives up" in res.stderr, res
    pids = pids_in(res.stdout)
    assert len(pids) == 3, res
    assert res.seconds < 60, res
    assert wait_gone(mark, pids, cwd_under=dst) == []


@pytest.mark.timeout(180)
def test_ctrl_c_stops_the_processes_on_every_host(server: Sshd, tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    dst = tmp_path / "remote"
    mark = marker()
    launcher = start_launcher(ssh_launch(server, tmp_path, ["pskv-a", "pskv-b"], [*marker_args(mark), "--", sys.executable, "sleep.py"], dst), project)
    try:
        pids = read_pids(launcher, 3)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 130, err
        assert "got SIGINT; stopping the job" in err
        assert wait_gone(mark, pids, cwd_under=dst, cmdline_contains=str(dst)) == []
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()


@pytest.mark.timeout(180)
def test_a_killed_launcher_takes_the_remote_processes_with_it(server: Sshd, tmp_path: Path) -> None:
    """SIGKILL leaves the launcher no chance to clean up: the ssh clients see their stdin close,
    and each remote guard stops its command; the scheduler's guard here does the same."""
    project = write_project(tmp_path / "project")
    dst = tmp_path / "remote"
    mark = marker()
    launcher = start_launcher(ssh_launch(server, tmp_path, ["pskv-a", "pskv-b"], [*marker_args(mark), "--", sys.executable, "sleep.py"], dst), project)
    try:
        pids = read_pids(launcher, 3)
        assert len(wait_gone(mark, timeout=0)) >= 6  # the scheduler, 2 servers, 3 workers at least
        launcher.kill()
        launcher.communicate(timeout=30)
        assert wait_gone(mark, pids, cwd_under=dst, cmdline_contains=str(dst), timeout=30) == []
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()


@pytest.mark.timeout(180)
def test_timeout_stops_the_processes_on_every_host(server: Sshd, tmp_path: Path) -> None:
    project = write_project(tmp_path / "project")
    dst = tmp_path / "remote"
    mark = marker()
    argv = ssh_launch(server, tmp_path, ["pskv-a", "pskv-b"], ["--timeout", "8", *marker_args(mark), "--", sys.executable, "sleep.py"], dst)
    res = run(argv, timeout=120, cwd=project)
    assert res.code == 124, res
    assert "the job ran past its time limit of 8 s; stopped it" in res.stderr, res
    pids = pids_in(res.stdout)
    assert len(pids) == 3, res
    assert wait_gone(mark, pids, cwd_under=dst, cmdline_contains=str(dst)) == []
