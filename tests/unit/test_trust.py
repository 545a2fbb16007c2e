"""Who may talk to a job: with a job secret, a connection that does not prove it holds it gets no
reply and changes nothing; oversized frames and NaN/Inf pushes are refused; a failed push changes
nothing (docs/DESIGN.md, "Who may talk to a job"). Jobs run as threads of this process."""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq

import pskv
from pskv import config
from pskv.kv import KVStore
from pskv.ps.message import PULL, PUSH, Message, Type, encode, tensor_frame
from pskv.ps.van import AUTH, ROLES, Van, _proof

Job = Callable[..., Any]
SECRET = "trust-tests-secret-0123456789"


def _proof_frame(secret: str, role: str, rank: int, endpoint: str, nonce: bytes = b"") -> bytes:
    nonce = nonce or os.urandom(16)
    r = ROLES.index(role)
    return AUTH.pack(b"PSKVAUTH", r, rank, nonce, _proof(secret.encode(), r, rank, nonce, endpoint))


def _socket(endpoint: str, first: bytes = b"") -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    if first:
        sock.send(first)
    return sock


def _replies(sock: zmq.Socket[bytes], wait: float = 1.0) -> list[list[bytes]]:
    out = []
    while sock.poll(int(wait * 1000)):
        out.append(sock.recv_multipart())
        wait = 0.2
    return out


def _forgeries() -> list[list[Any]]:
    """What an attacker who knows the protocol sends: a HELLO as worker 1, a push of 1000, lr=1000,
    a pull, the optimizer states, a huge INIT, and a REGISTER as worker 1."""
    sgd = {"name": "sgd", "hyper": {"learning_rate": 1000.0}}
    parts = [[0, 0, "float32", 1 << 27, 1, False, "x"]]
    return [
        encode(Message(Type.HELLO, 1, {"rank": 1, "answers": True})),
        encode(Message(Type.PUSH, 2, None, [PUSH.pack([(0, 0, 1, 0, 1, -1, 0, 0, 0, 0)]), tensor_frame(torch.full((8,), 1000.0))])),
        encode(Message(Type.SET_OPTIMIZER, 3, {"optimizer": sgd, "keep_states": False})),
        encode(Message(Type.PULL, 4, None, [PULL.pack([(0, 0, 0, 0, 0, 0, 0)])])),
        encode(Message(Type.GET_STATES, 5)),
        encode(Message(Type.INIT, 6, {"mode": "sync", "parts": parts}, [b"\x00" * 4])),
        encode(Message(Type.REGISTER, 7, {"role": "worker", "id": 1, "endpoint": None, "host": "evil", "pid": 1})),
    ]


def test_strangers_get_no_reply_and_change_nothing(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, capfd: Any) -> None:
    """Against a 2 x 2 dist_sync job with a secret: no proof, a proof made with another secret and
    a replayed proof: 0 replies, and every round follows the formula. A connection with a good proof
    is answered, so the test sees replies where there are any."""
    monkeypatch.setenv("PSKV_SECRET", SECRET)
    job = inproc_job(2, 2)
    # before any worker: an outsider registers as worker 1 (without a secret, the real worker 1 is refused)
    early = [_socket(job.root), _socket(job.root, _proof_frame("another-secret-0123456789", "worker", 1, job.root))]
    for sock in early:
        for frames in _forgeries():
            sock.send_multipart(frames)
    strangers: list[zmq.Socket[bytes]] = []
    accepted: list[zmq.Socket[bytes]] = []

    def attack(kv: KVStore) -> None:
        for endpoint in [job.root, *(s["endpoint"] for s in kv._client.servers)]:  # type: ignore[attr-defined]
            good = _proof_frame(SECRET, "worker", 0, endpoint)
            ok = _socket(endpoint, good)
            ok.send_multipart(encode(Message(Type.GET_STATES, 9)))  # no HELLO on it: an ERROR answer
            accepted.append(ok)
            strangers.append(_socket(endpoint, good))  # the same proof again: a replay
            strangers.append(_socket(endpoint))
            strangers.append(_socket(endpoint, _proof_frame("another-secret-0123456789", "worker", 0, endpoint)))
            strangers.append(_socket(endpoint, _proof_frame(SECRET, "worker", 0, "tcp://elsewhere:1")))  # bound to another listener
            for sock in strangers[-4:]:
                for frames in _forgeries():
                    sock.send_multipart(frames)

    def body(kv: KVStore) -> list[float]:
        kv.init("w", torch.ones(8))
        kv.set_optimizer(pskv.optim.create("sgd", learning_rate=0.1))
        out = torch.empty(8)
        seen = []
        for i in range(3):
            if i == 1 and kv.rank == 0:
                attack(kv)
            kv.push("w", torch.full((8,), kv.rank + 1.0))
            kv.pull("w", out)
            seen.append(out[0].item())
        return seen

    want = [pytest.approx(1 - 0.1 * 3 * (i + 1)) for i in range(3)]
    assert job.run_workers(body) == [want, want]
    assert job.join() == {"scheduler": 0, "server 0": 0, "server 1": 0}
    assert [len(_replies(s, 0.3)) for s in early + strangers] == [0] * len(early + strangers)
    answers = [_replies(s) for s in accepted]
    assert [len(a) for a in answers] == [1, 1, 1], "a proven connection is answered"
    for sock in early + strangers + accepted:
        sock.close()
    err = capfd.readouterr().err
    assert "did not prove it holds the job's secret" in err
    assert err.count("dropping what inproc sends") == 3, err  # once per listener and address
    assert "Traceback" not in err


def test_a_worker_proves_its_rank_and_hello_cannot_change_it(offline_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a secret, a server takes a worker's rank from its connection's proof, not from HELLO."""
    monkeypatch.setenv("PSKV_SECRET", SECRET)
    off = offline_server()
    off.server.van.who = lambda peer: ("worker", 0) if peer == "p0" else ("server", 0)  # type: ignore[method-assign]
    assert [m.type for m in off.send("p0", Message(Type.HELLO, 1, {"rank": 1, "answers": True}))] == [Type.OK]
    assert off.server.routes[0] == "p0" and off.server.ranks["p0"] == 0
    [answer] = off.send("p1", Message(Type.HELLO, 2, {"rank": 1, "answers": True}))
    assert answer.type == Type.ERROR and "only workers talk to servers" in answer.meta["message"]


def test_an_encrypted_job_over_tcp(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """PSKV_ENCRYPT=1: CURVE on every connection (keys from the secret); a plain client is refused at the handshake."""
    monkeypatch.setenv("PSKV_SECRET", SECRET)
    monkeypatch.setenv("PSKV_ENCRYPT", "1")
    job = inproc_job(2, 1, tcp=True)
    plain: list[zmq.Socket[bytes]] = []

    def body(kv: KVStore) -> float:
        kv.init(3, torch.zeros(1000))
        if kv.rank == 0:
            endpoint = kv._client.servers[0]["endpoint"]  # type: ignore[attr-defined]
            plain.append(_socket(endpoint, _proof_frame(SECRET, "worker", 0, endpoint)))
            plain[0].send_multipart(encode(Message(Type.GET_STATES, 1)))
        out = torch.empty(1000)
        kv.pushpull(3, torch.full((1000,), float(kv.rank + 1)), out)
        return out[0].item()

    assert job.run_workers(body) == [3.0, 3.0]
    assert _replies(plain[0]) == [], "a client without CURVE keys gets nothing, even with the proof"
    plain[0].close()
    monkeypatch.delenv("PSKV_SECRET")
    with pytest.raises(pskv.ClusterError, match="PSKV_ENCRYPT=1 needs the job's secret"):
        Van("worker")


def test_the_secret_comes_from_the_environment_or_a_private_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PSKV_SECRET", raising=False)
    assert config.secret() is None
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    monkeypatch.setenv("PSKV_SECRET_FILE", str(path))
    assert config.secret() == SECRET.encode()
    path.chmod(0o644)
    with pytest.raises(pskv.ClusterError, match=r"may be read by others; `chmod 600"):
        Van("server")
    monkeypatch.setenv("PSKV_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="missing: No such file"):
        config.secret()
    monkeypatch.setenv("PSKV_SECRET", "short")
    with pytest.raises(ValueError, match="at least 16 characters"):
        config.secret()


def test_without_a_secret_a_listener_off_loopback_warns_once(capfd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PSKV_SECRET", raising=False)
    for host, warned in (("127.0.0.1", False), ("0.0.0.0", True)):
        van = Van("server")
        van.listen(f"tcp://{host}:0")
        van.close(0)
        err = capfd.readouterr().err
        assert ("without a job secret" in err) == warned, err
        assert err.count("\n") == int(warned)


def test_a_port_in_use_is_one_line_naming_it() -> None:
    """A scheduler on a port in use (DMLC_PS_ROOT_PORT of another job) printed a 30-line traceback."""
    first, second = Van("scheduler"), Van("scheduler")
    endpoint = first.listen("tcp://127.0.0.1:0")
    try:
        with pytest.raises(pskv.ClusterError, match=f"cannot listen on {endpoint}: Address already in use"):
            second.listen(endpoint)
    finally:
        first.close(0)
        second.close(0)


def test_a_node_with_another_secret_is_told_the_scheduler_may_ignore_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Started by hand with another PSKV_SECRET than the scheduler's: the scheduler drops what it sends
    (by design, no reply), and the node's error said only 'the scheduler ... closed its connection: it exited
    or was killed' (or 'is it running?') when the scheduler gave up on it. It now names the settings."""
    import threading

    from pskv.launch.spec import free_port
    from pskv.ps.node import JobEnv, Node
    from pskv.ps.scheduler import Scheduler

    monkeypatch.setenv("PSKV_START_TIMEOUT", "1")
    monkeypatch.setenv("PSKV_SECRET", SECRET)
    port = free_port()
    scheduler = threading.Thread(target=Scheduler(JobEnv("scheduler", "127.0.0.1", port, 1, 1)).run, daemon=True)
    scheduler.start()
    monkeypatch.setenv("PSKV_SECRET", SECRET + "-other")
    node = Node(JobEnv("worker", "127.0.0.1", port, 1, 1))
    try:
        with pytest.raises(pskv.ClusterError, match=r"scheduler at tcp://127\.0\.0\.1:\d+ .*another PSKV_SECRET or PSKV_ENCRYPT"):
            node.join(None)
    finally:
        node.van.close(0)
        scheduler.join(30)


def test_a_frame_over_the_limit(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker refuses to send a frame over PSKV_MAX_MESSAGE_BYTES (a clear error, the store goes on);
    a server disconnects a client that sends one, before it is read."""
    monkeypatch.setenv("PSKV_MAX_MESSAGE_BYTES", "4096")
    job = inproc_job(1, 1, tcp=True)
    with job.worker() as kv:
        with pytest.raises(pskv.KVStoreError, match=r"key 0: a part of 8000 bytes .*PSKV_MAX_MESSAGE_BYTES=4096"):
            kv.init(0, torch.zeros(2000))  # (every worker refuses such a key before sending)
        big = Message(Type.SET_STATES, meta={"parts": []}, frames=[bytes(8000)])
        with pytest.raises(pskv.ProtocolError, match=r"SET_STATES to server 0 has a frame of 8000 bytes; servers take at most 4096 \(PSKV_MAX"):
            kv._client.send(0, big, "states").wait()  # type: ignore[attr-defined]
        kv.init(1, torch.zeros(10))
        out = torch.empty(10)
        kv.pushpull(1, torch.ones(10), out)
        assert torch.equal(out, torch.ones(10))
        endpoint = kv._client.servers[0]["endpoint"]  # type: ignore[attr-defined]
        for size, answered in ((4000, True), (5000, False)):  # garbage: an ERROR answer if it is read at all
            sock = _socket(endpoint)
            sock.send_multipart([b"x" * size])
            assert len(_replies(sock)) == int(answered), size
            sock.close()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_push_fails_and_changes_nothing(offline_server: Any, bad: float) -> None:
    off = offline_server()
    init = torch.tensor([1.0, 2.0, 3.0, 4.0])
    parts = [[5, 0, "float32", 4, 1, False, "w"]]
    off.send("w0", Message(Type.INIT, 1, {"mode": "sync", "parts": parts}, [tensor_frame(init)]))
    off.send("w1", Message(Type.INIT, 1, {"mode": "sync", "parts": parts}))
    grad = torch.tensor([1.0, bad, 0.0, 0.0])
    answer = off.send("w1", Message(Type.PUSH, 2, None, [PUSH.pack([(5, 0, 1, 0, 1, -1, 0, 0, 0, 0)]), tensor_frame(grad)]))[-1]
    assert answer.type == Type.ERROR and answer.meta["kind"] == "NonFiniteError"
    assert "worker 1 pushed NaN or Inf to key w part 0" in answer.meta["message"]
    part = off.server.rounds.part(5, 0)
    assert part.pushed.get(1, 0) == 0 and torch.equal(part.value.flatten(), init)


@pytest.mark.parametrize("ids", [[4], [-1], [0, 9]])
def test_a_row_sparse_push_naming_rows_outside_the_part_fails_and_changes_nothing(offline_server: Any, ids: list[int]) -> None:
    off = offline_server()
    init = torch.arange(8.0)
    parts = [[5, 0, "float32", 8, 2, False, "w"]]  # 4 rows of 2
    off.send("w0", Message(Type.INIT, 1, {"mode": "sync", "parts": parts}, [tensor_frame(init)]))
    off.send("w1", Message(Type.INIT, 1, {"mode": "sync", "parts": parts}))
    frames = [tensor_frame(torch.tensor(ids)), tensor_frame(torch.ones(len(ids), 2))]
    answer = off.send("w1", Message(Type.PUSH, 2, None, [PUSH.pack([(5, 0, 1, 1, 2, -1, 0, 0, 0, 0)]), *frames]))[-1]
    assert answer.type == Type.ERROR and answer.meta["kind"] == "ProtocolError", answer
    assert "key w part 0: pushed row ids outside [0, 4)" in answer.meta["message"]
    part = off.server.rounds.part(5, 0)
    assert part.pushed.get(1, 0) == 0 and torch.equal(part.value.flatten(), init)


@pytest.mark.parametrize(("dtype", "values", "finite"), [
    ("float16", [60000.0, 60000.0], True),  # finite values whose sum overflows float16: accepted
    ("complex64", [1 + 1j, complex(0, float("nan"))], False),
    ("complex64", [1 + 1j, 2 - 1j], True),
])  # fmt: skip
def test_the_nonfinite_check_is_exact(offline_server: Any, dtype: str, values: list[Any], finite: bool) -> None:
    off = offline_server()
    torch_dtype = getattr(torch, dtype)
    parts = [[5, 0, dtype, 2, 1, False, "w"]]
    off.send("w0", Message(Type.INIT, 1, {"mode": "sync", "parts": parts}, [tensor_frame(torch.zeros(2, dtype=torch_dtype))]))
    off.send("w1", Message(Type.INIT, 1, {"mode": "sync", "parts": parts}))
    grad = torch.tensor(values, dtype=torch_dtype)
    answer = off.send("w1", Message(Type.PUSH, 2, None, [PUSH.pack([(5, 0, 1, 0, 1, -1, 0, 0, 0, 0)]), tensor_frame(grad)]))[-1]
    assert (answer.type != Type.ERROR) == finite, answer.meta
    assert off.server.rounds.part(5, 0).pushed.get(1, 0) == int(finite)


def test_nonfinite_pushes_skipped_count_as_zeros(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, capfd: Any) -> None:
    monkeypatch.setenv("PSKV_NONFINITE", "skip")
    job = inproc_job(2, 1)

    def body(kv: KVStore) -> list[float]:
        kv.init("w", torch.zeros(6))
        out = torch.empty(6)
        seen = []
        for i in range(3):
            g = torch.full((6,), float("nan") if kv.rank == 1 and i != 1 else 1.0)
            kv.pushpull("w", g, out)
            seen.append(out[0].item())
        return seen

    assert job.run_workers(body) == [[1.0, 2.0, 1.0]] * 2  # worker 1's NaN rounds: only worker 0's 1
    err = capfd.readouterr().err
    assert "worker 1 pushed NaN or Inf to key 'w' part 0; pushed as zeros (1 so far)" in err
    assert "(2 so far)" in err and "Traceback" not in err


def test_live_sockets_take_thousands_of_fuzzed_messages(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, capfd: Any) -> None:
    """2,000 generated and mutated messages on a proven connection and 2,000 on an unproven one, at a
    running 1 x 1 job with a secret: no traceback, no reply to the unproven one, and afterwards a
    round that follows the formula (on a key the fuzzer never names: the proven connection is, to
    the server, worker 0, free to push to the keys it knows)."""
    from test_fuzz import generated, mutated

    monkeypatch.setenv("PSKV_SECRET", SECRET)
    job = inproc_job(1, 1)
    rng = random.Random(3)
    with job.worker() as kv:
        kv.init(10**6, torch.ones(4))
        endpoint = kv._client.servers[0]["endpoint"]  # type: ignore[attr-defined]
        proven, stranger = _socket(endpoint, _proof_frame(SECRET, "worker", 0, endpoint)), _socket(endpoint)
        for i in range(4000):
            frames = encode(generated(rng))
            frames = (mutated(frames, rng) if i % 3 == 0 else frames) or [b""]
            (proven if i % 2 else stranger).send_multipart(frames)
        deadline = time.monotonic() + 30
        got = 0
        while got < 2000 and time.monotonic() < deadline:  # every message on the proven one is answered
            got += len(_replies(proven, 1.0))
        assert got >= 1000, got  # HELLOs among them may route some answers elsewhere
        assert _replies(stranger) == []
        out = torch.empty(4)
        kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0))
        kv.pushpull(10**6, torch.full((4,), 2.0), out)
        assert torch.equal(out, torch.full((4,), 1.0 - 2.0))
        proven.close()
        stranger.close()
    assert "Traceback" not in capfd.readouterr().err


def test_a_pull_after_a_refused_push_raises_the_push_error_and_the_key_goes_on(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """The push is refused (NaN); the pull that follows it fails on the server too (its round was never
    pushed): the worker hears why, the NaN, whichever answer it reads first (fp16 without PSKV_NONFINITE)."""
    monkeypatch.setenv("PSKV_NONFINITE", "error")
    for _ in range(5):  # the push's answer comes before the pull is sent or after: either way
        with inproc_job(1, 1).worker() as kv:
            kv.init("w", torch.zeros(4))
            kv.push("w", torch.full((4,), float("nan")), wait=False)
            with pytest.raises(pskv.NonFiniteError, match="worker 0 pushed NaN or Inf to key 'w'"):
                kv.pull("w", torch.empty(4))
            out = torch.empty(4)  # the refused push counted no round on either side: the key goes on
            for value in (0.5, 0.25):
                kv.push("w", torch.full((4,), value))
                kv.pull("w", out)
                assert out.tolist() == [value] * 4


def test_a_strangers_closed_connection_does_not_hide_a_later_ones_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stranger's connection closes; a node's connection then gets its descriptor: that one's end is
    still reported at once (it was taken for the stranger's and ignored: a 30 s heartbeat wait)."""
    monkeypatch.setenv("PSKV_SECRET", SECRET)
    van = Van("scheduler")
    endpoint = van.listen("tcp://127.0.0.1:0")

    def drain(seconds: float) -> list[Any]:
        got, until = [], time.monotonic() + seconds
        while time.monotonic() < until:
            got += van.recv(0.1)
        return got

    try:
        for _ in range(2):
            stranger = _socket(endpoint, b"not a proof")
            drain(0.5)
            stranger.close()
            drain(0.5)
            node = _socket(endpoint, _proof_frame(SECRET, "server", 0, endpoint))
            node.send(encode(Message(Type.HEARTBEAT))[0])
            assert [m.type for _, m in drain(0.5)] == [Type.HEARTBEAT]
            node.close()
            gone = drain(1.0)
            assert [type(m).__name__ for _, m in gone] == ["PeerGone"], gone
    finally:
        van.close(0)
    van.wake()  # closed: nothing to wake (a store closed after the scheduler was lost said "closing the store failed")


@pytest.mark.parametrize("shm", ["0", "1"])
def test_pushes_sent_before_a_refusal_came_back_are_rounds_after_it(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, shm: str) -> None:
    """A blocking push returns once sent (TCP) or summed into its slot (shared memory: the next push of the
    key goes by TCP while the slot is read): the next one leaves numbered after the NaN push. The server
    refused it as a skipped round (and so the one after: two good pushes lost; through shared memory the
    error was taken for the next push's own and said to nobody); now it counts it in the refused one's
    place, and the next call says the refusal. SGD lr 1: w = -(0.5 + 0.25)."""
    monkeypatch.setenv("PSKV_NONFINITE", "error")
    monkeypatch.setenv("PSKV_SHM", shm)
    with inproc_job(1, 1, tcp=True).worker() as kv:
        kv.init("w", torch.zeros(4))
        kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0))
        kv.push("w", torch.full((4,), float("nan")))
        kv.push("w", torch.full((4,), 0.5))
        out = torch.empty(4)
        with pytest.raises(pskv.NonFiniteError, match="worker 0 pushed NaN or Inf to key 'w'"):
            kv.pull("w", out)
        kv.push("w", torch.full((4,), 0.25))
        kv.pull("w", out)
        assert out.tolist() == [-0.75] * 4


def test_a_peers_shared_memory_is_mapped_only_as_it_says_and_read_only_inside_its_arena(tmp_path: Any) -> None:
    """What a worker says of its shared memory (the probe, then each push's fd and offset) is checked before a server
    reads a byte: the pid the node table has, the arena's magic and token, and a slot inside the arena and aligned."""
    from pskv.ps.shm import ALIGN, Shared

    mine, theirs = Shared(), Shared()
    probe, pid = mine.probe(), os.getpid()
    refusals = [
        (lambda: theirs.accept({**probe, "pid": pid + 1}, pid), f"a shared-memory probe from pid {pid + 1}, but the peer registered pid {pid}"),
        (lambda: theirs.accept({"pid": pid}, pid), "a malformed shared-memory probe: KeyError"),
        (lambda: theirs.accept({**probe, "token": "zz"}, pid), "a malformed shared-memory probe: ValueError"),
        (lambda: theirs.accept({**probe, "token": "00" * 16}, pid), f"shared memory of pid {pid} fd {probe['fd']} has another token"),
    ]
    with open(tmp_path / "plain", "wb+") as f:
        f.write(b"x" * 4096)
        f.flush()
        refusals.append((lambda: theirs.tensor(pid, f.fileno(), ALIGN, 4, torch.float32), "is not a pskv arena"))
        refusals.append((lambda: theirs.tensor(pid, 10**6, ALIGN, 4, torch.float32), f"cannot open shared memory /proc/{pid}/fd/1000000"))
        for call, said in refusals:
            with pytest.raises(pskv.ProtocolError, match=re.escape(said)):
                call()
    theirs.accept(probe, pid)
    size = mine.arenas[0].size
    for offset, nbytes in ((0, 4), (ALIGN, size), (ALIGN + 2, 4), (ALIGN, 6), (size, 4)):  # the header, past the end, misaligned
        with pytest.raises(pskv.ProtocolError, match=r"shared-memory slot .* is outside pid"):
            theirs.tensor(pid, probe["fd"], offset, nbytes, torch.float32)
    arena, offset = mine.slot(16)
    arena.tensor(offset, 4, torch.float32).copy_(torch.arange(4.0))
    assert theirs.tensor(pid, probe["fd"], offset, 16, torch.float32).tolist() == [0.0, 1.0, 2.0, 3.0]
