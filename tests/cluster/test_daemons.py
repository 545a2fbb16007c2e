"""The cluster daemons of tests/cluster/daemons.py, exercised for real.

Each group skips (with the reason) where its software is missing; install it with
``scripts/install-cluster-deps.sh``. Every test has a hard timeout, and every helper stops
what it started, so a failing test leaves nothing running.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .daemons import (
    DaemonError,
    find_processes,
    gridengine,
    gridengine_available,
    mpi_available,
    mpi_env,
    mpi_hostfile,
    mpirun_mpmd,
    refused_port,
    remote_command,
    rsync_available,
    slurm,
    slurm_available,
    sshd,
    sshd_available,
    terminate,
)

INSTALL = "run scripts/install-cluster-deps.sh"
IS_ROOT = os.geteuid() == 0

needs_sshd = pytest.mark.skipif(
    not sshd_available(), reason=f"OpenSSH server/client not installed ({INSTALL} ssh)"
)
needs_rsync = pytest.mark.skipif(not rsync_available(), reason=f"rsync not installed ({INSTALL} ssh)")
needs_mpi = pytest.mark.skipif(not mpi_available(), reason=f"Open MPI's mpirun not installed ({INSTALL} mpi)")
needs_slurm = pytest.mark.skipif(
    not (slurm_available() and IS_ROOT),
    reason=f"Slurm not installed ({INSTALL} slurm)" if not slurm_available() else "slurmd needs root",
)
needs_sge = pytest.mark.skipif(
    not (gridengine_available() and IS_ROOT),
    reason=f"Grid Engine not installed ({INSTALL} sge)"
    if not gridengine_available()
    else "sge_execd needs root",
)


def _marker() -> dict[str, str]:
    """A unique environment variable to find a test's processes by."""
    return {"PSKV_TEST_MARKER": uuid.uuid4().hex}


def _wait_gone(environ: dict[str, str], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = find_processes(environ=environ)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------
# ssh


@needs_sshd
@pytest.mark.timeout(120)
def test_sshd_login_through_both_aliases(tmp_path: Path) -> None:
    with sshd(tmp_path) as s:
        assert s.host == "127.0.0.1"
        for alias in (*s.aliases, "127.0.0.1", "localhost"):
            res = subprocess.run(
                [*s.ssh_command(), alias, "echo ok"], capture_output=True, text=True, timeout=30, check=False
            )
            assert (res.returncode, res.stdout) == (0, "ok\n"), res.stderr
        # the key and port also work without the config file
        res = subprocess.run(
            [
                "ssh",
                "-p",
                str(s.port),
                "-i",
                str(s.identity_file),
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                f"UserKnownHostsFile={s.known_hosts}",
                "-o",
                "BatchMode=yes",
                f"{s.user}@{s.host}",
                "echo direct",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert res.stdout == "direct\n", res.stderr
        listening = [line for line in s.log_file.read_text().splitlines() if "listening" in line.lower()]
        assert listening and all("127.0.0.1" in line for line in listening)


@needs_sshd
@pytest.mark.timeout(120)
def test_sshd_inline_environment_and_cwd(tmp_path: Path) -> None:
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    env = {"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "3", "TRICKY": "a b 'c' \"d\" $HOME; echo no"}
    script = "import os, sys; print(os.getcwd()); [print(k + '=' + os.environ[k]) for k in sys.argv[1:]]"
    with sshd(tmp_path) as s:
        res = s.run("pskv-b", remote_command([sys.executable, "-c", script, *env], env, cwd=str(workdir)))
        lines = res.stdout.splitlines()
        assert lines[0] == str(workdir)
        assert lines[1:] == [f"{k}={v}" for k, v in env.items()]


@needs_sshd
@needs_rsync
@pytest.mark.timeout(120)
def test_rsync_over_sshd(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.py").write_text("print('a')\n")
    (src / "sub" / "b.bin").write_bytes(os.urandom(100_000))
    dst = tmp_path / "remote" / "x"
    with sshd(tmp_path) as s:
        res = subprocess.run(
            ["rsync", "-e", s.rsync_rsh(), "-a", "--mkpath", f"{src}/", f"pskv-a:{dst}/"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert res.returncode == 0, res.stderr
    assert (dst / "a.py").read_text() == "print('a')\n"
    assert (dst / "sub" / "b.bin").read_bytes() == (src / "sub" / "b.bin").read_bytes()


@needs_sshd
@pytest.mark.timeout(120)
def test_refused_host(tmp_path: Path) -> None:
    with refused_port() as port, pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with sshd(tmp_path) as s:
        t0 = time.monotonic()
        res = subprocess.run(
            [*s.ssh_command(), s.down_alias, "true"], capture_output=True, text=True, timeout=30, check=False
        )
        assert res.returncode == 255
        assert "Connection refused" in res.stderr
        assert time.monotonic() - t0 < 10


@needs_sshd
@pytest.mark.timeout(120)
def test_ssh_remote_process_lifetime(tmp_path: Path) -> None:
    """What a launcher must know: killing the ssh client leaves a remote command without a tty
    running; with -tt it gets SIGHUP. Leaving the sshd context stops both kinds."""
    notty, tty, survivor = _marker(), _marker(), _marker()
    with sshd(tmp_path) as s:
        procs = {}
        for name, env, flags in (("notty", notty, []), ("tty", tty, ["-tt"])):
            procs[name] = subprocess.Popen(
                [*s.ssh_command(), *flags, "pskv-a", remote_command(["sleep", "300"], env)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 30
        while not (find_processes(environ=notty) and find_processes(environ=tty)):
            assert time.monotonic() < deadline, "remote commands did not start"
            time.sleep(0.1)
        assert set(find_processes(environ=notty)) <= set(s.session_pids())
        for p in procs.values():
            p.kill()
            p.wait(timeout=10)
        assert _wait_gone(tty) == []
        assert find_processes(environ=notty), "a remote command without tty outlives its ssh client"
        # one that is still attached when the server goes away
        p = subprocess.Popen(
            [*s.ssh_command(), "pskv-b", remote_command(["sleep", "300"], survivor)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not find_processes(environ=survivor):
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert _wait_gone(survivor) == []
    p.wait(timeout=10)
    # the orphan of the killed client was re-parented to init: stop it ourselves, by PID
    terminate(find_processes(environ=notty))
    assert _wait_gone(notty) == []


@needs_sshd
@pytest.mark.timeout(60)
def test_sshd_start_failure_reports_log(tmp_path: Path) -> None:
    """A daemon that cannot start raises DaemonError with its log, and leaves nothing behind."""
    (tmp_path / "sshd").mkdir()
    (tmp_path / "sshd" / "ssh_host_ed25519_key").write_text("not a key\n")
    (tmp_path / "sshd" / "ssh_host_ed25519_key.pub").write_text("not a key\n")
    with pytest.raises(DaemonError) as err, sshd(tmp_path, timeout=10):
        pass
    assert "sshd" in str(err.value)
    assert find_processes(cwd_under=tmp_path) == []


# --------------------------------------------------------------------------------------------
# MPI

# Each process writes its own file: mpirun forwards the processes' output through one stream,
# and lines of different ranks can be cut into each other there.
_RANK_SCRIPT = """\
import os, sys
e = os.environ
row = [e["DMLC_ROLE"], e["OMPI_COMM_WORLD_RANK"], e["OMPI_COMM_WORLD_SIZE"], e["OMPI_MCA_orte_app_num"]]
row.append(e.get("ONLY_SERVERS", "-"))
with open(os.path.join(sys.argv[1], "rank" + e["OMPI_COMM_WORLD_RANK"]), "w") as f:
    f.write(" ".join(row))
"""


@needs_mpi
@pytest.mark.timeout(120)
def test_mpirun_mpmd_env_per_group(tmp_path: Path) -> None:
    hostfile = mpi_hostfile(tmp_path / "hostfile", slots=2)
    out = tmp_path / "out"
    out.mkdir()
    prog = [sys.executable, "-c", _RANK_SCRIPT, str(out)]
    cmd = mpirun_mpmd(
        [
            (1, {"DMLC_ROLE": "scheduler"}, prog),
            (2, {"DMLC_ROLE": "server", "ONLY_SERVERS": "yes"}, prog),
            (3, {"DMLC_ROLE": "worker"}, prog),
        ],
        hostfile=hostfile,
    )
    res = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=90, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = sorted(tuple(f.read_text().split()) for f in out.iterdir())
    assert rows == sorted(
        [
            ("scheduler", "0", "6", "0", "-"),
            ("server", "1", "6", "1", "yes"),
            ("server", "2", "6", "1", "yes"),
            ("worker", "3", "6", "2", "-"),
            ("worker", "4", "6", "2", "-"),
            ("worker", "5", "6", "2", "-"),
        ]
    )


@needs_mpi
@pytest.mark.timeout(120)
def test_mpirun_aborts_job_when_a_process_fails(tmp_path: Path) -> None:
    marker = _marker()
    cmd = mpirun_mpmd([(2, marker, ["sleep", "300"]), (1, marker, ["sh", "-c", "sleep 1; exit 3"])])
    t0 = time.monotonic()
    res = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=90, check=False)
    assert res.returncode == 3, res.stdout + res.stderr
    assert time.monotonic() - t0 < 60
    assert _wait_gone(marker) == []


# --------------------------------------------------------------------------------------------
# Slurm


@needs_slurm
@pytest.mark.timeout(120)
def test_slurm_srun_and_salloc(tmp_path: Path) -> None:
    with slurm(tmp_path) as c:
        assert c.node_state() == "idle"
        res = c.run(["srun", "--overcommit", "-N1", "-n3", "hostname"])
        assert res.stdout.splitlines() == [socket.gethostname()] * 3
        res = c.run(["salloc", "--overcommit", "-N1", "-n5", "srun", "-n5", "printenv", "SLURM_PROCID"])
        assert sorted(res.stdout.split()) == ["0", "1", "2", "3", "4"]


@needs_slurm
@pytest.mark.timeout(120)
def test_slurm_declared_cpus_need_no_overcommit(tmp_path: Path) -> None:
    with slurm(tmp_path, cpus=8) as c:
        assert c.run(["sinfo", "-h", "-N", "-o", "%c"]).stdout.strip() == "8"
        res = c.run(["salloc", "-N1", "-n6", "srun", "-n6", "printenv", "SLURM_PROCID"])
        assert sorted(res.stdout.split()) == ["0", "1", "2", "3", "4", "5"]


@needs_slurm
@pytest.mark.skipif(
    shutil.which("munged", path=os.defpath + ":/usr/sbin") is None, reason="munge not installed"
)
@pytest.mark.timeout(120)
def test_slurm_with_private_munge(tmp_path: Path) -> None:
    """The fallback for Slurm versions without auth/none: a munged of our own."""
    with slurm(tmp_path, auth="munge") as c:
        assert "AuthType=auth/munge" in c.conf.read_text()
        res = c.run(["srun", "--overcommit", "-n3", "printenv", "SLURM_PROCID"])
        assert sorted(res.stdout.split()) == ["0", "1", "2"]
        munge_dir = c.directory / "munge"
    assert find_processes(cwd_under=munge_dir.parent) == []


_BARRIER = """\
#!/bin/sh
# every task checks in, then waits until all 6 have: passes only if the steps run concurrently
touch "$BARRIER/$DMLC_ROLE.$SLURM_PROCID"
i=0
while [ "$(ls "$BARRIER" | wc -l)" -lt 6 ]; do
    i=$((i + 1)); [ $i -gt 600 ] && exit 9
    sleep 0.1
done
echo "$DMLC_ROLE $SLURM_PROCID $SLURM_NTASKS $SLURM_JOB_ID"
"""

_JOB = """\
#!/bin/sh
#SBATCH --nodes=1 --ntasks=6 --overcommit
#SBATCH --output={out}
srun --overlap --ntasks=1 --export=ALL,DMLC_ROLE=scheduler {task} & p1=$!
srun --overlap --ntasks=2 --export=ALL,DMLC_ROLE=server {task} & p2=$!
srun --overlap --ntasks=3 --export=ALL,DMLC_ROLE=worker {task} & p3=$!
rc=0
wait $p1 || rc=1
wait $p2 || rc=1
wait $p3 || rc=1
exit $rc
"""


@needs_slurm
@pytest.mark.timeout(120)
def test_slurm_sbatch_wait_with_concurrent_role_steps(tmp_path: Path) -> None:
    task = tmp_path / "task.sh"
    task.write_text(_BARRIER)
    task.chmod(0o755)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    out = tmp_path / "job.out"
    job = tmp_path / "job.sh"
    job.write_text(_JOB.format(out=out, task=task))
    with slurm(tmp_path) as c:
        env = c.env()
        env["BARRIER"] = str(barrier)
        res = subprocess.run(
            ["sbatch", "--wait", "--parsable", str(job)],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
            cwd=tmp_path,
        )
        assert res.returncode == 0, res.stderr + out.read_text() if out.exists() else res.stderr
        job_id = res.stdout.strip()
    rows = sorted(tuple(line.split()) for line in out.read_text().splitlines())
    assert rows == sorted(
        [
            ("scheduler", "0", "1", job_id),
            ("server", "0", "2", job_id),
            ("server", "1", "2", job_id),
            ("worker", "0", "3", job_id),
            ("worker", "1", "3", job_id),
            ("worker", "2", "3", job_id),
        ]
    )


@needs_slurm
@pytest.mark.timeout(120)
def test_slurm_failed_step_fails_sbatch(tmp_path: Path) -> None:
    job = tmp_path / "fail.sh"
    job.write_text(f"#!/bin/sh\n#SBATCH --output={tmp_path / 'fail.out'}\nsrun -n1 sh -c 'exit 7'\n")
    with slurm(tmp_path) as c:
        res = c.run(["sbatch", "--wait", str(job)], timeout=90, check=False, cwd=tmp_path)
        assert res.returncode != 0


@needs_slurm
@pytest.mark.timeout(120)
def test_slurm_exit_stops_running_jobs(tmp_path: Path) -> None:
    marker = _marker()
    with slurm(tmp_path) as c:
        env = {**c.env(), **marker}
        client = subprocess.Popen(
            ["srun", "--overcommit", "-n3", "sleep", "300"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while len(find_processes(environ=marker)) < 4:  # srun itself + 3 tasks
            assert time.monotonic() < deadline, "tasks did not start"
            time.sleep(0.1)
        assert c.job_ids()
        slurm_dir = c.directory
    try:
        client.wait(timeout=30)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert _wait_gone(marker) == []
    assert find_processes(cwd_under=slurm_dir) == []


# --------------------------------------------------------------------------------------------
# Grid Engine


@needs_sge
@pytest.mark.timeout(120)
def test_gridengine_array_job(tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text('#!/bin/sh\necho "$SGE_TASK_ID $DMLC_ROLE $DMLC_NUM_WORKER $(pwd)"\n')
    logs = tmp_path / "logs"
    logs.mkdir()
    with gridengine(tmp_path) as g:
        res = g.run(
            [
                "qsub",
                "-sync",
                "y",
                "-cwd",
                "-t",
                "1-3",
                "-S",
                "/bin/sh",
                "-q",
                g.queue,
                "-N",
                "pskvtest",
                "-j",
                "y",
                "-o",
                str(logs),
                "-v",
                "DMLC_ROLE=worker,DMLC_NUM_WORKER=3",
                str(script),
            ],
            timeout=90,
            cwd=tmp_path,
        )
        assert res.stdout.count("exited with exit code 0") == 3, res.stdout
    rows = sorted(line for f in logs.iterdir() for line in f.read_text().splitlines())
    assert rows == [f"{i} worker 3 {tmp_path}" for i in (1, 2, 3)]


@needs_sge
@pytest.mark.timeout(120)
def test_gridengine_failure_and_cleanup(tmp_path: Path) -> None:
    marker = _marker()
    env_arg = ",".join(f"{k}={v}" for k, v in marker.items())
    with gridengine(tmp_path) as g:
        # not "-b y sh -c 'exit 3'": a binary job's command line is split again by the queue's shell
        fail = tmp_path / "fail.sh"
        fail.write_text("#!/bin/sh\nexit 3\n")
        res = g.run(
            ["qsub", "-sync", "y", "-cwd", "-j", "y", "-o", str(tmp_path), str(fail)],
            timeout=90,
            check=False,
            cwd=tmp_path,
        )
        assert res.returncode == 3, res.stdout + res.stderr
        g.run(["qsub", "-b", "y", "-j", "y", "-o", "/dev/null", "-v", env_arg, "sleep", "300"], cwd=tmp_path)
        deadline = time.monotonic() + 60
        while not find_processes(environ=marker):
            assert time.monotonic() < deadline, "job did not start"
            time.sleep(0.2)
        sge_dir = g.root.parent
    assert _wait_gone(marker) == []
    assert find_processes(cwd_under=sge_dir) == []
