"""The GPU data path: gradients copied to page-locked host memory on a side stream, pulls copied
back without blocking, device lists summed on a device; run where a CUDA device is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import pytest
import torch

import pskv
from pskv.kv import KVStore
from tests.unit.test_trainer import _train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
Job = Callable[..., Any]


@pytest.mark.parametrize("store", ["dist_sync", "dist_device_sync"])
@pytest.mark.parametrize("shm", ["1", "0"])
def test_gpu_values_through_the_servers(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, store: str, shm: str) -> None:
    monkeypatch.setenv("PSKV_SHM", shm)
    job = inproc_job(2, 2)
    shapes = [(3,), (1200, 1000)]  # the second is cut over both servers

    def body(kv: KVStore) -> list[float]:
        dev = torch.device("cuda", 0)
        kv.init([0, 1], [torch.zeros(s, device=dev) for s in shapes])
        outs = [torch.full(s, float("nan"), device=dev) for s in shapes]
        seen = []
        for rnd in range(3):  # the page-locked buffers are used again every round
            grads = [[torch.full(s, kv.rank + 1.0 + rnd, device=dev)] * 2 for s in shapes]  # two "devices"
            kv.push([0, 1], grads)
            handle = kv.pull([0, 1], outs, wait=False)
            assert handle is not None
            handle.wait()
            seen.append([o.flatten()[-1].item() for o in outs])
            assert all(bool(torch.all(o == o.flatten()[0])) for o in outs)
        return [v for rnd in seen for v in rnd]

    want = [2 * (1 + 2 + 2 * rnd) for rnd in range(3) for _ in shapes]
    assert job.run_workers(body, store) == [want, want]


@pytest.mark.parametrize("flat", [None, False], ids=["flat keys (the default on GPUs)", "a key per parameter"])
def test_overlap_on_gpu_gives_the_numbers_of_the_plain_path(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, flat: Optional[bool]) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)  # (its convolutions' backward may sum in any order)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr("pskv.trainer.FLAT_KEYS", flat)
    plain = inproc_job(2, 2).run_workers(lambda kv: _train(kv, False, None, device="cuda"))
    overlapped = inproc_job(2, 2).run_workers(lambda kv: (_train(kv, True, None, device="cuda"), len(kv._keys)))
    assert [n for _, n in overlapped] == ([1, 1] if flat is None else [10, 10])  # (_Branchy: 10 parameters, 19 KB)
    overlapped = [w for w, _ in overlapped]
    for a, b in zip(plain[0], overlapped[0]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()


def test_two_pulls_of_one_key_in_flight_get_their_own_rounds(inproc_job: Job) -> None:
    """A pull into GPU outputs goes through the key's page-locked buffer; a second pull of the key
    while the first is in flight must not share it (each returns its own round's value)."""

    def body(kv: KVStore) -> list[float]:
        dev = torch.device("cuda", 0)
        kv.init(0, torch.zeros(1200, 1000, device=dev))
        first, second = torch.full((1200, 1000), float("nan"), device=dev), torch.full((1200, 1000), float("nan"), device=dev)
        kv.pull(0, first)  # the key's page-locked buffer is kept for its next pull
        kv.push(0, torch.ones(1200, 1000, device=dev))
        h1 = kv.pull(0, first, wait=False)
        kv.push(0, torch.full((1200, 1000), 10.0, device=dev))
        h2 = kv.pull(0, second, wait=False)
        assert h1 is not None and h2 is not None
        h2.wait()
        h1.wait()
        return [first.min().item(), first.max().item(), second.min().item(), second.max().item()]

    assert inproc_job(2, 2).run_workers(body, "dist_sync") == [[2.0, 2.0, 20.0, 20.0]] * 2


def test_a_second_push_of_a_gpu_key_waits_for_the_first_over_tcp(inproc_job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over TCP a GPU value is pushed from the part's page-locked slot; a second push of the key
    before the first is answered waits for it, so the first leaves with its own values (each round
    counts: the servers run SGD)."""
    monkeypatch.setenv("PSKV_SHM", "0")
    with inproc_job(1, 1).worker() as kv:
        dev = torch.device("cuda", 0)
        kv.init(0, torch.zeros(1200, 1000, device=dev))
        kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0))
        handles = [kv.push(0, torch.full((1200, 1000), v, device=dev), wait=False) for v in (2.0, 3.0)]
        for h in handles:
            assert h is not None
            h.wait()
        out = torch.full((1200, 1000), float("nan"), device=dev)
        kv.pull(0, out)
        assert torch.equal(out, torch.full_like(out, -5.0))


@pytest.mark.parametrize("shm", ["1", "0"])
def test_gpu_pushpull_into_several_outputs(inproc_job: Job, monkeypatch: pytest.MonkeyPatch, shm: str) -> None:
    """pushpull of GPU values (the DDP hook's call) with the sums going to two GPU outputs, and a
    blocking pull after it: every output holds the round's sum (the answers are copied in one go
    when the call is waited for, then to the second output)."""
    monkeypatch.setenv("PSKV_SHM", shm)
    shapes = [(5,), (700, 1000)]

    def body(kv: KVStore) -> list[float]:
        dev = torch.device("cuda", 0)
        kv.init([0, 1], [torch.zeros(s, device=dev) for s in shapes])
        seen = []
        for rnd in range(3):
            outs = [[torch.full(s, float("nan"), device=dev) for _ in range(2)] for s in shapes]
            handle = kv.pushpull([0, 1], [torch.full(s, kv.rank + 1.0 + rnd, device=dev) for s in shapes], outs, wait=False)
            assert handle is not None
            handle.wait()
            seen += [float(o.min()) for pair in outs for o in pair] + [float(o.max()) for pair in outs for o in pair]
            again = [torch.full(s, float("nan"), device=dev) for s in shapes]
            kv.pull([0, 1], again)
            seen += [float(o.min()) for o in again]
        return seen

    want = [v for rnd in range(3) for v in [3.0 + 2 * rnd] * 10]
    assert inproc_job(2, 2).run_workers(body) == [want, want]


def test_sgd_on_the_gpu_is_torchs_fused_sgd_per_dtype() -> None:
    """The local Trainer's update on a GPU: one fused call per dtype (a GPU call takes one dtype),
    the numbers of torch.optim.SGD(fused=True) key by key."""
    dev, gen = torch.device("cuda", 0), torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16]
    ws = [torch.randn(300 + k, generator=gen).to(dev, dt) for k, dt in enumerate(dtypes)]
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = pskv.optim.create("sgd", learning_rate=0.1, momentum=0.9, wd=1e-3, rescale_grad=0.5)
    theirs = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, fused=True)
    for _ in range(3):
        grads = [torch.randn(w.shape, generator=gen).to(dev, w.dtype) for w in ws]
        opt.update_all(range(len(ws)), grads, ws)
        for p, g in zip(params, grads):
            p.grad = g * 0.5
        theirs.step()
    assert all(torch.equal(w, p.detach()) for w, p in zip(ws, params))
