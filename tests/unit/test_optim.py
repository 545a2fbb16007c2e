"""pskv.optim against torch.optim: same hyperparameters, same numbers after several steps."""

from __future__ import annotations

import math

import pytest
import torch

import pskv
from pskv.optim import Optimizer, apply_push, create, scheduled_lr

STEPS = 6


def _grads(shape: tuple[int, ...], steps: int = STEPS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


def _run_pskv(opt: Optimizer, w0: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    w = w0.clone()
    for g in grads:
        before = g.to_dense().clone()
        opt.update(7, g, w)
        assert torch.equal(g.to_dense(), before), "update must not modify the gradient"
    return w


def _run_torch(cls: type[torch.optim.Optimizer], w0: torch.Tensor, grads: list[torch.Tensor], **kw: object) -> torch.Tensor:
    p = torch.nn.Parameter(w0.clone())
    opt = cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


DENSE_CASES = [
    ("sgd", {"learning_rate": 0.1}, torch.optim.SGD, {"lr": 0.1}),
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9}, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (
        "sgd",
        {"learning_rate": 0.05, "momentum": 0.9, "wd": 5e-4, "nesterov": True},
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "nesterov": True},
    ),
    (
        "sgd",
        {"learning_rate": 0.05, "momentum": 0.8, "dampening": 0.3, "wd": 1e-3},
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.8, "dampening": 0.3, "weight_decay": 1e-3},
    ),
    ("adam", {"learning_rate": 1e-2}, torch.optim.Adam, {"lr": 1e-2}),
    (
        "adam",
        {"learning_rate": 3e-3, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6, "wd": 1e-2},
        torch.optim.Adam,
        {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 1e-2},
    ),
    ("adamw", {"learning_rate": 1e-2}, torch.optim.AdamW, {"lr": 1e-2}),
    ("adamw", {"learning_rate": 1e-2, "wd": 0.1}, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    ("adagrad", {"learning_rate": 0.1}, torch.optim.Adagrad, {"lr": 0.1}),
    (
        "adagrad",
        {"learning_rate": 0.1, "lr_decay": 0.05, "wd": 1e-3, "initial_accumulator_value": 0.2, "epsilon": 1e-8},
        torch.optim.Adagrad,
        {"lr": 0.1, "lr_decay": 0.05, "weight_decay": 1e-3, "initial_accumulator_value": 0.2, "eps": 1e-8},
    ),
]


@pytest.mark.parametrize(("name", "hyper", "torch_cls", "torch_kw"), DENSE_CASES)
def test_dense_update_matches_torch(name: str, hyper: dict, torch_cls: type, torch_kw: dict) -> None:
    w0 = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    grads = _grads((5, 4))
    ours = _run_pskv(create(name, **hyper), w0, grads)
    theirs = _run_torch(torch_cls, w0, grads, **torch_kw)
    assert not torch.equal(ours, w0)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("name", "hyper", "torch_cls", "torch_kw"), DENSE_CASES)
def test_updating_inside_a_scratch_gradient_gives_the_same_numbers(name: str, hyper: dict, torch_cls: type, torch_kw: dict) -> None:
    w0 = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    grads = _grads((5, 4))
    keep, scratch = create(name, rescale_grad=0.5, **hyper), create(name, rescale_grad=0.5, **hyper)
    a, b = w0.clone(), w0.clone()
    for g in grads:
        keep.update(0, g, a)
        scratch.update(0, g.clone(), b, grad_is_scratch=True)
    assert torch.equal(a, b)


def _sparse_grads(rows: int, cols: int, steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, rows, (4,), generator=g)  # repeats allowed: torch coalesces
        vals = torch.randn(4, cols, generator=g)
        out.append(torch.sparse_coo_tensor(idx.unsqueeze(0), vals, (rows, cols), check_invariants=True))
    return out


SPARSE_CASES = [
    ("sgd", {"learning_rate": 0.1}, torch.optim.SGD, {"lr": 0.1}),
    ("adagrad", {"learning_rate": 0.1}, torch.optim.Adagrad, {"lr": 0.1}),
    ("adagrad", {"learning_rate": 0.1, "lr_decay": 0.1}, torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.1}),
    ("adam", {"learning_rate": 1e-2}, torch.optim.SparseAdam, {"lr": 1e-2}),
    (
        "adam",
        {"learning_rate": 1e-2, "beta1": 0.7, "beta2": 0.9, "epsilon": 1e-6},
        torch.optim.SparseAdam,
        {"lr": 1e-2, "betas": (0.7, 0.9), "eps": 1e-6},
    ),
]


@pytest.mark.parametrize(("name", "hyper", "torch_cls", "torch_kw"), SPARSE_CASES)
def test_row_sparse_update_matches_torch(name: str, hyper: dict, torch_cls: type, torch_kw: dict) -> None:
    w0 = torch.randn(10, 3, generator=torch.Generator().manual_seed(2))
    grads = _sparse_grads(10, 3)
    ours = _run_pskv(create(name, **hyper), w0, grads)
    theirs = _run_torch(torch_cls, w0, grads, **torch_kw)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    touched = torch.unique(torch.cat([g.coalesce().indices()[0] for g in grads]))
    untouched = [r for r in range(10) if r not in set(touched.tolist())]
    assert untouched, "the test needs rows no gradient touches"
    assert torch.equal(ours[untouched], w0[untouched])


@pytest.mark.parametrize(("name", "torch_cls"), [("adagrad", torch.optim.Adagrad), ("adam", torch.optim.SparseAdam), ("adamw", torch.optim.SparseAdam)])
def test_row_sparse_weight_decay_is_lazy_on_the_rows_present(name: str, torch_cls: type) -> None:
    """SPEC 4 and "Row-sparse": wd on a row-sparse gradient touches only the rows present (torch refuses wd with sparse
    gradients, so the reference folds it in by hand: L2 as ``g + wd * w`` on those rows; adamw's decoupled
    ``w *= 1 - lr * wd`` on them before SparseAdam's step)."""
    lr, wd = 0.05, 0.1
    w0 = torch.randn(10, 3, generator=torch.Generator().manual_seed(5))
    grads = _sparse_grads(10, 3)
    ours = _run_pskv(create(name, learning_rate=lr, wd=wd), w0, grads)
    p = torch.nn.Parameter(w0.clone())
    opt = torch_cls([p], lr=lr)
    for g in grads:
        g = g.coalesce()
        rows, vals = g.indices()[0], g.values()
        with torch.no_grad():
            if name == "adamw":
                p[rows] *= 1 - lr * wd
            else:
                vals = vals + wd * p[rows]
        p.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), vals, g.shape)
        opt.step()
    torch.testing.assert_close(ours, p.detach(), rtol=1e-6, atol=1e-7)
    touched = set(torch.cat([g.coalesce().indices()[0] for g in grads]).tolist())
    untouched = [r for r in range(10) if r not in touched]
    assert untouched and torch.equal(ours[untouched], w0[untouched])


def test_sparse_sgd_momentum_is_lazy_dense_rule_on_present_rows() -> None:
    opt = create("sgd", learning_rate=0.5, momentum=0.9)
    w = torch.zeros(4, 2)
    g1 = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 2), (4, 2), check_invariants=True)
    g2 = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.ones(2, 2), (4, 2), check_invariants=True)
    opt.update(0, g1, w)  # row 1: buf = 1, w = -0.5
    opt.update(0, g2, w)  # row 1: buf = 0.9 + 1 = 1.9, w = -0.5 - 0.95; row 3: buf = 1, w = -0.5
    assert torch.allclose(w[1], torch.full((2,), -1.45))
    assert torch.allclose(w[3], torch.full((2,), -0.5))
    assert torch.equal(w[0], torch.zeros(2)) and torch.equal(w[2], torch.zeros(2))


def test_rescale_and_clip_apply_before_the_rule() -> None:
    w0 = torch.randn(6, generator=torch.Generator().manual_seed(4))
    grads = [g * 10 for g in _grads((6,))]
    ours = _run_pskv(create("sgd", learning_rate=0.1, momentum=0.9, rescale_grad=0.25, clip_gradient=0.5), w0, grads)
    theirs = _run_torch(torch.optim.SGD, w0, [(g * 0.25).clamp(-0.5, 0.5) for g in grads], lr=0.1, momentum=0.9)
    torch.testing.assert_close(ours, theirs)


def test_lr_schedules() -> None:
    step = {"name": "step", "step": 3, "factor": 0.5}
    assert [scheduled_lr(1.0, step, n) for n in range(1, 8)] == [1, 1, 1, 0.5, 0.5, 0.5, 0.25]
    multi = {"name": "multifactor", "step": [2, 5], "factor": 0.1}
    assert [round(scheduled_lr(1.0, multi, n), 12) for n in (1, 2, 3, 5, 6)] == [1, 1, 0.1, 0.1, 0.01]
    cos = {"name": "cosine", "max_update": 10, "final_lr": 0.0, "warmup_steps": 0, "warmup_begin_lr": 0.0}
    assert scheduled_lr(2.0, cos, 5) == pytest.approx(2.0 * (1 + math.cos(math.pi * 0.5)) / 2)
    assert scheduled_lr(2.0, cos, 10) == 0.0
    warm = {"name": "cosine", "max_update": 10, "final_lr": 0.1, "warmup_steps": 4, "warmup_begin_lr": 0.0}
    assert scheduled_lr(1.0, warm, 2) == pytest.approx(0.5)


def test_scheduler_drives_updates_and_learning_rate() -> None:
    opt = create("sgd", learning_rate=1.0, lr_scheduler={"name": "step", "step": 2, "factor": 0.1})
    w = torch.zeros(1)
    lrs = []
    for _ in range(4):
        lrs.append(opt.learning_rate)
        opt.update(0, torch.ones(1), w)
    assert lrs == pytest.approx([1.0, 1.0, 0.1, 0.1])
    assert w.item() == pytest.approx(-2.2)
    opt.set_learning_rate(10.0)
    assert opt.learning_rate == pytest.approx(0.1)  # update 5: 10 * 0.1**2


def test_description_roundtrip_is_plain_data() -> None:
    opt = create("adam", learning_rate=0.01, wd=1e-4, lr_scheduler={"name": "step", "step": 10, "factor": 0.5})
    desc = opt.describe()
    import json

    again = Optimizer.from_description(json.loads(json.dumps(desc)))
    assert again.describe() == desc
    assert repr(opt) == "pskv.optim.create('adam', wd=0.0001, lr_scheduler={'name': 'step', 'step': 10, 'factor': 0.5})"
    assert repr(create("sgd")) == "pskv.optim.create('sgd')"  # (it said "create('sgd', )", in error messages too)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: create("rmsprop"), "unknown optimizer 'rmsprop'"),
        (lambda: create("sgd", lr=0.1), "did you mean 'learning_rate'"),
        (lambda: create("adam", momentum=0.9), r"it takes: beta1, beta2, clip_gradient, epsilon, learning_rate, lr_scheduler, rescale_grad, wd\)"),
        (lambda: create("sgd", learning_rate="0.1"), "learning_rate must be a finite number"),
        (lambda: create("sgd", learning_rate=float("nan")), "finite number"),
        (lambda: create("sgd", nesterov=True), "nesterov needs momentum"),
        (lambda: create("adam", beta1=1.0), r"beta1 must be in \[0, 1\)"),
        (lambda: create("sgd", learning_rate=-1), "learning_rate must be >= 0"),
        (lambda: create("adagrad", lr_decay=-0.5), "lr_decay must be >= 0"),  # a ZeroDivisionError at update 3
        (lambda: create("adagrad", initial_accumulator_value=-1), "initial_accumulator_value must be >= 0"),  # NaN weights
        (lambda: create("sgd", lr_scheduler={"name": "step", "step": 2, "factor": -0.5}), "factor must be a number >= 0"),
        (lambda: create("sgd", lr_scheduler={"name": "cosine", "max_update": 9, "final_lr": -1}), "final_lr must be a number >= 0"),
        (lambda: create("sgd", lr_scheduler={"name": "exp"}), "unknown lr_scheduler"),
        (lambda: create("sgd", lr_scheduler={"name": "step"}), "needs 'step'"),
        (lambda: Optimizer.from_description({"name": "sgd", "code": "import os"}), "not an optimizer description"),
        (lambda: Optimizer.from_description({"name": "sgd", "hyper": {"momentum": [1]}}), "finite number"),
    ],
)
def test_bad_optimizers_are_clear_errors(call: object, match: str) -> None:
    with pytest.raises(pskv.OptimizerError, match=match):
        call()  # type: ignore[operator]


@pytest.mark.parametrize("name", ["sgd", "adam", "adagrad"])
def test_state_dict_resumes_exactly(name: str) -> None:
    kw = {"learning_rate": 0.05, "momentum": 0.9} if name == "sgd" else {"learning_rate": 0.05}
    w0 = torch.randn(8, generator=torch.Generator().manual_seed(5))
    grads = _grads((8,), steps=6)
    straight = _run_pskv(create(name, **kw), w0, grads)
    first = create(name, **kw)
    w = _run_pskv(first, w0, grads[:3])
    state = first.state_dict()
    second = create(name, **kw)
    second.load_state_dict(state)
    resumed = _run_pskv(second, w, grads[3:])
    torch.testing.assert_close(resumed, straight, rtol=0, atol=0)


def test_apply_push_assigns_without_optimizer() -> None:
    stored = torch.ones(3, 2)
    apply_push(None, 0, torch.full((3, 2), 4.0), stored)
    assert torch.equal(stored, torch.full((3, 2), 4.0))
    rs = torch.sparse_coo_tensor(torch.tensor([[2]]), torch.full((1, 2), 7.0), (3, 2), check_invariants=True)
    apply_push(None, 0, rs, stored)
    assert torch.equal(stored, torch.tensor([[0.0, 0.0], [0.0, 0.0], [7.0, 7.0]]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hyper", [{}, {"momentum": 0.9, "wd": 0.01, "nesterov": True}])
def test_sgd_updates_every_element_of_half_precision_weights(dtype: torch.dtype, hyper: dict) -> None:
    """torch's fused CPU SGD left the vectorised elements (the first 16 k) of float16/bfloat16 weights
    as they were (and filled the momentum with garbage): the weights are those of float32, rounded."""
    gen = torch.Generator().manual_seed(0)
    w32, grads = torch.randn(40, generator=gen), [torch.randn(40, generator=gen) for _ in range(3)]
    low, ref = create("sgd", learning_rate=0.1, **hyper), create("sgd", learning_rate=0.1, **hyper)
    w = w32.to(dtype)
    for g in grads:
        low.update(0, g.to(dtype), w)
        ref.update(0, g, w32)
    torch.testing.assert_close(w.float(), w32, rtol=0, atol=0.05)


@pytest.mark.parametrize("hyper", [{}, {"momentum": 0.9, "wd": 1e-3, "rescale_grad": 0.5}, {"momentum": 0.8, "nesterov": True}, {"momentum": 0.9, "dampening": 0.1}])
@pytest.mark.parametrize("dtypes", [[torch.float32] * 3, [torch.bfloat16] * 3, [torch.float32, torch.float16, torch.float64]])
def test_update_all_is_update_key_by_key(hyper: dict, dtypes: list[torch.dtype]) -> None:
    """The path of the local Trainer (a fused call per dtype): bitwise the numbers of one update per
    key, with keys that join late (their momentum starts from their own first step)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (2, 2, 2)]
    one, many = pskv.optim.create("sgd", learning_rate=0.1, **hyper), pskv.optim.create("sgd", learning_rate=0.1, **hyper)
    w1 = [torch.randn(s, generator=gen).to(dt) for s, dt in zip(shapes, dtypes)]
    w2 = [w.clone() for w in w1]
    for step in range(4):
        keys = [0, 2] if step == 0 else [0, 1, 2]
        grads = [torch.randn(shapes[k], generator=gen).to(dtypes[k]) for k in keys]
        kept = [g.clone() for g in grads]
        for k, g in zip(keys, grads):
            one.update(k, g, w1[k])
        many.update_all(keys, grads, [w2[k] for k in keys])
        assert all(torch.equal(g, c) for g, c in zip(grads, kept)), "a gradient was changed"
        assert all(torch.equal(a, b) for a, b in zip(w1, w2)), step


def test_a_state_not_shaped_like_its_value_is_refused() -> None:
    """States loaded for another key (a local store's load before init): torch's fused kernel read and
    wrote past the state's end; now an error, and the weight is untouched."""
    opt = create("sgd", learning_rate=1.0, momentum=0.9)
    opt.update(0, torch.ones(2), torch.zeros(2))
    weight = torch.zeros(6)
    with pytest.raises(pskv.OptimizerError, match=r"key 0: its optimizer state is not the size of its value \(6,\)"):
        opt.update(0, torch.ones(6), weight)
    assert weight.tolist() == [0.0] * 6


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_gradient_not_shaped_like_its_value_is_refused(name: str) -> None:
    """sgd's fused kernel read past the end of a smaller gradient (garbage weights); adam raised torch's broadcast error."""
    weight = torch.zeros(5)
    with pytest.raises(pskv.OptimizerError, match=r"key 3: a gradient of shape \(2,\) for a value of shape \(5,\)"):
        create(name, learning_rate=1.0).update(3, torch.ones(2), weight)
    assert weight.tolist() == [0.0] * 5


@pytest.mark.parametrize("layout", ["a slice", "transposed, its gradient not", "channels_last, its gradient not", "channels_last, its gradient too"])
@pytest.mark.parametrize("hyper", [{}, {"momentum": 0.9, "wd": 1e-3}])
def test_sgd_of_a_weight_not_contiguous_matches_torch(layout: str, hyper: dict) -> None:
    """torch's fused kernel walks each tensor's memory in order: a parameter that is a slice (nn.Parameter(w[:, ::2])),
    or one whose gradient has other strides, got the update of other elements (a Trainer without a store, update_all)."""
    def make() -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        return {"a slice": lambda: torch.randn(5, 12, generator=gen)[:, ::2], "transposed, its gradient not": lambda: torch.randn(6, 5, generator=gen).t(),
                "channels_last, its gradient not": lambda: torch.randn(2, 3, 2, 2, generator=gen).to(memory_format=torch.channels_last)}[layout.replace("too", "not")]()
    one, many, ref = make(), make(), torch.nn.Parameter(make().contiguous())
    assert not one.is_contiguous()
    grads = [g.to(memory_format=torch.channels_last) if layout.endswith("too") else g for g in _grads(tuple(one.shape), steps=3)]
    a, b = create("sgd", learning_rate=0.1, **hyper), create("sgd", learning_rate=0.1, **hyper)
    opt = torch.optim.SGD([ref], lr=0.1, momentum=hyper.get("momentum", 0), weight_decay=hyper.get("wd", 0))
    for g in grads:
        a.update(0, g, one)
        b.update_all([0], [g], [many])
        ref.grad = g.clone()
        opt.step()
    for got in (one, many):
        torch.testing.assert_close(got, ref.detach(), rtol=1e-6, atol=1e-7)
