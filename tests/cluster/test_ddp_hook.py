"""pskv.ddp_hook: DistributedDataParallel exchanging its buckets through the servers, in real jobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.cluster import jobs

pytestmark = pytest.mark.timeout(300)

SCRIPT = """\
import sys, torch, torch.distributed as dist, pskv
from torch import nn

kv = pskv.kv.create("dist_sync")
W, r, op, unused = kv.num_workers, kv.rank, sys.argv[1], sys.argv[2] == "unused"
dist.init_process_group("gloo", rank=r, world_size=W)  # DDP's own group (pskv launch sets MASTER_ADDR/PORT)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
        self.spare = nn.Linear(3, 3)  # unused: its gradient is zero in every bucket

    def forward(self, x):
        return self.body(x) if unused else self.spare(self.body(x))


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


torch.manual_seed(0)
net = Net()
torch.manual_seed(0)
ref = Net()  # the reference: one process, the gradients of every worker's batch combined by hand
# 10 KB buckets: several keys; without unused parameters DDP rebuilds them after the first step
model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.01, find_unused_parameters=unused)
model.register_comm_hook(None, pskv.ddp_hook(kv, op))
opt, ref_opt = sgd(model.parameters()), sgd(ref.parameters())
for step in range(5):
    x, y = batch(step, r)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    ref_opt.zero_grad()
    losses = [nn.functional.cross_entropy(ref(batch(step, k)[0]), batch(step, k)[1]) for k in range(W)]
    (sum(losses) / (W if op == "average" else 1)).backward()
    ref_opt.step()
for (name, a), b in zip(net.named_parameters(), ref.parameters()):
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (name, (a - b).abs().max())
flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
got = [torch.empty_like(flat) for _ in range(W)]
dist.all_gather(got, flat)
assert all(torch.equal(g, got[0]) for g in got), "the workers' weights differ"
print(f"rank {r}: ddp hook {op} ok, {len(kv._keys)} bucket keys", flush=True)
kv.close()
"""


@pytest.mark.parametrize(("op", "params"), [("average", "unused"), ("sum", "all")])
def test_ddp_with_the_hook_trains_as_one_process_on_all_batches(tmp_path: Path, op: str, params: str) -> None:
    res = jobs.launch(tmp_path, SCRIPT, 2, 2, args=[op, params], timeout=240)
    assert res.code == 0, res
    for rank in (0, 1):
        assert f"rank {rank}: ddp hook {op} ok" in res.stdout, res
    keys = int(res.stdout.split(" bucket keys")[0].rsplit(", ", 1)[1])
    assert keys >= (2 if params == "unused" else 3), res  # several buckets (rebuilt after step 1: more keys)


TWO_MODELS = """\
import torch, torch.distributed as dist, pskv
kv = pskv.kv.create("dist_sync")
dist.init_process_group("gloo", rank=kv.rank, world_size=kv.num_workers)
models = [torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4)) for _ in range(2)]  # a GAN's G and D
for m in models:
    m.register_comm_hook(None, pskv.ddp_hook(kv))
for m in models:
    m(torch.ones(2, 4) * (kv.rank + 1)).sum().backward()
print(f"rank {kv.rank}:", [m.module.weight.grad[0, 0].item() for m in models], sorted(kv._keys), flush=True)
kv.close()
"""


def test_two_models_hooked_to_one_store_have_keys_of_their_own(tmp_path: Path) -> None:
    """The second model's buckets had the first's keys: DuplicateInitError from backward."""
    res = jobs.launch(tmp_path, TWO_MODELS, 2, 1, timeout=120)
    assert res.code == 0, res
    for rank in (0, 1):  # the mean of 2 x 1 and 2 x 2
        assert f"rank {rank}: [3.0, 3.0] ['ddp-bucket-0-20-float32', 'ddp-bucket-0-20-float32#1']" in res.stdout, res


A_WORKER_LEAVES = """\
import os, torch, torch.distributed as dist, pskv
kv = pskv.kv.create("dist_sync")
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=kv.rank, world_size=2)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
model.register_comm_hook(None, pskv.ddp_hook(kv))
model(torch.ones(2, 4)).sum().backward()
loss = model(torch.ones(2, 4)).sum()  # (this forward is collective: DDP rebuilds its buckets)
if kv.rank == 1:
    kv.close()  # worker 0's round 1 can never complete
else:
    try:
        loss.backward()
    except RuntimeError as e:
        print(f"backward raised {e}", flush=True)
dist.barrier()
"""


def test_a_failed_exchange_reaches_backward_as_pskvs_error(tmp_path: Path) -> None:
    """It was "Unable to cast <pskv's message> to Tensor": DDP took the exception for the bucket's sum."""
    res = jobs.launch(tmp_path, A_WORKER_LEAVES, 2, 1, timeout=120)
    assert res.code == 0, res
    assert "backward raised " in res.stdout and "Unable to cast" not in res.stdout, res
    assert "NodeFailedError: push and pull of 1 parts: worker 1 finished (closed its store) without pushing key" in res.stdout, res


def test_ddp_hook_refuses_what_it_cannot_do() -> None:
    import pskv

    kv = pskv.kv.create("local")
    with pytest.raises(pskv.KVStoreError, match="'max'"):
        pskv.ddp_hook(kv, "max")
    kv.set_optimizer(pskv.optim.create("sgd"))
    with pytest.raises(pskv.KVStoreError, match="optimizer"):
        pskv.ddp_hook(kv)
    kv.close()


def test_ddp_hook_on_a_local_store_is_the_identity_sum() -> None:
    """One process: the hook's future holds the bucket itself (a sum over one worker)."""
    import pskv

    kv = pskv.kv.create("local")
    hook = pskv.ddp_hook(kv, "sum")

    class Bucket:
        def __init__(self, t: torch.Tensor):
            self.t = t

        def buffer(self) -> torch.Tensor:
            return self.t

        def index(self) -> int:
            return 0

    grads = torch.arange(6.0)
    assert torch.equal(hook(None, Bucket(grads.clone())).wait(), grads)
    assert torch.equal(hook(None, Bucket(grads * 2)).wait(), grads * 2)  # the same key, a new round
    # a model with bf16 and fp32 parameters: after DDP rebuilds its buckets, index 0 may hold as many
    # elements of the other dtype (it was a DTypeMismatchError from backward)
    assert torch.equal(hook(None, Bucket(grads.bfloat16())).wait(), grads.bfloat16())
    assert sorted(kv._keys) == ["ddp-bucket-0-6-bfloat16", "ddp-bucket-0-6-float32"]
    kv.close()
