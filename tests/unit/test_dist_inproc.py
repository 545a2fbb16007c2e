"""The parameter-server system with several workers, inside one process (threads + inproc://).

The same contract is checked with real processes through ``pskv launch`` in tests/cluster;
these run in seconds and cover the failure paths in detail.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq

import pskv
from pskv.kv import KVStore
from pskv.ps.message import HEADER, MAGIC, PULL, PUSH, Message, Type, decode, encode, tensor_frame
from pskv.ps.node import Node

Job = Callable[..., Any]


def formula_sgd(workers: int, lr: float, r: float, rounds: int) -> float:
    return 1 - lr * r * workers * (workers + 1) / 2 * rounds


@pytest.mark.parametrize(("workers", "servers"), [(1, 1), (2, 2), (3, 2)])
def test_sync_rounds_follow_the_formula(inproc_job: Job, workers: int, servers: int) -> None:
    job = inproc_job(workers, servers)

    def body(kv: KVStore) -> list[float]:
        seen = []
        for shape in [(3,), (1200, 1200), (1211, 1211)]:
            name = f"w{shape[0]}"
            kv.init(name, torch.ones(shape))
            g = torch.full(shape, float(kv.rank + 1))
            out = torch.empty(shape)
            kv.push(name, g)
            kv.pull(name, out)
            assert torch.all(out == workers * (workers + 1) / 2), "no optimizer: the sum replaces the value"
        kv.set_optimizer(pskv.optim.create("sgd", learning_rate=0.1, rescale_grad=0.5))
        for shape in [(3,), (1200, 1200), (1211, 1211)]:
            name = f"o{shape[0]}"
            kv.init(name, torch.ones(shape))
            g = torch.full(shape, float(kv.rank + 1))
            out = torch.empty(shape)
            for i in range(3):
                kv.push(name, g)
                kv.pull(name, out)
                want = formula_sgd(workers, 0.1, 0.5, i + 1)
                assert torch.allclose(out, torch.full(shape, want)), (shape, i, out.flatten()[:3])
                assert torch.equal(g, torch.full(shape, float(kv.rank + 1))), "the pushed tensor changed"
            seen.append(out[0].flatten()[0].item())
        return seen

    results = job.run_workers(body)
    assert all(r == results[0] for r in results)
    assert job.join() == {"scheduler": 0, **{f"server {s}": 0 for s in range(servers)}}


@pytest.mark.parametrize("wait", [True, False])
def test_a_pull_after_a_push_of_the_same_parts_rides_on_its_request(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, wait: bool) -> None:
    """``kv.push`` then ``kv.pull`` (MXNet's idiom) sent a PUSH and a PULL to each server, each answered: the pull now
    rides on the push's rows (answered with the value, as pushpull's), one request and one answer per server. The
    blocking push's bytes are in shared memory, so it may leave with the pull. Values: the sum, then SPEC's SGD."""
    from pskv.ps import client

    monkeypatch.setenv("PSKV_SHM", "1")
    monkeypatch.setattr(client, "FLUSH_IDLE", 5.0)  # (the I/O thread sends queued rows after a pause: not before the pull here)
    monkeypatch.setattr(client, "FLUSH_DELAY", 10.0)
    job = inproc_job(2, 2)

    def body(kv: KVStore) -> list[list[tuple[str, int]]]:
        sent: list[tuple[str, int]] = []  # per message: its kind, and its rows (a PUSH's: those answered with the value)
        van = kv._client.data  # type: ignore[attr-defined]
        real = van.send

        def counting(peer: str, msg: Message, track: bool = False) -> Any:
            if msg.type in (Type.PUSH, Type.PULL):
                rows = list((PUSH if msg.type == Type.PUSH else PULL).unpack(msg.frames[0]))
                sent.append((msg.type.name, sum(r.reply for r in rows) if msg.type == Type.PUSH else len(rows)))
            return real(peer, msg, track)

        def step(keys: list[int], outs: list[torch.Tensor]) -> None:
            grads = [torch.full(out.shape, float(kv.rank + 1)) for out in outs]
            if wait:
                kv.push(keys, grads)
                kv.pull(keys, outs)
            else:
                for h in [kv.push(keys, grads, wait=False), kv.pull(keys, outs, wait=False)]:
                    h.wait()  # type: ignore[union-attr]

        van.send = counting
        seen = []
        for first, rounds in ((0, 1), (10, 3)):  # no optimizer: the sum replaces the value; then SGD on the servers
            keys = [first + k for k in range(3)]
            outs = [torch.empty(600, 600 + k) for k in range(3)]  # 2 parts each: one per server
            kv.init(keys, [torch.ones(out.shape) for out in outs])
            if first:
                kv.set_optimizer(pskv.optim.create("sgd", learning_rate=0.1, rescale_grad=0.5))
            for i in range(rounds):
                step(keys, outs)
                want = 3.0 if not first else formula_sgd(2, 0.1, 0.5, i + 1)
                assert all(torch.allclose(out, torch.full(out.shape, want)) for out in outs), (first, i, [o.flatten()[:2] for o in outs])
            seen.append(sorted(set(sent)))
            sent.clear()
        kv.pull(keys, outs)  # no push before it: PULLs of their own
        assert sorted(sent) == [("PULL", 3), ("PULL", 3)], sent
        return seen

    assert job.run_workers(body) == [[[("PUSH", 3)]] * 2] * 2  # each server's PUSH: its 3 parts answered with their values


def test_a_blocking_push_returns_once_its_rows_are_sent_when_the_io_thread_took_them(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blocking push over TCP sends the caller's tensor without a copy, so it returns once zmq has the bytes. If the
    I/O thread's flush (due for earlier rows) took its rows and had not sent them yet, push saw neither rows queued nor
    bytes sent and returned at once: the caller's next change of its tensor was what the server got (100, not 1)."""
    monkeypatch.setenv("PSKV_SHM", "0")
    job = inproc_job(1, 1, tcp=True)
    with job.worker() as kv:
        kv.init("k", torch.zeros(4))
        client = kv._client  # type: ignore[attr-defined]
        real, real_wait_sent = client._message, client.wait_sent
        taken, go = threading.Event(), threading.Event()

        def slow(server: int, kind: Type, batch: Any) -> Any:  # the I/O thread's flush: its rows taken, not sent yet
            if kind == Type.PUSH:
                taken.set()
                go.wait(10)
            return real(server, kind, batch)

        def racing(handle: Any) -> None:
            threading.Thread(target=client.flush, daemon=True).start()
            taken.wait(10)
            threading.Timer(0.3, go.set).start()
            real_wait_sent(handle)

        client._message, client.wait_sent = slow, racing
        g = torch.ones(4)
        kv.push("k", g)
        g.fill_(100.0)  # push returned: the caller may change its tensor
        go.wait(10)
        client._message, client.wait_sent = real, real_wait_sent
        out = torch.empty(4)
        kv.pull("k", out)
        assert out.tolist() == [1.0] * 4, out


@pytest.mark.parametrize("codec", [None, "fp16"])
def test_a_pull_that_rode_on_a_refused_push_is_answered_on_its_own(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, codec: Any) -> None:
    """A push of NaN refused (PSKV_NONFINITE=error) is said by its own wait, once; a pull after it gets the value as
    before that push (a request that fails answers that request and no other). The pull rode on the refused push's row
    (client._fold), and its wait raised the push's error again, its out not written."""
    monkeypatch.setenv("PSKV_NONFINITE", "error")
    monkeypatch.setenv("PSKV_SHM", "1")
    monkeypatch.setenv("PSKV_BIGARRAY_BOUND", "4")  # 2 parts, one a server: the NaN is in one
    with inproc_job(1, 2).worker() as kv:
        kv.init("k", torch.full((8,), 5.0))
        if codec:
            kv.set_gradient_compression({"type": codec})
        out = torch.zeros(8)
        pushed = kv.push("k", torch.tensor([1.0, float("nan"), 1, 1, 2, 2, 2, 2]), wait=False)
        pulled = kv.pull("k", out, wait=False)
        with pytest.raises(pskv.NonFiniteError, match="NaN"):
            pushed.wait()  # type: ignore[union-attr]
        pulled.wait()  # type: ignore[union-attr]
        assert out.tolist() == [5.0] * 4 + [2.0] * 4, out
        kv.push("k", torch.ones(8))
        kv.pull("k", out)
        assert out.tolist() == [1.0] * 8, out


def test_a_row_sparse_push_of_nan_counts_as_zero_rows_under_skip(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """PSKV_NONFINITE=skip: a push holding NaN or Inf counts as zeros (SPEC). For a row-sparse push, zeros on its rows:
    without an optimizer the round's rows replace the value (the others zero); with sgd the NaN rows move by lr * wd * w."""
    monkeypatch.setenv("PSKV_NONFINITE", "skip")
    job = inproc_job(2, 1)

    def body(kv: KVStore) -> list[list[float]]:
        rows = lambda r, v: torch.sparse_coo_tensor(torch.tensor([[r]]), torch.full((1, 2), v), (4, 2))  # noqa: E731
        kv.init(["plain", "opt"], [torch.full((4, 2), 3.0), torch.full((4, 2), 3.0)])
        kv.push("plain", rows(1, float("nan")) if kv.rank == 0 else rows(2, 5.0))
        out = torch.zeros(4, 2)
        kv.pull("plain", out)
        kv.set_optimizer(pskv.optim.create("sgd", learning_rate=0.5, wd=0.1))
        kv.push("opt", rows(1, float("inf")) if kv.rank == 0 else rows(2, 2.0))
        got = torch.zeros(4, 2)
        kv.pull("opt", got)
        return [out[:, 0].tolist(), [round(v, 5) for v in got[:, 0].tolist()]]

    # opt: row 1 (zeros pushed): 3 - 0.5 * 0.1 * 3 = 2.85; row 2: 3 - 0.5 * (2 + 0.1 * 3) = 1.85; rows 0 and 3 no gradient
    assert job.run_workers(body) == [[[0.0, 0.0, 5.0, 0.0], [3.0, 2.85, 1.85, 3.0]]] * 2


def test_a_blocking_push_waits_for_its_rows_where_a_window_may_hold_them_back(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blocking push through shared memory returns with its rows still queued, so that a pull may ride on them; with
    PSKV_WINDOW_BYTES (a job across hosts) a full window may hold them back, and a whole message sent next (set_optimizer,
    save_optimizer_states) would overtake them: there it waits for them to leave, as every blocking push did."""
    from pskv.ps import client

    monkeypatch.setenv("PSKV_SHM", "1")
    monkeypatch.setattr(client, "FLUSH_IDLE", 5.0)  # (the I/O thread would send them soon: not within this test)
    monkeypatch.setattr(client, "FLUSH_DELAY", 10.0)
    with inproc_job(1, 1).worker() as kv:
        kv.init(["k", "j"], [torch.zeros(4), torch.zeros(4)])
        worker = kv._client  # type: ignore[attr-defined]
        kv.push("k", torch.ones(4))
        assert worker._pending, "no window: the push's rows wait for the next flush"
        worker._window = 1 << 20
        kv.push("j", torch.ones(4))  # (another key: its shared-memory slot is free)
        assert not worker._pending, "a window: the push returned with its rows queued"
        kv.pull(["k", "j"], outs := [torch.empty(4), torch.empty(4)])
        assert all(o.tolist() == [1.0] * 4 for o in outs), outs


@pytest.mark.parametrize("shm", ["1", "0"])
def test_push_messages_per_data_path(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, shm: str) -> None:
    """Over TCP a push goes out every PSKV_BATCH_BYTES; through shared memory in one message per
    server per call (the stages share the memory bus, so there is nothing to overlap). Same sums."""
    monkeypatch.setenv("PSKV_SHM", shm)
    monkeypatch.setenv("PSKV_BATCH_BYTES", "1")  # over TCP: every part its own message
    job = inproc_job(2, 2)
    keys = list(range(6))

    def body(kv: KVStore) -> int:
        assert bool(kv._shm_servers) == (shm == "1")  # type: ignore[attr-defined]
        kv.init(keys, [torch.zeros(1000, 1000 + k) for k in keys])  # 2 parts each: one per server
        sends = []
        van = kv._client.data  # type: ignore[attr-defined]
        real = van.send

        def counting(peer: str, msg: Message, track: bool = False) -> Any:
            if msg.type == Type.PUSH:
                sends.append(len(list(PUSH.unpack(msg.frames[0]))))  # rows in its PUSH table
            return real(peer, msg, track)

        van.send = counting
        kv.push(keys, [torch.full((1000, 1000 + k), float(kv.rank + 1 + k)) for k in keys])
        outs = [torch.empty(1000, 1000 + k) for k in keys]
        kv.pull(keys, outs)
        for k, out in zip(keys, outs):
            assert torch.all(out == 3 + 2 * k), (k, out.flatten()[:3])
        assert sum(sends) == 2 * len(keys)
        return len(sends)

    expected = 2 if shm == "1" else 2 * len(keys)
    assert job.run_workers(body) == [expected] * 2


def test_shared_memory_is_given_back_when_a_store_closes_and_a_server_ends(inproc_job: Job) -> None:
    """The arenas' memory files (memfd) and mappings go when the store is closed (kept by its caller) and
    the server ends: they stayed until the process ended, with the memory written there (a model's size
    from each side)."""

    def arenas() -> tuple[int, int]:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
        with open("/proc/self/maps") as maps:
            return sum(link.startswith("/memfd:pskv") for link in links), sum("/memfd:pskv" in line for line in maps)

    def body(kv: KVStore) -> KVStore:
        kv.init(0, torch.zeros(1 << 20))
        kv.pushpull(0, torch.ones(1 << 20))
        assert kv._shm_servers  # type: ignore[attr-defined]
        return kv  # closed by run_workers, and kept

    gc.collect()
    before = arenas()
    job = inproc_job(2, 1)
    stores = job.run_workers(body)
    job.join()
    gc.collect()
    assert arenas() == before, stores


def test_a_second_push_waits_for_the_next_round(inproc_job: Job) -> None:
    """Round = one push from each *distinct* worker: worker 0 pushing twice does not complete it."""
    job = inproc_job(2, 1)

    def body(kv: KVStore) -> float:
        kv.init(0, torch.zeros(2))
        out = torch.empty(2)
        if kv.rank == 0:
            kv.push(0, torch.full((2,), 1.0))
            kv.push(0, torch.full((2,), 10.0))
            kv.pull(0, out)  # sees round 1: both of its pushes merged with worker 1's
        else:
            time.sleep(0.3)
            kv.push(0, torch.full((2,), 2.0))
            kv.pull(0, out)  # round 0: 1 + 2
            r0 = out[0].item()
            kv.push(0, torch.full((2,), 20.0))
            kv.pull(0, out)  # round 1: 10 + 20
            assert r0 == 3.0
        return out[0].item()

    assert job.run_workers(body) == [30.0, 30.0]


def test_device_lists_and_string_keys(inproc_job: Job) -> None:
    job = inproc_job(2, 2)

    def body(kv: KVStore) -> list[float]:
        kv.init(["a", "b"], [torch.zeros(4), torch.zeros(1500, 1000)])
        kv.push(["a", "b"], [[torch.ones(4)] * 3, [torch.ones(1500, 1000), torch.ones(1500, 1000)]])
        outs = [torch.empty(4), [torch.empty(1500, 1000), torch.empty(1500, 1000)]]
        kv.pull(["a", "b"], outs)
        return [outs[0][0].item(), outs[1][0][0, 0].item(), outs[1][1][-1, -1].item()]

    assert job.run_workers(body, "dist_device_sync") == [[6.0, 4.0, 4.0]] * 2


def test_async_applies_every_push(inproc_job: Job) -> None:
    job = inproc_job(3, 2)
    pushes, lr = 4, 0.01

    def body(kv: KVStore) -> float:
        kv.init("w", torch.zeros(1200, 1000))
        with pytest.raises(pskv.OptimizerRequiredError, match="set_optimizer"):
            kv.push("w", torch.ones(1200, 1000))
        kv.set_optimizer(pskv.optim.create("sgd", learning_rate=lr))
        for _ in range(pushes):
            kv.push("w", torch.full((1200, 1000), float(kv.rank + 1)))
        kv.barrier()
        out = torch.empty(1200, 1000)
        kv.pull("w", out)
        return float(out.mean())

    want = -lr * pushes * (1 + 2 + 3)
    assert job.run_workers(body, "dist_async") == pytest.approx([want] * 3)


def test_async_pushpull_goes_on_after_another_worker_finished(inproc_job: Job) -> None:
    """dist_async applies each push as it comes, but a pushpull's push (answered with the value) was refused once
    another worker had finished with fewer pushes: "worker 1 finished without pushing key 0 for round 2; it can
    never complete" (a pull was not: it checks that only in dist_sync). SGD lr 1: 0 - 1 - 1 - 1 = -3."""
    job = inproc_job(2, 1)
    closed = threading.Event()

    def body(kv: KVStore) -> list[float]:
        kv.init(0, torch.zeros(3))
        kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0))
        if kv.rank == 1:
            kv.close()  # finishes without a push
            closed.set()
            return []
        assert closed.wait(30)
        time.sleep(0.5)  # (its FINALIZE reaches the server)
        out = torch.empty(3)
        seen = []
        for _ in range(3):
            kv.pushpull(0, torch.ones(3), out)
            seen.append(out.tolist())
        return seen

    assert job.run_workers(body, "dist_async")[0] == [[-1.0] * 3, [-2.0] * 3, [-3.0] * 3]


def test_async_server_refuses_pushes_without_optimizer_and_stays_up(inproc_job: Job) -> None:
    """A worker that skips the client-side check still gets a clear error from the server."""
    job = inproc_job(1, 1)
    with job.worker("dist_async") as kv:
        kv.init(0, torch.zeros(3))
        kv._optimizer = pskv.optim.create("sgd")  # pretend, so the push reaches the server
        kv.push(0, torch.ones(3))
        with pytest.raises(pskv.OptimizerRequiredError, match="needs an optimizer"):
            kv.pull(0, torch.empty(3))
        kv._optimizer = None
        kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0))
        kv.push(0, torch.ones(3))
        out = torch.empty(3)
        kv.pull(0, out)
        assert torch.equal(out, -torch.ones(3))


def test_optimizer_states_through_the_servers(inproc_job: Job, tmp_path: Any) -> None:
    job = inproc_job(2, 2)
    path = str(tmp_path / "states")

    def body(kv: KVStore) -> list[float]:
        kv.init("w", torch.zeros(1200, 1000))
        kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0, momentum=0.5))
        out = torch.empty(1200, 1000)
        kv.pushpull("w", torch.ones(1200, 1000), out=out)  # sum 2: buf 2, w -2
        kv.barrier()
        if kv.rank == 0:
            kv.save_optimizer_states(path)
        kv.barrier()
        kv.pushpull("w", torch.ones(1200, 1000), out=out)  # buf 3, w -5
        kv.barrier()
        if kv.rank == 0:
            kv.load_optimizer_states(path)  # buf back to 2
        kv.barrier()
        kv.pushpull("w", torch.ones(1200, 1000), out=out)  # buf 3 again: w -8
        return [out[0, 0].item(), out[-1, -1].item()]

    assert job.run_workers(body) == [[-8.0, -8.0]] * 2
    saved = torch.load(path, weights_only=True)
    assert saved["keys"][0]["tensors"]["momentum_buffer"].shape == (1200, 1000)
    assert torch.all(saved["keys"][0]["tensors"]["momentum_buffer"] == 2.0)


def test_allgather_returns_every_workers_value_by_rank(inproc_job: Job) -> None:
    job = inproc_job(3, 1)

    def body(kv: KVStore) -> list[Any]:
        first = kv.allgather({"rank": kv.rank, "loss": 0.5 * kv.rank})
        kv.barrier()  # an ordinary barrier in between carries nothing
        second = kv.allgather(kv.rank * 10)
        with pytest.raises(pskv.InvalidValueError, match="JSON values"):
            kv.allgather(torch.ones(1))
        return [first, second]

    want = [[{"rank": r, "loss": 0.5 * r} for r in range(3)], [0, 10, 20]]
    assert job.run_workers(body) == [want] * 3
    assert pskv.kv.create().allgather([1, 2]) == [[1, 2]]


def test_an_allgather_whose_answer_would_be_too_big_is_refused_at_once(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler answers an allgather with every worker's value in one message of at most 1 MB: 3 workers each
    gathering 400 KB (predictions of an evaluation) waited PSKV_TIMEOUT plus a margin (330 s) for an answer the scheduler
    could not send (it logged "could not send OK"), then a DeadlineExceeded naming nothing. Now each value must fit its
    share, said at once; the store goes on."""
    monkeypatch.setenv("PSKV_TIMEOUT", "10")
    job = inproc_job(3, 1)

    def body(kv: KVStore) -> list[Any]:
        with pytest.raises(pskv.InvalidValueError, match=r"a value of 400002 bytes of JSON; with 3 workers each may have at most 349183"):
            kv.allgather("x" * 400_000)
        return kv.allgather("x" * 340_000)

    assert job.run_workers(body) == [["x" * 340_000] * 3] * 3


def test_row_sparse_over_split_keys(inproc_job: Job) -> None:
    job = inproc_job(2, 2)

    def body(kv: KVStore) -> list[list[float]]:
        weight = torch.arange(2000.0).repeat_interleave(600).view(2000, 600)
        kv.init("emb", weight.to_sparse(1))
        kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0))
        grad = torch.sparse_coo_tensor(torch.tensor([[5, 1999]]), torch.ones(2, 600), (2000, 600), check_invariants=True)
        kv.push("emb", grad)
        out = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.zeros(1, 600), (2000, 600), check_invariants=True)
        kv.row_sparse_pull("emb", out, row_ids=torch.tensor([1999, 5, 7, 5]))
        out = out.coalesce()
        return [out.indices()[0].tolist(), out.values()[:, 0].tolist()]

    assert job.run_workers(body) == [[[5, 7, 1999], [3.0, 7.0, 1997.0]]] * 2


def test_a_sparse_pull_holds_the_rows_pushed_that_sum_to_zero(inproc_job: Job) -> None:
    """No optimizer: the pushes' sum replaces the value; a pull into a sparse out holds the rows any worker
    pushed (row 5 sums to 0 over the workers, row 7 was pushed as 0), on a key split over both servers."""
    job = inproc_job(2, 2)

    def body(kv: KVStore) -> list[list[float]]:
        kv.init("emb", torch.ones(2000, 600))
        rows = [[5, 7, 1999], [5, 1500]][kv.rank]
        vals = torch.tensor([[1.0, 0, 2], [-1.0, 3]][kv.rank]).unsqueeze(1).expand(-1, 600)
        kv.push("emb", torch.sparse_coo_tensor(torch.tensor([rows]), vals, (2000, 600), check_invariants=True))
        out = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.zeros(1, 600), (2000, 600), check_invariants=True)
        kv.pull("emb", out, ignore_sparse=False)
        out = out.coalesce()
        kv.init("none", torch.ones(5, 0))  # rows without elements: none to hold
        empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 0), (5, 0))
        kv.pull("none", empty, ignore_sparse=False)
        return [out.indices()[0].tolist(), out.values()[:, 0].tolist(), empty._nnz()]

    assert job.run_workers(body) == [[[5, 7, 1500, 1999], [0.0, 0.0, 3.0, 2.0], 0]] * 2


def test_a_row_sparse_push_to_a_key_without_elements(inproc_job: Job) -> None:
    """A key of shape (5, 0): a row-sparse push failed in the worker with a bare RuntimeError ("shape '[2, 1]'
    is invalid for input of size 0", from a reshape), where local takes it; it is taken, with an optimizer too."""
    job = inproc_job(2, 2)

    def body(kv: KVStore) -> list[Any]:
        kv.init("none", torch.ones(5, 0))
        seen = []
        for opt in (None, pskv.optim.create("sgd", learning_rate=0.5, momentum=0.9)):
            if opt is not None:
                kv.set_optimizer(opt)
            kv.push("none", torch.sparse_coo_tensor(torch.tensor([[1, 3 + kv.rank]]), torch.zeros(2, 0), (5, 0)))
            dense, empty = torch.ones(5, 0), torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 0), (5, 0))
            kv.pull("none", [dense, empty], ignore_sparse=False)
            seen.append([tuple(dense.shape), tuple(empty.to_dense().shape)])
        return seen

    assert job.run_workers(body) == [[[(5, 0), (5, 0)]] * 2] * 2


def test_an_init_the_servers_cannot_take_is_refused_by_every_worker_naming_the_key(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows are never cut, so a part may pass PSKV_MAX_MESSAGE_BYTES: worker 0's INIT was refused ("INIT to server 0
    has a frame of 16000 bytes", no key named) and the others waited PSKV_TIMEOUT for its value. A dtype the wire
    has no name for was a ProtocolError naming no key."""
    monkeypatch.setenv("PSKV_MAX_MESSAGE_BYTES", "4096")
    monkeypatch.setenv("PSKV_CHUNK_BYTES", "1024")
    monkeypatch.setenv("PSKV_TIMEOUT", "5")
    job = inproc_job(2, 2)

    def body(kv: KVStore) -> list[float]:
        start = time.monotonic()
        with pytest.raises(pskv.KVStoreError, match=r"key 'rows': a part of 16000 bytes .*PSKV_MAX_MESSAGE_BYTES=4096"):
            kv.init(["ok", "rows"], [torch.ones(3), torch.zeros(2, 4000)])
        with pytest.raises(pskv.InvalidValueError, match=r"key 'u16': dtype torch.uint16 cannot travel"):
            kv.init("u16", torch.ones(3, dtype=torch.uint16))
        assert time.monotonic() - start < 2
        kv.init(["ok", "split"], [torch.ones(3), torch.zeros(4000)])  # (whole rows of 1 element: parts of 1 KB)
        kv.push(["ok", "split"], [torch.ones(3), torch.ones(4000)])
        out = torch.zeros(4000)
        kv.pull("split", out)
        return out.unique().tolist()

    assert job.run_workers(body) == [[2.0], [2.0]]


# -- failures: never a silent hang ----------------------------------------------------------------


def test_worker_leaving_early_fails_the_round_naming_it(inproc_job: Job) -> None:
    job = inproc_job(2, 1)

    def body(kv: KVStore) -> str:
        kv.init("w", torch.zeros(2))
        if kv.rank == 1:
            return "left"  # closes its store without pushing
        time.sleep(0.2)
        kv.push("w", torch.ones(2))
        start = time.monotonic()
        with pytest.raises(pskv.NodeFailedError, match=r"worker 1 finished \(closed its store\) without pushing key 'w'"):
            kv.pull("w", torch.empty(2))
        assert time.monotonic() - start < 5
        return "failed fast"

    assert job.run_workers(body) == ["failed fast", "left"]


def test_a_barrier_that_a_finished_worker_can_never_reach_fails_at_once_naming_it(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker 1 closes its store while worker 0 waits in a barrier: worker 0 hears at once that worker 1 finished
    without it (never silent), not after PSKV_TIMEOUT."""
    monkeypatch.setenv("PSKV_TIMEOUT", "60")

    def body(kv: KVStore) -> str:
        if kv.rank == 1:
            time.sleep(0.5)
            return "closed"  # (run_workers closes its store)
        start = time.monotonic()
        with pytest.raises(pskv.NodeFailedError, match=r"worker 1 .*finished \(closed its store\) without reaching the barrier of the workers"):
            kv.barrier()
        return f"failed in {time.monotonic() - start < 10}"

    assert inproc_job(2, 1).run_workers(body) == ["failed in True", "closed"]


def test_a_worker_that_fails_with_calls_in_flight_is_said_at_once(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing a store waited up to PSKV_TIMEOUT for the answers of its calls in flight, also when its worker failed
    (an uncaught exception, a KeyboardInterrupt), whose place in the job ends anyway: here worker 0 fails with a pushpull
    in flight that needs worker 1's push while worker 1 waits for it in a barrier, so the job heard of it 20 s later."""
    monkeypatch.setenv("PSKV_TIMEOUT", "20")
    job = inproc_job(2, 1)
    seen: list[tuple[float, str]] = []  # worker 1's wait in its barrier, and its end
    ready = threading.Event()

    def body(kv: KVStore) -> None:
        kv.init("w", torch.zeros(2))
        if kv.rank == 0:
            assert ready.wait(10)
            kv.pushpull("w", torch.ones(2), wait=False)
            raise KeyboardInterrupt  # (the store's with block sees it on its way out)
        ready.set()
        start = time.monotonic()
        try:
            kv.barrier()
        except pskv.PSKVError as exc:
            seen.append((time.monotonic() - start, str(exc)))

    with pytest.raises(KeyboardInterrupt):
        job.run_workers(body)
    assert len(seen) == 1 and seen[0][0] < 5, seen
    assert re.search(r"worker 0 .* failed: it exited with an uncaught KeyboardInterrupt", seen[0][1]), seen


def test_an_interrupt_as_an_answer_is_read_fails_that_call_once_and_the_store_goes_on(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt (SIGINT to the worker: Ctrl-C) that came while the waiting thread read an answer became its
    call's error: every later wait of it raised KeyboardInterrupt again, and so did the next call (a push's failure);
    the other answers taken with it were lost (their calls waited for PSKV_TIMEOUT), and a wait interrupted as it copied
    a pull's answer to its other outs left them as they were, for good (the next wait returned at once)."""
    monkeypatch.setenv("PSKV_SHM", "0")  # (answers come as frames)
    from pskv.ps import tracker

    job = inproc_job(1, 1)
    with job.worker() as kv:
        kv.init([0, 1], [torch.zeros(4), torch.zeros(4)])
        real, outs = tracker.frame_tensor, [torch.zeros(4), torch.zeros(4)]

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            monkeypatch.setattr(tracker, "frame_tensor", real)
            signal.raise_signal(signal.SIGINT)  # (raised in this thread, the main one, at its next call)
            return real(*args, **kwargs)

        monkeypatch.setattr(tracker, "frame_tensor", interrupted)
        h = kv.pushpull([0, 1], [torch.ones(4), torch.ones(4)], outs, wait=False)
        with pytest.raises(KeyboardInterrupt):
            h.wait()  # type: ignore[union-attr]
        try:
            with pytest.raises(pskv.ClusterError, match="push and pull of 2 parts: its answer was cut short by KeyboardInterrupt"):
                h.wait()  # type: ignore[union-attr]
            kv.pull([0, 1], outs)
            assert all(torch.equal(o, torch.ones(4)) for o in outs), outs
            h1 = kv.pull(0, outs[0], wait=False)
            time.sleep(0.05)  # (sent: h2 is another message, whose answer comes with h1's)
            h2 = kv.pull(1, outs[1], wait=False)
            time.sleep(0.2)
            monkeypatch.setattr(tracker, "frame_tensor", interrupted)
            with pytest.raises(KeyboardInterrupt):
                h2.wait()  # type: ignore[union-attr]
            assert h2.done(), "the answer read after the interrupted one was lost"  # type: ignore[union-attr]
            with pytest.raises(pskv.ClusterError, match="cut short by KeyboardInterrupt"):
                h1.wait()  # type: ignore[union-attr]
            kv.push(0, torch.full((4,), 5.0))
            h = kv.pull(0, [outs[0], outs[1]], wait=False)  # the second out is copied by the wait, once the answer is in
            copy, cut = h._finish[0], []  # type: ignore[union-attr]

            def cut_short() -> None:
                if not cut:
                    cut.append(True)
                    signal.raise_signal(signal.SIGINT)
                copy()

            h._finish = [cut_short]  # type: ignore[union-attr]
            with pytest.raises(KeyboardInterrupt):
                h.wait()  # type: ignore[union-attr]
            h.wait()  # type: ignore[union-attr]
            assert torch.equal(outs[1], torch.full((4,), 5.0)), "a wait after the interrupted one did not copy the answer"
        except KeyboardInterrupt:
            pytest.fail("KeyboardInterrupt again, with no signal")


def test_an_init_cut_short_by_an_interrupt_can_be_made_again(inproc_job: Job) -> None:
    """A KeyboardInterrupt (or a deadline) in init, which waits for worker 0's value, left the key unusable: the store
    had not taken it (KeyNotInitializedError) and the servers refused its init again (DuplicateInitError)."""
    job = inproc_job(2, 1)
    values: list[float] = []

    def worker0() -> None:
        with job.worker(rank=0) as kv:
            time.sleep(1.0)  # worker 1's init waits for this value
            kv.init("w", torch.full((3,), 7.0))
            kv.push("w", torch.ones(3))
            kv.pushpull("w", torch.ones(3), out := torch.empty(3))
            values.append(out[0].item())

    t = threading.Thread(target=worker0)
    t.start()
    with job.worker(rank=1) as kv:
        timer = threading.Timer(0.3, signal.raise_signal, (signal.SIGINT,))  # (its handler runs in this thread, the main one)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            kv.init("w", torch.zeros(3))
        kv.init("w", torch.zeros(3))
        kv.pull("w", out := torch.empty(3))
        assert torch.equal(out, torch.full((3,), 7.0)), out
        kv.push("w", torch.ones(3))
        kv.pushpull("w", torch.ones(3), out)
        values.append(out[0].item())
    t.join(20)
    assert values == [2.0, 2.0]


@pytest.mark.parametrize("released", [False, True])
def test_a_barrier_cut_short_by_an_interrupt_is_the_next_ones(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, released: bool) -> None:
    """Worker 1's allgather is cut short (KeyboardInterrupt) while worker 0 has not come yet, or once the scheduler
    released it (its answer not read): its next allgather is that barrier still, with its newest value if the
    scheduler held it, else the answer of the one it took part in; the workers stay in step, and no request is left
    open. The scheduler kept the older request unanswered (close waited PSKV_TIMEOUT for it), and one released took
    the next call for a new barrier, which worker 0's next allgather released: the workers were a barrier apart."""
    monkeypatch.setenv("PSKV_TIMEOUT", "10")  # (worker 1's last allgather waited for a barrier worker 0 never made)
    from pskv.ps.scheduler import Scheduler

    job = inproc_job(2, 1)
    go, passed, seen = threading.Event(), threading.Event(), {}
    real_barrier = Scheduler._barrier

    def barrier(self: Scheduler, node: Any, msg: Message) -> None:
        real_barrier(self, node, msg)
        if "replaces" in (msg.meta or {}):  # worker 1's next allgather is at the scheduler: worker 0 comes now
            go.set()

    monkeypatch.setattr(Scheduler, "_barrier", barrier)

    def worker0() -> None:
        with job.worker(rank=0) as kv:
            go.wait(20)
            seen[0] = [kv.allgather("zero")]
            passed.set()
            seen[0].append(kv.allgather("zero again"))

    t = threading.Thread(target=worker0)
    t.start()
    with job.worker(rank=1) as kv:
        client = kv._client  # type: ignore[attr-defined]
        if released:  # the interrupt comes once the scheduler answered (worker 0's allgather returned)
            go.set()
            real = client.tracker.pump

            def pump(timeout: float) -> None:
                passed.wait(20)
                client.tracker.pump = real
                raise KeyboardInterrupt

            client.tracker.pump = pump
        else:
            threading.Timer(0.3, signal.raise_signal, (signal.SIGINT,)).start()  # (its handler runs in this thread, the main one)
        with pytest.raises(KeyboardInterrupt):
            kv.allgather("first")
        seen[1] = [kv.allgather("second")]
        assert len(client.tracker) == 0, "a barrier request is left open"
        seen[1].append(kv.allgather("one again"))
    t.join(20)
    assert seen[0] == seen[1] == [["zero", "first" if released else "second"], ["zero again", "one again"]], seen


def test_pull_deadline_names_the_missing_workers(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSKV_TIMEOUT", "1.5")
    job = inproc_job(3, 1)

    def body(kv: KVStore) -> str:
        kv.init("w", torch.zeros(2))
        if kv.rank == 0:
            kv.push("w", torch.ones(2))
            with pytest.raises(pskv.DeadlineExceeded, match=r"workers \[1, 2\] have not pushed key 'w'.*pushed: \[0\]"):
                kv.pull("w", torch.empty(2))
            return "deadline"
        time.sleep(3.5)  # alive, heartbeating, but not pushing
        return "slow"

    assert job.run_workers(body) == ["deadline", "slow", "slow"]


def test_barrier_deadline_names_the_missing(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSKV_TIMEOUT", "1")
    job = inproc_job(2, 1)

    def body(kv: KVStore) -> str:
        if kv.rank == 0:
            with pytest.raises(pskv.DeadlineExceeded, match=r"barrier waited \d+ s \(PSKV_TIMEOUT=1\) for worker ranks \[1\] \(arrived: \[0\]\)"):
                kv.barrier()
        else:
            time.sleep(2.5)
        return "ok"

    job.run_workers(body)


def test_start_timeout_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSKV_START_TIMEOUT", "1")
    from tests.conftest import InprocJob

    job = InprocJob(workers=2, servers=1)  # no worker ever comes
    codes = job.join()
    assert codes["scheduler"] == 1 and codes["server 0"] == 1


def test_dead_scheduler_is_noticed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSKV_HEARTBEAT_TIMEOUT", "1")
    from pskv.ps.client import SCHEDULER, WorkerClient
    from pskv.ps.node import JobEnv

    root = "inproc://no-scheduler-here"
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)  # accepts the registration, then never answers
    fake.bind(root)
    try:
        client = WorkerClient(JobEnv("worker", root, 0, 1, 1))
        client.servers = [{"rank": 0, "endpoint": "inproc://nowhere"}]
        client.workers = [{"rank": 0}]
        client.rank = 0
        client.van.connect("scheduler", root)
        import threading

        client._thread = threading.Thread(target=client._loop, daemon=True)
        client._thread.start()
        req = client.send(SCHEDULER, Message(Type.BARRIER, meta={"group": "worker"}), "barrier")
        with pytest.raises(pskv.NodeFailedError, match=r"scheduler .* has not answered"):
            client.wait([req])
        client._stop = True
        client._thread.join(5)
    finally:
        fake.close(linger=0)


def test_a_scheduler_that_hears_no_node_says_it_may_be_the_one_cut_off(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The scheduler's host partitioned, every node alive: it named the first node past the timeout as failed
    (server 0, alive), as if one node were silent; now it says no node is heard, unless another one is."""
    monkeypatch.setenv("PSKV_HEARTBEAT_TIMEOUT", "6")
    from pskv.ps.node import JobEnv
    from pskv.ps.scheduler import Scheduler, _Node

    for others_heard, hint in ((5.5, True), (0.5, False)):  # seconds since the other nodes were last heard
        sched = Scheduler(JobEnv("scheduler", "inproc://hb-alone", 0, 1, 1))
        sched.started, sched.van.polled = True, 100.0
        sched.nodes = {"s": _Node("s", "server", {"hostname": "h1", "pid": 1}, 0, last_seen=93.5),
                       "w": _Node("w", "worker", {"hostname": "h2", "pid": 2}, 0, last_seen=100.0 - others_heard)}
        sched._check_heartbeats()
        err = capsys.readouterr().err
        assert sched.status == 1 and "server 0 (host h1, pid 1) failed: no heartbeat for 6.5 s" in err
        assert ("no node has been heard for 5.5 s: is this scheduler's host cut off?" in err) == hint, err
        sched.van.close(linger=0)


# -- hostile input --------------------------------------------------------------------------------


def _raw_client(endpoint: str) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    return sock


def test_malformed_and_hostile_messages_get_errors_and_the_server_keeps_serving(inproc_job: Job) -> None:
    import pickle

    from pskv.ps.message import PULL

    job = inproc_job(1, 1)
    with job.worker() as kv:
        kv.init(0, torch.ones(4))
        endpoint = kv._client.servers[0]["endpoint"]  # type: ignore[attr-defined]
        bad = _raw_client(endpoint)  # says HELLO as worker 0, then misbehaves
        stranger = _raw_client(endpoint)  # never says HELLO
        bad.send_multipart(encode(Message(Type.HELLO, meta={"rank": 0, "answers": True})))
        assert decode(bad.recv_multipart()).type == Type.OK

        class Evil:
            def __reduce__(self) -> tuple[Any, ...]:
                return (print, ("pwned",))

        def init(**part: Any) -> list[Any]:
            spec = {"key": 1, "part": 0, "dtype": "float32", "numel": 1, "row_numel": 1, "row_sparse": False, "name": "1", **part}
            return encode(Message(Type.INIT, meta={"mode": "sync", "parts": [list(spec.values())]}))

        cases = [
            [b"garbage"],
            [b"\x00" * HEADER.size],
            [HEADER.pack(MAGIC, 2, 99, 1, 0)],
            [pickle.dumps(Evil())],
            encode(Message(Type.PUSH, frames=[PUSH.pack([(0, 0, 1, 0, 1, -1, 0, 0, 0, 0)]), b"\x00" * 3])),  # wrong size
            encode(Message(Type.PUSH, frames=[PUSH.pack([(42, 0, 1, 0, 1, -1, 0, 0, 0, 0)]), b"\x00" * 16])),  # unknown key
            encode(Message(Type.PUSH, frames=[PUSH.pack([(0, 0, 5, 0, 1, -1, 0, 0, 0, 0)]), b"\x00" * 16])),  # a round skipped
            encode(Message(Type.PUSH, frames=[b"\x00" * 7])),  # not a table
            init(dtype="object"),
            init(numel=-5),
            encode(Message(Type.SET_OPTIMIZER, meta={"optimizer": {"name": "sgd", "hyper": {"learning_rate": "import os"}}})),
            encode(Message(Type.SET_OPTIMIZER, meta={"optimizer": {"name": "__import__"}})),
            encode(Message(Type.PULL, frames=[PULL.pack([(0, 0, 0, 0, 1, 0, 0)]), tensor_frame(torch.tensor([99]))])),  # row out of range
            encode(Message(Type.PULL, frames=[PULL.pack([(0, 0, 3, 0, 0, 0, 0)])])),  # a round never pushed
            encode(Message(Type.SHUTDOWN)),
        ]
        for frames in cases:
            bad.send_multipart(frames)
            reply = decode(bad.recv_multipart())
            assert reply.type == Type.ERROR, frames
            assert (reply.meta or {}).get("kind") in ("ProtocolError", "KeyNotInitializedError", "OptimizerError"), reply.meta
        stranger.send_multipart(encode(Message(Type.PULL, frames=[PULL.pack([(0, 0, 0, 0, 0, 0, 0)])])))
        assert "has not said HELLO" in (decode(stranger.recv_multipart()).meta or {})["message"]
        bad.close()
        stranger.close()
        kv.push(0, torch.full((4,), 3.0))  # still serving, values intact
        out = torch.empty(4)
        kv.pull(0, out)
        assert torch.equal(out, torch.full((4,), 3.0))
    assert job.join()["server 0"] == 0


def test_surplus_and_duplicate_registrations_are_refused(inproc_job: Job) -> None:
    job = inproc_job(1, 1)
    with job.worker() as kv:
        from pskv.ps.client import WorkerClient

        extra = WorkerClient(job.env("worker"))
        with pytest.raises(pskv.ClusterError, match="already has its 1 workers"):
            extra.join(None)
        extra.van.close(0)
        kv.init(0, torch.ones(1))


def test_a_node_started_with_other_counts_is_refused_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Roles started by hand, one with DMLC_NUM_WORKER=1 in a job of 2 workers: a server that
    believed so summed each round over 1 worker, and the workers pulled 1 instead of 3 (section 3).
    The scheduler refuses such a node at once, naming the variables (it waited for the start timeout)."""
    from pskv.ps.node import JobEnv
    from pskv.ps.scheduler import Scheduler

    monkeypatch.setenv("PSKV_START_TIMEOUT", "3")
    root = f"inproc://pskv-test-counts-{uuid.uuid4().hex[:8]}"
    scheduler = threading.Thread(target=Scheduler(JobEnv("scheduler", root, 0, num_workers=2, num_servers=1)).run, daemon=True)
    scheduler.start()
    odd = Node(JobEnv("server", root, 0, num_workers=1, num_servers=1))
    try:
        with pytest.raises(pskv.ClusterError, match=r"\[DMLC_NUM_SERVER, DMLC_NUM_WORKER\] = \[1, 1\], the scheduler \[1, 2\]"):
            odd.join("inproc://nowhere")
    finally:
        odd.van.close(0)
        scheduler.join(30)


def test_workers_started_with_other_placement_settings_are_refused_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Roles started by hand with different PSKV_REPLICAS: a scheduler with 1 and workers with 0 went on
    after a lost server whose parts no backup had (its keys came back wrong, and every process exited 0);
    different PSKV_BIGARRAY_BOUND or PSKV_CHUNK_BYTES put the workers' parts on different servers (an
    init that waited PSKV_TIMEOUT for worker 0's value, or a shape mismatch blaming the program). The
    scheduler refuses such a worker at once, naming the setting and whom it differs from, and its
    start-timeout error, which every waiting process gets, says so too. So is PSKV_MIN_WORKERS, which only the
    scheduler reads: set on the workers alone, a lost worker still ended the job."""
    from pskv.ps.node import JobEnv
    from pskv.ps.scheduler import Scheduler

    monkeypatch.setenv("PSKV_START_TIMEOUT", "3")
    monkeypatch.delenv("PSKV_MIN_WORKERS", raising=False)
    monkeypatch.setenv("PSKV_REPLICAS", "1")
    root = f"inproc://pskv-test-placement-{uuid.uuid4().hex[:8]}"
    scheduler = Scheduler(JobEnv("scheduler", root, 0, num_workers=2, num_servers=2))
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    monkeypatch.setenv("PSKV_REPLICAS", "0")
    first = Node(JobEnv("worker", root, 0, num_workers=2, num_servers=2))
    with pytest.raises(pskv.ClusterError, match="this worker has PSKV_REPLICAS=0, the scheduler 1"):
        first.join(None)
    first.van.close(0)
    monkeypatch.setenv("PSKV_REPLICAS", "1")
    monkeypatch.setenv("PSKV_MIN_WORKERS", "1")
    second = Node(JobEnv("worker", root, 0, num_workers=2, num_servers=2))
    with pytest.raises(pskv.ClusterError, match="this worker has PSKV_MIN_WORKERS=1, the scheduler 0"):
        second.join(None)
    second.van.close(0)
    monkeypatch.delenv("PSKV_MIN_WORKERS")
    nodes = [Node(JobEnv("worker", root, 0, num_workers=2, num_servers=2)) for _ in range(2)]
    told: list[str] = []

    def wait() -> None:
        try:
            nodes[0].join(None)
        except pskv.ClusterError as exc:
            told.append(str(exc))

    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    time.sleep(0.5)
    monkeypatch.setenv("PSKV_BIGARRAY_BOUND", "1000000")
    try:
        with pytest.raises(pskv.ClusterError, match=rf"PSKV_BIGARRAY_BOUND=1000000, the worker on \S+ \(pid {os.getpid()}\) 65536"):
            nodes[1].join(None)
    finally:
        waiting.join(30)
        for node in nodes:
            node.van.close(0)
        thread.join(30)
    assert scheduler.status == 1 and len(scheduler.refused) == 3 and "PSKV_MIN_WORKERS=1" in scheduler.refused[1]
    assert "PSKV_BIGARRAY_BOUND=1000000" in scheduler.refused[2], scheduler.refused
    assert len(told) == 1 and "start waited" in told[0] and "refused: a worker on" in told[0] and "PSKV_BIGARRAY_BOUND=1000000" in told[0], told


def test_a_node_beats_as_often_as_the_schedulers_heartbeat_timeout_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Roles started by hand, the scheduler with PSKV_HEARTBEAT_TIMEOUT=0.6 and a worker without (a beat a
    second): the scheduler declared the healthy worker dead ('no heartbeat for 0.6 s') and ended the job.
    The node table says how often the scheduler needs to hear, and a node that beats slower speeds up."""
    from pskv.ps.node import JobEnv
    from pskv.ps.scheduler import Scheduler

    root = f"inproc://pskv-test-beat-{uuid.uuid4().hex[:8]}"
    node = Node(JobEnv("worker", root, 0, num_workers=1, num_servers=0))  # its own setting: 1 s
    monkeypatch.setenv("PSKV_HEARTBEAT_TIMEOUT", "0.6")
    scheduler = Scheduler(JobEnv("scheduler", root, 0, num_workers=1, num_servers=0))
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    try:
        node.join(None)
        until = time.monotonic() + 2.0
        while time.monotonic() < until and scheduler.status is None:
            node.van.recv(0.05)
            node.tick(time.monotonic())
        assert scheduler.status is None and node.hb_interval == pytest.approx(0.2), node.hb_interval
    finally:
        node.van.close(0)
        thread.join(30)


def test_workers_check_inits_against_the_servers_frame_limit_not_their_own(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server started with a smaller PSKV_MAX_MESSAGE_BYTES than the workers' (roles started by hand):
    worker 0's INIT passed its own check, the server disconnected it for the frame, and the init waited
    PSKV_TIMEOUT for 'worker 0 sends it and has not'. The node table carries each server's limit."""
    from pskv import config

    own = config.max_frame_bytes  # the worker's: 64 MB
    monkeypatch.setattr(config, "max_frame_bytes", lambda: 4096 if threading.current_thread().name.startswith("server") else own())
    monkeypatch.setenv("PSKV_TIMEOUT", "5")
    job = inproc_job(1, 1, tcp=True)

    def body(kv: KVStore) -> list[float]:
        with pytest.raises(pskv.KVStoreError, match=r"key 'big': a part of 16000 bytes .*PSKV_MAX_MESSAGE_BYTES=4096"):
            kv.init("big", torch.zeros(4000))
        kv.init("ok", torch.ones(3))
        return kv.pushpull("ok", torch.ones(3), out=torch.empty(3)) or []

    assert job.run_workers(body, timeout=60) == [[]]


def test_the_start_timeout_names_a_few_of_many_absent_nodes(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A job of 5000 workers that none joined: the scheduler's error named all 5001 absent nodes in one line,
    sent to every node (with DMLC_NUM_WORKER=1e10 it filled the scheduler's memory and never said anything)."""
    from pskv.ps.node import JobEnv
    from pskv.ps.scheduler import Scheduler

    monkeypatch.setenv("PSKV_START_TIMEOUT", "0.5")
    assert Scheduler(JobEnv("scheduler", f"inproc://pskv-test-many-{uuid.uuid4().hex[:8]}", 0, num_workers=5000, num_servers=1)).run() == 1
    said = capsys.readouterr().err
    assert "not registered: server 0, worker 0, worker 1," in said and "worker 14 and 4985 more" in said and len(said) < 1000, said


def test_a_server_whose_node_host_is_not_on_this_host_is_advertised_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """DMLC_NODE_HOST is the address others reach a node at (behind NAT, in a container: not an address of
    this host, which then binds every interface). The server registered tcp://0.0.0.0:PORT, which a worker
    on another host takes for itself; it registers DMLC_NODE_HOST's address, as ps-lite does."""
    from pskv.launch.spec import free_port
    from pskv.ps.node import JobEnv
    from pskv.ps.scheduler import Scheduler
    from pskv.ps.server import Server

    monkeypatch.setenv("PSKV_START_TIMEOUT", "2")
    port = free_port()
    scheduler = Scheduler(JobEnv("scheduler", "127.0.0.1", port, num_workers=1, num_servers=1))
    threads = [threading.Thread(target=scheduler.run, daemon=True),
               threading.Thread(target=Server(JobEnv("server", "127.0.0.1", port, 1, 1, node_host="192.0.2.7")).run, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [n.meta["endpoint"].rsplit(":", 1)[0] for n in scheduler.nodes.values()] == ["tcp://192.0.2.7"]


def test_a_verbose_worker_says_where_it_registers_and_what_it_joined(inproc_job: Job, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """PS_VERBOSE=1 (PSKV_VERBOSE=1) logged the scheduler's and the servers' start, and nothing of a worker:
    one started by hand at a wrong scheduler address waited PSKV_START_TIMEOUT without a word."""
    monkeypatch.setenv("PS_VERBOSE", "1")
    job = inproc_job(1, 1)
    with job.worker():
        pass
    said = capsys.readouterr().err
    assert f"pskv worker: registering with the scheduler at {job.root} (pid {os.getpid()})" in said, said
    assert "pskv worker 0: joined: 1 workers, 1 servers; shared memory with servers [" in said, said


def test_a_node_pointed_at_a_server_instead_of_the_scheduler_is_told_so(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """DMLC_PS_ROOT_PORT set by hand to a server's port: the server answered 'the scheduler refused this
    worker: a REGISTER on a connection that has not said HELLO', naming neither itself nor the variables."""
    from pskv.ps.node import JobEnv

    monkeypatch.setenv("PSKV_START_TIMEOUT", "5")
    with inproc_job(1, 1).worker() as kv:
        lost = Node(JobEnv("worker", kv._client.servers[0]["endpoint"], 0, num_workers=1, num_servers=1))  # type: ignore[attr-defined]
        try:
            with pytest.raises(pskv.ProtocolError, match=r"this is server 0, not the scheduler \(check DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT\)"):
                lost.join(None)
        finally:
            lost.van.close(0)


def test_a_second_worker_with_the_same_id_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers started with DMLC_WORKER_ID=0: the second to register is refused at once, naming the
    variable and the process that holds that rank (it said "two workers asked for id 0"); the first
    waits for the start timeout, as the job never gets its worker 1."""
    import os

    from pskv.ps.node import JobEnv
    from pskv.ps.scheduler import Scheduler

    monkeypatch.setenv("PSKV_START_TIMEOUT", "3")
    root = f"inproc://pskv-test-twins-{uuid.uuid4().hex[:8]}"
    scheduler = threading.Thread(target=Scheduler(JobEnv("scheduler", root, 0, num_workers=2, num_servers=1)).run, daemon=True)
    scheduler.start()
    twins = [Node(JobEnv("worker", root, 0, num_workers=2, num_servers=1, worker_id=0)) for _ in range(2)]
    errors: list[str] = []

    def join(node: Node) -> None:
        try:
            node.join(None)
        except pskv.ClusterError as exc:  # the first to register waits for a job that never starts
            errors.append(str(exc))
        finally:
            node.van.close(0)

    threads = [threading.Thread(target=join, args=(n,), daemon=True) for n in twins]
    for t in threads:
        t.start()
    for t in [*threads, scheduler]:
        t.join(30)
    refused = [e for e in errors if re.search(rf"this worker: DMLC_WORKER_ID=0 again: the worker on \S+ \(pid {os.getpid()}\) has it", e)]
    assert len(errors) == 2 and len(refused) == 1, errors
    assert all("DMLC_WORKER_ID=0 again" in e for e in errors), errors  # the first's start-timeout error says why too


def test_a_job_whose_scheduler_is_at_an_ipv6_address_runs(inproc_job: Job) -> None:
    """DMLC_PS_ROOT_URI=::1 (a bracketed tcp://[::1]:PORT endpoint): the scheduler could not listen
    there ("No such device": zmq sockets take IPv6 only when told) and every other role waited for
    the start timeout. Values follow section 3's formula."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")

    def body(kv: KVStore) -> list[float]:
        kv.init(0, torch.ones(2))
        out = torch.empty(2)
        kv.pushpull(0, torch.full((2,), kv.rank + 1.0), out=out)
        return out.tolist()

    assert inproc_job(2, 1, tcp=True, host="::1").run_workers(body, timeout=60) == [[3.0, 3.0]] * 2


def test_thousands_of_small_calls_in_flight_travel_in_few_messages(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """2,000 keys of 4 floats, one pushpull per key with wait=False: rows queued together share
    messages, and every value follows the formula. With the I/O thread's delay made long, all of
    a round's rows leave when the first handle is waited for: one PUSH per server."""
    monkeypatch.setattr("pskv.ps.client.FLUSH_DELAY", 600.0)
    monkeypatch.setattr("pskv.ps.client.FLUSH_IDLE", 600.0)
    job = inproc_job(2, 2)
    keys = list(range(2000))

    def body(kv: KVStore) -> int:
        kv.init(keys, [torch.zeros(4)] * len(keys))
        sent = []
        van = kv._client.data  # type: ignore[attr-defined]
        real = van.send
        van.send = lambda peer, msg, track=False: (sent.append(msg.type), real(peer, msg, track))[1]
        outs = [torch.empty(4) for _ in keys]
        for rnd in range(2):
            handles = [kv.pushpull(k, torch.full((4,), float(kv.rank + 1 + k)), out=o, wait=False) for k, o in zip(keys, outs)]
            for h in handles:
                h.wait()  # type: ignore[union-attr]
            assert all(torch.all(o == 3 + 2 * k) for k, o in zip(keys, outs)), rnd
        return sum(t == Type.PUSH for t in sent)

    assert job.run_workers(body) == [2 * 2, 2 * 2]  # 2 rounds x 2 servers, for 4,000 pushes


def test_calls_not_waited_for_are_sent_by_the_io_thread(inproc_job: Job) -> None:
    job = inproc_job(1, 1)
    with job.worker() as kv:
        kv.init("w", torch.zeros(3))
        h = kv.push("w", torch.ones(3), wait=False)
        until = time.monotonic() + 10
        while not h.done() and time.monotonic() < until:  # type: ignore[union-attr]
            time.sleep(0.01)
        assert h.done(), "nobody waited, and the push never left"  # type: ignore[union-attr]
        h = kv.pull("w", out := torch.zeros(3), wait=False)
        while not h.done() and time.monotonic() < until:  # type: ignore[union-attr]
            time.sleep(0.01)
        assert h.done() and torch.equal(out, torch.ones(3))  # type: ignore[union-attr]


def test_a_push_waits_for_an_earlier_pull_of_the_same_key(inproc_job: Job) -> None:
    """An answer may be the server's value itself: pushing the key again before reading it could
    change it under the reader, so the store waits for the pull first."""
    job = inproc_job(2, 1)

    def body(kv: KVStore) -> list[float]:
        kv.init("w", torch.zeros(1000))
        seen = []
        for i in range(20):
            out = torch.empty(1000)
            kv.push("w", torch.full((1000,), float(i + kv.rank)), wait=False)
            h = kv.pull("w", out, wait=False)
            kv.push("w", torch.full((1000,), 1000.0), wait=False)  # the next round, before h is waited for
            kv.pull("w", torch.empty(1000))
            h.wait()  # type: ignore[union-attr]
            assert torch.all(out == out[0]), "a torn read"
            seen.append(out[0].item())
        return seen

    want = [2.0 * i + 1 for i in range(20)]
    assert job.run_workers(body) == [want, want]


@pytest.mark.parametrize("wait", [False, True])
def test_a_call_is_done_only_once_every_row_of_it_was_sent_and_answered(inproc_job: Job, wait: bool) -> None:
    """A call's rows are counted as they are queued: they were counted as they were sent, so a call whose first rows
    were answered before its last ones left was done. pushpull of keys 0 and 1 after a pull of key 1 not waited for
    (the push of key 1 waits for it, sending key 0's row meanwhile) returned with key 1's value of the round before
    (every time, with a single thread and one worker)."""
    job = inproc_job(1, 1)
    with job.worker() as kv:
        kv.init([0, 1], [torch.zeros(10), torch.zeros(10)])
        o0, o1 = torch.empty(10), torch.empty(10)
        for i in range(1, 21):
            kv.pull(1, o1, wait=False)
            h = kv.pushpull([0, 1], [torch.full((10,), float(i))] * 2, [o0, o1], wait=wait)
            if h is not None:
                h.wait()
            assert (o0[0].item(), o1[0].item()) == (i, i), f"round {i}: the second key's out holds {o1[0].item()}"


def test_threads_of_each_worker_that_call_at_once_do_not_wait_for_each_other(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blocking call waited for the other workers holding its store's lock, so threads of two workers deadlocked at
    once (until PSKV_TIMEOUT, blaming the other worker): worker 0's pushpull of key 0 waited for worker 1's push of
    it, which waited for worker 1's pushpull of key 1, which waited for worker 0's push of it, and so with a barrier."""
    monkeypatch.setenv("PSKV_TIMEOUT", "10")
    job = inproc_job(2, 1)

    def body(kv: KVStore) -> list[float]:
        kv.init([0, 1], [torch.zeros(10), torch.zeros(10)])
        seen: list[float] = []
        errors: list[BaseException] = []

        def calls(key: int) -> None:
            try:
                out = torch.empty(10)
                for i in range(10):
                    if key < 0:
                        seen.extend(kv.allgather(i))
                        continue
                    kv.pushpull(key, torch.full((10,), float(kv.rank + 1)), out)
                    kv.pull(key, out)
                    seen.append(out[0].item())
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=calls, args=(key,)) for key in (0, 1, -1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        return sorted(seen)

    want = sorted([3.0] * 20 + [float(i) for i in range(10)] * 2)
    assert job.run_workers(body) == [want, want]


@pytest.mark.parametrize("spans_hosts", [False, True])
def test_parts_and_batches_are_small_when_the_job_spans_hosts(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, spans_hosts: bool) -> None:
    """Across hosts parts default to 1 MB, TCP batches to 256 KB (answers flow down a link while
    pushes flow up) and the window to 4 MB; on one host to 4 MB, 8 MB and none; PSKV_CHUNK_BYTES /
    PSKV_BATCH_BYTES win over both. The kernel sizes the send buffers, unless a smaller window caps them."""
    table = {"servers": [{"host": "10.0.0.1"}], "workers": [{"host": "10.0.0.2" if spans_hosts else "10.0.0.1"}]}
    assert Node.across_hosts.fget(type("Table", (), table)) is spans_hosts  # type: ignore[attr-defined]
    monkeypatch.setattr(Node, "across_hosts", property(lambda self: spans_hosts))
    with inproc_job(1, 1).worker() as kv:
        kv.init("w", torch.zeros(1000, 1000))  # 4 MB: one part on one host
        sizes = [p.numel * 4 for p in kv._parts[0]]  # type: ignore[attr-defined]
        assert max(sizes) <= (1 << 20 if spans_hosts else 4 << 20) and (len(sizes) > 1) == spans_hosts
        assert kv._client._batch_bytes == (256 << 10 if spans_hosts else 8 << 20)  # type: ignore[attr-defined]
        assert kv._client._window == (4 << 20 if spans_hosts else 0)  # type: ignore[attr-defined]
        assert kv._client.data._dealers["server 0/tx"].getsockopt(zmq.SNDBUF) == -1  # type: ignore[attr-defined]
    monkeypatch.setenv("PSKV_CHUNK_BYTES", "1048576")
    monkeypatch.setenv("PSKV_BATCH_BYTES", "65536")
    monkeypatch.setenv("PSKV_WINDOW_BYTES", "262144")
    with inproc_job(1, 1).worker() as kv:
        kv.init("w", torch.zeros(1000, 1000))
        assert len(kv._parts[0]) == 4 and kv._client._batch_bytes == 65536  # type: ignore[attr-defined]
        assert kv._client.data._dealers["server 0/tx"].getsockopt(zmq.SNDBUF) == 131072  # type: ignore[attr-defined]  # (the kernel doubles it)


def test_pushes_wait_for_the_window_and_leave_by_priority(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over TCP at most PSKV_WINDOW_BYTES of pushes wait in a server's connection; the rows held back
    leave the highest priority first, except that a key's later push never passes its earlier one
    (the server would refuse its round). Values as without a window."""
    monkeypatch.setenv("PSKV_SHM", "0")
    monkeypatch.setenv("PSKV_WINDOW_BYTES", "1")
    monkeypatch.setenv("PSKV_BATCH_BYTES", "1")
    gate = threading.Event()  # zmq is "done" with no pushed bytes until it is set
    with inproc_job(1, 1).worker() as kv:
        keys = ["a", "b", "c", "d"]
        kv.init(keys, [torch.zeros(100)] * 4)
        van, order = kv._client.data, []  # type: ignore[attr-defined]
        real = van.send

        def send(peer: str, msg: Message, track: bool = False) -> Any:
            if msg.type == Type.PUSH:
                order.extend((keys[row.key], row.round) for row in PUSH.unpack(msg.frames[0]))
            waiter = real(peer, msg, track)
            return None if waiter is None else lambda timeout: gate.is_set() and waiter(timeout)

        van.send = send
        handles = [kv.push("a", torch.full((100,), 1.0), priority=0, wait=False)]  # leaves at once: the window is empty
        time.sleep(0.05)  # (the I/O thread sends it)
        handles += [kv.push(k, torch.full((100,), v), priority=p, wait=False) for k, v, p in
                    [("b", 2.0, 0), ("b", 3.0, 10), ("c", 4.0, 5), ("d", 5.0, -1)]]  # fmt: skip
        time.sleep(0.05)
        assert order == [("a", 1)], "the window is full: the other pushes wait"
        gate.set()
        for h in handles:
            h.wait()  # type: ignore[union-attr]
        assert order == [("a", 1), ("c", 1), ("b", 1), ("b", 2), ("d", 1)]
        outs = [torch.empty(100) for _ in keys]
        kv.pull(keys, outs)
        assert [o[0].item() for o in outs] == [1.0, 3.0, 4.0, 5.0]  # (no optimizer: the last round's sum)


@pytest.mark.parametrize("window", ["0", "1"])
def test_a_blocking_push_waits_for_every_batch_it_sent(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, window: str) -> None:
    """Over TCP a push leaves in PSKV_BATCH_BYTES messages as it is queued; it returns only once
    zmq has the bytes of all of them (with a window of 1 byte, most wait to be sent first), so
    the caller may change its tensor at once."""
    monkeypatch.setenv("PSKV_SHM", "0")
    monkeypatch.setenv("PSKV_BATCH_BYTES", "65536")
    monkeypatch.setenv("PSKV_WINDOW_BYTES", window)
    job = inproc_job(1, 2)
    with job.worker() as kv:
        kv.init("w", torch.zeros(1100, 1000))
        g = torch.full((1100, 1000), 2.0)
        kv.push("w", g)
        g.fill_(100.0)
        out = torch.empty(1100, 1000)
        kv.pull("w", out)
        assert torch.equal(out, torch.full((1100, 1000), 2.0))


def test_a_compressed_nan_reaches_the_servers_rules_and_leaves_the_residual(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """2bit and fp16 send a NaN on as NaN (PSKV_NONFINITE=skip: that push counts as zeros); the worker's
    residual does not keep it, so the next rounds follow the formula."""
    monkeypatch.setenv("PSKV_NONFINITE", "skip")
    for params in ({"type": "2bit", "threshold": 0.5}, {"type": "fp16"}):

        def body(kv: KVStore, params: dict[str, Any] = params) -> list[list[float]]:
            kv.set_gradient_compression(params)
            kv.init("w", torch.zeros(2))
            out, seen = torch.empty(2), []
            for i in range(3):
                kv.pushpull("w", torch.tensor([float("nan") if kv.rank == 1 and i == 0 else 0.5, 0.5]), out)
                seen.append(out.tolist())
            return seen

        assert inproc_job(2, 1).run_workers(body) == [[[0.5, 0.5], [1.0, 1.0], [1.0, 1.0]]] * 2  # the NaN push: zeros


def test_workers_that_init_names_in_different_orders_are_told(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Names take ids in init order: worker 1's 'b' had worker 0's 'a' id, and the two values mixed
    without a word; now the server compares the names (whichever worker's init comes second fails)."""
    monkeypatch.setenv("PSKV_TIMEOUT", "20")

    def body(kv: KVStore) -> str:
        try:
            for name in ("a", "b") if kv.rank == 0 else ("b", "a"):
                kv.init(name, torch.full((3,), float(kv.rank)))
        except pskv.KVStoreError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    said = [s for s in inproc_job(2, 1).run_workers(body) if s != "ok"]
    assert said and all(s.startswith("ShapeMismatchError: ") and " named " in s for s in said), said
    assert any(("key 'a' part 0:" in s and "named 'b'" in s) or ("key 'b' part 0:" in s and "named 'a'" in s) for s in said), said


@pytest.mark.parametrize("window", ["1", "262144"])
def test_a_pull_waits_behind_its_parts_push_that_the_window_holds(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, window: str) -> None:
    """Across hosts at most PSKV_WINDOW_BYTES of pushes wait in a connection: a big push fills it, the
    small key's push waits behind it, and its pull must too (it left first: "pulls round 2 but pushed
    only 1", or an old value)."""
    monkeypatch.setenv("PSKV_SHM", "0")
    monkeypatch.setenv("PSKV_WINDOW_BYTES", window)
    with inproc_job(1, 1, tcp=True).worker() as kv:
        kv.init(["big", "b"], [torch.zeros(1_000_000), torch.zeros(4)])
        out, seen = torch.empty(4), []
        for i in range(30):
            handles = [kv.push("big", torch.ones(1_000_000), wait=False), kv.push("b", torch.full((4,), float(i)), wait=False)]
            kv.pull("b", out)
            seen.append(out[0].item())
            for h in handles:
                h.wait()
        assert seen == [float(i) for i in range(30)]


def test_close_leaves_a_pulls_handle_whole_and_says_a_refused_push(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, capfd: Any) -> None:
    """A pull in flight at close(): its wait() after it fills every out (it raised the scheduler's normal
    end of the connection as a failure, and the second out stayed empty); a push refused in flight is said
    by close(), the next call (nothing said it)."""
    monkeypatch.setenv("PSKV_NONFINITE", "error")
    job = inproc_job(1, 1, tcp=True)
    kv = job.worker()
    kv.init(["a", "b"], [torch.full((4,), 5.0), torch.zeros(4)])
    outs = [torch.zeros(4), torch.zeros(4)]
    handle = kv.pull("a", outs, wait=False)
    kv.push("b", torch.full((4,), float("nan")), wait=False)
    kv.close()
    handle.wait()
    assert [o.tolist() for o in outs] == [[5.0] * 4] * 2
    assert "pskv: while closing the store: push of 1 parts: worker 0 pushed NaN or Inf to key 'b'" in capfd.readouterr().err


def test_a_second_push_without_waiting_does_not_wait_for_the_first_through_shared_memory(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through shared memory the second push of a key waited for the first's round to merge (its slot was
    still read), so push(wait=False) blocked and this program, fine over TCP, hung at the barrier. The
    second now goes by TCP while the slot is in use."""
    monkeypatch.setenv("PSKV_SHM", "1")
    monkeypatch.setenv("PSKV_TIMEOUT", "20")

    def body(kv: KVStore) -> list[float]:
        kv.init("k", torch.zeros(4))
        if kv.rank == 0:
            handles = [kv.push("k", torch.full((4,), v), wait=False) for v in (1.0, 2.0, 3.0)]
            kv.barrier()
            for h in handles:
                h.wait()
        else:
            kv.barrier()
            for v in (10.0, 20.0, 30.0):
                kv.push("k", torch.full((4,), v))
        out, seen = torch.empty(4), []
        kv.pull("k", out)
        seen.append(out[0].item())
        kv.push("k", torch.full((4,), 0.5))  # the slot again, once free
        kv.pull("k", out)
        return [*seen, out[0].item()]

    assert inproc_job(2, 1, tcp=True).run_workers(body, timeout=60) == [[33.0, 1.0]] * 2


def test_a_scheduler_without_servers_is_said_by_the_worker() -> None:
    """The scheduler has DMLC_NUM_SERVER=0, the worker's environment another number (JobEnv's check of
    DMLC_NUM_SERVER=0 does not see it): the scheduler refuses it, naming both (was a ValueError at init)."""
    from pskv.kv.dist import DistStore
    from pskv.ps.node import JobEnv
    from pskv.ps.scheduler import Scheduler

    uri = "inproc://pskv-no-servers"
    scheduler = Scheduler(JobEnv("scheduler", uri, 0, num_workers=1, num_servers=0))
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    try:
        with pytest.raises(pskv.ClusterError, match=r"DMLC_NUM_WORKER\] = \[1, 1\], the scheduler \[0, 1\]"):
            DistStore("dist_sync", JobEnv("worker", uri, 0, num_workers=1, num_servers=1, worker_id=0))
    finally:
        scheduler.status = 0  # (its loop ends)
        thread.join(timeout=10)


def test_a_worker_gone_before_the_job_started_fails_the_start_at_once(monkeypatch: pytest.MonkeyPatch, capfd: Any) -> None:
    """Worker 0 of 2 registers, then is killed while the job waits for worker 1: the scheduler took a closed
    connection for a lost node only once the job had started (nodes sent no heartbeats before), so the job
    would have started with a dead worker, noticed PSKV_HEARTBEAT_TIMEOUT later; or waited out the start."""
    import os
    import signal
    import subprocess
    import sys

    from pskv.launch.spec import free_port
    from pskv.ps.node import JobEnv
    from pskv.ps.scheduler import Scheduler

    monkeypatch.setenv("PSKV_START_TIMEOUT", "60")
    monkeypatch.setenv("PSKV_HEARTBEAT_INTERVAL", "0.2")
    port = free_port()
    scheduler = Scheduler(JobEnv("scheduler", "127.0.0.1", port, num_workers=2, num_servers=1))
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    env = {**os.environ, "DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
           "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1"}  # fmt: skip
    worker = subprocess.Popen([sys.executable, "-c", "import pskv; pskv.kv.create('dist_sync')"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(n.role == "worker" for n in list(scheduler.nodes.values())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.poll() is None, worker.communicate()
        os.kill(worker.pid, signal.SIGKILL)
        thread.join(15)
        assert not thread.is_alive() and scheduler.status == 1, "the scheduler waits for a job with a dead worker"
    finally:
        worker.kill()
        worker.communicate(timeout=30)  # (closes the pipe)
    err = capfd.readouterr().err
    assert "a worker (host " in err and "no rank yet) failed: its connection to the scheduler closed" in err and "before the job started" in err, err


@pytest.mark.parametrize("codec", [None, "fp16"])
def test_a_workers_own_nonfinite_setting_goes_with_its_pushes(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, codec: Any) -> None:
    """Servers started with PSKV_NONFINITE=error, workers with skip (pskv train --amp fp16 sets allow after
    pskv launch started the servers): worker 1's Inf push counts as zeros (it failed the push), with the
    compression codec beside the setting in the PUSH metadata too."""
    import math

    from pskv.ps.server import Server

    made = Server.__init__

    def servers_on_error(self: Server, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        self.nonfinite = "error"  # (whatever the environment says when its thread makes it)

    monkeypatch.setattr(Server, "__init__", servers_on_error)
    monkeypatch.setenv("PSKV_NONFINITE", "skip")  # the workers'
    job = inproc_job(2, 1)

    def body(kv: KVStore) -> list[float]:
        if codec:
            kv.set_gradient_compression({"type": codec})
        kv.init("w", torch.zeros(2))
        out, seen = torch.empty(2), []
        for i in range(2):
            kv.pushpull("w", torch.full((2,), math.inf if kv.rank == 1 and i == 0 else 1.0), out)
            seen.append(out[0].item())
        return seen

    assert job.run_workers(body) == [[1.0, 2.0]] * 2


def test_a_barrier_returns_when_answered_not_when_the_waiters_poll_times_out(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's answer reaches the I/O thread while the waiting thread polls the servers'
    connections (50 ms at a time: every barrier and allgather took 50 ms): the I/O thread now wakes
    it. With polls made 30 s long, the allgather must still return long before one ends."""
    from pskv.ps.client import WorkerClient

    pump = WorkerClient._pump
    monkeypatch.setattr(WorkerClient, "_pump", lambda self, timeout: pump(self, 30.0 if timeout == 0.05 else timeout))
    job = inproc_job(2, 1)

    def body(kv: KVStore) -> tuple[list[Any], float]:
        kv.barrier()
        t0 = time.monotonic()
        got = kv.allgather(kv.rank)
        return got, time.monotonic() - t0

    for got, took in job.run_workers(body):
        assert got == [0, 1] and took < 15.0, took


def test_tens_of_thousands_of_keys_init_in_one_call(inproc_job: Job) -> None:
    """An init lists every part in the metadata of one INIT per server, which is at most 1 MB: 7,000 keys with
    names of 170 characters (28,000 int keys with one server) failed with "metadata of INIT ... is 1405915 bytes;
    at most 1048576", naming no key and no setting. Now several INITs go; the values follow the formula. A name
    too long for any message is refused before anything is sent."""
    job = inproc_job(2, 1)
    keys = [f"{'encoder.layer.' * 11}{k:06d}.weight" for k in range(7_000)]

    def body(kv: KVStore) -> list[float]:
        kv.init(keys, [torch.full((2,), float(k)) for k in range(len(keys))])
        with pytest.raises(pskv.errors.KeyTypeError, match="a name of 1000002 characters is too long"):
            kv.init(["short", "x" * 1_000_000], [torch.zeros(1), torch.zeros(1)])
        kv.init("short", torch.zeros(1))  # (the refused call initialised nothing)
        outs = [torch.empty(2) for _ in keys]
        kv.pushpull(keys, [torch.full((2,), kv.rank + 1.0)] * len(keys), out=outs)
        return sorted({float(o[0]) for o in outs})

    assert job.run_workers(body, timeout=120) == [[3.0], [3.0]]


def test_optimizer_states_of_tens_of_thousands_of_keys_are_saved_and_loaded(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """A server answered GET_STATES with a table of its parts in the metadata, which is at most 1 MB: with 17,000 keys
    (ints near 2**62) it logged "could not send DATA" and save_optimizer_states waited PSKV_TIMEOUT plus a margin (330 s),
    then said only that it had no answer; load_optimizer_states failed alike on SET_STATES's table. The tables travel as a
    frame now. sgd(lr=0.5, momentum=0.5), grads of 1: 1 -> 0.5 (buffer 1, saved) -> -0.25 (buffer 1.5); loaded, -0.25 - 0.75."""
    monkeypatch.setenv("PSKV_TIMEOUT", "60")  # (a push of 17,000 parts with momentum may take 15 s here on a busy machine)
    keys, ones = [2**62 - 1 - k for k in range(17_000)], [torch.ones(1)] * 17_000
    with inproc_job(1, 1).worker() as kv:
        kv.init(keys, ones)
        kv.set_optimizer(pskv.optim.create("sgd", learning_rate=0.5, momentum=0.5))
        kv.push(keys, ones)
        kv.save_optimizer_states(tmp_path / "states")
        kv.push(keys, ones)
        kv.load_optimizer_states(tmp_path / "states")
        kv.push(keys, ones)
        outs = [torch.empty(1) for _ in keys]
        kv.pull(keys, outs)
        assert {float(o) for o in outs} == {-1.0}


def test_a_row_sparse_push_over_many_parts_takes_each_part_its_run_of_rows(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row-sparse push found each part's rows with masks over all the push's rows: its work grew as parts x rows (an
    embedding of 10M x 16, 160 parts of 4 MB, a push of 100,000 rows: 71 ms of masks, the rest of the push 50-130 ms).
    The rows are sorted, so a part's are a run found by bisection. Counted: the elements the push's tensor ops make on
    its thread (the masks made 3 per row and part: 248,000 here; now about 6,000); the value pushed arrives whole."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Made(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if not func.is_view:  # (views make nothing; a sparse tensor's numel is its dense size)
                self.elements += sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and not t.is_sparse)
            return out

    monkeypatch.setenv("PSKV_CHUNK_BYTES", "4096")  # rows of 4 floats: parts of 256 rows
    rows, nnz = 20_000, 1_000
    with inproc_job(1, 1).worker() as kv:
        kv.init("emb", torch.zeros(rows, 4))
        assert len(kv._parts[0]) == 79  # type: ignore[attr-defined]
        grad = torch.sparse_coo_tensor(torch.randperm(rows)[:nnz].unsqueeze(0), torch.randn(nnz, 4), (rows, 4))
        with Made() as made:
            kv.push("emb", grad)
        assert made.elements < 10 * nnz * (4 + 1), made.elements
        kv.pull("emb", out := torch.empty(rows, 4))
        assert torch.equal(out, grad.to_dense())  # (no optimizer: the push replaces the value, absent rows zero)
