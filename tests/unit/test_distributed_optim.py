"""pskv.DistributedOptimizer and the broadcasts: a torch optimizer and its LR scheduler on every
worker, the gradients summed by the servers; checked against one process training on all batches."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import pytest
import torch
from torch import nn

import pskv
from pskv.kv import KVStore

Job = Callable[..., Any]
STEPS = 6


def _net() -> nn.Module:
    net, g = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)), torch.Generator().manual_seed(0)
    with torch.no_grad():  # (workers are threads here: the global RNG is shared)
        for p in net.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return net


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _adamw(net: nn.Module) -> tuple[torch.optim.Optimizer, Callable[[torch.optim.Optimizer], Any]]:
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.05)
    return opt, lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS)


def _sgd_foreach(net: nn.Module) -> tuple[torch.optim.Optimizer, Callable[[torch.optim.Optimizer], Any]]:
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True, foreach=True)
    return opt, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)


def _reference(make: Callable[..., Any], workers: int, op: str) -> list[torch.Tensor]:
    """One process: each step's gradient is the mean (or sum) of every worker's batch gradient."""
    net = _net()
    opt, sched = make(net)
    scheduler = sched(opt)
    for step in range(STEPS):
        opt.zero_grad()
        losses = [nn.functional.cross_entropy(net(x), y) for x, y in (_batch(step, r) for r in range(workers))]
        (sum(losses) / (workers if op == "average" else 1)).backward()
        opt.step()
        scheduler.step()
    return [p.detach().clone() for p in net.parameters()]


def _train(kv: KVStore, make: Callable[..., Any], op: str, overlap: bool = False, scheduler_first: bool = False) -> list[torch.Tensor]:
    net = _net()
    opt, sched = make(net)
    scheduler = sched(opt) if scheduler_first else None  # it puts a step of its own on the optimizer it gets
    dopt = pskv.DistributedOptimizer(opt, kv, op=op, overlap=overlap)
    assert isinstance(dopt, type(opt))
    scheduler = scheduler or sched(dopt)  # a torch LR scheduler takes the wrapper
    for step in range(STEPS):
        dopt.zero_grad(set_to_none=True)
        x, y = _batch(step, kv.rank)
        nn.functional.cross_entropy(net(x), y).backward()
        dopt.step()
        scheduler.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize(("make", "op", "overlap", "first"), [(_adamw, "average", False, False), (_adamw, "average", True, False),
                                                            (_adamw, "sum", False, True), (_sgd_foreach, "average", True, True),
                                                            (_sgd_foreach, "sum", False, False)])  # fmt: skip
def test_two_workers_train_as_one_process_on_all_batches(inproc_job: Job, make: Callable[..., Any], op: str, overlap: bool, first: bool) -> None:
    """AdamW with OneCycleLR, and a foreach SGD with StepLR; overlap: gradients leave during backward;
    first: the LR scheduler made before the optimizer is wrapped (its step, copied, skipped the sum)."""
    got = inproc_job(2, 2).run_workers(lambda kv: _train(kv, make, op, overlap, first))
    want = _reference(make, 2, op)
    for a, b, w in zip(got[0], got[1], want):
        assert torch.equal(a, b), "the workers' weights differ"
        assert torch.allclose(a, w, rtol=1e-5, atol=1e-6), (a - w).abs().max()


def test_one_process_without_servers_is_the_plain_optimizer() -> None:
    """A local store on one device sums nothing: the steps are torch's own, bit for bit."""
    assert all(torch.equal(a, b) for a, b in zip(_train(pskv.kv.create("local"), _adamw, "average"), _reference(_adamw, 1, "average")))


def test_broadcasts_give_every_worker_rank_0s_weights_and_states(inproc_job: Job) -> None:
    def body(kv: KVStore) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        net, g = nn.Linear(4, 2), torch.Generator().manual_seed(kv.rank)
        with torch.no_grad():  # different weights on each worker
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        opt = torch.optim.Adam(net.parameters(), lr=0.1 * (kv.rank + 1))
        if kv.rank == 0:  # only rank 0 has states, as after a resume
            net(torch.ones(3, 4)).sum().backward()
            opt.step()
        before = [p.detach().clone() for p in net.parameters()]
        pskv.broadcast_parameters(net.state_dict(), kv)
        pskv.broadcast_optimizer_state(opt, kv)
        state = opt.state_dict()
        assert state["param_groups"][0]["lr"] == pytest.approx(0.1)
        moments = [state["state"][i][n] for i in sorted(state["state"]) for n in ("exp_avg", "exp_avg_sq")]
        return before, [*(p.detach().clone() for p in net.parameters()), *moments]

    (mine, first), (_, second) = inproc_job(2, 1).run_workers(body)
    assert all(torch.equal(a, b) for a, b in zip(mine, first))  # rank 0 keeps its own weights
    assert len(first) == 6 and all(torch.equal(a, b) for a, b in zip(first, second))


def test_bad_arguments_are_named() -> None:
    kv = pskv.kv.create("local")
    net = nn.Linear(2, 2)
    with pytest.raises(pskv.TrainerError, match="'max'"):
        pskv.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), kv, op="max")
    with pytest.raises(pskv.TrainerError, match=r"torch\.optim\.Optimizer"):
        pskv.DistributedOptimizer(net, kv)  # type: ignore[arg-type]
    with pytest.raises(pskv.TrainerError, match="kvstore must be a store type name, a KVStore or None, not int"):
        pskv.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), 3)  # type: ignore[arg-type]  # (an AttributeError)
    pskv.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), None).step()  # type: ignore[arg-type]  # no store: as before
    with pytest.raises(pskv.TrainerError, match="root_rank must be 0"):
        pskv.broadcast_parameters(net.parameters(), kv, root_rank=1)
    with pytest.raises(pskv.TrainerError, match="at least one"):
        pskv.broadcast_parameters([], kv)



def _scaled(make: Callable[[nn.Module], Any], one_step: Callable[..., None], overflow: Callable[[int], bool]) -> tuple[list[torch.Tensor], list[float]]:
    """fp16-style loss scaling with torch's GradScaler: ``one_step(opt, net, scaler, step, inf)`` runs
    a step's forward, backward and optimizer step (``inf``: this step's loss overflows); the weights
    and the scale after each step."""
    net = _net()
    opt, scaler, scales = make(net), torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2), []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        one_step(opt, net, scaler, step, overflow(step))
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in net.parameters()], scales


def test_grad_scaler_skips_the_same_steps_on_every_worker(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker 1's loss overflows at step 2: the sums, the same everywhere, hold Inf, so every worker's
    GradScaler skips that step and halves its scale (Horovod's order: synchronize, unscale_, then
    step inside skip_synchronize). Checked against one process on all batches."""
    monkeypatch.setenv("PSKV_NONFINITE", "allow")  # (the servers sum an overflowed gradient as it is)
    inf = 2

    def sgd(net: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    def worker(kv: KVStore) -> tuple[list[torch.Tensor], list[float]]:
        def one_step(dopt: Any, net: nn.Module, scaler: Any, step: int, overflow: bool) -> None:
            x, y = _batch(step, kv.rank)
            scaler.scale(nn.functional.cross_entropy(net(x), y) * (math.inf if overflow else 1.0)).backward()
            dopt.synchronize()
            scaler.unscale_(dopt)
            with dopt.skip_synchronize():
                scaler.step(dopt)

        return _scaled(lambda net: pskv.DistributedOptimizer(sgd(net), kv), one_step, lambda s: s == inf and kv.rank == 1)

    def reference(opt: Any, net: nn.Module, scaler: Any, step: int, overflow: bool) -> None:
        losses = [nn.functional.cross_entropy(net(x), y) for x, y in (_batch(step, r) for r in range(2))]
        scaler.scale((losses[0] + losses[1] * (math.inf if overflow else 1.0)) / 2).backward()
        scaler.step(opt)

    (w0, s0), (w1, s1) = inproc_job(2, 2).run_workers(worker)
    want, scales = _scaled(sgd, reference, lambda s: s == inf)
    assert s0 == s1 == scales and scales[inf] == scales[inf - 1] / 2, (s0, s1, scales)
    for a, b, w in zip(w0, w1, want):
        assert torch.equal(a, b), "the workers' weights differ"
        assert torch.allclose(a, w, rtol=1e-5, atol=1e-6), (a - w).abs().max()


class _TwoHeads(nn.Module):
    """Head ``b`` at steps 2 and 5 on every worker (``a`` unused by all), and at step 1 on worker 1 only."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3), nn.Linear(16, 3)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
        return (self.b if step % 3 == 2 or (step, rank) == (1, 1) else self.a)(torch.tanh(self.body(x)))


def test_a_parameter_no_worker_used_keeps_no_gradient(inproc_job: Job) -> None:
    """AdamW with weight decay moves a parameter that has a gradient, even a zero one; one that no
    worker used this step has none and stays, as in one process (and with DDP)."""

    def train(kv: Any, ranks: list[int]) -> list[torch.Tensor]:
        net = _TwoHeads()
        opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.5)
        if kv is not None:
            opt = pskv.DistributedOptimizer(opt, kv)
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            losses = [nn.functional.cross_entropy(net(*_batch(step, r)[:1], step, r), _batch(step, r)[1]) for r in ranks]
            (sum(losses) / len(losses)).backward()
            opt.step()
        return [p.detach().clone() for p in net.parameters()]

    got = inproc_job(2, 1).run_workers(lambda kv: train(kv, [kv.rank]))
    want = train(None, [0, 1])
    for a, b, w in zip(got[0], got[1], want):
        assert torch.equal(a, b), "the workers' weights differ"
        assert torch.allclose(a, w, rtol=1e-5, atol=1e-6), (a - w).abs().max()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("missing", [0, 1])
def test_a_worker_whose_sparse_embedding_got_no_gradient_takes_the_others_row_sparse_sum(inproc_job: Job, overlap: bool, missing: int) -> None:
    """Worker 1 does not use the nn.Embedding(sparse=True) in step ``missing``: the zeros pushed for it came back as a
    dense gradient there, a sparse one on worker 0 (SparseAdam: 'does not support dense gradients'; SGD with momentum
    'add(sparse, dense) is not supported'). In step 0 it has not yet seen the key's gradient row-sparse, so it pushes
    dense zeros and the wrapper makes the sum row-sparse again."""

    def train(kv: Any, ranks: list[int]) -> list[torch.Tensor]:
        emb = nn.Embedding(10, 3, sparse=True)
        with torch.no_grad():
            emb.weight.copy_(torch.arange(30.0).view(10, 3) / 10)
        opts = [torch.optim.SparseAdam(emb.parameters(), lr=0.1), torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9)]
        if kv is not None:
            opts = [pskv.DistributedOptimizer(o, kv, overlap=overlap) for o in opts]
        for step in range(3):
            for o in opts:
                o.zero_grad()
            used = [r for r in ranks if (step, r) != (missing, 1)]
            (sum((emb(torch.tensor([r + step, 5])).sum() for r in used), torch.zeros((), requires_grad=True)) / len(ranks)).backward()
            for o in opts:
                o.step()
        return [emb.weight.detach().clone()]

    got = inproc_job(2, 1).run_workers(lambda kv: train(kv, [kv.rank]))
    want = train(None, [0, 1])
    assert torch.equal(got[0][0], got[1][0]), "the workers' weights differ"
    torch.testing.assert_close(got[0][0], want[0])


def test_the_ddp_hook_refuses_a_store_that_got_an_optimizer_and_hooks_share_the_stores_thread() -> None:
    import threading

    def threads() -> int:
        return sum(t.name == "pskv-ddp-hook" for t in threading.enumerate())

    kv, before = pskv.kv.create("local"), threads()
    hooks = [pskv.ddp_hook(kv) for _ in range(3)]
    assert threads() == before + 1  # one per store, not one per hook made (they stayed)
    kv.set_optimizer(pskv.optim.create("sgd"))  # after the hook was made: it returned weights as gradients
    with pytest.raises(pskv.KVStoreError, match="the store runs an optimizer"):
        hooks[0](None, None)


@pytest.mark.parametrize("overlap", [False, True])
def test_gradients_are_the_averages_when_backward_returns(inproc_job: Job, overlap: bool) -> None:
    """As with DDP: clip_grad_norm_ between backward and step clips the average (overlap on, the edit
    was lost: the sums came over it; off, it clipped each worker's own gradient); a synchronize()
    before step is not a second sum. Checked against one process on both workers' batches."""

    def worker(kv: KVStore) -> list[torch.Tensor]:
        net = _net()
        opt = pskv.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5), kv, overlap=overlap)
        for step in range(3):
            opt.zero_grad()
            x, y = _batch(step, kv.rank)
            nn.functional.cross_entropy(net(x), y).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            opt.synchronize()
            opt.step()
        opt._pskv.synchronize()  # type: ignore[attr-defined]
        return [p.detach().clone() for p in net.parameters()]

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    for step in range(3):
        opt.zero_grad()
        (sum(nn.functional.cross_entropy(net(x), y) for x, y in (_batch(step, r) for r in range(2))) / 2).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
    for got in inproc_job(2, 1).run_workers(worker):
        for a, w in zip(got, net.parameters()):
            assert torch.allclose(a, w, rtol=1e-5, atol=1e-6), (a - w).abs().max()


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_load_state_dict_reaches_the_optimizer_a_scheduler_made_before_wrapping_steps(scheduler_first: bool) -> None:
    """The wrapper and the optimizer share one __dict__: states and param_groups that load_state_dict
    sets are the ones the step uses (with a scheduler made before wrapping, the old ones were), and
    the scheduler sees its own step (no "optimizer.step() has been overridden" warning)."""
    import warnings

    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0, momentum=0.9)
    saved = {"state": {0: {"momentum_buffer": torch.full((2,), 10.0)}}, "param_groups": [{**opt.state_dict()["param_groups"][0], "lr": 0.5}]}
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1) if scheduler_first else None
    dopt = pskv.DistributedOptimizer(opt, "local")
    sched = sched or torch.optim.lr_scheduler.StepLR(dopt, step_size=1, gamma=0.1)
    dopt.load_state_dict(saved)
    p.grad = torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dopt.step()
        sched.step()
    assert p.tolist() == [1 - 0.5 * (0.9 * 10 + 1)] * 2  # lr 0.5, buffer 10 -> 10
    assert dopt.param_groups[0]["lr"] == pytest.approx(0.05) and opt.param_groups is dopt.param_groups


def test_a_dist_async_store_is_refused_in_the_wrappers_words(inproc_job: Job) -> None:
    """It said 'update_on_kvstore=False is not possible', an argument the user never passed."""
    opt = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    with inproc_job(1, 1).worker("dist_async") as kv, pytest.raises(pskv.TrainerError, match="DistributedOptimizer needs summed rounds"):
        pskv.DistributedOptimizer(opt, kv)


def test_parameters_the_wrapper_does_not_sum_are_refused_by_name() -> None:
    """A group added after wrapping, or a parameter frozen when wrapped and unfrozen later, was trained
    on each worker's own gradient (divided by the workers: 'average') without a word."""
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2), requires_grad=False)
    dopt = pskv.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0), "local")
    with pytest.raises(pskv.TrainerError, match="add_param_group on a DistributedOptimizer"):
        dopt.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
    b.requires_grad_(True)
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    with pytest.raises(pskv.TrainerError, match=r"parameters \[1\] \(in param_groups order\) have gradients but were frozen"):
        dopt.step()
    assert a.tolist() == [1.0, 1.0]  # nothing stepped
    pskv.DistributedOptimizer(torch.optim.SGD([a, b], lr=1.0), "local").step()  # wrapped after unfreezing: fine
    assert a.tolist() == b.tolist() == [0.0, 0.0]


@pytest.mark.parametrize(("op", "overlap"), [("average", None), ("sum", None), ("sum", True)])
def test_two_backward_passes_before_a_step_count_each_once(inproc_job: Job, op: str, overlap: Optional[bool]) -> None:
    """A GAN's D: errD_real.backward(); errD_fake.backward(); step(). With the sum made when each backward
    ends, op="sum" counted the first backward W times, and with overlap (a GPU's default) its gradients left
    in the first backward: the second was a TrainerError; and a re-wrapped optimizer (after unfreezing) whose
    LR scheduler was made before the first wrap must not step itself in a loop."""

    def worker(kv: KVStore) -> list[torch.Tensor]:
        net = _net()
        base = torch.optim.SGD(net.parameters(), lr=0.5)
        sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
        pskv.DistributedOptimizer(base, kv, op=op, overlap=overlap)
        dopt = pskv.DistributedOptimizer(base, kv, op=op, overlap=overlap)  # wrapped again (a parameter unfrozen, say)
        for step in range(2):
            dopt.zero_grad()
            for half in (0, 1):
                x, y = _batch(step, 2 * kv.rank + half)
                nn.functional.cross_entropy(net(x), y).backward()
            dopt.step()
            sched.step()
        return [p.detach().clone() for p in net.parameters()]

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(2):
        opt.zero_grad()
        loss = sum(nn.functional.cross_entropy(net(x), y) for x, y in (_batch(step, k) for k in range(4)))
        (loss / (2 if op == "average" else 1)).backward()
        opt.step()
        sched.step()
    for got in inproc_job(2, 1).run_workers(worker):
        for a, w in zip(got, net.parameters()):
            assert torch.allclose(a, w, rtol=1e-5, atol=1e-6), (a - w).abs().max()


@pytest.mark.parametrize("op", ["average", "sum"])
def test_a_closure_that_the_optimizer_calls_several_times_is_summed_each_time(inproc_job: Job, op: str) -> None:
    """LBFGS calls its closure (zero_grad, forward, backward) several times a step, as it does with DDP: each
    call's gradients are summed. The wrapper called the closure once itself and LBFGS's step without it
    (TypeError: missing 'closure'). Checked against one process on both workers' batches."""

    def train(kv: Any, ranks: list[int]) -> list[torch.Tensor]:
        net = _net()
        opt = torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=4)
        if kv is not None:
            opt = pskv.DistributedOptimizer(opt, kv, op=op)
        for step in range(2):
            def closure(step: int = step) -> torch.Tensor:
                opt.zero_grad()
                loss = sum(nn.functional.cross_entropy(net(x), y) for x, y in (_batch(step, r) for r in ranks))
                (loss / (len(ranks) if op == "average" else 1)).backward()  # type: ignore[union-attr]
                return loss  # type: ignore[return-value]
            opt.step(closure)
        return [p.detach().clone() for p in net.parameters()]

    got = inproc_job(2, 1).run_workers(lambda kv: train(kv, [kv.rank]))
    want = train(None, [0, 1])
    for a, b, w in zip(got[0], got[1], want):
        assert torch.equal(a, b), "the workers' weights differ"
        assert torch.allclose(a, w, rtol=1e-4, atol=1e-5), (a - w).abs().max()
