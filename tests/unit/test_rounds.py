"""The round engine on its own: requests in, answers out, no sockets and no threads.

Values are checked against SPEC.md section 3: W workers pushing ``(rank+1)*ones`` to a key
initialised to ones give ``W(W+1)/2`` without an optimizer, and ``1 - lr*r*W(W+1)/2*(i+1)``
after round i with ``sgd(learning_rate=lr, rescale_grad=r)``.
"""

from __future__ import annotations

import re
import time
from typing import Any, Optional

import pytest
import torch

import pskv
from pskv.errors import (
    DeadlineExceeded,
    KeyNotInitializedError,
    NodeFailedError,
    OptimizerError,
    OptimizerRequiredError,
    ProtocolError,
    ShapeMismatchError,
)
from pskv.ps.rounds import Answer, InitEntry, PullEntry, PushEntry, Rounds


def entry(key: int = 0, numel: int = 4, value: Optional[torch.Tensor] = None, row_numel: int = 1) -> InitEntry:
    return InitEntry(key, 0, str(key), torch.float32, numel, row_numel, value)


def made(workers: int, numel: int = 4, mode: str = "sync") -> Rounds:
    """An engine whose key 0 every worker has initialised to ones."""
    r = Rounds(workers, timeout=10.0)
    for rank in range(workers):
        r.init(f"init {rank}", rank, mode, [entry(numel=numel, value=torch.ones(numel) if rank == 0 else None)])
    return r


def answered(answers: list[Answer]) -> list[tuple[Any, int]]:
    assert all(a.error is None for a in answers), [a.error for a in answers]
    return [(a.req, a.entry) for a in answers]


def push(r: Rounds, rank: int, round_: int, value: float, numel: int = 4, ack_when_merged: bool = False) -> list[Answer]:
    return r.push(f"push {rank}/{round_}", rank, [PushEntry(r.part(0, 0), round_, torch.full((numel, 1), value), ack_when_merged)])


def test_init_waits_for_worker_0s_value_and_checks_every_worker() -> None:
    r = Rounds(2, timeout=10.0)
    assert r.init("w1", 1, "sync", [entry()]) == []  # no value yet: the INIT waits
    with pytest.raises(KeyNotInitializedError):
        r.part(0, 0)
    for bad, said in ((entry(numel=5, value=torch.ones(5)), r"initialised it as 5 x torch\.float32"),
                      (InitEntry(0, 0, "'b'", torch.float32, 4, 1, torch.ones(4)), r"another worker as 4 x torch\.float32 \(sync\) named 0")):
        r = Rounds(2, timeout=10.0)  # worker 1's INIT waits for a value that will not come: it is told too
        assert r.init("w1", 1, "sync", [entry()]) == []
        answers = r.init("w0", 0, "sync", [bad])
        assert [a.req for a in answers] == ["w0", "w1"] and all(isinstance(a.error, ShapeMismatchError) for a in answers), answers
        assert re.search(said, str(answers[0].error)) and answers[1].error is answers[0].error
    r = made(2)
    answers = r.init("w0", 0, "async", [entry(value=torch.ones(4))])  # a part with its value: the latecomer alone
    assert [a.req for a in answers] == ["w0"] and re.search(r"\(async\)", str(answers[0].error))
    r = Rounds(2, timeout=10.0)
    assert r.init("w1", 1, "sync", [entry()]) == []
    with pytest.raises(ProtocolError, match="worker 0 sends the init value, and only worker 0"):
        r.init("w0", 0, "sync", [entry()])
    with pytest.raises(ProtocolError, match="mode 'fast'"):
        r.init("w0", 0, "fast", [entry(value=torch.ones(4))])
    assert r.parts[(0, 0)].value is None and r.parts[(0, 0)].initialised_by == {1}  # the failures changed nothing
    assert sorted(answered(r.init("w0", 0, "sync", [entry(value=torch.arange(4.0))]))) == [("w0", 0), ("w1", 0)]
    assert torch.equal(r.part(0, 0).value.view(-1), torch.arange(4.0))
    # a worker's init again (one cut short by an interrupt or its deadline: the store did not take the key) is answered
    assert answered(r.init("again", 1, "sync", [entry()])) == [("again", 0)]  # (it was refused as a duplicate: the key was lost)
    assert answered(r.init("again0", 0, "sync", [entry(value=torch.ones(4))])) == [("again0", 0)]
    assert torch.equal(r.part(0, 0).value.view(-1), torch.arange(4.0)), "the first value stays"


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_round_is_one_push_of_every_worker(workers: int) -> None:
    r = made(workers)
    for rank in range(workers - 1):
        push(r, rank, 1, rank + 1.0)
        assert r.part(0, 0).rounds == 0
    push(r, workers - 1, 1, float(workers))
    assert r.part(0, 0).rounds == 1
    assert torch.all(r.part(0, 0).value == workers * (workers + 1) / 2)  # no optimizer: the sum replaces the value


def test_sgd_on_the_server_follows_the_formula() -> None:
    workers, lr, rescale = 3, 0.1, 0.5
    r = made(workers)
    r.set_optimizer(pskv.optim.create("sgd", learning_rate=lr, rescale_grad=rescale).describe(), keep_states=False)
    for i in range(3):
        for rank in range(workers):
            push(r, rank, i + 1, rank + 1.0)
        want = 1 - lr * rescale * workers * (workers + 1) / 2 * (i + 1)
        assert torch.allclose(r.part(0, 0).value, torch.full((4, 1), want))


def test_a_second_push_waits_for_the_next_round_and_pulls_wait_for_their_round() -> None:
    r = made(2)
    p = r.part(0, 0)
    push(r, 0, 1, 1.0)
    push(r, 0, 2, 10.0)  # worker 0 twice: still round 0
    assert p.rounds == 0
    assert r.pull("pull0", 0, [PullEntry(p, 2)]) == []  # waits for round 2
    got = r.push("push1", 1, [PushEntry(p, 1, torch.full((4, 1), 2.0), False)])
    assert p.rounds == 1 and torch.all(p.value == 3.0)
    assert answered(got) == [("push1", 0)]  # the pull of round 2 still waits
    got = r.push("push1b", 1, [PushEntry(p, 2, torch.full((4, 1), 20.0), False)])
    assert p.rounds == 2 and sorted(answered(got), key=str) == [("pull0", 0), ("push1b", 0)]
    pulled = next(a for a in got if a.req == "pull0")
    assert pulled.part is p and pulled.value is p.value and torch.all(pulled.value == 30.0)  # the stored value, no copy


def test_pushes_in_shared_memory_are_acknowledged_once_merged() -> None:
    r = made(2)
    assert push(r, 0, 1, 1.0, ack_when_merged=True) == []
    got = push(r, 1, 1, 2.0, ack_when_merged=True)
    assert sorted(answered(got)) == [("push 0/1", 0), ("push 1/1", 0)]


def test_a_push_sent_twice_is_applied_once_and_a_skipped_round_is_refused() -> None:
    r = made(1)
    r.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0).describe(), keep_states=False)
    push(r, 0, 1, 1.0)
    assert answered(push(r, 0, 1, 1.0)) == [("push 0/1", 0)]  # acknowledged, not applied again
    assert torch.all(r.part(0, 0).value == 0.0)
    with pytest.raises(ProtocolError, match="pushed round 3 but its next round is 2"):
        push(r, 0, 3, 1.0)
    assert r.part(0, 0).rounds == 1 and r.part(0, 0).pushed == {0: 1}


def test_pull_checks_its_round_and_rows_first() -> None:
    r = made(1, numel=6)
    p = r.part(0, 0)
    with pytest.raises(ProtocolError, match="pulls round 1 but pushed only 0"):
        r.pull("x", 0, [PullEntry(p, 0), PullEntry(p, 1)])
    with pytest.raises(ProtocolError, match=r"row ids outside \[0, 6\)"):
        r.pull("x", 0, [PullEntry(p, 0, torch.tensor([6]))])
    p.value.view(-1).copy_(torch.arange(6.0))
    (a,) = r.pull("rows", 0, [PullEntry(p, 0, torch.tensor([4, 1]))])
    assert a.part is None and a.value.view(-1).tolist() == [4.0, 1.0]


def test_async_applies_on_arrival_and_needs_an_optimizer() -> None:
    r = made(2, mode="async")
    p = r.part(0, 0)
    with pytest.raises(OptimizerRequiredError, match="needs an optimizer"):
        push(r, 0, 1, 1.0)
    r.set_optimizer(pskv.optim.create("sgd", learning_rate=0.5).describe(), keep_states=False)
    push(r, 0, 2, 1.0)  # round 1 was refused; async does not mind the gap
    push(r, 1, 1, 2.0)
    assert torch.all(p.value == 1 - 0.5 * 3)
    (a,) = r.pull("snap", 1, [PullEntry(p, 5)])  # async: at once, a snapshot
    assert a.part is None and a.value is not p.value and torch.equal(a.value, p.value)


def test_sparse_pushes_are_merged_as_rows() -> None:
    r = Rounds(2, timeout=10.0)
    for rank in range(2):
        r.init(rank, rank, "sync", [entry(numel=6, row_numel=2, value=torch.zeros(6) if rank == 0 else None)])
    p = r.part(0, 0)
    for rank, rows in enumerate(([0, 2], [2])):
        g = torch.sparse_coo_tensor(torch.tensor([rows]), torch.ones(len(rows), 2), (3, 2))
        r.push(rank, rank, [PushEntry(p, 1, g, False)])
    assert p.value.tolist() == [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]]  # the sum replaces every row


def test_a_round_of_sparse_and_dense_pushes_sums_them_all() -> None:
    r = Rounds(2, timeout=10.0)
    for rank in range(2):
        r.init(rank, rank, "sync", [entry(numel=6, row_numel=2, value=torch.full((6,), 9.0) if rank == 0 else None)])
    p = r.part(0, 0)
    r.push(0, 0, [PushEntry(p, 1, torch.sparse_coo_tensor(torch.tensor([[2, 0, 2]]), torch.ones(3, 2), (3, 2)), False)])
    r.push(1, 1, [PushEntry(p, 1, torch.arange(6.0).view(3, 2), False)])
    assert p.value.tolist() == [[1.0, 2.0], [2.0, 3.0], [6.0, 7.0]]  # row 2 twice in one push: summed too


def test_a_finished_worker_fails_the_rounds_that_need_it_at_once() -> None:
    r = made(2)
    p = r.part(0, 0)
    push(r, 0, 1, 1.0, ack_when_merged=True)
    assert r.pull("pull", 0, [PullEntry(p, 1)]) == []
    failed = r.finish(1)
    assert {a.req for a in failed} == {"pull", "push 0/1"}
    assert all(isinstance(a.error, NodeFailedError) for a in failed)
    assert "worker 1 finished (closed its store) without pushing key 0 for round 0" in str(failed[0].error)
    with pytest.raises(NodeFailedError, match="worker 1 finished"):
        r.pull("later", 0, [PullEntry(p, 1)])
    with pytest.raises(NodeFailedError, match="pushed after it finished"):
        push(r, 1, 1, 1.0)


def test_workers_finishing_pass_over_the_parts_nothing_waits_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each worker's finish looked at every part for the rounds it blocks, and each look walked the workers finished so
    far: parts x W^2 in all at a job's end (32 workers with 50,000 parts on a server held its loop for 26 s, near the
    heartbeat deadline). A part whose pushes are all merged and on which no pull waits is passed over. Counted: the
    parts looked at; a round the finished worker blocks still fails at once."""
    r = Rounds(4, timeout=10.0)
    for rank in range(4):
        r.init("i", rank, "sync", [InitEntry(k, 0, str(k), torch.float32, 4, 1, torch.ones(4) if rank == 0 else None) for k in range(100)])
        r.push("p", rank, [PushEntry(r.part(k, 0), 1, torch.ones(4, 1), False) for k in range(100)])  # round 1 of every part merges
    push(r, 0, 2, 1.0)  # worker 0 goes on with key 0 and waits for its round 2
    assert r.pull("pull", 0, [PullEntry(r.part(0, 0), 2)]) == []
    looked: list[Any] = []
    monkeypatch.setattr(r, "_fail_blocked", lambda p, real=r._fail_blocked: looked.append(p) or real(p))
    (failed,) = r.finish(1)
    assert failed.req == "pull" and "worker 1 finished (closed its store) without pushing key 0 for round 1" in str(failed.error)
    assert r.finish(2) == [] and r.finish(3) == [] and r.finish(0) == []
    assert looked == [r.part(0, 0)]


def test_inits_waiting_for_the_value_of_a_finished_worker_0_fail_at_once() -> None:
    """Worker 0 sends every init value; one that closed its store at once (a program that leaves early, by
    hand or under pskv launch) left the other workers' inits waiting PSKV_TIMEOUT, then blamed it for not
    sending. They fail when it finishes, and an init that comes later fails at once; keys it sent still init."""
    r = Rounds(3, timeout=10.0)
    assert r.init("w1", 1, "sync", [entry(key=0)]) == []
    assert answered(r.init("w0", 0, "sync", [entry(key=1, value=torch.ones(4))])) == [("w0", 0)]
    failed = r.finish(0)
    assert [a.req for a in failed] == ["w1"] and isinstance(failed[0].error, NodeFailedError), failed
    assert "worker 0 finished (closed its store) without sending the init value of key 0" in str(failed[0].error)
    later = r.init("w2", 2, "sync", [entry(key=0), entry(key=1)])
    assert [(a.req, a.entry, type(a.error)) for a in later] == [("w2", 1, type(None)), ("w2", 0, NodeFailedError)], later


def test_the_expiry_sweep_looks_only_at_parts_with_requests_waiting() -> None:
    """A server sweeps for late requests every 0.5 s. It built two lists for every part it holds,
    waiting or not: 25 ms a sweep for 20,000 keys, a server's CPU spent on an idle store. Parts
    with nothing waiting are now passed over without reading their lists."""

    class Watched(list[Any]):
        reads = 0

        def __iter__(self) -> Any:
            Watched.reads += 1
            return super().__iter__()

    r = Rounds(1, timeout=10.0)
    r.init("i", 0, "sync", [entry(key=k, value=torch.ones(4)) for k in range(100)])
    for p in r.parts.values():
        p.pulls, p.inits = Watched(), Watched()
    assert r.expire(1e12) == [] and Watched.reads == 0


def test_the_expiry_sweep_still_fails_every_late_request_among_idle_parts() -> None:
    """The sweep looks only at the parts where something waited since the one before (a look at every part took
    23 ms for 100,000 parts): a pull that waits, a part answered and then waiting again, and an INIT waiting for
    its value still fail once late, in the order of their keys; nothing fails before its deadline, or twice."""
    r = Rounds(2, timeout=10.0)
    for rank in range(2):
        r.init("i", rank, "sync", [entry(key=k, value=torch.ones(4) if rank == 0 else None) for k in range(100)])
    assert r.init("lonely", 1, "sync", [entry(key=100)]) == []
    p3, p7 = r.part(3, 0), r.part(7, 0)
    for p in (p7, p3):
        r.push("p", 0, [PushEntry(p, 1, torch.ones(4, 1), False)])
        assert r.pull(f"pull {p.key}", 0, [PullEntry(p, 1)]) == []
    assert answered(r.push("p", 1, [PushEntry(p3, 1, torch.ones(4, 1), False)])) == [("p", 0), ("pull 3", 0)]
    assert r.expire(time.monotonic()) == []  # key 3's pull was answered: the sweep forgets the part
    r.push("p", 0, [PushEntry(p3, 2, torch.ones(4, 1), False)])
    assert r.pull("again 3", 0, [PullEntry(p3, 2)]) == []  # and it waits again
    late = r.expire(time.monotonic() + 11)
    assert [(a.req, type(a.error)) for a in late] == [("again 3", DeadlineExceeded), ("pull 7", DeadlineExceeded),
                                                      ("lonely", DeadlineExceeded)], late
    assert "have not pushed key 3" in str(late[0].error) and "have not pushed key 7" in str(late[1].error)
    assert r.expire(time.monotonic() + 22) == []


def test_expiry_names_the_workers_that_have_not_pushed() -> None:
    r = made(3)
    p = r.part(0, 0)
    push(r, 0, 1, 1.0)
    r.pull("slow", 0, [PullEntry(p, 1)])
    assert r.expire(p.pulls[0].since + 5) == []
    (a,) = r.expire(p.pulls[0].since + 11)
    assert isinstance(a.error, DeadlineExceeded) and "workers [1, 2] have not pushed key 0" in str(a.error)
    assert "pushed: [0]" in str(a.error) and p.pulls == []
    lonely = Rounds(2, timeout=1.0)
    lonely.init("w1", 1, "sync", [entry(key=5)])
    (a,) = lonely.expire(lonely.parts[(5, 0)].inits[0].since + 2)
    assert "for its value: worker 0 sends it and has not; workers that called init: [1]" in str(a.error)


def test_optimizer_states_keep_change_and_are_checked_before_loading() -> None:
    r = made(1)
    sgd = pskv.optim.create("sgd", learning_rate=1.0, momentum=0.5)
    r.set_optimizer(sgd.describe(), keep_states=False)
    push(r, 0, 1, 1.0)
    ((p, state),) = r.states()
    assert torch.all(state.tensors["momentum_buffer"] == 1.0) and state.step == 1
    sgd.set_learning_rate(0.5)
    r.set_optimizer(sgd.describe(), keep_states=True)  # new hyperparameters, same states
    assert r.states()[0][1] is state
    with pytest.raises(OptimizerError, match="cannot change optimizer 'sgd' to 'adam' and keep its states"):
        r.set_optimizer(pskv.optim.create("adam").describe(), keep_states=True)
    with pytest.raises(OptimizerError, match=r"saved states are \['exp_avg'\]"):
        r.load_states(sgd.describe(), 3, [(p, 7, {"exp_avg": torch.zeros(4)})])
    with pytest.raises(OptimizerError, match="4 elements"):
        r.load_states(sgd.describe(), 3, [(p, 7, {"momentum_buffer": torch.zeros(3)})])
    assert r.states()[0][1] is state and r.optimizer is not None and r.optimizer.num_update == 1  # unchanged
    r.load_states(sgd.describe(), 3, [(p, 7, {"momentum_buffer": torch.full((4,), 9.0)})])
    assert r.states()[0][1].step == 7 and torch.all(r.states()[0][1].tensors["momentum_buffer"] == 9.0)
    assert r.optimizer.num_update == 3


def test_a_held_round_waits_for_the_rescale_a_pull_brings() -> None:
    """The Trainer pushes before it knows the batch size: the summed round waits for the rescale
    of step(batch_size), which its pull brings, and is applied with exactly that."""
    r = made(2)
    p = r.part(0, 0)
    r.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0).describe(), keep_states=False)
    for rank in range(2):
        r.push(f"push {rank}", rank, [PushEntry(p, 1, torch.full((4, 1), rank + 1.0), False, held=True)])
    assert p.rounds == 0 and p.held is not None and torch.all(p.value == 1.0)  # summed, not applied
    assert r.pull("plain", 1, [PullEntry(p, 1)]) == []  # no rescale: it waits too
    (a,) = r.expire(p.pulls[0].since + 11)
    assert "every worker pushed; its update waits for the rescale a pull of it brings" in str(a.error)
    r.pull("plain", 1, [PullEntry(p, 1)])
    got = r.pull("step", 0, [PullEntry(p, 1, rescale=0.25)])
    assert sorted(a.req for a in got) == ["plain", "step"] and p.rounds == 1 and p.held is None
    assert torch.all(p.value == 1 - 1.0 * 0.25 * 3)
    push(r, 0, 2, 1.0)  # an ordinary round after it: applied at once, with the optimizer's own rescale
    push(r, 1, 2, 1.0)
    assert p.rounds == 2 and torch.allclose(p.value, torch.full((4, 1), 0.25 - 1.0 * 2))  # (not the held round's 0.25)


def test_a_pull_of_held_rounds_answers_its_first_parts_before_it_updates_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Trainer's step pulls every key with the rescale: the forward needs the first layers
    first, so their answers go out after every ANSWER_BYTES of updates, not after the last one."""
    monkeypatch.setattr("pskv.ps.rounds.ANSWER_BYTES", 128)  # two parts of 16 floats
    r = Rounds(1, timeout=10.0)
    r.init("init", 0, "sync", [entry(key, numel=16, value=torch.ones(16)) for key in range(5)])
    r.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0).describe(), keep_states=False)
    parts = [r.part(key, 0) for key in range(5)]
    r.push("push", 0, [PushEntry(p, 1, torch.full((16, 1), 2.0), False, held=True) for p in parts])
    sent: list[tuple[list[Any], list[int]]] = []  # what went early, and the parts still held then
    early = lambda done: sent.append((answered(done), [k for k, p in enumerate(parts) if p.held is not None]))  # noqa: E731
    rest = r.pull("step", 0, [PullEntry(p, 1, rescale=0.5) for p in parts], early=early)
    assert sent == [([("step", 0), ("step", 1)], [2, 3, 4]), ([("step", 2), ("step", 3)], [4])]
    assert answered(rest) == [("step", 4)]
    assert all(torch.all(p.value == 1 - 1.0 * 0.5 * 2) for p in parts)
    assert len(r.pull("again", 0, [PullEntry(p, 1) for p in parts], early=early)) == 5 and len(sent) == 2  # no updates: all at the end


def test_a_lost_worker_leaves_its_rounds_to_the_others() -> None:
    """``lose`` (PSKV_MIN_WORKERS): the lost worker's unmerged push is dropped, a waiting round
    completes with the others' pushes, later rounds need only them, and the lost worker is refused."""
    r = made(3)
    p = r.part(0, 0)
    push(r, 2, 1, 5.0)  # worker 2's push of round 1, then it is lost before the round merges
    push(r, 0, 1, 1.0)
    assert r.pull("pull 0", 0, [PullEntry(p, 1)]) == []
    got = r.lose(2)
    assert p.rounds == 0 and got == []  # worker 1 has not pushed round 1 yet
    got = push(r, 1, 1, 2.0)
    assert ("pull 0", 0) in answered(got) and p.rounds == 1 and torch.all(p.value == 3.0)  # 1 + 2, not 5
    push(r, 0, 2, 1.0)
    assert answered(r.lose(1)) == [] and p.rounds == 2 and torch.all(p.value == 1.0)  # round 2: worker 0 alone
    with pytest.raises(NodeFailedError, match="worker 2 was declared lost"):
        push(r, 2, 2, 1.0)
    assert r.finish(2) == [] and 2 not in r.finished  # closing its store later blocks no round


def test_a_worker_back_in_a_lost_ones_place_counts_its_rounds_from_the_parts() -> None:
    """``rejoin`` (pskv launch --max-restarts): the new worker 2 inits again (its value, as worker 0's
    would be, does not replace the trained one), is refused until admitted, then numbers its rounds
    from 1 again, and every round from the next one sums its push too."""
    r = made(3)
    p = r.part(0, 0)
    for round_ in (1, 2):  # worker 2 pushed round 1 only, then was lost
        for rank in (0, 1, 2) if round_ == 1 else (0, 1):
            push(r, rank, round_, 1.0)
        if round_ == 1:
            r.lose(2)
    assert p.rounds == 2 and torch.all(p.value == 2.0)
    assert answered(r.init("init again", 2, "sync", [entry()])) == [("init again", 0)]
    with pytest.raises(NodeFailedError, match="a worker in its place pushes once admitted"):
        push(r, 2, 1, 1.0)
    r.rejoin(2)
    assert answered(r.pull("pull", 2, [PullEntry(p, 0)])) == [("pull", 0)]  # its round 0: the part's round 2
    with pytest.raises(ProtocolError, match="worker 2 pushed round 4 but its next round is 3"):
        push(r, 2, 2, 1.0)  # its round 2 would be the part's 4
    push(r, 2, 1, 5.0)
    assert p.rounds == 2 and r.pull("pull 3", 2, [PullEntry(p, 1)]) == []  # round 3 waits for workers 0 and 1
    push(r, 0, 3, 1.0)
    got = push(r, 1, 3, 1.0)
    assert ("pull 3", 0) in answered(got) and p.rounds == 3 and torch.all(p.value == 7.0)
    rank0 = made(2)  # worker 0 back: its INIT value leaves the part's value alone
    push(rank0, 0, 1, 1.0)
    push(rank0, 1, 1, 2.0)
    rank0.lose(0)
    rank0.init("again", 0, "sync", [entry(value=torch.zeros(4))])
    assert torch.all(rank0.part(0, 0).value == 3.0)


def test_a_rescale_that_comes_before_its_round_merges_is_kept_for_it() -> None:
    """A pull that brings the rescale of a round not merged yet leaves it on the part: when the
    last push arrives (and its pusher never pulls, e.g. it was lost), the round is applied."""
    r = made(2)
    p = r.part(0, 0)
    r.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0).describe(), keep_states=False)
    r.push("push 0", 0, [PushEntry(p, 1, torch.full((4, 1), 1.0), False, held=True)])
    assert r.pull("step 0", 0, [PullEntry(p, 1, rescale=0.5)]) == []
    got = r.push("push 1", 1, [PushEntry(p, 1, torch.full((4, 1), 2.0), False, held=True)])
    assert ("step 0", 0) in answered(got) and p.rounds == 1 and p.held is None
    assert torch.all(p.value == 1 - 0.5 * 3)


def test_a_mirror_pull_brings_the_rescale_and_is_only_acknowledged() -> None:
    """A backup (PSKV_REPLICAS) gets every push and, from each pull with a rescale, a mirror row:
    it applies the held round as the primary does and answers with an acknowledgement, no value."""
    r = made(2)
    p = r.part(0, 0)
    r.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0).describe(), keep_states=False)
    for rank in range(2):
        r.push(f"push {rank}", rank, [PushEntry(p, 1, torch.full((4, 1), rank + 1.0), False, held=True)])
    (a,) = r.pull("mirror", 0, [PullEntry(p, 1, rescale=0.25, mirror=True)])
    assert (a.req, a.value) == ("mirror", None) and p.rounds == 1 and torch.all(p.value == 1 - 0.25 * 3)


def test_a_held_rounds_rescale_is_for_its_update_only() -> None:
    """A held round (Trainer.step) is applied with the rescale its pull brings; a plain push of
    another key merged afterwards uses the optimizer's own rescale_grad, not the one left behind
    (the replicated-server test's pushpull key once got 1/32 or 1 by timing)."""
    r = made(1)
    r.init("init 1", 0, "sync", [entry(key=1, value=torch.ones(4))])
    held, plain = r.part(0, 0), r.part(1, 0)
    r.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0).describe(), keep_states=False)
    r.push("held", 0, [PushEntry(held, 1, torch.full((4, 1), 1.0), False, held=True)])
    r.pull("step", 0, [PullEntry(held, 1, rescale=0.5)])
    assert torch.all(held.value == 1 - 0.5)
    r.push("plain", 0, [PushEntry(plain, 1, torch.full((4, 1), 1.0), False)])
    assert torch.all(plain.value == 1 - 1.0) and r.optimizer is not None and r.optimizer.rescale_grad == 1.0


def test_parts_of_different_keys_never_share_an_optimizer_state() -> None:
    """A state's key was ``key << 20 | part``: part 2**20 of key 0 (a key cut in over a million parts, possible with a
    small PSKV_CHUNK_BYTES) and part 0 of key 1 shared one momentum buffer, so each got the other's momentum."""
    r = Rounds(1, timeout=10.0)
    big = InitEntry(0, 1 << 20, "0", torch.float32, 1, 1, torch.zeros(1))
    r.init("init", 0, "sync", [big, entry(key=1, numel=1, value=torch.zeros(1))])
    r.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0, momentum=0.5).describe(), keep_states=False)
    a, b = r.part(0, 1 << 20), r.part(1, 0)
    for step in range(1, 3):
        r.push("push", 0, [PushEntry(a, step, torch.ones(1, 1), False), PushEntry(b, step, torch.full((1, 1), 10.0), False)])
    # momentum SGD (SPEC): m = 0.5 m + g; w -= lr * m; two steps from 0 with g: -(g + 1.5 g) = -2.5 g each
    assert a.value.item() == -2.5 and b.value.item() == -25.0, (a.value, b.value)
