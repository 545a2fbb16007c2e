"""``pskv launch --launcher local``: environment, output, exit status, stopping."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .jobs import REPO, launch, run
from .launch_checks import (
    check_formulas,
    env_args,
    formulas_args,
    marker,
    marker_args,
    wait_gone,
    write_project,
)

pytestmark = pytest.mark.timeout(180)


def test_environment_prefixes_and_env_options(tmp_path: Path) -> None:
    script = """
    import os
    keys = ["DMLC_ROLE", "DMLC_WORKER_ID", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI", "RANK", "WORLD_SIZE", "A", "B", "C"]
    print(" ".join(f"{k}={os.environ.get(k)}" for k in keys))
    """
    res = launch(
        tmp_path,
        script,
        2,
        0,
        env={"B": "from-launcher"},
        launch_args=["--env", "A:1", "--env", "B", "--env-worker", "C:w"],
    )
    assert res.code == 0, res
    for w in range(2):
        want = (
            f"[worker {w}] DMLC_ROLE=worker DMLC_WORKER_ID={w} DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=0 "
            f"DMLC_PS_ROOT_URI=127.0.0.1 RANK={w} WORLD_SIZE=2 A=1 B=from-launcher C=w"
        )
        assert want in res.stdout, res


def test_servers_get_their_own_env(tmp_path: Path) -> None:
    script = """
    import torch, pskv
    kv = pskv.kv.create("dist_sync")
    kv.init(0, torch.zeros(2))
    kv.close()
    """
    res = launch(tmp_path, script, 1, 2, launch_args=["--env-server", "PSKV_VERBOSE:1"])
    assert res.code == 0, res
    for s in range(2):
        assert f"[server {s}] pskv server {s}: serving on tcp://127.0.0.1:" in res.stderr, res
        assert f"[server {s}] pskv server {s}: exiting with status 0" in res.stderr, res
    assert "pskv scheduler:" not in res.stderr and "pskv worker" not in res.stderr, res


def test_failing_worker_status_is_the_launchers_and_the_rest_stop(tmp_path: Path) -> None:
    script = """
    import os, sys, time
    print("pid", os.getpid(), flush=True)
    if os.environ["DMLC_WORKER_ID"] == "1":
        time.sleep(2)  # let every worker print its pid before the job is stopped
        print("worker 1 gives up", file=sys.stderr, flush=True)
        sys.exit(3)
    time.sleep(120)
    """
    res = launch(tmp_path, script, 3, 1)
    assert res.code == 3, res
    assert "worker 1 exited with status 3; stopped the other processes of the job" in res.stderr, res
    assert "worker 1 gives up" in res.stderr
    assert res.seconds < 60, res
    pids = [int(line.split()[-1]) for line in res.stdout.splitlines() if " pid " in line]
    assert len(pids) == 3
    for pid in pids:
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
        )


def test_what_a_worker_leaves_in_its_group_is_stopped_with_it(tmp_path: Path) -> None:
    """A worker's own children (a helper it started and did not stop) end when it does, as the guard's
    COMMAND's do on the other launchers: worker 0 exits 0, worker 1 is killed by SIGKILL (the OOM
    killer's way); both children ran on, orphaned, after pskv launch returned."""
    script = """
    import os, signal, subprocess, time
    child = subprocess.Popen(["sleep", "300"])
    print("child", child.pid, flush=True)
    if os.environ["DMLC_WORKER_ID"] == "1":
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    mark = marker()
    res = launch(tmp_path, script, 2, 0, env=mark, timeout=60)
    left = wait_gone(mark, timeout=5)
    for pid in left:  # (not for the next tests)
        os.kill(pid, signal.SIGKILL)
    assert res.code == 128 + signal.SIGKILL, res
    assert sum(" child " in line for line in res.stdout.splitlines()) == 2, res
    assert left == [], res


def test_the_status_is_the_failed_workers_not_that_of_one_its_exit_failed(tmp_path: Path) -> None:
    """Worker 1 leaves the job and exits 3 a second later; worker 0's push fails at once, its error
    naming worker 1: the launcher waits for the worker named and reports it (it reported worker 0)."""
    script = """
    import sys, time, torch, pskv
    kv = pskv.kv.create("dist_sync")
    kv.init("w", torch.zeros(3))
    if kv.rank == 1:
        kv.close()
        time.sleep(1.0)
        sys.exit(3)
    kv.pushpull("w", torch.ones(3))
    """
    res = launch(tmp_path, script, 2, 1, timeout=60)
    assert res.code == 3, res
    assert "pskv launch: worker 1 exited with status 3; stopped the other processes of the job" in res.stderr, res
    assert "NodeFailedError" in res.stderr and "worker 1 finished (closed its store)" in res.stderr, res


def test_timeline_files_are_merged_when_the_job_ends(tmp_path: Path) -> None:
    script = """
    import torch, pskv
    kv = pskv.kv.create("dist_sync")
    kv.init("w", torch.zeros(4))
    kv.push("w", torch.ones(4))
    out = torch.empty(4)
    kv.pull("w", out)
    assert torch.equal(out, torch.full((4,), 2.0)), out
    kv.close()
    """
    path = tmp_path / "t.json"
    res = launch(tmp_path, script, 2, 1, env={"PSKV_TIMELINE": str(path)})
    assert res.code == 0, res
    assert path.exists() and not list(tmp_path.glob("t.json.*")), sorted(tmp_path.iterdir())
    assert "timeline:" not in res.stderr, res  # (every process's file was there)
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict)
    events = doc["traceEvents"]
    processes = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert {"worker 0", "worker 1", "server 0"} <= set(processes), processes
    spans = [e for e in events if e["ph"] == "X"]
    for w in ("worker 0", "worker 1"):
        assert any(e["name"] == "send PUSH" and e["pid"] == processes[w] for e in spans), w
    assert any(e["name"].startswith("PUSH from worker") and e["pid"] == processes["server 0"] for e in spans)


def test_timeline_files_missing_at_the_end_are_said(tmp_path: Path) -> None:
    """Workers that never made a store write no timeline (as processes on another host write theirs there).
    A part an earlier job left (its launcher killed by SIGKILL) is not merged into this job's (it was)."""
    path = tmp_path / "t.json"
    stale = tmp_path / "t.json.worker-3.json"
    stale.write_text('[\n{"name": "process_name", "ph": "M", "pid": 1003, "args": {"name": "worker 3"}},\n')
    os.utime(stale, (time.time() - 60, time.time() - 60))
    res = launch(tmp_path, "print('no store')", 2, 1, env={"PSKV_TIMELINE": str(path)})
    assert res.code == 0, res
    assert "timeline: none of the 3 processes wrote one here (on a cluster" in res.stderr, res
    assert not path.exists() and stale.exists(), res


def test_timeline_keeps_the_spans_of_processes_the_launcher_stopped(tmp_path: Path) -> None:
    """Worker 1 dies (os._exit: no atexit); pskv launch stops worker 0 and the servers with SIGTERM:
    their spans are in the merged file, which is valid JSON."""
    script = """
    import os, time, torch, pskv
    kv = pskv.kv.create("dist_sync")
    kv.init("w", torch.zeros(4))
    kv.pushpull("w", torch.ones(4), out=torch.empty(4))
    if kv.rank == 1:
        os._exit(3)
    time.sleep(120)
    """
    path = tmp_path / "t.json"
    res = launch(tmp_path, script, 2, 2, timeout=90, launch_args=["--env-worker", f"PSKV_TIMELINE:{path}", "--env-server", f"PSKV_TIMELINE:{path}"])
    assert res.code == 3, res
    events = json.loads(path.read_text())["traceEvents"]
    processes = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert {"worker 0", "server 0", "server 1"} <= set(processes), processes
    assert any(e["name"] == "send PUSH" and e["pid"] == processes["worker 0"] for e in events), events
    assert any(e["name"] == "PUSH from worker 0" and e["pid"] in (processes["server 0"], processes["server 1"]) for e in events)


def test_torch_distributed_runs_under_pskv_launch(tmp_path: Path) -> None:
    """-s 0 starts workers only, with the variables torchrun sets: gloo just works."""
    script = """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    print("allreduce", t.tolist())
    dist.destroy_process_group()
    """
    res = launch(tmp_path, script, 2, 0)
    assert res.code == 0, res
    assert res.stdout.count("allreduce [3.0, 3.0, 3.0]") == 2, res


def test_shell_command_string(tmp_path: Path) -> None:
    res = run(
        [sys.executable, "-m", "pskv", "launch", "-n", "2", "-s", "0", "echo hello $DMLC_WORKER_ID"],
        timeout=60,
    )
    assert res.code == 0, res
    assert "[worker 0] hello 0" in res.stdout and "[worker 1] hello 1" in res.stdout, res


def test_workers_that_never_make_a_store_end_the_job_at_once(tmp_path: Path) -> None:
    """A script that never makes a dist store: the scheduler and server are stopped as soon as the
    workers finish (they used to wait out the 60 s finish timeout and fail the job)."""
    res = launch(tmp_path, "print('no store here')", 2, 1, timeout=30)
    assert res.code == 0, res
    assert res.stdout.count("no store here") == 2, res
    assert "the workers finished before the job started (none made a dist store); stopped scheduler, server 0" in res.stderr, res


def test_a_worker_that_finishes_without_joining_ends_a_job_the_others_joined(tmp_path: Path) -> None:
    """Worker 1 never makes a store and exits 0 while worker 0 waits in create(): the job can never
    start, and the launcher says so at once (it waited for the start timeout, 120 s by default)."""
    script = """
    import os, sys
    if os.environ["DMLC_WORKER_ID"] == "1":
        sys.exit(0)
    import pskv
    pskv.kv.create("dist_sync")
    """
    res = launch(tmp_path, script, 2, 1, timeout=60)
    assert res.code == 1, res
    assert "pskv launch: worker 1 finished before the job started, without joining it (no dist store); the job" in res.stderr, res


def test_the_start_timeout_names_who_did_not_register_and_the_schedulers_port(tmp_path: Path) -> None:
    script = """
    import os, time
    if os.environ["DMLC_WORKER_ID"] == "1":
        time.sleep(60)
    import pskv
    pskv.kv.create("dist_sync")
    """  # (the start timeout leaves the others' imports 20 s: a loaded 2-core machine took over 10)
    res = launch(tmp_path, script, 2, 1, timeout=90, env={"PSKV_START_TIMEOUT": "20"})
    assert res.code != 0, res
    said = re.search(r"1 of 2 workers registered with the scheduler at tcp://127\.0\.0\.1:(\d+); not registered: worker 1", res.stderr)
    assert said and int(said[1]) > 0, res  # the port it listens on (it said :0, what it was asked for)


def test_a_job_whose_workers_make_no_store_is_told_of_s_0_at_the_start_timeout(tmp_path: Path) -> None:
    """A torch-only program (torchrun's users' first try) under the default servers: the start timeout
    says that a program that needs no servers runs with -s 0."""
    res = launch(tmp_path, "import time\ntime.sleep(60)", 1, 1, timeout=60, env={"PSKV_START_TIMEOUT": "3"})
    assert res.code != 0, res
    assert "0 of 1 workers registered" in res.stderr and "a program that needs no servers runs with -s 0" in res.stderr, res


def test_a_bad_setting_is_one_clear_line_not_a_traceback(tmp_path: Path) -> None:
    res = launch(tmp_path, "import pskv\npskv.kv.create('dist_sync')", 1, 1, timeout=60, launch_args=["--env", "PSKV_TIMEOUT:abc"])
    assert res.code == 2, res  # the launcher's "could not start" status
    assert "pskv serve: environment variable PSKV_TIMEOUT='abc' is not a valid float" in res.stdout + res.stderr, res
    assert "Traceback" not in res.stdout + res.stderr, res
    for var, value, said in (("PSKV_HEARTBEAT_TIMEOUT", "0", "PSKV_HEARTBEAT_TIMEOUT='0' is not a valid float >= 0.01"),
                             ("PSKV_TIMEOUT", "nan", "PSKV_TIMEOUT='nan' is not a valid float >= 0.01")):  # fmt: skip
        res = launch(tmp_path, "import pskv\npskv.kv.create('dist_sync')", 1, 1, timeout=60, launch_args=["--env", f"{var}:{value}"])
        assert res.code == 2 and said in res.stdout + res.stderr and "Traceback" not in res.stdout + res.stderr, res
    # set in the environment instead of by their flags: checked before anything starts, as the flags are
    for env, said in (({"PSKV_MIN_WORKERS": "1", "PSKV_MAX_RESTARTS": "abc"}, "PSKV_MAX_RESTARTS='abc' is not a whole number"),
                      ({"PSKV_REPLICAS": "5"}, "--replicas 5: it must be at least 0 and less than the number of servers, 2"),
                      ({"PSKV_MIN_WORKERS": "5"}, "--min-workers 5: it must be at least 1 and less than -n 2")):  # fmt: skip
        res = run([sys.executable, "-m", "pskv", "launch", "-n", "2", "-s", "2", "--", "true"], timeout=60, env=env)
        assert res.code == 2 and said in res.stderr and "Traceback" not in res.stderr, res
    res = run([sys.executable, "-m", "pskv", "launch", "-n", "2", "-s", "0", "--min-workers", "1", "--", "true"], timeout=60)
    assert res.code == 2 and "--min-workers and --max-restarts need servers: with -s 0 no scheduler" in res.stderr, res
    # a misspelled setting is said, and the job runs (it was ignored without a word)
    res = run([sys.executable, "-m", "pskv", "launch", "-n", "1", "-s", "0", "--env", "PSKV_TIMEOUTS:5", "--", "true"], timeout=60, env={"PSKV_NONFINTE": "skip"})
    assert res.code == 0, res
    assert "PSKV_TIMEOUTS is not a pskv setting (did you mean PSKV_TIMEOUT?); it is ignored" in res.stderr, res
    assert "PSKV_NONFINTE is not a pskv setting (did you mean PSKV_NONFINITE?)" in res.stderr, res


def test_bad_arguments_are_clear(tmp_path: Path) -> None:
    res = run(
        [
            sys.executable,
            "-m",
            "pskv",
            "launch",
            "-n",
            "1",
            "-s",
            "0",
            "--env",
            "NOT_SET_ANYWHERE_X",
            "--",
            "true",
        ],
        timeout=60,
    )
    assert res.code == 2 and "NOT_SET_ANYWHERE_X is not set here" in res.stderr, res
    res = run(
        [sys.executable, "-m", "pskv", "launch", "-n", "1", "-s", "0", "--", "/no/such/program"], timeout=60
    )
    assert res.code == 2 and "cannot start /no/such/program" in res.stderr, res
    # a script without the execute bit, or without a #! line: the same clear error, no traceback (was one, status 1)
    script = tmp_path / "job.py"
    script.write_text("print('hi')\n")
    for mode, said in ((0o644, "Permission denied"), (0o755, "Exec format error")):
        script.chmod(mode)
        res = run([sys.executable, "-m", "pskv", "launch", "-n", "1", "-s", "1", "--", str(script)], timeout=60)
        assert res.code == 2 and f"cannot start {script}: {said}; " in res.stderr and "Traceback" not in res.stderr, res
    res = run([sys.executable, "-m", "pskv", "launch", "-n", "1"], timeout=60)
    assert res.code == 2 and "no command to run" in res.stderr, res


def test_ctrl_c_stops_the_whole_job(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(300)\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pskv", "launch", "-n", "2", "-s", "1", "--", sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    try:
        assert launcher.stdout is not None
        pids = [int(launcher.stdout.readline().split()[-1]) for _ in range(2)]
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 130, err
        assert "got SIGINT; stopping the job" in err
        time.sleep(0.2)
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists(), f"worker pid {pid} survived"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()


def test_random_bytes_and_truncated_messages_on_a_servers_tcp_port(tmp_path: Path) -> None:
    """Garbage on a server's port: a proven connection gets an ERROR per message, an unproven one nothing."""
    script = """
    import os, socket, torch, zmq, pskv
    from pskv.ps.message import HEADER, Message, Type, decode, encode
    kv = pskv.kv.create("dist_sync")
    kv.init("w", torch.ones(8))
    endpoint = kv._client.servers[0]["endpoint"]
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    for blob in [os.urandom(4096), b"\\xff" * 10, b"GET / HTTP/1.0\\r\\n\\r\\n"]:   # not even zmq
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(blob)
    from pskv.ps.van import AUTH, _proof
    secret, nonce = os.environ["PSKV_SECRET"].encode(), os.urandom(16)  # pskv launch made the job's secret
    sock, stranger = zmq.Context.instance().socket(zmq.DEALER), zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    stranger.connect(endpoint)
    sock.send(AUTH.pack(b"PSKVAUTH", 2, 0, nonce, _proof(secret, 2, 0, nonce, endpoint)))  # as worker 0
    frames = encode(Message(Type.PUSH, frames=[b"\\x00" * 32]))
    for cut in [frames[0][:10], frames[0][: HEADER.size - 1], os.urandom(HEADER.size)]:
        sock.send_multipart([cut])
        stranger.send_multipart([cut])
        reply = decode(sock.recv_multipart())
        assert reply.type == Type.ERROR and reply.meta["kind"] == "ProtocolError", reply
    assert stranger.poll(1000) == 0, "a connection without the secret's proof is answered"
    sock.close(linger=0)
    stranger.close(linger=0)
    kv.push("w", torch.full((8,), 2.0))
    out = torch.empty(8)
    kv.pull("w", out)
    assert torch.equal(out, torch.full((8,), 2.0)), out
    print("server kept serving")
    kv.close()
    """
    res = launch(tmp_path, script, 1, 1)
    assert res.code == 0 and "server kept serving" in res.stdout, res


def test_scheduler_runs_without_torch() -> None:
    code = "import sys, pskv.cli, pskv.ps, pskv.ps.scheduler; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.stdout.strip() == "False", out


@pytest.mark.timeout(240)
def test_three_workers_two_servers_with_the_jobs_secret(tmp_path: Path) -> None:
    """The formulas job of every launcher, here: pskv launch makes a secret and every role holds it."""
    project = write_project(tmp_path / "project")
    mark = marker()
    res = run([sys.executable, "-m", "pskv", "launch", "-n", "3", "-s", "2", *env_args(), *marker_args(mark), *formulas_args()], timeout=200, cwd=project)
    check_formulas(res)
    assert wait_gone(mark) == []


def test_a_killed_launcher_ends_every_process_with_an_error(tmp_path: Path) -> None:
    """``kill -9`` of ``pskv launch``: its lifeline pipe ends, and the scheduler, servers and workers
    each stop with an error (exit status not 0) at once. A harness adopts the orphans (Linux
    PR_SET_CHILD_SUBREAPER) to read their exit statuses."""
    (tmp_path / "job.py").write_text(
        "import os, time, torch, pskv\n"
        "kv = pskv.kv.create('dist_sync')\n"
        "kv.init('w', torch.zeros(10))\n"
        "open(f'ready.{kv.rank}', 'w').close()\n"
        "try:\n"
        "    while True:\n"
        "        kv.pushpull('w', torch.ones(10), torch.empty(10))\n"
        "        time.sleep(0.02)\n"
        "except pskv.errors.NodeFailedError as exc:\n"
        "    open(f'error.{kv.rank}', 'w').write(str(exc))\n"
        "    raise\n"
    )
    harness = """
import ctypes, glob, json, os, signal, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the job's orphans become ours
launcher = subprocess.Popen([sys.executable, "-m", "pskv", "launch", "-n", "2", "-s", "2", "--", sys.executable, "job.py"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
until = time.monotonic() + 120
while len(glob.glob("ready.*")) < 2 and time.monotonic() < until and launcher.poll() is None:
    time.sleep(0.05)
os.kill(launcher.pid, signal.SIGKILL)
killed, ended = time.monotonic(), {}
while time.monotonic() - killed < 60:
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    ended[pid] = [os.waitstatus_to_exitcode(status), time.monotonic() - killed]
print(json.dumps({"launcher": launcher.pid, "ended": ended}))
"""
    res = run([sys.executable, "-c", harness], timeout=150, cwd=tmp_path)
    assert res.code == 0, res
    report = json.loads(res.stdout)
    ended = {int(pid): v for pid, v in report["ended"].items()}
    assert ended.pop(report["launcher"])[0] == -signal.SIGKILL, res
    assert len(ended) == 5, res  # scheduler, 2 servers, 2 workers
    assert all(code != 0 and took < 10 for code, took in ended.values()), res
    for rank in (0, 1):
        text = (tmp_path / f"error.{rank}").read_text()
        assert f"the launcher (pid {report['launcher']}) that started this job is gone" in text, text


def test_a_killed_launcher_without_servers_ends_its_workers() -> None:
    """``kill -9`` of ``pskv launch -s 0`` (torchrun's part, no scheduler to read the lifeline) while its
    workers are busy outside pskv: the kernel sends each SIGTERM (PR_SET_PDEATHSIG), at once."""
    harness = """
import ctypes, json, os, signal, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the job's orphans become ours
launcher = subprocess.Popen([sys.executable, "-m", "pskv", "launch", "-n", "2", "-s", "0", "--", sys.executable, "-c",
                             "print('busy', flush=True); import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
for _ in range(2):
    launcher.stdout.readline()
os.kill(launcher.pid, signal.SIGKILL)
killed, ended = time.monotonic(), {}
while time.monotonic() - killed < 20:
    try:
        pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if pid:
        ended[pid] = [os.waitstatus_to_exitcode(status), time.monotonic() - killed]
    time.sleep(0.01)
print(json.dumps({"launcher": launcher.pid, "ended": ended}))
"""
    res = run([sys.executable, "-c", harness], timeout=120)
    assert res.code == 0, res
    report = json.loads(res.stdout)
    ended = {int(pid): v for pid, v in report["ended"].items()}
    assert ended.pop(report["launcher"])[0] == -signal.SIGKILL, res
    assert sorted(code for code, _ in ended.values()) == [-signal.SIGTERM] * 2, res
    assert all(took < 10 for _, took in ended.values()), res
