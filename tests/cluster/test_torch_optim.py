"""pskv.DistributedOptimizer and the broadcasts in a real job: torch's AdamW and OneCycleLR on each
worker, the gradients summed by two servers, against one process training on all batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import jobs

pytestmark = pytest.mark.timeout(300)

SCRIPT = """\
import hashlib, torch, pskv
from torch import nn

kv = pskv.kv.create("dist_sync")
W, r = kv.num_workers, kv.rank


def make(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))


def batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def optimizer(net):
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.05, foreach=True)
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8)


net = make(r)  # each worker starts elsewhere: the broadcast makes them rank 0's
opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.05, foreach=True)
pskv.broadcast_parameters(net.named_parameters(), kv)
dopt = pskv.DistributedOptimizer(opt, kv)
sched = torch.optim.lr_scheduler.OneCycleLR(dopt, max_lr=0.05, total_steps=8)
ref = make(0)
ref_opt, ref_sched = optimizer(ref)
for step in range(8):
    if step == 4:  # a resumed job: only rank 0 has the states, then everyone has them
        if r != 0:
            opt.state.clear()
        pskv.broadcast_optimizer_state(dopt, kv)
    dopt.zero_grad(set_to_none=True)
    x, y = batch(step, r)
    nn.functional.cross_entropy(net(x), y).backward()
    dopt.step()
    sched.step()
    ref_opt.zero_grad()
    (sum(nn.functional.cross_entropy(ref(batch(step, k)[0]), batch(step, k)[1]) for k in range(W)) / W).backward()
    ref_opt.step()
    ref_sched.step()
for (name, a), b in zip(net.named_parameters(), ref.parameters()):
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (name, (a - b).abs().max())
digest = hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy().tobytes()).hexdigest()
assert len(set(kv.allgather(digest))) == 1, "the workers' weights differ"
print(f"rank {r}: torch optimizer ok, lr {sched.get_last_lr()[0]:.6f}", flush=True)
kv.close()
"""


def test_adamw_and_onecycle_through_the_servers_train_as_one_process(tmp_path: Path) -> None:
    res = jobs.launch(tmp_path, SCRIPT, 2, 2, timeout=240)
    assert res.code == 0, res
    for rank in (0, 1):
        assert f"rank {rank}: torch optimizer ok" in res.stdout, res
