"""The parameter-server contract with real processes on 127.0.0.1, started by ``pskv launch``.

Each worker script checks the numbers itself (SPEC.md section 3's formulas) and exits non-zero
on a mismatch; the test checks the launcher's status and shows every process's output if not 0.
"""

from __future__ import annotations

import re
import signal
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from .jobs import formulas_script, launch

pytestmark = pytest.mark.timeout(240)

FORMULAS = formulas_script()


@pytest.mark.parametrize(("workers", "servers"), [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)])
def test_sync_formulas(tmp_path: Path, workers: int, servers: int) -> None:
    res = launch(tmp_path, FORMULAS, workers, servers, args=[str(workers), str(servers)])
    assert res.code == 0, res
    for w in range(workers):
        assert f"[worker {w}] rank {w}: formulas ok" in res.stdout, res


def test_dist_device_sync_and_int_keys(tmp_path: Path) -> None:
    script = """
    import torch, pskv
    kv = pskv.kv.create("dist_device_sync")
    kv.init([3, 9], [torch.zeros(2), torch.zeros(1100, 1000)])
    kv.push([3, 9], [[torch.ones(2)] * 2, [torch.ones(1100, 1000)] * 4])
    a, b = torch.empty(2), torch.empty(1100, 1000)
    kv.pull([3, 9], [a, b])
    assert torch.all(a == 2 * kv.num_workers) and torch.all(b == 4 * kv.num_workers), (a, b[0, 0])
    print("device sync ok")
    """
    res = launch(tmp_path, script, 2, 2)
    assert res.code == 0 and res.stdout.count("device sync ok") == 2, res


def test_dist_async(tmp_path: Path) -> None:
    script = """
    import torch, pskv
    kv = pskv.kv.create("dist_async")
    kv.init("w", torch.zeros(1300, 1000))
    try:
        kv.push("w", torch.ones(1300, 1000))
        raise SystemExit("push without an optimizer was accepted")
    except pskv.OptimizerRequiredError as exc:
        print("refused:", exc)
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=0.01))
    for handle in [kv.push("w", torch.full((1300, 1000), kv.rank + 1.0), wait=False) for _ in range(5)]:
        handle.wait()  # applied (a push returns once its bytes are sent; MXNet's test called kv.wait here)
    kv.barrier()
    out = torch.empty(1300, 1000)
    kv.pull("w", out)
    want = -0.01 * 5 * sum(range(1, kv.num_workers + 1))
    assert torch.allclose(out, torch.full_like(out, want)), (out[0, 0], want)
    print("async ok", out[0, 0].item())
    kv.close()
    """
    res = launch(tmp_path, script, 3, 2)
    assert res.code == 0, res
    assert res.stdout.count("async ok") == 3 and "needs an optimizer" in res.stdout, res


def test_optimizer_states_saved_and_restored_through_the_servers(tmp_path: Path) -> None:
    script = """
    import torch, pskv
    kv = pskv.kv.create("dist_sync")
    kv.init("w", torch.zeros(1200, 1000))
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0, momentum=0.5))
    out = torch.empty(1200, 1000)
    W = kv.num_workers
    kv.pushpull("w", torch.ones(1200, 1000), out=out)      # buf W, w -W
    kv.barrier()
    if kv.rank == 0:
        kv.save_optimizer_states("states.pskv")
    kv.barrier()
    kv.pushpull("w", torch.ones(1200, 1000), out=out)      # buf 1.5W, w -2.5W
    kv.barrier()
    if kv.rank == 0:
        kv.load_optimizer_states("states.pskv")             # buf back to W
    kv.barrier()
    kv.pushpull("w", torch.ones(1200, 1000), out=out)      # buf 1.5W again, w -4W
    assert torch.allclose(out, torch.full_like(out, -4.0 * W)), out[0, 0]
    print("states ok")
    kv.close()
    """
    res = launch(tmp_path, script, 2, 2)
    assert res.code == 0 and res.stdout.count("states ok") == 2, res
    import torch

    saved = torch.load(tmp_path / "states.pskv", weights_only=True)
    assert torch.all(saved["keys"][0]["tensors"]["momentum_buffer"] == 2.0)


def test_worker_leaving_early_is_named(tmp_path: Path) -> None:
    script = """
    import time, torch, pskv
    kv = pskv.kv.create("dist_sync")
    kv.init("w", torch.zeros(2))
    if kv.rank == 1:
        raise SystemExit(0)  # leaves without pushing; its store closes at exit
    time.sleep(1)
    kv.push("w", torch.ones(2))
    kv.pull("w", torch.empty(2))
    """
    res = launch(tmp_path, script, 2, 1, env={"PSKV_TIMEOUT": "60"})
    assert res.code != 0, res
    assert "worker 1 finished (closed its store) without pushing key 'w'" in res.stderr, res
    assert res.seconds < 60, "the error must come long before PSKV_TIMEOUT"


CRASH = """
import sys, time, torch, pskv
kv = pskv.kv.create("dist_sync")
kv.init("w", torch.zeros(4))
out, seen = torch.empty(4), []
for step in range(5):
    if kv.rank == 1 and step == 2:
        raise {}  # uncaught: its store still closes at exit
    kv.push("w", torch.ones(4))
    kv.pull("w", out)
    seen.append(out[0].item())
    time.sleep(0.2)
print("seen", seen, flush=True)
"""


def test_a_worker_dying_of_an_uncaught_exception_failed_it_did_not_finish(tmp_path: Path) -> None:
    """Started by hand (no launcher): worker 1 raises at its 3rd step. Its store, closed at exit,
    tells the scheduler it failed and why: worker 0's call names it, the scheduler and the server exit 1."""
    import os
    import subprocess
    import sys

    from pskv.launch.local import free_port

    (script := tmp_path / "w.py").write_text(CRASH.format('RuntimeError("worker 1 crashes at step 2")'))
    base = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": str(free_port()), "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "PSKV_TIMEOUT": "60"}  # fmt: skip
    serve = [sys.executable, "-m", "pskv", "serve"]
    procs = {name: subprocess.Popen(argv, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, argv, env in [("scheduler", serve, {"DMLC_ROLE": "scheduler"}), ("server", serve, {"DMLC_ROLE": "server"}),
                                     *((f"worker {i}", [sys.executable, str(script)], {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(i)}) for i in (0, 1))]}  # fmt: skip
    try:
        outs = {name: p.communicate(timeout=60) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    codes = {name: p.returncode for name, p in procs.items()}
    assert codes == {"scheduler": 1, "server": 1, "worker 0": 1, "worker 1": 1}, (codes, outs)
    failed = f"worker 1 (host {socket.gethostname()}, pid {procs['worker 1'].pid}) failed: it exited with an uncaught RuntimeError: worker 1 crashes at step 2"
    assert failed in outs["scheduler"][1] and failed in outs["server"][1], outs
    assert re.search(f"NodeFailedError: (pull|push|push and pull) of 1 parts: {re.escape(failed)}", outs["worker 0"][1]), outs  # (a pull may ride on its push)
    assert "finished" not in outs["worker 0"][1], outs


def test_a_worker_whose_store_fails_after_it_joined_failed_it_did_not_finish(tmp_path: Path) -> None:
    """Started by hand, worker 0 with PSKV_SHM=1 and the server with PSKV_SHM=0: worker 0 joins, then its
    store fails to start (a ClusterError naming both settings). Its store closed as if it had finished, so
    the scheduler said 'worker 0 finished' and worker 1's init waited PSKV_TIMEOUT for worker 0's value
    ('worker 0 sends it and has not'). Now every process names worker 0's failure, at once."""
    import os
    import subprocess
    import time

    from pskv.launch.local import free_port

    (script := tmp_path / "w.py").write_text("import torch, pskv\nkv = pskv.kv.create('dist_sync')\nkv.init('w', torch.zeros(4))\n")
    base = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": str(free_port()), "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "PSKV_TIMEOUT": "120"}  # fmt: skip
    serve = [sys.executable, "-m", "pskv", "serve"]
    procs = {name: subprocess.Popen(argv, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, argv, env in [("scheduler", serve, {"DMLC_ROLE": "scheduler"}), ("server", serve, {"DMLC_ROLE": "server", "PSKV_SHM": "0"}),
                                     ("worker 0", [sys.executable, str(script)], {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0", "PSKV_SHM": "1"}),
                                     ("worker 1", [sys.executable, str(script)], {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "1"})]}  # fmt: skip
    until, outs = time.monotonic() + 60, {}
    for name, p in procs.items():  # (one overdue is killed: its output still shows below)
        try:
            outs[name] = p.communicate(timeout=max(0.1, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            outs[name] = p.communicate()
    codes = {name: p.returncode for name, p in procs.items()}
    assert codes == {"scheduler": 1, "server": 1, "worker 0": 1, "worker 1": 1}, (codes, outs)
    failed = (f"worker 0 (host {socket.gethostname()}, pid {procs['worker 0'].pid}) failed: it exited with an uncaught "
              "pskv.errors.ClusterError: PSKV_SHM=1, but shared memory with server 0 failed")
    assert all(failed in outs[name][1] for name in ("scheduler", "server", "worker 1")), outs


@pytest.mark.parametrize("within", [False, True], ids=["store closed at exit", "store closed by its with block"])
def test_min_workers_the_job_goes_on_without_a_worker_that_raised(tmp_path: Path, within: bool) -> None:
    """SPEC "Going on without a worker": a worker that exited with an error (here an uncaught
    KeyboardInterrupt) is lost, not finished; with ``--min-workers 1`` the other goes on alone. Also
    when the exception closed the store on its way out of ``with pskv.kv.create(...) as kv:``."""
    script = CRASH.format("KeyboardInterrupt")
    if within:  # the lines after the store's creation in its with block
        lines = script.splitlines()
        k = next(i for i, line in enumerate(lines) if "pskv.kv.create" in line)
        script = "\n".join([*lines[:k], 'with pskv.kv.create("dist_sync") as kv:', *("    " + line for line in lines[k + 1 :])])
    res = launch(tmp_path, script, 2, 1, launch_args=["--min-workers", "1"], timeout=120)
    assert res.code == 0 and "seen [2.0, 2.0, 1.0, 1.0, 1.0]" in res.stdout, res
    assert "worker 1 (host" in res.stderr and "failed: it exited with an uncaught KeyboardInterrupt" in res.stderr, res


def test_killed_server_is_named_and_the_job_stops(tmp_path: Path) -> None:
    script = """
    import os, signal, time, torch, pskv
    kv = pskv.kv.create("dist_sync")
    kv.init("w", torch.zeros(1200, 1000))
    if kv.rank == 0:
        victim = kv._client.servers[1]["pid"]
        print("killing server 1, pid", victim, flush=True)
        os.kill(victim, signal.SIGKILL)
    time.sleep(60)
    """
    res = launch(tmp_path, script, 2, 2)
    assert res.code == 128 + 9, res
    assert "server 1 was killed by SIGKILL; stopped the other processes of the job" in res.stderr, res
    assert res.seconds < 45, res


FIND = """
import os, signal, sys, time, torch, pskv
from pskv.ps import message, van
def find(*words):
    \"\"\"The pid of this job's process whose environment holds every one of ``words`` (None: none yet).\"\"\"
    want = [f"PSKV_LIFELINE={os.environ['PSKV_LIFELINE']}".encode(), *(w.encode() for w in words)]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\\0")
        except OSError:
            continue
        if all(w in env for w in want):
            return int(pid)
def once_answered(then):
    \"\"\"Run ``then`` once the scheduler answers a heartbeat, so it has this node's REGISTER.\"\"\"
    recv = van.Van.recv
    def recv_then(self, timeout):
        got = recv(self, timeout)
        if any(getattr(m, "type", None) == message.Type.HEARTBEAT_ACK for _, m in got) and not os.environ.get("ONCE"):
            os.environ["ONCE"] = "1"
            then()
        return got
    van.Van.recv = recv_then
"""


def test_a_stopped_scheduler_is_named_not_the_worker_that_noticed(tmp_path: Path) -> None:
    """The scheduler stopped (SIGSTOP) past the heartbeat timeout: the workers fail ("has not answered"),
    and the launcher named the first of them; the scheduler is stopped, and it is the one to name."""
    script = FIND + """
kv = pskv.kv.create("dist_sync")
kv.init("w", torch.zeros(4))
if kv.rank == 0:
    os.kill(find("DMLC_ROLE=scheduler"), signal.SIGSTOP)
for _ in range(600):
    kv.push("w", torch.ones(4))
    kv.pull("w", torch.empty(4))
    time.sleep(0.05)
"""
    res = launch(tmp_path, script, 2, 2, env={"PSKV_HEARTBEAT_TIMEOUT": "3"}, timeout=120)
    assert res.code == 1 and "has not answered" in res.stderr, res
    assert "pskv launch: scheduler is stopped (SIGSTOP?)" in res.stderr, res


def test_a_stopped_server_without_replicas_is_named_not_the_scheduler(tmp_path: Path) -> None:
    """A server stopped (SIGSTOP) past the heartbeat timeout, no --replicas: the scheduler declares it
    lost and exits 1 first; the launcher named the scheduler, though the server is the one stopped."""
    script = FIND + """
kv = pskv.kv.create("dist_sync")
kv.init("w", torch.zeros(4))
if kv.rank == 0:
    os.kill(kv._client.servers[1]["pid"], signal.SIGSTOP)
time.sleep(60)
"""
    res = launch(tmp_path, script, 2, 2, env={"PSKV_HEARTBEAT_TIMEOUT": "3"}, timeout=120)
    assert res.code == 1 and "pskv scheduler: server 1 (host " in res.stderr, res
    assert "pskv launch: server 1 is stopped (SIGSTOP?)" in res.stderr, res


@pytest.mark.parametrize("first", ["SIGKILL", "SIGSTOP"])
def test_replicas_the_server_lost_past_them_is_named_not_the_one_lost_before(tmp_path: Path, first: str) -> None:
    """``--replicas 1`` of 3 servers: server 1 lost (killed or stopped; the job goes on), then server 2,
    its backup, stopped: the job ends. The launcher named server 1 (the scheduler's last lines name it
    first), or the scheduler, not server 2, the one whose loss ended the job."""
    script = FIND + f"""
kv = pskv.kv.create("dist_sync")
kv.init(list(range(6)), [torch.zeros(4)] * 6)  # (on every server)
for i in range(600):
    if kv.rank == 0 and i == 3:
        os.kill(kv._client.servers[1]["pid"], signal.{first})
    if kv.rank == 0 and i > 3 and 1 in kv._client.lost_servers:
        os.kill(kv._client.servers[2]["pid"], signal.SIGSTOP)
        time.sleep(60)
    kv.push(list(range(6)), [torch.ones(4)] * 6)
    kv.pull(list(range(6)), [torch.empty(4) for _ in range(6)])
    time.sleep(0.05)
"""
    res = launch(tmp_path, script, 2, 3, env={"PSKV_HEARTBEAT_TIMEOUT": "3"}, launch_args=["--replicas", "1"], timeout=120)
    assert res.code == 1 and "pskv scheduler: server 2 (host " in res.stderr, res
    assert "pskv launch: server 2 is stopped (SIGSTOP?)" in res.stderr, res


def test_a_worker_lost_across_the_start_is_told_so_when_it_goes_on(tmp_path: Path) -> None:
    """Worker 1 registers and stops (SIGSTOP); the job starts and declares it lost at the heartbeat
    deadline; worker 0 then continues it. It read its node table and failed 3 s later with "the scheduler
    has not answered" (the scheduler had told everyone but it); it is now told it was declared lost."""
    script = FIND + """
if os.environ["DMLC_WORKER_ID"] == "1":
    once_answered(lambda: os.kill(os.getpid(), signal.SIGSTOP))
else:  # starts the job once worker 1 is stopped
    while (victim := find("DMLC_ROLE=worker", "DMLC_WORKER_ID=1")) is None or "T" not in open(f"/proc/{victim}/stat").read().rsplit(")", 1)[1].split()[:1]:
        time.sleep(0.1)
try:
    kv = pskv.kv.create("dist_sync")
    kv.init("w", torch.zeros(4))
    kv.pushpull("w", torch.ones(4), out=torch.empty(4))
except pskv.NodeFailedError:
    if os.environ["DMLC_WORKER_ID"] == "0":  # worker 1 was declared lost: it goes on now
        os.kill(victim, signal.SIGCONT)
        time.sleep(60)
    raise
"""
    res = launch(tmp_path, script, 2, 2, env={"PSKV_HEARTBEAT_TIMEOUT": "3"}, timeout=120)
    assert res.code == 1 and "pskv launch: worker 1 exited with status 1" in res.stderr, res
    assert re.search(r"\[worker 1\] pskv\.errors\.NodeFailedError: .*worker 1 \(host .*\) failed: no heartbeat", res.stderr), res
    assert "has not answered" not in res.stderr, res


def test_a_worker_that_asked_for_its_rank_and_died_before_the_start_is_named_by_it(tmp_path: Path) -> None:
    """Worker 0's store (in a child: the launcher sees no exit) registers with DMLC_WORKER_ID=0 and
    dies before the start: the scheduler called it "a worker (host, pid, no rank yet)"."""
    script = FIND + """
if sys.argv[1:] == ["child"]:
    once_answered(lambda: os.kill(os.getpid(), signal.SIGKILL))
    pskv.kv.create("dist_sync")
elif os.environ["DMLC_WORKER_ID"] == "0":
    import subprocess
    subprocess.run([sys.executable, __file__, "child"])
time.sleep(60)
"""
    res = launch(tmp_path, script, 2, 2, env={"PSKV_HEARTBEAT_TIMEOUT": "3"}, timeout=120)
    assert res.code == 1 and "pskv scheduler: worker 0 (host " in res.stderr, res
    assert "no rank yet" not in res.stderr, res


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL])
def test_a_lost_server_is_named_at_once_without_the_launcher(tmp_path: Path, sig: signal.Signals) -> None:
    """Started by hand (no launcher watching): a killed server's closed connection tells the scheduler
    at once, though heartbeats would wait 30 s; a stopped one (hung, not dead) only heartbeats can tell."""
    import os
    import subprocess
    import sys
    import time

    from pskv.launch.local import free_port

    port = free_port()
    base = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": str(port),
        "DMLC_NUM_WORKER": "1",
        "DMLC_NUM_SERVER": "2",
        "PSKV_HEARTBEAT_TIMEOUT": "3" if sig == signal.SIGSTOP else "30",
        "PSKV_TIMEOUT": "120",
    }
    script = tmp_path / "w.py"
    script.write_text(
        "import time, torch, pskv\n"
        "kv = pskv.kv.create('dist_sync')\n"
        "kv.init('w', torch.zeros(1200, 1000))\n"
        "print('ready', flush=True)\n"
        "kv.push('w', torch.ones(1200, 1000))\n"
        "kv.pull('w', torch.empty(1200, 1000))\n"
        "time.sleep(2)\n"
        "kv.pull('w', torch.empty(1200, 1000))\n"
    )
    serve = [sys.executable, "-m", "pskv", "serve"]
    procs = {
        "scheduler": subprocess.Popen(
            serve, env={**base, "DMLC_ROLE": "scheduler"}, stderr=subprocess.PIPE, text=True
        ),
        "server 0": subprocess.Popen(
            serve,
            env={**base, "DMLC_ROLE": "server", "DMLC_SERVER_ID": "0"},
            stderr=subprocess.PIPE,
            text=True,
        ),
        "server 1": subprocess.Popen(
            serve,
            env={**base, "DMLC_ROLE": "server", "DMLC_SERVER_ID": "1"},
            stderr=subprocess.PIPE,
            text=True,
        ),
    }
    worker = subprocess.Popen(
        [sys.executable, str(script)],
        env={**base, "DMLC_ROLE": "worker"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "ready"
        procs["server 1"].send_signal(sig)
        start = time.monotonic()
        _, err = worker.communicate(timeout=60)
        took = time.monotonic() - start
        assert worker.returncode != 0, err
        how = "no heartbeat" if sig == signal.SIGSTOP else "its connection to the scheduler closed"
        assert "NodeFailedError" in err and f"server 1 (host {socket.gethostname()}, pid {procs['server 1'].pid}) failed: {how}" in err, err
        assert sig == signal.SIGKILL or re.search("NodeFailedError: (push and )?pull of 1 parts: server 1", err), err  # what it was doing (a pull may ride on its push)
        assert took < (20 if sig == signal.SIGSTOP else 10), took
        for name in ("scheduler", "server 0"):
            _, err = procs[name].communicate(timeout=20)
            assert procs[name].returncode == 1 and "server 1" in err, (name, err)
    finally:
        for p in [*procs.values(), worker]:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.communicate()  # reaps it and closes its pipes


def test_trainer_formula_three_workers_two_servers(tmp_path: Path) -> None:
    """SPEC.md section 6: weights of ones, grads rank+1, sgd(learning_rate=1), step(1) -> 1 - W(W+1)/2."""
    script = """
    import torch, pskv
    kv = pskv.kv.create("dist_sync")
    W = kv.num_workers
    small, big = torch.nn.Parameter(torch.ones(7)), torch.nn.Parameter(torch.ones(1200, 1000))
    trainer = pskv.Trainer([small, big], "sgd", {"learning_rate": 1.0}, kvstore=kv)
    for step in range(2):
        small.grad = torch.full((7,), kv.rank + 1.0)
        big.grad = torch.full((1200, 1000), kv.rank + 1.0)
        trainer.step(1)
        want = 1 - W * (W + 1) / 2 * (step + 1)
        assert torch.all(small == want) and torch.all(big == want), (step, small[0].item(), big[0, 0].item(), want)
    print("trainer ok", small[0].item())
    kv.close()
    """
    res = launch(tmp_path, script, 3, 2)
    assert res.code == 0 and res.stdout.count("trainer ok -11.0") == 3, res


def test_pskv_train_as_the_workers_program_with_two_devices_each(tmp_path: Path) -> None:
    import json
    import sys

    from .jobs import run

    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "pskv", "launch", "-n", "2", "-s", "1", "--", sys.executable, "-m", "pskv", "train",
            "--model", "small_cnn", "--dataset", "synthetic", "--image-size", "16", "--epochs", "2",
            "--devices", "cpu,cpu", "--no-progress", "--report", str(report)]  # fmt: skip
    res = run(argv, timeout=200)
    assert res.code == 0, res
    assert "[worker 0] epoch 2, loss" in res.stdout and "[worker 1] epoch" not in res.stdout, res
    data = json.loads(report.read_text())
    assert data["workers"] == 2 and data["servers"] == 1 and data["devices"] == ["cpu", "cpu"]
    assert data["epochs"][1]["loss"] < data["epochs"][0]["loss"], data["epochs"]


def test_every_role_can_run_the_users_script(tmp_path: Path) -> None:
    """MXNet style: the same command for every role; kv.create serves and exits in a server/scheduler."""
    import os
    import subprocess
    import sys

    from pskv.launch.local import free_port

    script = tmp_path / "same.py"
    script.write_text(
        "import torch, pskv\n"
        "kv = pskv.kv.create('dist_sync')\n"  # servers and the scheduler serve here, then exit 0
        "kv.init('w', torch.zeros(3))\n"
        "kv.push('w', torch.ones(3) * (kv.rank + 1))\n"
        "out = torch.empty(3)\n"
        "kv.pull('w', out)\n"
        "print('worker', kv.rank, 'pulled', out.tolist(), flush=True)\n"
    )
    base = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": str(free_port()), "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1"}  # fmt: skip
    roles = ["scheduler", "server", "worker", "worker"]
    procs = [
        subprocess.Popen([sys.executable, str(script)], env={**base, "DMLC_ROLE": r}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in roles
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    printed = sorted(o for o, _ in outs[2:])
    assert printed == ["worker 0 pulled [3.0, 3.0, 3.0]\n", "worker 1 pulled [3.0, 3.0, 3.0]\n"], outs
    assert outs[0][0] == "" and outs[1][0] == ""  # the serving roles never reached the user's code


def test_a_store_dropped_without_close_still_finishes_the_job(tmp_path: Path) -> None:
    """A worker that lets its store go (out of scope, or alive at exit) without close() is done:
    the scheduler hears it finished, and the job ends cleanly (not at the heartbeat deadline)."""
    script = """
    import gc, time, torch, pskv
    def work():
        kv = pskv.kv.create("dist_sync")
        kv.init(0, torch.ones(2))
        kv.pushpull(0, torch.ones(2))
    work()
    gc.collect()
    print("dropped", flush=True)
    time.sleep(1.0)  # the job must not fail meanwhile: the store said it finished
    """
    res = launch(tmp_path, script, 2, 1, env={"PSKV_HEARTBEAT_TIMEOUT": "6"})
    assert res.code == 0 and res.stdout.count("dropped") == 2, res


def test_a_child_forked_by_a_worker_exits_without_touching_its_store(tmp_path: Path) -> None:
    """A child of os.fork that ended normally (atexit) closed the parent's store it had copied: it waited PSKV_TIMEOUT
    and more for answers its parent's calls in flight would get, through sockets whose threads the fork did not copy."""
    script = """
    import os, sys, time, torch, pskv
    kv = pskv.kv.create("dist_sync")
    kv.init(0, torch.zeros(4))
    out = torch.empty(4)
    h = kv.pushpull(0, torch.ones(4), out, wait=False)  # in flight as the worker forks
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # (atexit handlers run)
    until = time.monotonic() + 10
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > until:
            os.kill(pid, 9)
            sys.exit("the forked child did not exit within 10 s")
        time.sleep(0.05)
    h.wait()
    kv.pushpull(0, torch.ones(4), out)
    print("forked, went on:", out.tolist(), flush=True)
    """
    res = launch(tmp_path, script, 2, 1, env={"PSKV_TIMEOUT": "30"}, timeout=90)
    assert res.code == 0 and res.stdout.count("forked, went on: [2.0, 2.0, 2.0, 2.0]") == 2, res


def test_a_second_dist_store_in_a_worker_is_refused_at_once(tmp_path: Path) -> None:
    """A worker has one place in its job: a second dist store (a Trainer given a type name after
    ``create``) and one made after ``close()`` fail at once, saying so; they waited for the start
    timeout, the first with "the job already has its 2 workers", the second naming the scheduler."""
    script = """
    import torch, pskv
    kv = pskv.kv.create("dist_sync")
    try:
        pskv.Trainer(torch.nn.Linear(2, 2).parameters(), "sgd", {"learning_rate": 0.1}, kvstore="dist_sync")
    except pskv.KVStoreError as exc:
        print("second:", type(exc).__name__, exc, flush=True)
    kv.close()
    try:
        pskv.kv.create("dist_sync")
    except pskv.KVStoreError as exc:
        print("after close:", type(exc).__name__, exc, flush=True)
    """
    res = launch(tmp_path, script, 2, 1, timeout=60)
    assert res.code == 0, res
    for rank in (0, 1):
        assert f"second: KVStoreError this process already has a dist store ('dist_sync', worker {rank})" in res.stdout, res
    assert res.stdout.count("after close: StoreClosedError this process's dist store was closed") == 2, res


def test_pskv_train_resumes_a_killed_job_from_its_checkpoint(tmp_path: Path) -> None:
    """``kill -9`` of ``pskv train`` after its first checkpoint, then ``--resume`` with another number of
    servers: the weights after 3 epochs equal those of a run never stopped (same data order, same
    optimizer states and schedule step; 2 workers' sums do not depend on the servers)."""
    import json
    import subprocess
    import sys
    import time

    import torch

    from .jobs import REPO, run

    train = [sys.executable, "-m", "pskv", "train", "--model", "small_cnn", "--epochs", "3", "--no-progress"]
    res = run([*train, "--checkpoint-dir", str(tmp_path / "whole")], timeout=200)
    assert res.code == 0, res
    killed = subprocess.Popen(
        [*train, "--checkpoint-dir", str(tmp_path / "cut")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    until = time.monotonic() + 150
    while not (tmp_path / "cut" / "epoch-1" / "progress.json").exists() and killed.poll() is None:
        assert time.monotonic() < until, "no checkpoint after 150 s"
        time.sleep(0.01)
    killed.kill()  # the launcher; its lifeline stops the job's processes
    out, _ = killed.communicate(timeout=30)
    assert killed.returncode == -signal.SIGKILL, out
    report = tmp_path / "report.json"
    res = run([*train, "--checkpoint-dir", str(tmp_path / "cut"), "--resume", "--servers", "1", "--report", str(report)], timeout=200)
    assert res.code == 0 and "pskv train: resuming from" in res.stdout, res
    done = sorted(p.name for p in (tmp_path / "cut").iterdir())
    assert done == ["epoch-3"], done  # older checkpoints removed, no temporary left
    whole = torch.load(tmp_path / "whole" / "epoch-3" / "model.pt")
    resumed = torch.load(tmp_path / "cut" / "epoch-3" / "model.pt")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole), [k for k in whole if not torch.equal(whole[k], resumed[k])]
    assert [row["epoch"] for row in json.loads(report.read_text())["epochs"]] == [1, 2, 3]


def test_pskv_train_on_dist_async_sizes_and_resumes_the_servers_schedule(tmp_path: Path) -> None:
    """dist_async applies every push: 2 workers x 23 steps are 46 updates an epoch on the servers. The
    schedule was sized in one worker's steps (the LR was 0 from half the run on: its second epoch of 2
    left the weights as they were), and a resume scaled the servers' count down to 23 an epoch (and
    lost it, and the momentum, at its first step: the saved rescale was the short last batch's)."""
    import torch

    from .jobs import run

    train = [sys.executable, "-m", "pskv", "train", "--model", "small_cnn", "--kv-store", "dist_async", "--no-progress",
             "--checkpoint-dir", str(tmp_path)]  # fmt: skip
    for epochs in (2, 3):  # then one more epoch, resumed
        res = run([*train, "--epochs", str(epochs), *(["--resume"] if epochs == 3 else [])], timeout=200)
        assert res.code == 0, res
        saved = torch.load(tmp_path / f"epoch-{epochs}" / "optimizer.pt", weights_only=True)
        assert saved["num_update"] == saved["optimizer"]["lr_scheduler"]["max_update"] == 46 * epochs, saved["num_update"]


def test_pskv_train_resume_needs_a_checkpoint_dir(tmp_path: Path) -> None:
    import sys

    from .jobs import run

    res = run([sys.executable, "-m", "pskv", "train", "--resume"], timeout=60)
    assert res.code == 2 and "--resume needs --checkpoint-dir" in res.stderr, res
    for args, said in (  # said before a job starts (they came as tracebacks from every worker)
        (["--servers", "0"], "--image-size and (with a dist store) --servers must be >= 1"),
        (["--image-size", "0"], "--image-size and (with a dist store) --servers must be >= 1"),
        (["--model", "small_cnn", "--image-size", "13"], ">= 14 with small_cnn)"),  # (a traceback)
        (["--image-size", "8"], "(--image-size >= 9 with resnet18"),  # (a traceback at a last batch of 1)
        (["--dataset", "cifar10"], "--dataset cifar10 reads files: --data-dir must be a folder, got None"),
        (["--dataset", "folder", "--data-dir", str(tmp_path / "none")], f"--data-dir must be a folder, got {tmp_path / 'none'}"),
    ):
        res = run([sys.executable, "-m", "pskv", "train", *args], timeout=60)
        assert res.code == 2 and said in res.stderr and "launching" not in res.stderr, res
    res = run([sys.executable, "-m", "pskv", "train", "--kv-store", "local", "--workers", "1", "--model", "small_cnn",
               "--epochs", "1", "--no-progress", "--checkpoint-dir", str(tmp_path), "--resume"], timeout=120)  # fmt: skip
    assert res.code == 0 and f"no checkpoint in {tmp_path} yet; starting" in res.stdout, res
    assert (tmp_path / "epoch-1" / "model.pt").is_file(), res


def test_min_workers_the_job_goes_on_without_a_killed_worker(tmp_path: Path) -> None:
    """``--min-workers 2`` of 3: worker 2 is killed (-9) before its 4th push; the rounds from then on
    sum the 2 live workers' pushes (no optimizer: the value is the sum), barriers and allgather go on
    without it, and the job ends with status 0."""
    script = """
    import os, signal, torch, pskv
    kv = pskv.kv.create("dist_sync")
    kv.init("w", torch.zeros(4))
    out, seen = torch.empty(4), []
    for step in range(8):
        if kv.rank == 2 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        kv.push("w", torch.ones(4))
        kv.pull("w", out)
        seen.append(out[0].item())
    assert seen == [3.0] * 3 + [2.0] * 5, seen
    kv.barrier()
    print("members", kv.rank, kv.allgather(kv.rank), flush=True)
    kv.close()
    """
    res = launch(tmp_path, script, 3, 2, launch_args=["--min-workers", "2"], timeout=120)
    assert res.code == 0, res
    assert "members 0 [0, 1]" in res.stdout and "members 1 [0, 1]" in res.stdout, res
    assert "worker 2 was killed by SIGKILL; the job goes on with 2 workers (--min-workers 2)" in res.stderr, res
    assert "worker 2 (host" in res.stderr and "the job goes on with 2 workers (PSKV_MIN_WORKERS=2)" in res.stderr, res
    res = launch(tmp_path, script, 3, 2, launch_args=["--min-workers", "3"], timeout=60)
    assert res.code == 2 and "--min-workers 3: it must be at least 1 and less than -n 3" in res.stderr, res
    early = "import os\nif os.environ['DMLC_WORKER_ID'] == '2':\n    raise SystemExit(3)\n" + textwrap.dedent(script)  # before the job starts
    res = launch(tmp_path, early, 3, 2, launch_args=["--min-workers", "2"], timeout=60)
    assert res.code == 3 and "worker 2 exited with status 3; stopped the other processes" in res.stderr, res
    assert res.seconds < 30, "not at the start deadline: nothing could go on without it before the job started"


def test_min_workers_pskv_train_finishes_without_a_killed_worker(tmp_path: Path) -> None:
    """``pskv train`` by 3 workers, one killed (-9) once the first epoch is reported: the other two
    share the data from the next epoch and finish every epoch."""
    import json
    import os
    import subprocess
    import sys

    from .jobs import REPO

    report = tmp_path / "report.json"
    argv = [sys.executable, "-m", "pskv", "launch", "-n", "3", "-s", "1", "--min-workers", "2", "--", sys.executable, "-m",
            "pskv", "train", "--model", "small_cnn", "--epochs", "3", "--no-progress", "--report", str(report)]  # fmt: skip
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert launcher.stdout is not None
        lines = []
        for line in launcher.stdout:
            lines.append(line)
            if line.startswith("[worker 0] epoch 1,"):
                break
        victim = next(int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _is_worker_2_of(int(pid), launcher.pid))
        os.kill(victim, signal.SIGKILL)
        try:
            out, err = launcher.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            launcher.kill()
            out, err = launcher.communicate()
            raise AssertionError(f"timed out\n{''.join(lines)}{out}\n--- stderr ---\n{err}") from None
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    out = "".join(lines) + out
    assert launcher.returncode == 0, f"{out}\n{err}"
    assert "worker 2 was killed by SIGKILL; the job goes on with 2 workers" in err, err
    epochs = json.loads(report.read_text())["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3] and all(e["loss"] == e["loss"] for e in epochs), epochs


def _is_worker_2_of(pid: int, parent: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            if int(f.read().rsplit(")", 1)[1].split()[1]) != parent:
                return False
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"DMLC_WORKER_ID=2" in f.read().split(b"\0")
    except (OSError, ValueError, IndexError):
        return False


REPLICATED = """
import os, signal, sys, torch, pskv
kills = {int(step): int(server) for step, server in (k.split(":") for k in sys.argv[1:])}  # step -> server to kill
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(50, 400), torch.nn.ReLU(), torch.nn.Linear(400, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10))
kv = pskv.kv.create("dist_sync")
trainer = pskv.Trainer(net.parameters(), "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-4}, kvstore=kv, overlap=True)
kv.init(1000, torch.zeros(70000))  # cut over the servers; pushpull: pushes answered with the value
g = torch.Generator().manual_seed(kv.rank)
extra = torch.empty(70000)
for step in range(24):
    if step in kills and kv.rank == 0:
        os.kill(kv._client.servers[kills[step]]["pid"], signal.SIGKILL)
        print(f"killed server {kills[step]}", flush=True)
    x, y = torch.randn(32, 50, generator=g), torch.randint(0, 10, (32,), generator=g)
    net.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y, reduction="sum").backward()
    trainer.step(32)
    kv.pushpull(1000, torch.randn(70000, generator=g), extra)
trainer.synchronize()
torch.save({**net.state_dict(), "extra": extra}, f"params.{kv.rank}.pt")
kv.close()
"""


@pytest.mark.parametrize("replicas", [1, 2])
def test_replicas_a_killed_server_changes_no_result(tmp_path: Path, replicas: int) -> None:
    """``--replicas R``, 2 workers x 3 servers: server 1 killed (-9) in the middle of training (the
    Trainer's overlapped held rounds, and pushpull), and with R=2 server 2 later too. The next live
    backup serves the lost server's parts, the workers send it what the lost one had not answered,
    and the weights at the end equal, bit for bit, those of a run without replicas or faults."""
    import torch

    (tmp_path / "plain").mkdir()
    (tmp_path / "cut").mkdir()
    res = launch(tmp_path / "plain", REPLICATED, 2, 3, timeout=120)
    assert res.code == 0, res
    kills = ["10:1", "16:2"][:replicas]
    res = launch(tmp_path / "cut", REPLICATED, 2, 3, args=kills, launch_args=["--replicas", str(replicas)], timeout=120)
    assert res.code == 0 and "killed server 1" in res.stdout, res
    assert f"server 1 was killed by SIGKILL; its backup serves its parts (--replicas {replicas})" in res.stderr, res
    assert f"server 2, its backup, serves its parts (PSKV_REPLICAS={replicas})" in res.stderr, res
    if replicas == 2:  # server 2 held its parts, server 1's and server 0's: server 0 now holds all
        assert "server 0, its backup, serves its parts (PSKV_REPLICAS=2)" in res.stderr, res
    want = torch.load(tmp_path / "plain" / "params.0.pt")
    for rank in (0, 1):
        got = torch.load(tmp_path / "cut" / f"params.{rank}.pt")
        assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])]


def test_min_workers_a_stopped_worker_is_declared_lost_and_left_behind(tmp_path: Path) -> None:
    """A worker that stops (SIGSTOP: alive, silent) is declared lost at the heartbeat deadline; the
    other finishes, and the launcher stops the stopped one and exits 0 instead of waiting for it."""
    script = """
    import os, signal, torch, pskv
    kv = pskv.kv.create("dist_sync")
    kv.init("w", torch.zeros(4))
    out = torch.empty(4)
    for step in range(6):
        if kv.rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGSTOP)
        kv.push("w", torch.ones(4))
        kv.pull("w", out)
    print("done", kv.rank, out[0].item(), flush=True)
    kv.close()
    """
    res = launch(tmp_path, script, 2, 1, launch_args=["--min-workers", "1"], env={"PSKV_HEARTBEAT_TIMEOUT": "3"}, timeout=90)
    assert res.code == 0 and "done 0 1.0" in res.stdout, res
    assert "worker 1 (host" in res.stderr and "no heartbeat" in res.stderr, res
    assert "the job finished; stopped worker 1, declared lost earlier" in res.stderr, res


def test_replicas_a_blocking_push_of_a_large_key_goes_on_after_a_lost_server(tmp_path: Path) -> None:
    """``--replicas 1``, a 16 MB key, blocking ``push`` then ``pull``: server 0 is killed while its
    connections still hold pushed bytes, which zmq never lets go of; a push that waited for them
    failed after PSKV_TIMEOUT (or hung with the default). Every round's value follows SGD (lr 1)."""
    script = """
    import os, signal, time, torch, pskv
    kv = pskv.kv.create("dist_sync")
    kv.init("big", torch.zeros(4 << 20))
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0))
    out, ones, seen = torch.empty(4 << 20), torch.ones(4 << 20), []
    for r in range(8):
        if r == 3 and kv.rank == 0:
            os.kill(kv._client.servers[0]["pid"], signal.SIGKILL)
            time.sleep(6)
        kv.push("big", ones)
        kv.pull("big", out)
        seen.append(sorted(set(out.tolist())))
    print("seen", kv.rank, seen, flush=True)
    kv.close()
    """
    res = launch(tmp_path, script, 2, 2, launch_args=["--replicas", "1"], env={"PSKV_TIMEOUT": "15"}, timeout=120)
    assert res.code == 0, res
    for rank in (0, 1):
        assert f"seen {rank} {[[-2.0 * r] for r in range(1, 9)]}" in res.stdout, res


def test_replicas_work_after_close_is_not_cut_short(tmp_path: Path) -> None:
    """With ``--replicas 1`` (or ``--min-workers``) the launcher stops only processes the scheduler
    declared lost: a worker still busy after ``kv.close()`` (saving, evaluating) finishes."""
    script = """
    import time, torch, pskv
    kv = pskv.kv.create("dist_sync")
    kv.init("w", torch.zeros(10))
    kv.push("w", torch.ones(10))
    kv.close()
    time.sleep(7)
    print("saved", kv.rank, flush=True)
    """
    res = launch(tmp_path, script, 2, 2, launch_args=["--replicas", "1", "--min-workers", "1"], timeout=90)
    assert res.code == 0 and "saved 0" in res.stdout and "saved 1" in res.stdout, res


REJOINING = """
import os, signal, sys, time, torch, pskv
numel, server_kill, worker_kill = map(int, sys.argv[1:])  # worker 2 kills itself before push worker_kill
kv = pskv.kv.create("dist_sync")
kv.init("w", torch.zeros(numel))
out, seen = torch.empty(numel), []
def step():
    kv.push("w", torch.ones(numel))
    kv.pull("w", out)
    seen.append(out[0].item() if torch.all(out == out[0]) else "mixed")
if kv.rejoined:
    assert kv.rank == 2 and os.environ["PSKV_RESTARTS"] == "1", (kv.rank, os.environ.get("PSKV_RESTARTS"))
    members = kv.allgather(kv.rank)
    kv.pull("w", out)
    seen.append(out[0].item())
else:
    for i in range(8):
        if kv.rank == 0 and i == server_kill:
            os.kill(kv._client.servers[1]["pid"], signal.SIGKILL)
        if kv.rank == 2 and i == worker_kill:
            os.kill(os.getpid(), signal.SIGKILL)
        step()
    while len(members := kv.allgather(kv.rank)) < 3:  # until worker 2 is back
        time.sleep(0.2)
for i in range(4):
    step()
print("seen", kv.rank, members, seen, flush=True)
kv.close()
"""


def test_max_restarts_a_killed_worker_rejoins_the_running_job(tmp_path: Path) -> None:
    """``--min-workers 2 --max-restarts 1`` of 3: worker 2 kills itself (-9) before its 4th push; the
    launcher starts it again (``PSKV_RESTARTS=1``, ``kv.rejoined``); it waits in its first allgather
    for the others' next one, is admitted there, pulls the current value (the 2 live workers' sum) and
    from then on every round sums 3 pushes again (no optimizer: the value is the round's sum)."""
    res = launch(tmp_path, REJOINING, 3, 2, args=["4", "-1", "3"], launch_args=["--min-workers", "2", "--max-restarts", "1"], timeout=150)
    assert res.code == 0, res
    for rank in (0, 1):
        assert f"seen {rank} [0, 1, 2] {[3.0] * 3 + [2.0] * 5 + [3.0] * 4}" in res.stdout, res
    assert "seen 2 [0, 1, 2] [2.0, 3.0, 3.0, 3.0, 3.0]" in res.stdout, res  # the value then, then its pushes count
    assert "restarted worker 2 (restart 1 of 1)" in res.stderr, res


def test_a_plain_barrier_of_a_worker_back_is_refused_by_name(tmp_path: Path) -> None:
    """SPEC: a plain ``barrier()`` admits no one. One by a worker back in a lost one's place was taken
    as its request to be admitted, and everyone's allgather then held None for it (``pskv train
    --resume`` with ``--max-restarts`` crashed so): now an error that says so; its allgather admits it."""
    script = """
    import os, signal, time, torch, pskv
    kv = pskv.kv.create("dist_sync")
    kv.init("w", torch.zeros(2))
    if kv.rejoined:
        try:
            kv.barrier()
        except pskv.PSKVError as exc:
            print("refused:", exc, flush=True)
        print("members", kv.allgather({"rank": kv.rank}), flush=True)
    elif kv.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        while len(got := kv.allgather({"rank": kv.rank})) < 3:
            time.sleep(0.2)
        print("members", got, flush=True)
    kv.close()
    """
    res = launch(tmp_path, script, 3, 1, launch_args=["--min-workers", "2", "--max-restarts", "1"], timeout=90)
    assert res.code == 0, res
    assert "worker 2 (host" in res.stdout and "is back in a lost worker's place and joins at the others' next allgather" in res.stdout, res
    assert res.stdout.count("members [{'rank': 0}, {'rank': 1}, {'rank': 2}]") == 3, res


def test_max_restarts_a_worker_back_with_weights_of_its_own_is_refused(tmp_path: Path) -> None:
    """With update_on_kvstore=False the servers hold the summed gradients, not the weights: a worker back
    in a lost one's place pulled those as its weights (and pushed gradients of them into every sum).
    Its Trainer now refuses, by name, and the job goes on with the others (--min-workers)."""
    script = """
    import os, signal, time, torch, pskv
    kv = pskv.kv.create("dist_sync")
    net = torch.nn.Linear(4, 2)
    trainer = pskv.Trainer(net.parameters(), "sgd", {"learning_rate": 0.1}, kvstore=kv, update_on_kvstore=False)
    print("trainer made", flush=True)
    for step in range(100):
        if kv.rank == 2 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        net.zero_grad()
        net(torch.ones(2, 4)).sum().backward()
        trainer.step(2)
        kv.allgather(step)
        time.sleep(0.1)
    kv.close()
    """
    res = launch(tmp_path, script, 3, 1, launch_args=["--min-workers", "2", "--max-restarts", "1"], timeout=90)
    assert res.code == 0 and "restarted worker 2 (restart 1 of 1)" in res.stderr, res
    assert "TrainerError: this worker is back in a lost one's place (pskv launch --max-restarts), but with update_on_kvstore=False" in res.stderr, res
    assert res.stdout.count("trainer made") == 3, res  # worker 2 in its first life; not back
    assert "worker 2 (host" in res.stderr and "failed: it exited with an uncaught pskv.errors.TrainerError" in res.stderr, res  # lost, not finished


@pytest.mark.parametrize("victim", ["2", "0"])
def test_max_restarts_pskv_train_takes_a_restarted_worker_back(tmp_path: Path, victim: str) -> None:
    """``pskv train`` by 3 workers, ``--max-restarts 1``, checkpoints and ``--resume``: worker 2 (or 0,
    the one that reports) killed (-9) after the first epoch is back for a later epoch (it takes the
    job's weights, not the checkpoint's); the report counts 3 workers again and every epoch is in
    it, printed once, and in the last checkpoint (worker 1 writes them while worker 0 is away, and
    after: it has every epoch's row)."""
    import json

    from .jobs import REPO, run

    report = tmp_path / "report.json"
    script = tmp_path / "victim.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        import pskv.kv.base as base
        from pskv.app.train import main
        first_life = os.environ.get("DMLC_WORKER_ID") == os.environ["VICTIM"] and "PSKV_RESTARTS" not in os.environ
        allgather = base.KVStore.allgather
        def die_after_the_first_epoch(self, value):
            got = allgather(self, value)
            if first_life and isinstance(value, dict) and value.get("epoch") == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if len(got) == 2:  # epochs of 0.3 s: give the restarted worker time to come back
                time.sleep(1.5)
            return got
        base.KVStore.allgather = die_after_the_first_epoch
        sys.exit(main(sys.argv[1:]))
    """))
    argv = [sys.executable, "-m", "pskv", "launch", "-n", "3", "-s", "1", "--min-workers", "2", "--max-restarts", "1", "--",
            sys.executable, str(script), "--model", "small_cnn", "--epochs", "12", "--no-progress", "--report", str(report),
            "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "--tensorboard", str(tmp_path / "tb")]  # fmt: skip
    res = run(argv, timeout=240, env={"PYTHONPATH": str(REPO), "VICTIM": victim}, cwd=tmp_path)
    assert res.code == 0, res
    assert f"restarted worker {victim} (restart 1 of 1)" in res.stderr, res
    epochs = json.loads(report.read_text())["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(1, 13)), epochs
    counts = [e["workers"] for e in epochs]
    assert counts[0] == 3 and 2 in counts and counts[-1] == 3 and counts.index(2) < len(counts) - 1, counts
    printed = [str(e) for e in range(1 if victim == "2" else 2, 13)]  # (worker 0 dies before it prints epoch 1)
    assert re.findall(r"\] epoch (\d+), loss", res.stdout) == printed, res
    assert res.stdout.count("pskv train: small_cnn") == 1, res
    saved = json.loads((tmp_path / "ck" / "epoch-12" / "progress.json").read_text())["history"]
    assert [e["epoch"] for e in saved] == list(range(1, 13)), saved
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    curves, batches = [], []  # the epochs' rows on disk: the reporting worker's (a worker 0 back wrote its own too)
    for path in (tmp_path / "tb").glob("events.out.tfevents.*"):
        (events := EventAccumulator(str(path))).Reload()
        curves.append([s.step for s in events.Scalars("epoch/loss")] if "epoch/loss" in events.Tags()["scalars"] else [])
        batches += [s.step for s in events.Scalars("step/loss")] if "step/loss" in events.Tags()["scalars"] else []
    assert sorted(step for c in curves for step in c) == [int(e) for e in printed], curves
    assert len(batches) == len(set(batches)), sorted(batches)  # (epochs of 2 workers after the loss wrote steps 45-52 twice)


def test_max_restarts_with_replicas_after_a_lost_server(tmp_path: Path) -> None:
    """``--replicas 1 --min-workers 2 --max-restarts 1``, 3 workers x 3 servers, a key cut over the
    servers: server 1 is killed, then worker 2; the restarted worker skips the lost server (the node
    table marks it), is counted in by the two live servers (primary and backup alike) and every
    element of every round's value is the round's sum."""
    launch_args = ["--replicas", "1", "--min-workers", "2", "--max-restarts", "1"]
    res = launch(tmp_path, REJOINING, 3, 3, args=["300000", "2", "4"], launch_args=launch_args, timeout=150)
    assert res.code == 0, res
    for rank in (0, 1):
        assert f"seen {rank} [0, 1, 2] {[3.0] * 4 + [2.0] * 4 + [3.0] * 4}" in res.stdout, res
    assert "seen 2 [0, 1, 2] [2.0, 3.0, 3.0, 3.0, 3.0]" in res.stdout, res


def test_max_restarts_a_worker_restarted_too_late_is_stopped_when_the_job_ends(tmp_path: Path) -> None:
    """SPEC: if the others finish first, a restarted worker is let go and the job still succeeds. One
    that had not registered when the scheduler ended the job (slow to start) waited PSKV_START_TIMEOUT
    (120 s) for a scheduler that was gone, and the launcher with it; it is now stopped at the end."""
    script = """
    import os, signal, time, torch, pskv
    if os.environ.get("PSKV_RESTARTS"):
        time.sleep(30)  # slow to start: the job ends first
    kv = pskv.kv.create("dist_sync")
    kv.init("w", torch.zeros(2))
    if kv.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    while len(kv.allgather(kv.rank)) > 1:  # until worker 1 is declared lost
        time.sleep(0.2)
    kv.close()
    print("worker 0 finished", flush=True)
    """
    res = launch(tmp_path, script, 2, 1, launch_args=["--min-workers", "1", "--max-restarts", "1"], timeout=60)
    assert res.code == 0 and "worker 0 finished" in res.stdout, res
    assert "restarted worker 1 (restart 1 of 1)" in res.stderr and "stopped worker 1" in res.stderr, res
