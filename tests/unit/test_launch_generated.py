"""The cluster launchers without a cluster: hostfiles, placement, each role's environment, the
remote guard, and the documents generated for YARN and Kubernetes (parsed and checked).

Where a launcher would call a cluster tool (mpirun, srun, sbatch, qsub, yarn, kubectl), a small
stand-in script on PATH answers or records what it was given; ``--dry-run`` shows the commands.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import pytest

from pskv import cli
from pskv.errors import LaunchError
from pskv.launch import parse_env_specs
from pskv.launch.guard import GuardError, child_env, rank_from
from pskv.launch.job import ProcessContext, Spool
from pskv.launch.kubernetes import Kubernetes, manifests
from pskv.launch.spec import (
    Host,
    JobSpec,
    parse_hostfile,
    place,
    scheduler_address,
    shell_command,
)
from pskv.launch.yarn import SCHEDULER_DNS, yarn_service

PY = sys.executable


# --------------------------------------------------------------------------------------------
# hostfiles and placement


def test_hostfile_lines_comments_ports_and_slots() -> None:
    text = """
    # the cluster
    node1                      # a comment after a host
    node2:2222
    user@node3 slots=4
    node4:2200 slots=2 max_slots=8

    [fe80::1]:22
    ::1
    node1 slots=2              # listed again: the slots add up
    """
    hosts = parse_hostfile(text)
    assert hosts == [
        Host("node1", None, 3),
        Host("node2", 2222, 1),
        Host("user@node3", None, 4),
        Host("node4", 2200, 2),
        Host("fe80::1", 22, 1),
        Host("::1", None, 1),
    ]
    assert str(hosts[1]) == "node2:2222" and str(hosts[0]) == "node1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "lists no host"),
        ("# only a comment\n", "lists no host"),
        ("a slots=x\n", "line 1: 'slots=x': slots must be a whole number"),
        ("a\nb slots=0\n", "line 2: 'slots=0': slots must be at least 1"),
        ("a cpus=4\n", "line 1: unexpected 'cpus=4'"),
        ("a:22x\n", "the port must be a number"),
        ("a:70000\n", "port out of range"),
        (":22\n", "no host name"),
    ],
)
def test_hostfile_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(LaunchError, match=message.replace("(", r"\(")):
        parse_hostfile(text, "hosts.txt")


def test_placement_round_robin_with_slots_as_weights() -> None:
    a, b, c = Host("a"), Host("b"), Host("c")
    assert [h.name for h in place(5, [a, b, c])] == ["a", "b", "c", "a", "b"]
    heavy = [Host("a", slots=2), Host("b"), Host("c", slots=3)]
    assert [h.name for h in place(6, heavy)] == ["a", "b", "c", "a", "c", "c"]  # one round: each host once per slot
    assert [h.name for h in place(7, heavy)] == ["a", "b", "c", "a", "c", "c", "a"]
    assert place(0, [a]) == []
    with pytest.raises(LaunchError):
        place(1, [])


# --------------------------------------------------------------------------------------------
# the environment of each role


def _spec(**kw: Any) -> JobSpec:
    args: dict[str, Any] = {
        "num_workers": 3,
        "num_servers": 2,
        "command": ["python3", "train.py"],
        "env": {"ALL": "a"},
        "role_env": {"server": {"ONLY_S": "s"}, "worker": {"ONLY_W": "w"}},
        "environ": {"PSKV_TIMEOUT": "60", "PSKV_PORT_FD": "7", "PSKV_SSH": "ssh -F x", "DMLC_INTERFACE": "eth1",
                    "DMLC_NODE_HOST": "10.9.9.9", "HOME": "/root", "PATH": "/usr/bin"},
        "name": "job1",
    }  # fmt: skip
    args.update(kw)
    return JobSpec(**args)


@pytest.mark.parametrize("timeout", [0.0, -3.0, float("nan")])
def test_a_timeout_must_be_positive(timeout: float) -> None:
    with pytest.raises(LaunchError, match=f"--timeout must be a positive number of seconds, got {timeout:g}"):
        _spec(timeout=timeout)


def test_env_options_reach_exactly_their_roles() -> None:
    spec = _spec()
    server = spec.process_env("server", "10.0.0.1", 9000, 1)
    worker = spec.process_env("worker", "10.0.0.1", 9000, 2)
    scheduler = spec.process_env("scheduler", "10.0.0.1", 9000)
    common = {
        "DMLC_PS_ROOT_URI": "10.0.0.1",
        "DMLC_PS_ROOT_PORT": "9000",
        "DMLC_NUM_WORKER": "3",
        "DMLC_NUM_SERVER": "2",
        "PYTHONUNBUFFERED": "1",
        "PSKV_TIMEOUT": "60",
        "DMLC_INTERFACE": "eth1",
        "ALL": "a",
    }
    assert server == {**common, "DMLC_ROLE": "server", "DMLC_SERVER_ID": "1", "ONLY_S": "s"}
    assert worker == {**common, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "2", "RANK": "2", "WORLD_SIZE": "3", "ONLY_W": "w"}
    assert scheduler == {**common, "DMLC_ROLE": "scheduler"}
    # launcher-side settings and this machine's own address and paths stay here
    for env in (server, worker, scheduler):
        assert not {"PSKV_PORT_FD", "PSKV_SSH", "DMLC_NODE_HOST", "HOME", "PATH"} & set(env)


def test_env_precedence_launcher_counts_are_not_options_role_options_last() -> None:
    with pytest.raises(LaunchError, match="--env DMLC_NUM_WORKER, RANK: pskv launch sets these for each process"):
        _spec(env={"DMLC_NUM_WORKER": "99"}, role_env={"server": {}, "worker": {"RANK": "5"}})  # (it overrode them quietly)
    spec = _spec(env={"X": "all"}, role_env={"server": {}, "worker": {"X": "worker"}})
    worker = spec.process_env("worker", "h", 1, 0, torch={"LOCAL_RANK": "0", "X": "torch"})
    assert worker["DMLC_NUM_WORKER"] == "3" and worker["X"] == "worker" and worker["LOCAL_RANK"] == "0"
    here = spec.process_env("worker", "h", 1, 0, base={"HOME": "/h", "X": "base"})
    assert here["HOME"] == "/h" and here["X"] == "worker"
    picked = _spec(env={"MASTER_PORT": "29500"}).process_env("worker", "h", 1, 0, torch={"MASTER_PORT": "4242"})
    assert picked["MASTER_PORT"] == "29500"  # --env MASTER_PORT:29500 (for every process) was replaced by the launcher's pick
    forwarded = _spec(environ={"PSKV_A": "1", "PSKV_PORT_FD": "3", "OTHER": "x"}, env={}).process_env("scheduler", "h", 1)
    assert {k: v for k, v in forwarded.items() if not k.startswith(("DMLC_", "PYTHON"))} == {"PSKV_A": "1"}


def test_env_specs_set_pass_or_are_rejected_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSKV_TEST_PASSED", "from here")
    monkeypatch.delenv("PSKV_TEST_UNSET", raising=False)
    assert parse_env_specs(["A:1", "B_2:x:y", "EMPTY:", "PSKV_TEST_PASSED"]) == {
        "A": "1",
        "B_2": "x:y",  # the value is everything after the first colon
        "EMPTY": "",
        "PSKV_TEST_PASSED": "from here",
    }
    with pytest.raises(LaunchError, match="PSKV_TEST_UNSET is not set here"):
        parse_env_specs(["PSKV_TEST_UNSET"])
    for bad in ("1ABC:x", "A-B:x", ":x", "A B", "", "\u00c9A:1", "A\u00b2"):  # (not ASCII: an ssh or sge job's script would refuse it)
        with pytest.raises(LaunchError, match="expected NAME or NAME:VALUE"):
            parse_env_specs([bad])


def test_scheduler_address_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert scheduler_address({"DMLC_NODE_HOST": "10.1.2.3"}, ["127.0.0.1"]) == "10.1.2.3"
    assert scheduler_address({"DMLC_INTERFACE": "lo"}, []) == "127.0.0.1"
    with pytest.raises(LaunchError, match="no-such-nic"):
        scheduler_address({"DMLC_INTERFACE": "no-such-nic"}, [])
    assert scheduler_address({}, ["127.0.0.1", "localhost"]) == "127.0.0.1"
    import pskv.ps.node as po

    seen: list[str] = []
    monkeypatch.setattr(po, "route_address", lambda remote: seen.append(remote) or "192.0.2.77")
    assert scheduler_address({}, ["127.0.0.1", "192.0.2.5"]) == "192.0.2.77"
    assert seen == ["192.0.2.5"]  # the route to the first host that is not this machine's loopback


def test_shell_command_quotes_everything() -> None:
    cmd = shell_command(["python3", "a b.py", "$HOME"], {"A": "x y", "B": "it's; rm -rf /"}, cwd="/tmp/my dir")
    assert cmd == "cd '/tmp/my dir' && exec env 'A=x y' 'B=it'\"'\"'s; rm -rf /' python3 'a b.py' '$HOME'"
    out = subprocess.run(
        ["sh", "-c", cmd.replace("cd '/tmp/my dir' && ", "").replace("python3", shlex.quote(PY), 1).replace("'a b.py'", "-c 'import os,sys; print(os.environ[\"B\"], sys.argv[1:])'")],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert out.stdout == "it's; rm -rf / ['$HOME']\n"
    with pytest.raises(LaunchError, match="not an environment variable name"):
        shell_command(["x"], {"A-B": "1"})


# --------------------------------------------------------------------------------------------
# the commands each launcher would run (--dry-run, with stand-ins for the cluster tools)


def _tool(bindir: Path, name: str, body: str) -> None:
    bindir.mkdir(exist_ok=True)
    path = bindir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _env_tokens(tokens: list[str]) -> dict[str, str]:
    env = {}
    for t in tokens:
        if "=" not in t or t.startswith("-"):
            break
        k, _, v = t.partition("=")
        env[k] = v
    return env


ENV_OPTS = ["--env", "ALL:a b", "--env-server", "ONLY_S:s", "--env-worker", "ONLY_W:w,x"]


def _check_roles(envs: Mapping[str, Mapping[str, str]]) -> None:
    """MXNet's launcher lost --env-server/--env-worker; here each reaches its role only."""
    for name, env in envs.items():
        role = name.split()[0]
        assert env["ALL"] == "a b", name
        assert ("ONLY_S" in env) == (role == "server"), name
        assert ("ONLY_W" in env) == (role == "worker"), name
        assert env["DMLC_ROLE"] == role and env["DMLC_NUM_WORKER"] == "3" and env["DMLC_NUM_SERVER"] == "2"
    assert envs["worker 0"]["ONLY_W"] == "w,x"


def test_ssh_dry_run_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "hosts").write_text("h1\nh2:2222 slots=2\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DMLC_NODE_HOST", raising=False)
    monkeypatch.delenv("DMLC_INTERFACE", raising=False)
    code, out, _ = _cli(
        ["launch", "--launcher", "ssh", "-n", "3", "-s", "2", "-H", "hosts", "--sync-dst-dir", "/dst", "--ssh-command",
         "ssh -F /cfg", "--dry-run", *ENV_OPTS, "--", "python3", "train.py"],
        capsys,
    )  # fmt: skip
    assert code == 0
    procs: dict[str, list[str]] = {}
    for line in out.splitlines():
        name, sep, rest = line.partition(": ")
        if sep and name.split()[0] in ("server", "worker"):
            procs[name] = shlex.split(rest)
    # placement over h1, h2 (h2 has two slots): h1, h2, h2, h1, ...
    assert sorted(procs) == ["server 0@h1", "server 1@h2:2222", "worker 0@h1", "worker 1@h2:2222", "worker 2@h2:2222"]
    envs = {}
    for name, argv in procs.items():
        assert argv[:9] == ["ssh", "-F", "/cfg", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-T", *argv[8:9]]
        host = name.split("@")[1].split(":")[0]
        assert argv[-2] == host and (("-p" in argv) == name.endswith(":2222"))
        remote = shlex.split(argv[-1])
        assert remote[:4] == ["cd", "/dst", "&&", "exec"] and remote[4] == "env"
        env = _env_tokens(remote[5:])
        envs[name.split("@")[0]] = env
        rest = remote[5 + len(env) :]
        assert rest[:5] == ["python3", "-m", "pskv.launch.guard", "--watch-stdin", "--secret-stdin"]  # the secret: on stdin
        assert not any("PSKV_SECRET" in a for a in argv)
        tail = rest[rest.index("--") + 1 :]
        assert tail == (["python3", "-m", "pskv", "serve"] if name.startswith("server") else ["python3", "train.py"])
    _check_roles(envs)
    assert [envs[f"worker {w}"]["DMLC_WORKER_ID"] for w in range(3)] == ["0", "1", "2"]
    assert [envs[f"server {s}"]["DMLC_SERVER_ID"] for s in range(2)] == ["0", "1"]
    assert envs["worker 2"]["LOCAL_RANK"] == "1" and envs["worker 2"]["LOCAL_WORLD_SIZE"] == "2"
    assert "rsync -a --mkpath -e 'ssh -F /cfg -o BatchMode=yes -o ConnectTimeout=10 -T -p 2222' ./ h2:/dst/" in out


def test_a_dry_run_into_a_reader_that_stops_early_is_no_traceback(tmp_path: Path) -> None:
    """`pskv launch --dry-run | head`: the reader closes the pipe; that was a BrokenPipeError traceback and status 1."""
    (tmp_path / "hosts").write_text("localhost\n")
    argv = ["launch", "-H", str(tmp_path / "hosts"), "-n", "500", "-s", "500", "--dry-run", "--", "python3", "x.py"]
    proc = subprocess.Popen([sys.executable, "-m", "pskv", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().startswith("# pskv launch --launcher ssh")
    proc.stdout.close()  # (the plan is some 200 KB: more than the pipe holds)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("flavor", ["openmpi", "mpich"])
def test_mpi_dry_run_mpmd_command(flavor: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    version = "mpirun (Open MPI) 4.1.4" if flavor == "openmpi" else "HYDRA build details:\n    Version: 4.1"
    _tool(tmp_path / "bin", "mpirun", f"echo '{version}'\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "hosts").write_text("n1 slots=4\nn2\n")
    monkeypatch.chdir(tmp_path)
    code, out, _ = _cli(
        ["launch", "--launcher", "mpi", "-n", "3", "-s", "2", "-H", "hosts", "--dry-run", "--launcher-args=--bind-to none",
         *ENV_OPTS, "--", "python3", "train.py"],
        capsys,
    )  # fmt: skip
    assert code == 0
    name, _, line = next(line for line in out.splitlines() if "pskv.launch.guard" in line).partition(": ")
    argv = shlex.split(line)
    assert name == "mpirun" and argv[0].endswith("/bin/mpirun")
    # servers 0, 1 and workers 0, 1, 2 placed round robin over the hostfile's cycle n1, n2, n1, n1, n1
    # (n1 has 4 slots), as the ssh launcher places them
    placement = [("server", "n1"), ("server", "n2"), ("worker", "n1"), ("worker", "n2"), ("worker", "n1")]
    if flavor == "openmpi":
        # one app context per process (runs on one host would share one), each with its --host;
        # the launcher places them all, so more processes than slots are fine
        assert argv[1:4] == ["--oversubscribe", "--bind-to", "none"]
        first = 4
        want = [(role, ["-np", "1", "--host", host]) for role, host in placement]
    else:
        # MPICH's hydra: rank r runs on the r-th entry of the hostfile, which lists the placement in rank order
        assert argv[1:4] == ["--bind-to", "none", "-f"]
        hostfile = argv[4]
        assert f"hostfile {hostfile}:\nn1:1\nn2:1\nn1:1\nn2:1\nn1:1\n" in out
        assert not Path(hostfile).exists()  # a dry run leaves nothing behind
        first = 5
        want = [("server", ["-n", "2"]), ("worker", ["-n", "3"])]
    contexts: list[list[str]] = [[]]
    for a in argv[first:]:
        if a == ":":
            contexts.append([])
        else:
            contexts[-1].append(a)
    assert len(contexts) == len(want)
    envs = {}
    for ctx, (role, head) in zip(contexts, want):
        assert ctx[: len(head)] == head
        env = {}
        i = len(head)
        while ctx[i] in ("-x", "-env", "-envlist"):
            if ctx[i] in ("-x", "-envlist"):  # -x NAME / -envlist NAME: the value from mpirun's environment
                k, eq, v = ctx[i + 1].partition("=")
                v = v if eq else "(mpirun's)"
                i += 2
            else:
                k, v = ctx[i + 1], ctx[i + 2]
                i += 3
            env[k] = v
        assert env.pop("PSKV_SECRET") == "(mpirun's)"  # the job's secret is not on the command line
        assert envs.setdefault(f"{role} 0", env) == env  # every context of a role has the same variables
        guard = ctx[i : ctx.index("--")]
        assert guard[:3] == ["python3", "-m", "pskv.launch.guard"]
        assert guard[guard.index("--rank-from") + 1] == "OMPI_COMM_WORLD_RANK,PMI_RANK,PMIX_RANK"
        # MPI numbers the processes through the contexts in order: workers start after the 2 servers
        assert ("--rank-offset" in guard) == (role == "worker")
        if role == "worker":
            assert guard[guard.index("--rank-offset") + 1] == "2"
        assert guard[guard.index("--prefix") + 1] == f"{role} {{rank}}"
        assert ctx[ctx.index("--") + 1 :] == (["python3", "-m", "pskv", "serve"] if role == "server" else ["python3", "train.py"])
    _check_roles(envs)
    assert "DMLC_WORKER_ID" not in envs["worker 0"]  # the guard sets it from the MPI rank
    # rsync copies a relative --sync-dst-dir to the remote home, but mpirun's --wdir looks for it here
    code, _, err = _cli(["launch", "--launcher", "mpi", "-n", "1", "-H", "hosts", "--sync-dst-dir", "job", "--dry-run", "--", "t"], capsys)
    assert code == 2 and "--sync-dst-dir job: the mpi launcher needs an absolute path" in err, err


def test_mpi_without_hostfile_leaves_placement_to_mpirun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _tool(tmp_path / "bin", "mpirun", "echo 'mpirun (Open MPI) 4.1.4'\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    code, out, _ = _cli(["launch", "--launcher", "mpi", "-n", "3", "-s", "2", "--dry-run", "--", "python3", "t.py"], capsys)
    assert code == 0
    argv = shlex.split(next(line for line in out.splitlines() if line.startswith("mpirun: ")).partition(": ")[2])
    assert "--oversubscribe" not in argv and "--host" not in argv and "--hostfile" not in argv
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "-np"] == ["2", "3"] and argv.count(":") == 1


def test_slurm_dry_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _tool(tmp_path / "bin", "srun", "exit 0\n")
    _tool(tmp_path / "bin", "sbatch", "exit 0\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "my job").mkdir()
    monkeypatch.chdir(tmp_path / "my job")  # a space in the path of the batch job's output
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    # outside an allocation: the batch script runs this launcher again inside the job
    code, out, _ = _cli(
        ["launch", "--launcher", "slurm", "-n", "3", "-s", "2", "--job-name", "jb", "--timeout", "100", "--dry-run",
         "--launcher-args=--overcommit --partition p", *ENV_OPTS, "--", "python3", "train.py", "--lr", "0.1"],
        capsys,
    )  # fmt: skip
    assert code == 0
    assert "#SBATCH --job-name=jb\n#SBATCH --ntasks=5\n" in out and "#SBATCH --time=3\n" in out
    output = next(line for line in out.splitlines() if line.startswith("#SBATCH --output="))
    assert shlex.split(output[17:])[0].startswith(f"{tmp_path}/my job/.pskv-slurm-")  # quoted: sbatch splits at spaces
    inner = shlex.split(next(line for line in out.splitlines() if line.startswith("exec "))[5:])
    assert inner[:12] == ["python3", "-m", "pskv", "launch", "--launcher", "slurm", "-n", "3", "-s", "2", "--python", "python3"]
    assert inner[inner.index("--") + 1 :] == ["python3", "train.py", "--lr", "0.1"]
    for flag, value in (("--env", "ALL:a b"), ("--env-server", "ONLY_S:s"), ("--env-worker", "ONLY_W:w,x")):
        assert inner[inner.index(flag) + 1] == value
    submit = shlex.split(out.split("# submit\n")[1].splitlines()[0])
    assert submit[1:6] == ["--wait", "--parsable", "--overcommit", "--partition", "p"]
    assert not list((tmp_path / "my job").glob(".pskv-slurm-*"))
    # inside an allocation: one srun step per role, the environment in srun's own
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    code, out, _ = _cli(
        ["launch", "--launcher", "slurm", "-n", "3", "-s", "2", "--job-name", "jb", "--dry-run", *ENV_OPTS, "--", "python3", "t.py"],
        capsys,
    )  # fmt: skip
    assert code == 0
    envs = {}
    for line in out.splitlines():
        name, _, rest = line.partition(": ")
        if not name.startswith("srun "):
            continue
        tokens = shlex.split(rest)
        env = _env_tokens(tokens)
        role = env["DMLC_ROLE"]
        assert name == f"srun {role}s"
        envs[f"{role} 0"] = env
        argv = tokens[len(env) :]
        assert argv[1:6] == ["--overlap", f"--ntasks={3 if role == 'worker' else 2}", "--kill-on-bad-exit=1", f"--job-name=jb-{role}", "--export=ALL"]
        assert argv[argv.index("--rank-from") + 1] == "SLURM_PROCID"
        assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1"
    _check_roles(envs)


def test_sge_dry_run_scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _tool(tmp_path / "bin", "qsub", "exit 0\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("DMLC_NODE_HOST", "10.3.3.3")
    monkeypatch.chdir(tmp_path)
    for bad in ("my job", "a/b", "x:y"):  # qsub refused them with "Error reading answer list"
        code, _, err = _cli(["launch", "--launcher", "sge", "-n", "1", "--job-name", bad, "--dry-run", "--", "x"], capsys)
        assert code == 2 and f"--job-name {bad!r}: Grid Engine takes no spaces" in err, err
    code, out, _ = _cli(
        ["launch", "--launcher", "sge", "-n", "3", "-s", "2", "--job-name", "jb", "--dry-run", "--launcher-args=-q all.q",
         *ENV_OPTS, "--", "python3", "train.py"],
        capsys,
    )  # fmt: skip
    assert code == 0
    envs = {}
    for role, n in (("server", 2), ("worker", 3)):
        script = out.split(f"# {role} script ")[1].split("\n# submit")[0]
        env = {}
        for line in script.splitlines():
            if line.startswith("export "):
                k, _, v = line[7:].partition("=")
                env[k] = shlex.split(v)[0]
        envs[f"{role} 0"] = env
        assert env["DMLC_PS_ROOT_URI"] == "10.3.3.3" and "PSKV_SECRET" not in env
        assert env["PSKV_START_TIMEOUT"] == "3600"  # a task may wait that long for the other array, still queued
        assert env.pop("PSKV_SECRET_FILE").endswith("/secret")  # a 0600 file in the job's private directory
        exec_line = shlex.split(next(line for line in script.splitlines() if line.startswith("exec ")))
        guard = exec_line[1 : exec_line.index("--")]
        assert guard[guard.index("--rank-from") + 1] == "SGE_TASK_ID" and guard[guard.index("--rank-offset") + 1] == "1"
        assert "--status-dir" in guard
        submit = shlex.split(out.split(f"# {role} script ")[1].split("# submit\n")[1].splitlines()[0])
        assert submit[1:10] == ["-terse", "-cwd", "-V", "-S", "/bin/sh", "-N", f"jb-{role}", "-t", f"1-{n}"]
        assert submit[-3:-1] == ["-q", "all.q"]
    _check_roles(envs)


def test_options_that_a_launcher_does_not_use_are_errors(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(["launch", "-n", "1", "--launcher", "local", "-H", "hosts", "--", "true"], capsys)
    assert code == 2 and "-H/--hostfile is not used by the local launcher" in err
    code, _, err = _cli(["launch", "-n", "1", "-H", "no-such-hostfile", "--", "true"], capsys)  # -H alone: ssh, as MXNet's
    assert code == 2 and "cannot read the hostfile no-such-hostfile" in err
    code, _, err = _cli(["launch", "-n", "1", "--launcher", "ssh", "--", "true"], capsys)
    assert code == 2 and "needs the hosts: -H/--hostfile FILE" in err
    code, _, err = _cli(["launch", "-n", "1", "--launcher", "mpi", "--image", "x", "--", "true"], capsys)
    assert code == 2 and "--image is not used by the mpi launcher" in err
    code, _, err = _cli(["launch", "-n", "0", "--launcher", "kubernetes", "--image", "x", "--", "true"], capsys)
    assert code == 2 and "need at least one worker" in err


def test_a_setting_that_stands_for_an_option_the_launcher_does_not_use_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """PSKV_MAX_RESTARTS stands for --max-restarts (local only): under ssh it was ignored without a word."""
    (tmp_path / "hosts").write_text("localhost\n")
    monkeypatch.setenv("PSKV_MIN_WORKERS", "1")
    monkeypatch.setenv("PSKV_MAX_RESTARTS", "1")
    code, _, err = _cli(["launch", "-n", "2", "-s", "1", "-H", str(tmp_path / "hosts"), "--dry-run", "--", "true"], capsys)
    assert code == 2 and "--max-restarts is not used by the ssh launcher (it is for: local)" in err, err


# --------------------------------------------------------------------------------------------
# YARN


def test_yarn_service_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PSKV_TIMEOUT", "77")
    out_file = tmp_path / "svc.json"
    code, _, err = _cli(
        ["launch", "--launcher", "yarn", "-n", "3", "-s", "2", "--job-name", "jb", "--memory", "4096", "--cpus", "2",
         "--timeout", "3600", "--output", str(out_file), *ENV_OPTS, "--", "python3", "train.py", "--lr", "0.1"],
        capsys,
    )  # fmt: skip
    assert code == 0 and f"wrote the YARN service spec to {out_file}" in err and "yarn app -launch jb" in err
    svc = json.loads(out_file.read_text())
    assert svc["name"] == "jb" and svc["version"] and svc["lifetime"] == "3600"
    comps = {c["name"]: c for c in svc["components"]}
    assert list(comps) == ["scheduler", "server", "worker"]
    assert [comps[n]["number_of_containers"] for n in comps] == [1, 2, 3]
    assert all(c["restart_policy"] == "NEVER" for c in comps.values())
    assert comps["server"]["dependencies"] == comps["worker"]["dependencies"] == ["scheduler"]
    sched = comps["scheduler"]["configuration"]["env"]
    assert sched["DMLC_ROLE"] == "scheduler" and sched["DMLC_PS_ROOT_URI"] == "0.0.0.0" and sched["DMLC_PS_ROOT_PORT"] == "9091"
    assert shlex.split(comps["scheduler"]["launch_command"]) == ["python3", "-m", "pskv", "serve"]
    envs = {}
    for role, cmd in (("server", ["python3", "-m", "pskv", "serve"]), ("worker", ["python3", "train.py", "--lr", "0.1"])):
        comp = comps[role]
        env = comp["configuration"]["env"]
        envs[f"{role} 0"] = env
        assert env["DMLC_PS_ROOT_URI"] == SCHEDULER_DNS == "scheduler-0.${SERVICE_NAME}.${USER}.${DOMAIN}"
        assert env["PSKV_RANK"] == "${COMPONENT_ID}" and env["PSKV_TIMEOUT"] == "77"
        assert env["PSKV_START_TIMEOUT"] == sched["PSKV_START_TIMEOUT"] == "3600"  # containers may wait in YARN's queue
        argv = shlex.split(comp["launch_command"])
        assert argv[: argv.index("--")] == ["python3", "-m", "pskv.launch.guard", "--rank-from", "PSKV_RANK"]
        assert argv[argv.index("--") + 1 :] == cmd
        assert comp["resource"] == {"cpus": 2, "memory": "4096"}
    _check_roles(envs)
    secrets = {c["configuration"]["env"]["PSKV_SECRET"] for c in comps.values()}
    assert len(secrets) == 1 and len(secrets.pop()) == 64 and out_file.stat().st_mode & 0o777 == 0o600
    assert "artifact" not in comps["worker"]
    docker = yarn_service(_spec(image="reg/img:1", command=["python3", "x.py"]))
    assert all(c["artifact"] == {"id": "reg/img:1", "type": "DOCKER"} for c in docker["components"])
    monkeypatch.setenv("PSKV_START_TIMEOUT", "50")  # the user's own wins
    assert _cli(["launch", "--launcher", "yarn", "-n", "1", "-s", "1", "--output", str(out_file), "--", "python3", "x.py"], capsys)[0] == 0
    assert {c["configuration"]["env"]["PSKV_START_TIMEOUT"] for c in json.loads(out_file.read_text())["components"]} == {"50"}


def test_yarn_submission_needs_yarn_or_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, _, err = _cli(["launch", "--launcher", "yarn", "-n", "1", "-s", "1", "--", "python3", "x.py"], capsys)
    assert code == 2 and "needs `yarn`" in err and "--output FILE" in err
    log = tmp_path / "yarn.log"
    _tool(tmp_path / "bin", "yarn", f'echo "$@" > {log}\ncp "$4" {log}.json\necho launched\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    code, out, err = _cli(["launch", "--launcher", "yarn", "-n", "2", "-s", "1", "--job-name", "jb", "--", "python3", "x.py"], capsys)
    assert code == 0, err
    args = log.read_text().split()
    assert args[:3] == ["app", "-launch", "jb"] and args[3].endswith(".json")
    assert json.loads(Path(f"{log}.json").read_text())["name"] == "jb"
    assert "launched" in out and "yarn app -destroy jb" in err
    assert not Path(args[3]).exists()  # the temporary spec is removed


# --------------------------------------------------------------------------------------------
# Kubernetes


def _by_kind(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{i['kind']}/{i['metadata']['name']}": i for i in items}


def _env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_kubernetes_manifests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "job.json"
    code, _, err = _cli(
        ["launch", "--launcher", "kubernetes", "-n", "3", "-s", "2", "--job-name", "jb", "--image", "reg/pskv:1",
         "--port", "9500", "--cpus", "1.5", "--memory", "2048", "--timeout", "600", "--output", str(out_file),
         *ENV_OPTS, "--", "python3", "train.py"],
        capsys,
    )  # fmt: skip
    assert code == 0 and "kubectl apply -f" in err
    doc = json.loads(out_file.read_text())
    assert doc["apiVersion"] == "v1" and doc["kind"] == "List"
    items = _by_kind(doc["items"])
    assert list(items) == ["Secret/jb-secret", "Service/jb-scheduler", "Job/jb-scheduler", "Job/jb-server", "Job/jb-worker"]
    assert out_file.stat().st_mode & 0o777 == 0o600  # it holds the job's secret
    secret = items["Secret/jb-secret"]["stringData"]["PSKV_SECRET"]
    assert len(secret) == 64 and secret not in err
    from_secret = {"secretKeyRef": {"name": "jb-secret", "key": "PSKV_SECRET"}}
    svc = items["Service/jb-scheduler"]
    assert svc["spec"]["selector"] == {"pskv/job": "jb", "pskv/role": "scheduler"}
    assert svc["spec"]["ports"] == [{"name": "scheduler", "port": 9500, "targetPort": 9500}]
    pod_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
    sched_job = items["Job/jb-scheduler"]
    assert sched_job["spec"]["template"]["metadata"]["labels"]["pskv/role"] == "scheduler"
    sched = sched_job["spec"]["template"]["spec"]["containers"][0]
    assert sched["command"] == ["python3", "-m", "pskv", "serve"] and sched["image"] == "reg/pskv:1"
    sched_env = _env_of(sched)
    assert sched_env["DMLC_ROLE"] == "scheduler" and sched_env["DMLC_PS_ROOT_URI"] == pod_ip
    assert sched_env["PSKV_SECRET"] == from_secret
    envs = {}
    for role, n, cmd in (("server", 2, ["python3", "-m", "pskv", "serve"]), ("worker", 3, ["python3", "train.py"])):
        job = items[f"Job/jb-{role}"]
        spec = job["spec"]
        assert (spec["completions"], spec["parallelism"], spec["completionMode"], spec["backoffLimit"]) == (n, n, "Indexed", 0)
        assert spec["activeDeadlineSeconds"] == 600
        pod = spec["template"]["spec"]
        assert pod["restartPolicy"] == "Never"
        c = pod["containers"][0]
        assert c["command"] == ["python3", "-m", "pskv.launch.guard", "--rank-from", "JOB_COMPLETION_INDEX", "--", *cmd]
        assert c["resources"] == {"requests": {"cpu": "1.5", "memory": "2048Mi"}, "limits": {"memory": "2048Mi"}}
        env = _env_of(c)
        assert env["DMLC_PS_ROOT_URI"] == "jb-scheduler" and env["DMLC_PS_ROOT_PORT"] == "9500"
        assert env["DMLC_NODE_HOST"] == pod_ip and env["PSKV_SECRET"] == from_secret
        assert env["PSKV_START_TIMEOUT"] == sched_env["PSKV_START_TIMEOUT"] == "3600"  # pods may wait for a node, an image
        envs[f"{role} 0"] = env
    _check_roles(envs)


def test_kubernetes_yaml_file_and_dry_run_are_the_json_document(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A .yaml file holds the same JSON List (JSON is YAML 1.2: kubectl apply -f job.yaml reads it)."""
    tricky = 'a "quoted": value\nnext line # not a comment'
    monkeypatch.setenv("PSKV_TRICKY", tricky)
    monkeypatch.setenv("PSKV_SECRET", "given-secret-0123456789")  # every spec below uses it
    spec = _spec(image="img", name="jb", env={"PSKV_TRICKY": tricky, "EMPTY": ""}, environ=dict(os.environ), role_env={"server": {}, "worker": {}})
    items = json.loads(Kubernetes(spec).text)["items"]
    argv = ["launch", "--launcher", "kubernetes", "-n", "3", "-s", "2", "--image", "img", "--job-name", "jb",
            "--env", "PSKV_TRICKY", "--env", "EMPTY:", "--", "python3", "train.py"]  # fmt: skip
    code, _, _ = _cli([*argv[:-3], "--output", str(tmp_path / "job.yaml"), *argv[-3:]], capsys)
    assert code == 0
    text = (tmp_path / "job.yaml").read_text()
    assert json.loads(text) == {"apiVersion": "v1", "kind": "List", "items": items}
    code, out, _ = _cli([*argv[:-3], "--dry-run", *argv[-3:]], capsys)
    assert code == 0 and "given-secret-0123456789" not in out  # a dry run prints no secret
    shown = out.split("\n", 1)[1].replace("<the job's secret, made anew at launch>", "given-secret-0123456789")
    assert json.loads(shown) == json.loads(text)
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if system_python is None or subprocess.run([system_python, "-c", "import yaml"], capture_output=True).returncode != 0:
        pytest.skip("no YAML parser here (the system python3 has no PyYAML) to read the YAML back")
    parsed = subprocess.run(
        [system_python, "-c", "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))"],
        input=text, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert json.loads(parsed.stdout) == json.loads(text)


def test_kubernetes_errors_and_kubectl_apply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(["launch", "--launcher", "kubernetes", "-n", "1", "--", "python3", "x.py"], capsys)
    assert code == 2 and "needs --image" in err
    code, _, err = _cli(["launch", "--launcher", "kubernetes", "-n", "1", "--image", "i", "--job-name", "Bad_Name", "--", "x"], capsys)
    assert code == 2 and "Kubernetes names are lower-case" in err
    log = tmp_path / "kubectl.log"
    _tool(tmp_path / "bin", "kubectl", f'echo "$@" > {log}\ncat > {log}.json\necho "job.batch/jb-worker created"\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    code, out, err = _cli(
        ["launch", "--launcher", "kubernetes", "-n", "2", "-s", "1", "--image", "i", "--job-name", "jb",
         "--launcher-args=--namespace team", "--", "python3", "x.py"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert log.read_text().split() == ["apply", "-f", "-", "--namespace", "team"]
    sent = json.loads(Path(f"{log}.json").read_text())
    assert sent["kind"] == "List" and len(sent["items"]) == 5
    assert "created" in out and "kubectl delete job,service,secret -l pskv/job=jb" in err


def test_kubernetes_without_servers_has_no_scheduler() -> None:
    items = manifests(_spec(image="i", num_servers=0, num_workers=2))
    assert [f"{i['kind']}/{i['metadata']['name']}" for i in items] == ["Secret/job1-secret", "Job/job1-worker"]


# --------------------------------------------------------------------------------------------
# the guard


def test_rank_mapping() -> None:
    assert rank_from({"OMPI_COMM_WORLD_RANK": "4"}, ["PMI_RANK", "OMPI_COMM_WORLD_RANK"], 2) == 2
    assert rank_from({"SGE_TASK_ID": "1"}, ["SGE_TASK_ID"], 1) == 0
    assert rank_from({"X": "worker-12"}, ["X"]) == 12
    with pytest.raises(GuardError, match="none of A, B is set"):
        rank_from({}, ["A", "B"])
    with pytest.raises(GuardError, match="negative rank"):
        rank_from({"SGE_TASK_ID": "0"}, ["SGE_TASK_ID"], 1)
    with pytest.raises(GuardError, match="holds no rank number"):
        rank_from({"X": "abc"}, ["X"])
    env = child_env({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "4", "SLURM_PROCID": "3"}, ["SLURM_PROCID"], 0, workers_here=2)
    assert env["DMLC_WORKER_ID"] == env["RANK"] == "3" and env["WORLD_SIZE"] == "4"
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    env = child_env({"DMLC_ROLE": "server", "JOB_COMPLETION_INDEX": "1", "OMP_NUM_THREADS": "9"}, ["JOB_COMPLETION_INDEX"], workers_here=2)
    assert env["DMLC_SERVER_ID"] == "1" and "DMLC_WORKER_ID" not in env and "RANK" not in env and env["OMP_NUM_THREADS"] == "9"
    env = child_env({"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "5", "OMP_NUM_THREADS": "2"}, workers_here=3)
    assert env["DMLC_WORKER_ID"] == "5" and "RANK" not in env and env["OMP_NUM_THREADS"] == "2"


def _guard(args: list[str], env: Optional[dict[str, str]] = None, new_session: bool = True) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PY, "-m", "pskv.launch.guard", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=new_session,
    )


def _finish(g: subprocess.Popen[str]) -> None:
    if g.poll() is None:
        g.kill()
    g.wait(timeout=30)
    for f in (g.stdin, g.stdout, g.stderr):
        if f is not None:
            f.close()


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text().lower() for p in pids):
            return True
        time.sleep(0.05)
    return False


# the child starts a grandchild, prints both pids, ignores nothing and sleeps
FAMILY = "import os, subprocess, sys, time; c = subprocess.Popen(['sleep', '300']); print(os.getpid(), c.pid, flush=True); time.sleep(300)"


@pytest.mark.parametrize("new_session", [True, False], ids=["session-leader", "not-leader"])
def test_guard_stops_the_command_and_its_children_when_stdin_closes(new_session: bool) -> None:
    g = _guard(["--watch-stdin", "--grace", "2", "--", PY, "-c", FAMILY], {"DMLC_ROLE": "worker"}, new_session)
    try:
        assert g.stdout is not None and g.stdin is not None
        pids = [int(p) for p in g.stdout.readline().split()]
        t0 = time.monotonic()
        g.stdin.close()
        assert g.wait(timeout=15) == 143
        assert time.monotonic() - t0 < 5
        assert _gone(pids), pids
        assert "standard input closed" in g.stderr.read()  # type: ignore[union-attr]
    finally:
        _finish(g)


def test_guard_escalates_to_sigkill_after_the_grace() -> None:
    stubborn = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); time.sleep(300)"
    g = _guard(["--watch-stdin", "--grace", "1", "--", PY, "-c", stubborn], {"DMLC_ROLE": "server"})
    try:
        assert g.stdout is not None and g.stdin is not None
        pid = int(g.stdout.readline())
        g.stdin.close()
        assert g.wait(timeout=15) == 137
        assert _gone([pid])
        assert "sending SIGKILL" in g.stderr.read()  # type: ignore[union-attr]
    finally:
        _finish(g)


def test_guard_killed_outright_takes_its_command_along() -> None:
    """Not a session leader (as under mpirun or srun): the command has its own session and
    PR_SET_PDEATHSIG kills it when the guard dies by SIGKILL."""
    g = _guard(["--", PY, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(300)"], new_session=False)
    try:
        assert g.stdout is not None
        pid = int(g.stdout.readline())
        g.kill()
        g.wait(timeout=10)
        assert _gone([pid])
    finally:
        _finish(g)


def test_guard_exit_status_prefix_and_status_file(tmp_path: Path) -> None:
    env = {"DMLC_ROLE": "worker", "PMI_RANK": "5"}
    script = "import sys; print('line one'); print('to stderr', file=sys.stderr); sys.stdout.write('no newline'); sys.exit(7)"
    g = _guard(["--rank-from", "OMPI_COMM_WORLD_RANK,PMI_RANK", "--rank-offset", "2", "--prefix", "{role} {rank}",
                "--status-dir", str(tmp_path), "--", PY, "-c", script], env)  # fmt: skip
    out, err = g.communicate(timeout=30)
    assert g.returncode == 7
    assert out == "[worker 3] line one\n[worker 3] no newline\n"
    assert "[worker 3] to stderr\n" in err
    assert "[worker 3] pskv guard: worker 3 failed: " in err and "exited with status 7 on host " in err
    assert (tmp_path / "worker.3.status").read_text() == "7\n"
    g = _guard(["--", "sh", "-c", "kill -9 $$"], {"DMLC_ROLE": "server", "DMLC_SERVER_ID": "1"})
    _, err = g.communicate(timeout=30)
    assert g.returncode == 137 and "server 1 failed: sh -c kill -9 $$ was killed by signal 9" in err
    g = _guard(["--", "/no/such/program"])
    _, err = g.communicate(timeout=30)
    assert g.returncode == 127 and "cannot start /no/such/program" in err
    g = _guard(["--rank-from", "NOT_SET_X", "--", "true"], {"DMLC_ROLE": "worker"})
    _, err = g.communicate(timeout=30)
    assert g.returncode == 2 and "none of NOT_SET_X is set" in err


def test_guard_forwards_sigterm() -> None:
    script = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('child got TERM', flush=True), sys.exit(5)))\n"
        "print(os.getpid(), flush=True)\n"
        "time.sleep(300)\n"
    )
    # a long grace: on a loaded machine the SIGKILL that follows it must not be what the test sees
    g = _guard(["--grace", "60", "--", PY, "-c", script], {"DMLC_ROLE": "worker"})
    assert g.stdout is not None
    int(g.stdout.readline())
    g.send_signal(signal.SIGTERM)
    out, err = g.communicate(timeout=90)
    assert g.returncode == 5 and "child got TERM" in out, f"status {g.returncode}\nstdout: {out}\nstderr: {err}"
    assert "got SIGTERM; stopped the command (status 5)" in err, err


def test_guard_passes_the_schedulers_port_pipe() -> None:
    r, w = os.pipe()
    try:
        g = subprocess.Popen(
            [PY, "-m", "pskv.launch.guard", "--", PY, "-c", f"import os; os.write({w}, b'4242\\n')"],
            env={**os.environ, "PSKV_PORT_FD": str(w)},
            pass_fds=(w,),
        )
        os.close(w)
        assert g.wait(timeout=30) == 0
        assert os.read(r, 100) == b"4242\n"
        assert os.read(r, 100) == b""  # the guard closed its copy too
    finally:
        os.close(r)


# --------------------------------------------------------------------------------------------
# the process context's additions


def test_stdin_pipe_is_closed_on_stop_and_on_stop_runs_once(capsys: pytest.CaptureFixture[str]) -> None:
    ctx = ProcessContext()
    calls: list[str] = []
    ctx.on_stop = lambda: calls.append("stop")
    reader = ctx.start("worker 0", [PY, "-c", "import sys; sys.stdin.read(); print('eof seen')"], {}, stdin="pipe")
    t0 = time.monotonic()
    ctx.stop_all()
    ctx.stop_all()
    assert reader.returncode == 0 and time.monotonic() - t0 < 8  # EOF, not SIGTERM, ended it
    assert "[worker 0] eof seen" in capsys.readouterr().out
    assert calls == ["stop"]


class _Remote:
    def __init__(self, name: str, code: Optional[int]):
        self.name, self._code, self.tail = name, code, ["last words"]

    @property
    def returncode(self) -> Optional[int]:
        return self._code


def test_wait_watches_processes_that_run_elsewhere(capsys: pytest.CaptureFixture[str]) -> None:
    ctx = ProcessContext()
    sleeper = ctx.start("scheduler", [PY, "-c", "import time; time.sleep(60)"], {})
    ctx.watch(_Remote("worker 4", 6), main=True)
    assert ctx.wait() == 6
    assert sleeper.returncode is not None
    err = capsys.readouterr().err
    assert "worker 4 exited with status 6" in err and "last words" in err
    ctx = ProcessContext()
    ctx.watch(_Remote("worker 0", 0), main=True)
    ctx.watch(_Remote("server 0", 0), main=False)
    assert ctx.wait() == 0


def test_spool_copies_whole_lines_of_files_that_appear_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    spool = Spool(".spool-", "*.out")
    assert Path(spool.dir).parent == tmp_path
    a, b = Path(spool.path("a.out")), Path(spool.path("b.out"))
    spool.start()
    a.write_bytes(b"[worker 0] one\n[worker 0] h\xc3")  # a line, then half a line ending inside a character
    time.sleep(0.5)
    assert capsys.readouterr().out == "[worker 0] one\n"
    with open(a, "ab") as f:
        f.write(b"\xa9llo\n")
    b.write_bytes(b"[worker 1] last, no newline")
    (tmp_path / "not-followed.txt").write_text("x\n")
    spool.close(1, "the files")
    out, err = capsys.readouterr()
    assert out == "[worker 0] h\u00e9llo\n[worker 1] last, no newline\n"
    assert f"the files are in {spool.dir}" in err
    assert a.exists()  # kept after a failure
    spool = Spool(".spool-", "*.out")
    spool.close(0, "the files")
    assert not Path(spool.dir).exists()  # removed after success


def test_launch_local_signature_is_unchanged() -> None:
    import inspect

    from pskv.launch.local import launch_local

    assert list(inspect.signature(launch_local).parameters) == [
        "num_workers", "num_servers", "command", "extra_env", "role_extra", "timeout", "quiet", "peak_rss_mb", "secret",
    ]  # fmt: skip
