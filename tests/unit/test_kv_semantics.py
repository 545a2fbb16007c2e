"""Store semantics of SPEC.md section 2, on every store type (dist types in an in-process job)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

import pskv
from pskv.kv import KVStore


def rs(rows: list[int], vals: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A row-sparse tensor holding ``vals`` at ``rows``."""
    return torch.sparse_coo_tensor(torch.tensor([rows]), vals, shape, check_invariants=True)


def pulled(kv: KVStore, key: object, like: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(like, float("nan"))
    kv.pull(key, out)  # type: ignore[arg-type]
    return out


# -- basics -------------------------------------------------------------------------------------


def test_create_types_and_identity() -> None:
    assert pskv.kv.create().type == "local"
    assert pskv.kv.create("device").type == "device"
    assert pskv.kv.create("local_allreduce_device").type == "device"
    kv = pskv.kv.create()
    assert (kv.rank, kv.num_workers) == (0, 1)
    with pytest.raises(pskv.KVStoreError, match=r"unknown store type 'dist_foo'.*local"):
        pskv.kv.create("dist_foo")


def test_init_value_is_pulled_and_init_copies(kv: KVStore) -> None:
    v = torch.arange(6.0).view(2, 3)
    kv.init("w", v)
    v.add_(100)  # the store kept its own copy
    assert torch.equal(pulled(kv, "w", v), torch.arange(6.0).view(2, 3))


def test_four_device_values_are_summed(kv: KVStore) -> None:
    kv.init(3, torch.ones(2, 3))
    kv.push(3, [torch.ones(2, 3)] * 4)
    assert torch.equal(pulled(kv, 3, torch.ones(2, 3)), torch.full((2, 3), 4.0))


def test_push_replaces_without_optimizer(kv: KVStore) -> None:
    kv.init("w", torch.ones(3))
    kv.push("w", torch.full((3,), 2.0))
    kv.push("w", torch.full((3,), 5.0))
    assert torch.equal(pulled(kv, "w", torch.ones(3)), torch.full((3,), 5.0))


def test_repeated_keys_in_one_call_are_summed(kv: KVStore) -> None:
    kv.init(["a", "b"], [torch.zeros(2), torch.zeros(2)])
    kv.push(["a", "b", "a"], [torch.ones(2), torch.full((2,), 7.0), [torch.ones(2), torch.full((2,), 2.0)]])
    assert torch.equal(pulled(kv, "a", torch.ones(2)), torch.full((2,), 4.0))
    assert torch.equal(pulled(kv, "b", torch.ones(2)), torch.full((2,), 7.0))


def test_pull_into_a_list_writes_every_output(kv: KVStore) -> None:
    kv.init(0, torch.full((4,), 3.0))
    outs = [torch.zeros(4), torch.zeros(4), torch.zeros(4)]
    kv.pull(0, outs)
    assert all(torch.equal(o, torch.full((4,), 3.0)) for o in outs)
    a, b = torch.zeros(4), [torch.zeros(4), torch.zeros(4)]
    kv.init(1, torch.ones(4))
    kv.pull([0, 1], [a, b])
    assert torch.equal(a, torch.full((4,), 3.0)) and all(torch.equal(x, torch.ones(4)) for x in b)


def test_sgd_optimizer_follows_the_round_formula(kv: KVStore) -> None:
    # W "workers" as W device values (rank+1)*ones: after round i the value is
    # 1 - lr * r * W(W+1)/2 * (i+1)   (SPEC.md section 3 with one process)
    workers, lr, r = 3, 0.1, 0.5
    kv.init("w", torch.ones(5))
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=lr, rescale_grad=r))
    grads = [torch.full((5,), float(rank + 1)) for rank in range(workers)]
    for i in range(4):
        kv.push("w", grads)
        want = 1 - lr * r * workers * (workers + 1) / 2 * (i + 1)
        torch.testing.assert_close(pulled(kv, "w", torch.ones(5)), torch.full((5,), want))


def test_momentum_optimizer_runs_in_place_with_state(kv: KVStore) -> None:
    kv.init(0, torch.zeros(2))
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0, momentum=0.5))
    for _ in range(3):
        kv.push(0, torch.ones(2))
    # buf: 1, 1.5, 1.75; w = -(1 + 1.5 + 1.75)
    torch.testing.assert_close(pulled(kv, 0, torch.ones(2)), torch.full((2,), -4.25))


def test_set_optimizer_again_keeps_or_restarts_the_states_alike_on_every_type(kv: KVStore) -> None:
    """The same description again changes nothing; another optimizer starts afresh, also an earlier
    object set again (local resumed its old momentum, the servers started afresh)."""
    kv.init(0, torch.zeros(2))
    first = pskv.optim.create("sgd", learning_rate=1.0, momentum=0.5)
    steps = [first, pskv.optim.create("sgd", learning_rate=1.0, momentum=0.5), pskv.optim.create("sgd", learning_rate=1.0, momentum=0.25), first]
    seen = []
    for opt, grad in zip(steps, (1.0, 2.0, 4.0, 8.0)):
        kv.set_optimizer(opt)
        kv.push(0, torch.full((2,), grad))
        seen.append(pulled(kv, 0, torch.ones(2))[0].item())
    # buffers: 1 (first), 0.5 + 2 (the same description: kept), 4 (another: afresh), 8 (first again: afresh)
    assert seen == [-1.0, -3.5, -7.5, -15.5]


def test_set_optimizer_again_compares_with_the_description_last_set(kv: KVStore) -> None:
    """An optimizer changed since it was set (not set again: the servers still run what they were sent),
    then another one like it as changed: another optimizer, so afresh on every type (local kept the
    old momentum: it compared with the changed object)."""
    kv.init(0, torch.zeros(2))
    first = pskv.optim.create("sgd", learning_rate=1.0, momentum=0.5)
    kv.set_optimizer(first)
    kv.push(0, torch.full((2,), 1.0))
    first.set_learning_rate(2.0)
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=2.0, momentum=0.5))
    kv.push(0, torch.full((2,), 2.0))
    assert pulled(kv, 0, torch.ones(2))[0].item() == -1.0 - 2.0 * 2.0  # buffer 2: afresh


def test_pushed_tensor_is_never_modified_and_can_be_pushed_again(kv: KVStore) -> None:
    """MXNet 1.9.1 overwrote a pushed CPU array with the pulled result; pskv must not."""
    grad = torch.ones(3)
    kv.init("w", torch.zeros(3))
    for _ in range(4):
        kv.push("w", grad)
        assert torch.equal(grad, torch.ones(3))
    assert torch.equal(pulled(kv, "w", grad), torch.ones(3))
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0))
    kv.push("w", [grad, grad])
    assert torch.equal(grad, torch.ones(3))
    assert torch.equal(pulled(kv, "w", grad), torch.full((3,), -1.0))


def test_push_takes_the_value_at_call_time(kv: KVStore) -> None:
    """The caller may reuse a pushed tensor as soon as push returns (dist: TCP frames are sent
    without a copy, so push waits until the bytes are handed over)."""
    kv.init("w", torch.zeros(1100, 1000))
    g = torch.full((1100, 1000), 2.0)
    kv.push("w", g)
    g.fill_(100.0)
    assert torch.equal(pulled(kv, "w", g), torch.full((1100, 1000), 2.0))


def test_pushpull_writes_back_into_value_or_out(kv: KVStore) -> None:
    kv.init(0, torch.zeros(3))
    v = [torch.ones(3), torch.full((3,), 2.0)]
    kv.pushpull(0, v)
    assert all(torch.equal(x, torch.full((3,), 3.0)) for x in v)
    src, out = torch.full((3,), 5.0), torch.zeros(3)
    kv.pushpull(0, src, out=out)
    assert torch.equal(out, src) and torch.equal(src, torch.full((3,), 5.0))


def test_broadcast_inits_then_pulls(kv: KVStore) -> None:
    outs = [torch.zeros(2, 2), torch.zeros(2, 2)]
    kv.broadcast("w", torch.full((2, 2), 9.0), outs)
    assert all(torch.equal(o, torch.full((2, 2), 9.0)) for o in outs)
    with pytest.raises(pskv.DuplicateInitError):
        kv.broadcast("w", torch.zeros(2, 2), outs)
    with pytest.raises(pskv.ShapeMismatchError):
        kv.broadcast("v", torch.zeros(2, 2), torch.zeros(3))
    with pytest.raises(pskv.KeyNotInitializedError):  # the rejected broadcast left nothing behind
        kv.pull("v", torch.zeros(2, 2))


def test_parameters_with_requires_grad_are_fine(kv: KVStore) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    kv.init(0, p)
    kv.push(0, p)
    kv.pull(0, p)
    assert torch.equal(p.detach(), torch.ones(3))


# -- errors: clear, named, and harmless ---------------------------------------------------------


def test_errors_name_the_key_and_leave_the_store_usable(kv: KVStore) -> None:
    kv.init("w", torch.ones(2, 3))
    kv.init("b", torch.ones(3))
    with pytest.raises(pskv.ShapeMismatchError, match=r"key 'w'.*shape \(3, 2\).*shape \(2, 3\)"):
        kv.push("w", torch.ones(3, 2))
    with pytest.raises(pskv.DTypeMismatchError, match=r"key 'w'.*torch.float64.*torch.float32"):
        kv.push("w", torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(pskv.ShapeMismatchError, match="key 'b'"):
        kv.pull("b", torch.ones(4))
    with pytest.raises(pskv.KeyNotInitializedError, match="key 'nope'"):
        kv.push("nope", torch.ones(1))
    with pytest.raises(pskv.DuplicateInitError, match="key 'w'"):
        kv.init("w", torch.ones(2, 3))
    with pytest.raises(pskv.KeyTypeError, match="never mixes"):
        kv.init(5, torch.ones(1))
    with pytest.raises(pskv.KeyTypeError, match="int or str"):
        kv.push(1.5, torch.ones(1))  # type: ignore[arg-type]
    with pytest.raises(pskv.InvalidValueError, match=r"key 'w'.*torch\.Tensor"):
        kv.push("w", [[1.0, 2.0]])  # type: ignore[list-item]
    with pytest.raises(pskv.ValueCountError):
        kv.push(["w", "b"], [torch.ones(2, 3)])
    with pytest.raises(pskv.KVStoreError, match=r"priority must be a whole number .* got 'high'"):
        kv.push("w", torch.ones(2, 3), priority="high")  # type: ignore[arg-type]
    # a failing multi-key call changes nothing, not even its valid part
    with pytest.raises(pskv.ShapeMismatchError):
        kv.push(["b", "w"], [torch.full((3,), 9.0), torch.ones(1)])
    assert torch.equal(pulled(kv, "b", torch.ones(3)), torch.ones(3))
    # every key still works
    kv.push("w", torch.full((2, 3), 2.0))
    assert torch.equal(pulled(kv, "w", torch.ones(2, 3)), torch.full((2, 3), 2.0))
    assert all(issubclass(c, pskv.KVStoreError) for c in (pskv.ShapeMismatchError, pskv.KeyTypeError))


def test_an_out_that_cannot_hold_a_value_is_refused_before_anything(kv: KVStore) -> None:
    """An expanded out (stride 0): torch's RuntimeError came from the copy, after pushpull had pushed, broadcast had
    initialised the key, and a multi-key pull had written the keys before it."""
    kv.init(["a", "b"], [torch.ones(3), torch.ones(3)])
    with pytest.raises(pskv.InvalidValueError, match=r"key 'a'.*expanded"):
        kv.pushpull("a", torch.full((3,), 5.0), out=torch.zeros(1).expand(3))
    out_b = torch.zeros(3)
    with pytest.raises(pskv.InvalidValueError, match=r"key 'a'.*expanded"):
        kv.pull(["b", "a"], [out_b, torch.zeros(1).expand(3)])
    assert torch.equal(out_b, torch.zeros(3)) and torch.equal(pulled(kv, "a", torch.ones(3)), torch.ones(3))
    with pytest.raises(pskv.InvalidValueError, match=r"key 'd'.*expanded"):
        kv.broadcast("d", torch.ones(3), out=torch.zeros(1).expand(3))
    kv.init("d", torch.ones(3))  # the refused broadcast did not init it
    kv.init("c", torch.ones(1, 3))
    kv.pull("c", torch.zeros(3).as_strided((1, 3), (0, 1)))  # a stride of 0 on a dimension of one element shares nothing


def test_mixed_key_kinds_in_one_init_leave_nothing() -> None:
    kv = pskv.kv.create()
    with pytest.raises(pskv.KeyTypeError):
        kv.init([1, "a"], [torch.ones(1), torch.ones(1)])
    kv.init("a", torch.ones(1))  # the store's key kind was not fixed by the failed call
    with pytest.raises(pskv.DuplicateInitError):
        kv.init(["b", "b"], [torch.ones(1), torch.ones(1)])
    kv.init("b", torch.ones(1))


def test_closed_store_refuses_calls() -> None:
    with pskv.kv.create() as kv:
        kv.init(0, torch.ones(1))
    with pytest.raises(pskv.StoreClosedError):
        kv.pull(0, torch.ones(1))
    kv.close()  # idempotent


# -- row-sparse ---------------------------------------------------------------------------------


def test_row_sparse_pull_returns_exactly_the_requested_rows(kv: KVStore) -> None:
    weight = torch.arange(24.0).view(6, 4)
    kv.init("emb", weight.to_sparse(1))
    out = rs([0], torch.zeros(1, 4), (6, 4))
    kv.row_sparse_pull("emb", out, row_ids=torch.tensor([4, 1, 4, 2]))
    out = out.coalesce()
    assert out.indices()[0].tolist() == [1, 2, 4]
    assert torch.equal(out.values(), weight[[1, 2, 4]])
    dense = torch.full((6, 4), -1.0)
    kv.row_sparse_pull("emb", dense, row_ids=torch.tensor([5]))
    want = torch.zeros(6, 4)
    want[5] = weight[5]
    assert torch.equal(dense, want)
    kv.row_sparse_pull("emb", dense, row_ids=torch.tensor([], dtype=torch.int64))  # (a batch without ids: dist waited for nothing)
    assert torch.equal(dense, torch.zeros(6, 4))


def test_row_sparse_pull_of_a_key_whose_rows_have_no_elements(kv: KVStore) -> None:
    """A key of shape (5, 0): dist stores failed with a bare RuntimeError ("shape '[2, 0]' is invalid for input of size 2")."""
    kv.init("none", torch.ones(5, 0))
    dense, sparse = torch.ones(5, 0), rs([0], torch.zeros(1, 0), (5, 0))
    kv.row_sparse_pull("none", [dense, sparse], row_ids=torch.tensor([3, 1, 3]))
    assert dense.shape == (5, 0) and sparse.coalesce().indices()[0].tolist() == [1, 3]


def test_row_sparse_pull_into_device_list_with_own_rows(kv: KVStore) -> None:
    weight = torch.arange(12.0).view(6, 2)
    kv.init(0, weight)
    outs = [torch.zeros(6, 2), torch.zeros(6, 2)]
    kv.row_sparse_pull(0, outs, row_ids=[torch.tensor([0]), torch.tensor([3, 3])])
    assert torch.equal(outs[0][0], weight[0]) and outs[0][1:].abs().sum() == 0
    assert torch.equal(outs[1][3], weight[3]) and outs[1].abs().sum() == weight[3].sum()


def test_row_sparse_key_rules(kv: KVStore) -> None:
    kv.init("emb", rs([0], torch.ones(1, 2), (4, 2)))
    with pytest.raises(pskv.SparseError, match="key 'emb' is row-sparse"):
        kv.pull("emb", torch.zeros(4, 2))
    sparse_out = rs([1], torch.ones(1, 2), (4, 2))
    with pytest.warns(UserWarning, match="skipped the row-sparse outputs of key") as caught:
        kv.pull("emb", sparse_out)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    assert sparse_out.coalesce().indices()[0].tolist() == [1]  # untouched
    kv.pull("emb", sparse_out, ignore_sparse=False)
    assert torch.equal(sparse_out.to_dense(), torch.tensor([[1.0, 1.0], [0, 0], [0, 0], [0, 0]]))
    with pytest.raises(pskv.SparseError, match=r"row_ids must be in \[0, 4\)"):
        kv.row_sparse_pull("emb", sparse_out, row_ids=torch.tensor([4]))
    with pytest.raises(pskv.SparseError, match="1-D integer"):
        kv.row_sparse_pull("emb", sparse_out, row_ids=torch.tensor([1.0]))
    # pushpull pulls dense values: refused before it pushes (it pushed, then failed or skipped the pull)
    for key, out in (("emb", torch.zeros(4, 2)), ("emb", sparse_out)):
        with pytest.raises(pskv.SparseError, match="key 'emb': pushpull pulls whole dense values"):
            kv.pushpull(key, rs([2], torch.ones(1, 2), (4, 2)), out)
    kv.init("d", torch.zeros(3))
    with pytest.raises(pskv.SparseError, match="key 'd': pushpull pulls whole dense values"):
        kv.pushpull("d", torch.ones(3), torch.zeros(3).to_sparse())
    dense = torch.zeros(4, 2)
    kv.row_sparse_pull("emb", dense, row_ids=torch.arange(4))
    assert torch.equal(dense, torch.tensor([[1.0, 1.0], [0, 0], [0, 0], [0, 0]]))  # no push went through
    kv.pull("d", d := torch.empty(3))
    assert torch.equal(d, torch.zeros(3))


def test_row_sparse_push_replaces_or_updates_rows(kv: KVStore) -> None:
    kv.init("emb", torch.ones(5, 2).to_sparse(1))
    kv.push("emb", [rs([1, 3], torch.ones(2, 2), (5, 2)), rs([3], torch.ones(1, 2), (5, 2))])
    dense = torch.zeros(5, 2)
    kv.row_sparse_pull("emb", dense, row_ids=torch.arange(5))
    assert dense[:, 0].tolist() == [0, 1, 0, 2, 0]  # replaced: absent rows are zero
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=0.5))
    kv.push("emb", rs([3], torch.full((1, 2), 2.0), (5, 2)))
    kv.row_sparse_pull("emb", dense, row_ids=torch.arange(5))
    assert dense[:, 0].tolist() == [0, 1, 0, 1, 0]
    for bad in (5, -1, 10**9):  # torch makes such tensors without a word; the store refuses them, and keeps its rows
        with pytest.raises(pskv.SparseError, match=rf"key 'emb': a sparse pushed value has row indices outside \[0, 5\): min {bad}"):
            wrong = torch.sparse_coo_tensor(torch.tensor([[bad]]), torch.ones(1, 2), (5, 2), check_invariants=False)
            kv.push("emb", [rs([1], torch.ones(1, 2), (5, 2)), wrong])
    kv.row_sparse_pull("emb", dense, row_ids=torch.arange(5))
    assert dense[:, 0].tolist() == [0, 1, 0, 1, 0]
    kv.push("emb", [torch.ones(5, 2), rs([1], torch.full((1, 2), 4.0), (5, 2))])  # dense and sparse: their dense sum
    kv.row_sparse_pull("emb", dense, row_ids=torch.arange(5))
    assert dense[:, 0].tolist() == [-0.5, -1.5, -0.5, 0.5, -0.5]


def test_an_empty_row_sparse_push_changes_no_row(kv: KVStore) -> None:
    """A gradient with no rows (an embedding that saw no index) is a push like any other (dist: it failed in a reshape)."""
    kv.init("emb", torch.ones(4, 2))
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=0.5))
    kv.push("emb", torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 2), (4, 2), check_invariants=True))
    kv.push("emb", rs([2], torch.ones(1, 2), (4, 2)))
    assert pulled(kv, "emb", torch.zeros(4, 2))[:, 0].tolist() == [1, 1, 0.5, 1]


def test_a_device_list_of_dense_and_row_sparse_values_is_compressed_as_their_dense_sum(kv: KVStore) -> None:
    """The same numbers on every type: dist stores encode the dense sum (row 1: 0.6 -> 0.5); local compressed
    only the dense value and added the rows uncompressed (0.3)."""
    kv.init("emb", torch.zeros(3, 2))
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.push("emb", [torch.full((3, 2), 0.3), rs([1], torch.full((1, 2), 0.3), (3, 2))])
    assert pulled(kv, "emb", torch.zeros(3, 2))[:, 0].tolist() == [0, 0.5, 0]


def test_sparse_embedding_gradients_train_through_the_store(kv: KVStore) -> None:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(8, 3, sparse=True)
    start = emb.weight.detach().clone()
    kv.init("emb", emb.weight.detach())
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=0.1))
    emb(torch.tensor([2, 5, 2])).sum().backward()
    grad = emb.weight.grad
    assert grad is not None and grad.is_sparse
    kv.push("emb", grad)
    kv.pull("emb", emb.weight)
    want = start.clone()
    want[2] -= 0.2
    want[5] -= 0.1
    torch.testing.assert_close(emb.weight.detach(), want)


def test_a_1bit_push_with_nan_in_one_key_pushes_none(kv: KVStore) -> None:
    """1bit cannot send NaN: the call is refused before any key goes (the keys before it went)."""
    kv.init(["a", "b"], [torch.zeros(3), torch.zeros(3)])
    kv.set_gradient_compression({"type": "1bit", "threshold": 0.0})
    with pytest.raises(pskv.NonFiniteError, match="key 'b': a gradient with NaN or Inf cannot be sent with 1bit"):
        kv.push(["a", "b"], [torch.ones(3), torch.tensor([1.0, float("nan"), 1.0])])
    torch.testing.assert_close(pulled(kv, "a", torch.zeros(3)), torch.zeros(3))


# -- optimizer states ---------------------------------------------------------------------------


def test_loaded_optimizer_states_replace_all_states(kv: KVStore, tmp_path: object) -> None:
    """A key that had no state in the file starts afresh after the load, on every store type (dist
    stores kept its later state: they merged the file into the servers' states)."""
    import pathlib

    path = pathlib.Path(str(tmp_path)) / "states.pskv"
    kv.init([0, 1], [torch.zeros(3), torch.zeros(2)])
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0, momentum=0.5))
    kv.push(0, torch.ones(3))  # key 0: buf 1, w -1; key 1: no state yet
    kv.save_optimizer_states(path)
    kv.push([0, 1], [torch.ones(3), torch.ones(2)])  # key 0: buf 1.5, w -2.5; key 1: buf 1, w -1
    kv.load_optimizer_states(path)
    kv.push([0, 1], [torch.ones(3), torch.ones(2)])  # key 0: buf 1.5 again, w -4; key 1: buf 1 (fresh), w -2
    torch.testing.assert_close(pulled(kv, 0, torch.ones(3)), torch.full((3,), -4.0))
    torch.testing.assert_close(pulled(kv, 1, torch.ones(2)), torch.full((2,), -2.0))


def test_optimizer_states_save_and_load(kv: KVStore, make_store: Callable[[str], KVStore], tmp_path: object) -> None:
    import pathlib

    path = pathlib.Path(str(tmp_path)) / "states.pskv"
    kv.init([0, 1], [torch.zeros(3), torch.zeros(2)])
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0, momentum=0.5))
    kv.push([0, 1], [torch.ones(3), torch.ones(2)])
    kv.save_optimizer_states(path)
    kv.push([0, 1], [torch.ones(3), torch.ones(2)])  # buf 1.5
    kv.load_optimizer_states(path)  # back to buf 1
    kv.push(0, torch.ones(3))  # buf 1.5 again -> w = -1 - 1.5 - 1.5
    torch.testing.assert_close(pulled(kv, 0, torch.ones(3)), torch.full((3,), -4.0))
    fresh = make_store(kv.type)
    fresh.init([0, 1], [torch.zeros(3), torch.zeros(2)])
    fresh.load_optimizer_states(path)  # installs the saved optimizer too
    fresh.push(0, torch.ones(3))
    torch.testing.assert_close(pulled(fresh, 0, torch.ones(3)), torch.full((3,), -1.5))
    other = make_store(kv.type)
    other.init([0, 1], [torch.zeros(3), torch.zeros(2)])
    other.set_optimizer(pskv.optim.create("adam"))
    with pytest.raises(pskv.OptimizerError, match="'sgd' states"):
        other.load_optimizer_states(path)
    bad = pathlib.Path(str(tmp_path)) / "bad"
    bad.write_bytes(b"not a state file")
    with pytest.raises(pskv.OptimizerError, match="bad is not a pskv optimizer-state file") as caught:
        kv.load_optimizer_states(bad)
    assert "weights_only" not in str(caught.value)  # not torch's advice to load it unsafely
    with pytest.raises(pskv.OptimizerError, match=r"cannot read optimizer states from .*missing: No such file"):
        kv.load_optimizer_states(bad.parent / "missing")
    with pytest.raises(pskv.OptimizerError, match=r"cannot write optimizer states to .*no-dir"):
        kv.save_optimizer_states(bad.parent / "no-dir" / "states")


def test_optimizer_states_load_by_the_keys_names(kv: KVStore, make_store: Callable[[str], KVStore], tmp_path: object) -> None:
    """A store whose keys were initialised in another order gets each key's own state (the file's
    states went by init order: 'a' took 'b''s momentum, silently)."""
    import pathlib

    path = pathlib.Path(str(tmp_path)) / "states.pskv"
    kv.init(["a", "b"], [torch.zeros(2), torch.zeros(2)])
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0, momentum=0.5))
    kv.push(["a", "b"], [torch.ones(2), torch.full((2,), 4.0)])  # buf a 1, b 4
    kv.save_optimizer_states(path)
    fresh = make_store(kv.type)
    fresh.init(["b", "a"], [torch.zeros(2), torch.zeros(2)])
    fresh.load_optimizer_states(path)
    fresh.push(["a", "b"], [torch.zeros(2), torch.zeros(2)])  # w = -0.5 * buf
    torch.testing.assert_close(pulled(fresh, "a", torch.ones(2)), torch.full((2,), -0.5))
    torch.testing.assert_close(pulled(fresh, "b", torch.ones(2)), torch.full((2,), -2.0))


def test_set_optimizer_needs_an_optimizer(kv: KVStore) -> None:
    with pytest.raises(pskv.OptimizerError, match=r"pskv.optim.create"):
        kv.set_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(pskv.OptimizerError, match="no optimizer"):
        kv.save_optimizer_states("/nonexistent/never-written")


# -- compression in process ---------------------------------------------------------------------


def test_2bit_compression_per_device_residuals(kv: KVStore) -> None:
    kv.init(0, torch.zeros(2))
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    g = [torch.tensor([0.3, 0.6]), torch.tensor([0.3, -0.6])]
    kv.push(0, g)  # dev0 sends [0, .5], dev1 sends [0, -.5]
    assert torch.equal(pulled(kv, 0, torch.ones(2)), torch.tensor([0.0, 0.0]))
    kv.push(0, g)  # residuals: dev0 [.6, .7] -> [.5, .5]; dev1 [.6, -.7] -> [.5, -.5]
    assert torch.equal(pulled(kv, 0, torch.ones(2)), torch.tensor([1.0, 0.0]))
    assert torch.equal(g[0], torch.tensor([0.3, 0.6]))
    kv.init(1, torch.zeros(3, dtype=torch.int64))  # integers travel as they are (2bit's levels of 0.5 made them 0)
    kv.push(1, torch.tensor([3, -4, 7]))
    kv.pull(1, out := torch.zeros(3, dtype=torch.int64))
    assert out.tolist() == [3, -4, 7]


# -- device -------------------------------------------------------------------------------------


def test_device_store_sums_on_first_tensors_device() -> None:
    kv = pskv.kv.create("device")
    kv.init(0, torch.zeros(3, dtype=torch.float64))
    kv.push(0, [torch.ones(3, dtype=torch.float64)] * 2)
    out = torch.zeros(3, dtype=torch.float64)
    kv.pull(0, out)
    assert torch.equal(out, torch.full((3,), 2.0, dtype=torch.float64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_store_on_cuda() -> None:
    n = torch.cuda.device_count()
    devs = [torch.device("cuda", i) for i in range(n)]
    kv = pskv.kv.create("device")
    kv.init(0, torch.zeros(4, device=devs[0]))
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0))
    kv.push(0, [torch.ones(4, device=d) for d in devs])
    outs = [torch.zeros(4, device=d) for d in devs]
    kv.pull(0, outs)
    for o in outs:
        assert torch.equal(o.cpu(), torch.full((4,), -float(n)))


def test_no_warning_from_internal_sparse_tensors(kv: KVStore) -> None:
    kv.init(0, torch.ones(3, 2).to_sparse(1))
    out = rs([0], torch.zeros(1, 2), (3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kv.row_sparse_pull(0, out, row_ids=torch.tensor([2]))
        kv.push(0, [rs([1], torch.ones(1, 2), (3, 2)), rs([1, 2], torch.ones(2, 2), (3, 2))])


# -- calls in flight (wait=False) -----------------------------------------------------------------


def test_calls_in_flight_return_handles(kv: KVStore) -> None:
    keys = [f"k{i}" for i in range(5)]
    kv.init(keys, [torch.zeros(3)] * 5)
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0))
    grads = [torch.full((3,), float(i + 1)) for i in range(5)]
    pushes = [kv.push(k, g, wait=False) for k, g in zip(keys, grads)]
    for g in grads:
        g.fill_(100.0)  # the values were taken when push returned
    outs = [torch.full((3,), float("nan")) for _ in keys]
    pulls = [kv.pull(k, o, wait=False) for k, o in zip(keys, outs)]
    for h in pulls + pushes:
        assert h is not None
        h.wait()
        assert h.done()
    assert [o.tolist() for o in outs] == [[-(i + 1.0)] * 3 for i in range(5)]
    both = kv.pushpull(keys, [torch.ones(3)] * 5, out=outs, wait=False)
    assert both is not None
    both.wait()
    assert [o[0].item() for o in outs] == [-(i + 2.0) for i in range(5)]
    assert kv.push(keys[0], torch.ones(3)) is None  # blocking calls return nothing
    with pytest.raises(pskv.KeyNotInitializedError):
        kv.pull("nope", torch.empty(3), wait=False)  # arguments are checked before anything is sent


def test_an_optimizer_refuses_a_key_it_cannot_update(kv: KVStore) -> None:
    """An integer key with an optimizer: an error by name (torch's kernels failed deep inside, and on
    a dist store the round was lost: later pulls waited PSKV_TIMEOUT); nothing changes, and the key goes on."""
    kv.init("ids", torch.tensor([1, 2]))
    kv.init("w", torch.zeros(2))
    kv.set_optimizer(pskv.optim.create("sgd", learning_rate=1.0, momentum=0.9))
    out, w = torch.empty(2, dtype=torch.int64), torch.empty(2)
    with pytest.raises(pskv.OptimizerError, match=r"key 'ids'.*an optimizer updates floating-point values; these are torch.int64"):
        kv.push("ids", torch.tensor([1, 1]))
        kv.pull("ids", out)  # (a dist store's push returns once sent: the pull after it says why it failed)
    kv.pull("ids", out)
    kv.push("w", torch.ones(2))
    kv.pull("w", w)
    assert out.tolist() == [1, 2] and w.tolist() == [-1.0, -1.0]


def test_outs_that_hold_no_data_or_cannot_be_written_or_are_two_keys_memory_are_refused_naming_the_key(kv: KVStore) -> None:
    """A meta value, an inference tensor as an out outside inference mode (torch's errors named no key; the dist
    stores' came once the round was answered), and one memory as the out of two keys in one call (which value it
    held depended on which answer came last): refused before anything is sent, naming the key."""
    kv.init(["a", "b"], [torch.ones(4), torch.full((4,), 2.0)])
    with pytest.raises(pskv.InvalidValueError, match=r"key 'm'.*meta device"):
        kv.init("m", torch.empty(4, device="meta"))
    with pytest.raises(pskv.InvalidValueError, match=r"key 'a'.*meta device"):
        kv.push("a", torch.empty(4, device="meta"))
    kv.init("m", torch.ones(4))  # the refused init left nothing
    with torch.inference_mode():
        made_inside = torch.zeros(4)
        kv.pull("a", out=made_inside)  # inside inference mode it can be written
    assert torch.equal(made_inside, torch.ones(4))
    with pytest.raises(pskv.InvalidValueError, match=r"key 'a'.*inference_mode"):
        kv.pull("a", out=made_inside)
    one = torch.zeros(8)
    for outs in ([one[:4], one[:4]], [one[:4], one[2:6]], [one.view(2, 4)[0], one[:4]]):
        with pytest.raises(pskv.InvalidValueError, match=r"key '[ab]'.*shares memory with the out of key '[ab]'"):
            kv.pull(["a", "b"], out=outs)
        with pytest.raises(pskv.InvalidValueError, match="shares memory"):
            kv.pushpull(["a", "b"], [torch.ones(4), torch.ones(4)], out=outs)
    assert torch.equal(one, torch.zeros(8)) and torch.equal(pulled(kv, "a", torch.ones(4)), torch.ones(4))
    kv.pull(["a", "b"], out=[one[:4], one[4:]])  # side by side: each its own
    kv.pull(["a", "a"], out=[one[:4], one[:4]])  # one key twice: the same value
    assert torch.equal(one, torch.tensor([1.0] * 4 + [2.0] * 4))
