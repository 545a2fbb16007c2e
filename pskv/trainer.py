"""The Trainer: gradients summed over devices and workers, then one optimizer step, on the store
(``update_on_kvstore``) or here. Semantics: docs/SPEC.md, "Trainer"; overlap: docs/DESIGN.md."""

from __future__ import annotations

import contextlib
import numbers
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union, cast

import torch
from torch import Tensor
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from . import optim
from .compression import Codec
from .errors import OptimizerError, TrainerError
from .kv import ALIASES, TYPES, KVStore, create
from .kv.base import Key
from .ps import timeline
from .ps.tracker import Handle

BROADCAST_KEYS = 2**40  # int keys from here up are the broadcasts' (pskv.distributed), below a Trainer's
RUN_BYTES = 4 << 20  # with overlap, gradients are pushed and weights pulled in calls of about this many bytes
FLAT_KEYS: Optional[bool] = None  # with overlap, a store key per run of parameters (_flatten); None: where they are on GPUs
_FLAT: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()  # parameters in runs (id -> itself): another Trainer's keep theirs
ParamsArg = Union[Iterable[Tensor], Iterable[tuple[str, Tensor]], Mapping[str, Tensor], Sequence[Any]]


def _replicas(params: ParamsArg) -> tuple[list[Key], list[list[Tensor]], list[tuple[Key, Tensor]]]:
    """Keys and, per device replica, the tensors (one replica unless a list of them is given); a
    shared tensor is trained once, frozen ones are left out (the third: replica 0's, by name or place)."""
    if isinstance(params, Tensor):  # (list() would take its rows for parameters)
        raise TrainerError("params must be an iterable of tensors (model.parameters()), not one tensor")
    groups = [params] if isinstance(params, Mapping) else list(params)
    if not groups:
        raise TrainerError("the Trainer got no parameters")
    if all(isinstance(g, (Tensor, tuple)) for g in groups):
        groups = [groups]  # one replica
    replicas, frozen = cast(list[dict[int, tuple[Key, Tensor]]], []), cast(list[tuple[Key, Tensor]], [])
    for group in groups:
        if isinstance(group, Tensor):
            raise TrainerError("params must be tensors, or one list of them per device replica; got a tensor beside lists")
        kept: dict[int, tuple[Key, Tensor]] = {}  # id(tensor) -> its key and itself
        for n, item in enumerate(group.items() if isinstance(group, Mapping) else group):
            name, t = item if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) else (None, item)
            if not isinstance(t, Tensor):
                groups_hint = " (torch's param groups? A Trainer runs one optimizer for all: per-group settings need pskv.DistributedOptimizer)"
                raise TrainerError(f"params must be tensors, (name, tensor) pairs, a dict, or one of those per device replica, got "
                                   f"{t!r:.60}" + (groups_hint if name == "params" else ""))
            if t.requires_grad and t.layout != torch.strided:  # (the local update failed inside torch, a store's pull skipped it)
                raise TrainerError(f"parameter {name or len(kept)!r} has layout {t.layout}: the Trainer trains dense parameters (row-sparse "
                                   "gradients come from dense weights, as nn.Embedding(sparse=True)'s)")
            if t.requires_grad:
                kept.setdefault(id(t), (name if name is not None else len(kept), t))
            elif not replicas:
                frozen.append((name if name is not None else f"#{n} given", t))
        replicas.append(kept)
    keys = [[k for k, _ in kept.values()] for kept in replicas]
    tensors = [[t for _, t in kept.values()] for kept in replicas]
    if not tensors[0]:
        raise TrainerError("every parameter is frozen (requires_grad=False): nothing to train")
    if any(k != keys[0] or [t.shape for t in ts] != [t.shape for t in tensors[0]] for k, ts in zip(keys, tensors)):
        raise TrainerError("every device replica must have the same parameters, in the same order and shapes")
    return keys[0], tensors, frozen


def _runs(ts: Sequence[Tensor], alike: Callable[[Tensor], Any] = lambda t: None) -> list[list[int]]:
    """Indexes of ``ts`` in runs of about ``RUN_BYTES``, in order; one unlike its run's first (``alike``) starts another."""
    runs: list[list[int]] = []
    for i, t in enumerate(ts):
        if not runs or alike(t) != alike(ts[runs[-1][0]]) or sum(ts[j].nbytes for j in runs[-1]) >= RUN_BYTES:
            runs.append([])
        runs[-1].append(i)
    return runs


def _flatten(keys: list[Key], reps: list[list[Tensor]]) -> tuple[list[Key], list[list[Tensor]], list[list[int]], dict[int, tuple[Tensor, Tensor]]]:
    """The runs of parameters as flat tensors (docs/DESIGN.md, "Flat keys"; gradients: :meth:`Trainer._gathered`): the runs'
    store keys, their flat tensors per replica, each run's parameter indexes, and each parameter's weight and gradient views (by its id)."""
    runs = _runs(reps[0], lambda t: (t.dtype, t.device))
    flats: list[list[Tensor]] = []
    views: dict[int, tuple[Tensor, Tensor]] = {}
    for rep in reps:
        flats.append([])
        for run in runs:
            flat = torch.cat([rep[i].detach().reshape(-1) for i in run])
            flat.grad = torch.zeros_like(flat)
            at = 0
            for i in run:
                views[id(rep[i])] = flat[at : at + rep[i].numel()].view_as(rep[i]), flat.grad[at : at + rep[i].numel()].view_as(rep[i])
                rep[i].data, _FLAT[id(rep[i])] = views[id(rep[i])][0], rep[i]
                at += rep[i].numel()
            flats[-1].append(flat)
    return [keys[run[0]] for run in runs], flats, runs, views


class _FirstReads(TorchFunctionMode):
    """Inside the outermost module forwards before the first step, in the thread that made the Trainer:
    the modules whose forwards run at each parameter's first read, outermost first (``where``: a
    parameter's id to its index). Not inside torch.compile's module (it would compile the recording)."""

    def __init__(self, where: dict[int, int]):
        super().__init__()
        self.where, self.running, self.first = where, cast(list[int], []), cast(dict[int, tuple[int, ...]], {})
        self.thread = threading.get_ident()

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        for t in tree_leaves((args, kwargs)):
            if (i := self.where.get(id(t))) is not None:
                self.first.setdefault(i, (*self.running,))
        return func(*args, **(kwargs or {}))

    def starts(self, module: torch.nn.Module) -> None:
        self.running.append(id(module))
        if len(self.running) == 1 and "_orig_mod" not in module._modules:
            self.__enter__()  # type: ignore[no-untyped-call]

    def ends(self, module: torch.nn.Module) -> None:
        self.running.pop()
        if not self.running and "_orig_mod" not in module._modules:
            self.__exit__(None, None, None)  # type: ignore[no-untyped-call]


def _own_keys(kv: KVStore, keys: list[Key]) -> list[Key]:
    """``keys``, or, where another Trainer on ``kv`` has them (a GAN's two), the next free ones: ints
    after the store's (below the broadcasts'), names with ``#1``, ``#2``, ... (every worker makes
    its Trainers in one order, so they agree)."""
    taken = set(kv._keys)
    if not taken.intersection(keys):
        return keys
    if isinstance(keys[0], int):
        start = max(k for k in taken if isinstance(k, int) and k < BROADCAST_KEYS) + 1
        return [start + cast(int, k) for k in keys]
    n = next(i for i in range(1, len(taken) + 2) if not taken.intersection(f"{k}#{i}" for k in keys))
    return [f"{k}#{n}" for k in keys]


class Trainer:
    """Applies an optimizer to parameters through a store (docs/SPEC.md, "Trainer" and "Overlap");
    not thread-safe. ``params``: tensors, ``(name, tensor)`` pairs or a dict (keys: the order, or the
    names), or one of those per device replica; shared tensors are trained once, frozen ones left alone.
    ``kvstore``: a store type name, a store, or ``None``. ``update_on_kvstore=None``: True whenever a
    store is used. ``overlap=None`` picks (SPEC); with overlap, accumulate gradients inside
    :meth:`no_sync` and call :meth:`synchronize` before reading weights outside a forward."""

    def __init__(self, params: ParamsArg, optimizer: Union[str, optim.Optimizer],
                 optimizer_params: Optional[dict[str, Any]] = None,
                 kvstore: Union[str, KVStore, None] = "device",
                 compression_params: Optional[dict[str, Any]] = None,
                 update_on_kvstore: Optional[bool] = None, overlap: Optional[bool] = None):
        self._keys, self._reps, self._frozen = _replicas(params)
        if not isinstance(optimizer, optim.Optimizer):
            optimizer = optim.create(optimizer, **(optimizer_params or {}))
        elif optimizer_params:
            raise OptimizerError("give optimizer_params only with an optimizer name")
        self._optimizer = optimizer
        self._scale = self._sent_scale = optimizer.rescale_grad  # _sent_scale: the store's optimizer's
        self._steps, self._sparse = 0, set[int]()  # _sparse: keys whose gradients came row-sparse
        if isinstance(kvstore, str):  # a local store for one device in one process would sum nothing
            if kvstore not in (*TYPES, *ALIASES):
                raise TrainerError(f"unknown store type {kvstore!r}; known: {', '.join([*TYPES, *ALIASES])}")
            one_device = not kvstore.startswith("dist") and len(self._reps) == 1 and not update_on_kvstore
            kvstore = None if one_device else create(kvstore)
        elif kvstore is not None and not isinstance(kvstore, KVStore):
            raise TrainerError(f"kvstore must be a store type name, a KVStore or None, not {type(kvstore).__name__}")
        kv = self._kv = kvstore
        self._async = kv is not None and kv.type == "dist_async"
        self._pace = kv.num_workers if kv is not None and self._async else 1  # the servers' updates per step: dist_async applies every worker's push
        sharing = [t._update_on_kvstore for t in kv.__dict__.get("_trainers", ())] if kv is not None else []  # of those on it
        if sharing and (update_on_kvstore or any(sharing) or self._async):
            raise TrainerError("a second Trainer on this store: a store runs one optimizer, for every key, so Trainers that "
                               "share one all pass update_on_kvstore=False (each updates its own parameters; the store "
                               "sums; not on dist_async), or one Trainer takes every parameter")
        if sharing and kv is not None and compression_params and (now := kv._compressor and kv._compressor.codec.describe()) != Codec.create(compression_params).describe():
            raise TrainerError(f"compression_params {dict(compression_params)} on a store that another Trainer's gradients "
                               f"cross as {now or 'uncompressed'}: a store has one codec for every key; give them the same")
        update_on_kvstore = False if sharing else update_on_kvstore
        if kv is None and update_on_kvstore:
            raise TrainerError("update_on_kvstore=True needs a store, but kvstore is None")
        if kv is None and len(self._reps) > 1:  # (update() takes replica 0's gradient for all)
            raise TrainerError(f"{len(self._reps)} device replicas need a store to sum their gradients: kvstore='device', not None")
        if self._async and update_on_kvstore is False:
            raise TrainerError("dist_async applies updates on the servers: update_on_kvstore=False is not possible")
        self._update_on_kvstore = kv is not None and (update_on_kvstore is None or bool(update_on_kvstore))
        if kv is not None and not self._update_on_kvstore and kv._optimizer is not None:
            raise TrainerError("update_on_kvstore=False on a store that runs an optimizer (set_optimizer): its pulls would "
                               "bring updated weights, not the summed gradients; give the Trainer a store without one")
        dist = kv is not None and kv.type.startswith("dist")
        if overlap and not dist:  # (before the store is touched)
            raise TrainerError("overlap needs a dist store: an in-process store has no exchange to overlap")
        # dist_sync types: gradients go "held" and the update waits for step's rescale (see rounds.py)
        self._held = kv is not None and self._update_on_kvstore and kv.type in ("dist_sync", "dist_device_sync")
        if overlap is None:  # on where it pays: parameters on a GPU, or servers on other hosts
            remote = kv is not None and len(getattr(kv, "_shm_servers", ())) < getattr(kv, "num_servers", 0)
            overlap = dist and (remote or any(t.is_cuda for rep in self._reps for t in rep))
        self._overlap = bool(overlap)
        self._names, self._params = self._keys, self._reps  # the parameters; the store's keys and values may be runs of them
        self._members, self._views = [[i] for i in range(len(self._keys))], cast(dict[int, tuple[Tensor, Tensor]], {})
        self._seen: dict[int, list[int]] = {}  # key index -> its weights' versions once its last pull was in (update_on_kvstore)
        if self._overlap and not any(id(t) in _FLAT or t.untyped_storage().nbytes() != t.nbytes for rep in self._reps for t in rep) and (
                FLAT_KEYS if FLAT_KEYS is not None else all(t.is_cuda for rep in self._reps for t in rep)):
            self._keys, self._reps, self._members, self._views = _flatten(self._keys, self._reps)
        if kv is not None:
            if compression_params:
                kv.set_gradient_compression(compression_params)
            self._keys = _own_keys(kv, self._keys)
            kv.init(self._keys, [t.detach() for t in self._reps[0]])
            self._metas = [kv._keys[k] for k in self._keys]  # (its calls from hooks skip the checks: _checked)
            self.pull_weights()  # worker 0's, everywhere
            if self._update_on_kvstore:  # (dist_async: every worker's is the same, its own rescale_grad; each push brings its 1/batch_size)
                kv.set_optimizer(optimizer)
        elif compression_params:
            raise TrainerError("compression_params need a store; this Trainer runs without one (local, one device)")
        self._pushed = [False] * len(self._keys)  # this step's gradient of each key is on its way
        self._cut = False  # a step() began and did not reach its end (an error, an interrupt): its gradients may have left
        self._ready = [0] * len(self._keys)  # replicas whose gradient of each key backward produced
        self._inflight: dict[int, Handle] = {}  # key index -> its exchange not waited for yet
        self._bucket: list[int] = []  # with overlap: key indexes whose gradients wait for the next push
        self._versions: dict[int, list[int]] = {}  # key index -> its gradients' versions when pushed (update_on_kvstore)
        self._syncing = True
        if kv is not None:  # (made: the Trainers on a store, while they live)
            kv.__dict__.setdefault("_trainers", weakref.WeakSet()).add(self)
        # the forwards before the first step (no pull in flight yet) show where each parameter's first read
        # is (a module reads a child's weights before, or without, calling it: MultiheadAttention its
        # out_proj's): later, the innermost forward running then of a module that holds it waits for it
        self._called: Optional[dict[int, torch.nn.Module]] = {} if self._overlap else None
        self._reads: dict[int, list[int]] = {}
        self._eager: list[int] = []  # keys no module's forward waits for (plain tensors, .forward() calls): step does
        self._queued, self._after_backward = False, cast(Optional[Callable[[], None]], None)
        if self._overlap:
            self._arm()

    def _arm(self) -> None:
        """The overlap's hooks (docs/DESIGN.md, "Overlap in the Trainer"): gradients leave in pushes of about
        ``RUN_BYTES``, and a module's forward waits for the run of ``step``'s pulls that holds its parameters."""
        self._sizes = [t.nbytes for t in self._reps[0]]
        self._runs = _runs(self._reps[0])
        where = self._where = {id(rep[j]): i for rep in self._params for i, run in enumerate(self._members) for j in run}
        reads = self._first_reads = _FirstReads(where)
        me = weakref.ref(self)  # the hooks must not keep the Trainer alive: they go when it does
        def grad_ready(param: Tensor) -> None:
            trainer = me()
            if trainer is not None:
                trainer._grad_ready(param)

        def before_forward(module: torch.nn.Module, args: Any) -> None:
            trainer = None if torch.compiler.is_compiling() else me()  # (compiled forwards: step waits, see _next_step)
            if trainer is not None and trainer._called is not None and threading.get_ident() == reads.thread:
                trainer._called[id(module)] = module
                reads.starts(module)
            if trainer is not None and trainer._inflight:
                own = module._parameters.values() if module.training else module.parameters()  # (eval: fast paths read all)
                for i in [where.get(id(t)) for t in own] + trainer._reads.get(id(module), []):
                    if i is not None and i in trainer._inflight:
                        t0 = timeline.now()
                        trainer._wait(i)
                        timeline.span(f"wait {trainer._keys[i]}", t0)
        def after_forward(module: torch.nn.Module, args: Any, out: Any) -> None:
            if not torch.compiler.is_compiling() and reads.running and threading.get_ident() == reads.thread:
                reads.ends(module)

        hooks = [t.register_post_accumulate_grad_hook(grad_ready) for rep in self._params for t in rep]  # type: ignore[no-untyped-call]
        self._after_forward = register_module_forward_hook(after_forward, always_call=True)  # (removed at the first step)
        for hook in [*hooks, register_module_forward_pre_hook(before_forward), self._after_forward]:
            weakref.finalize(self, hook.remove)

    def _grad_ready(self, param: Tensor) -> None:
        if not self._syncing:
            return
        if not self._queued:  # when this backward ends: what is left of the bucket goes, then _after_backward
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        if not self._overlap or self._async:  # (armed only to hear when backward ends: a DistributedOptimizer's; dist_async
            return  # applies a push as it arrives, with the 1/batch_size that step sends first: its gradients leave in step)
        i = self._where[id(param)]
        if self._pushed[i]:
            self._versions.pop(i, None)  # (this error says it: step goes on with the gradient that left)
            raise TrainerError(f"parameter {self._name(param)!r} got a second gradient before step(): " + (
                               "the last step() did not finish (an error or an interrupt in it), and its gradient had left; "
                               "call step() again to finish it" if self._cut else
                               "with overlap it left in the first backward; accumulate inside `with trainer.no_sync():` (all "
                               "but the last backward), and keep a backward from filling gradients not stepped (a GAN's D in "
                               "G's backward: `with trainer_d.no_sync():` around it, or D.requires_grad_(False))"))
        self._gathered(param)
        self._ready[i] += 1
        grads: list[Tensor] = [rep[i].grad for rep in self._reps]  # type: ignore[misc]
        if self._ready[i] < len(self._reps) * len(self._members[i]) or (not self._update_on_kvstore and any(g.is_sparse for g in grads)):
            return  # a sparse sum comes back by pull in step (pushpull would not fill a sparse grad)
        self._pushed[i] = True  # till the end of step: a second gradient before then is refused
        self._bucket.append(i)
        if sum(self._sizes[j] for j in self._bucket) >= RUN_BYTES:
            self._send_bucket()

    def _name(self, param: Tensor) -> Key:
        return next(k for rep in self._params for k, t in zip(self._names, rep) if t is param)

    def _gathered(self, param: Tensor) -> None:
        """With flat keys, ``param``'s gradient becomes its view of its run's (copied there if autograd made a
        new one); none: the view is zeros, and the gradient stays None (a row-sparse one later is refused)."""
        weight, view = self._views.get(id(param), (None, None))
        if view is None:
            return
        if param.data_ptr() != weight.data_ptr() or param.shape != weight.shape:  # type: ignore[union-attr]
            raise TrainerError(f"parameter {self._name(param)!r} is no longer the tensor the Trainer was made with (param.data "
                               "= ...?): its store key is a run of parameters (flat keys: parameters on GPUs, with overlap) "
                               "whose weights are views of one tensor; copy new values in (param.copy_, load_state_dict)")
        if param.grad is view:
            return
        if param.grad is not None and param.grad.layout != torch.strided:
            raise TrainerError(f"parameter {self._name(param)!r} got a row-sparse gradient, but its store key is a run of "
                               "parameters (flat keys: parameters on GPUs, with overlap): pass overlap=False")
        with torch.no_grad():
            view.copy_(param.grad) if param.grad is not None else view.zero_()
        if param.grad is not None:
            param.grad = view

    def _backward_end(self) -> None:
        self._queued = False
        self._send_bucket()
        if self._overlap and self._kv is not None:  # the first layers' gradients, needed first: not batched with step's pulls
            self._kv._hurry()
        if self._after_backward is not None:  # (a DistributedOptimizer: the sums, as DDP has them then)
            self._after_backward()

    def _send_bucket(self) -> None:
        """Push the gradients of the bucket in one call, without waiting; with pushpull the sums
        come back into the gradients."""
        which, self._bucket = self._bucket, []
        if not which:
            return
        assert self._kv is not None
        t0 = timeline.now()
        push = [(self._metas[i], cast(list[Tensor], [rep[i].grad for rep in self._reps])) for i in which]
        if self._update_on_kvstore:
            self._kv._checked(push, None, -which[-1], held=self._held)
            self._versions.update((i, self._stamps(i, grads=True)) for i in which)
        else:
            self._inflight.update(dict.fromkeys(which, self._kv._checked(push, push, -which[-1])))
        timeline.span(f"push {self._keys[which[0]]}..{self._keys[which[-1]]}", t0, keys=len(which))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of the backward passes inside stay here (they accumulate); the next backward
        outside sends the sums. Only meaningful with overlap (otherwise ``step`` sends them)."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def pull_weights(self) -> None:
        """Copy the store's weights into every replica (a worker that rejoined a running job does)."""
        kv = cast(KVStore, self._kv)
        if kv.rejoined and not self._update_on_kvstore:
            raise TrainerError("this worker is back in a lost one's place (pskv launch --max-restarts), but with update_on_kvstore="
                               "False the servers hold the summed gradients, not the weights (each worker keeps its own, and its "
                               "optimizer's states), so it cannot take the job's: use update_on_kvstore=True, or no --max-restarts")
        kv.pull(self._keys, [list(ts) for ts in zip(*self._reps)])
        self._landed(range(len(self._keys)))

    def synchronize(self) -> None:
        """Wait for every exchange still in flight: the weights are then the step's (or the
        summed gradients, with ``update_on_kvstore=False``)."""
        self._send_bucket()
        while self._inflight:
            self._wait(next(iter(self._inflight)))

    def _wait(self, i: int) -> None:
        self._inflight.pop(i).wait()
        self._landed([i])

    def _landed(self, which: Iterable[int]) -> None:
        """Note the versions of ``which`` keys' weights as their pulls left them: a change after that (load_state_dict) step refuses."""
        self._seen.update((i, self._stamps(i)) for i in which)

    def _stamps(self, i: int, grads: bool = False) -> list[int]:
        """The version counters of key ``i``'s weights, or of their gradients (-1: none), in every replica."""
        return [getattr(ps[j].grad, "_version", -1) if grads else ps[j]._version for ps in self._params for j in self._members[i]]

    @property
    def kvstore(self) -> Optional[KVStore]:
        """The store the Trainer uses (None when it needs none)."""
        return self._kv

    @property
    def optimizer(self) -> optim.Optimizer:
        return self._optimizer

    @property
    def update_on_kvstore(self) -> bool:
        return self._update_on_kvstore

    @property
    def overlap(self) -> bool:
        """Whether the exchange overlaps backward and the next forward."""
        return self._overlap

    @property
    def learning_rate(self) -> float:
        """The learning rate the next step uses (a schedule applied; dist_async counts W updates a step)."""
        return self._optimizer.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        """Set the base learning rate, on the servers too when they run the optimizer."""
        self.synchronize()
        self._optimizer.set_learning_rate(lr)
        if self._update_on_kvstore and self._kv is not None:
            self._kv.set_optimizer(self._optimizer)  # the same object: states are kept

    def _set_scale(self, batch_size: float) -> float:
        if not isinstance(batch_size, numbers.Real) or isinstance(batch_size, bool) or not 0 < batch_size < float("inf"):
            raise TrainerError(f"batch_size must be a positive number, got {batch_size!r}")  # (numpy's numbers too)
        scale = self._scale / float(batch_size)
        if not self._async:  # dist_sync: the scale goes with the pulls of the held round; dist_async: with each push
            self._optimizer.set_rescale_grad(scale)
        if self._update_on_kvstore and self._kv is not None and not self._held and self._optimizer.rescale_grad != self._sent_scale:
            self._kv.set_optimizer(self._optimizer)
            self._sent_scale = self._optimizer.rescale_grad
        return scale

    def _unsent(self, ignore_stale_grad: bool) -> tuple[list[int], list[list[Tensor]]]:
        """The keys backward did not push (all of them without overlap) and their gradients."""
        if late := [n for n, t in self._frozen if t.requires_grad and t.grad is not None]:
            raise TrainerError(f"parameters {late[:3]} have gradients but were frozen (requires_grad=False) when the Trainer was made, "
                               "which left them out, so it does not train them: make the Trainer after unfreezing them")
        which = [i for i, sent in enumerate(self._pushed) if not sent]
        for j in (j for i in which for j in self._members[i]):
            for d, params in enumerate(self._params):
                if params[j].grad is None and not ignore_stale_grad:
                    raise TrainerError(f"parameter {self._names[j]!r} (replica {d}) has no gradient: it was "
                                       "not used in the forward pass since the last step; pass "
                                       "ignore_stale_grad=True to push zeros for it")
                self._gathered(params[j])
        grads: list[list[Tensor]] = []
        for i in which:
            grads.append([])
            for rep in self._reps:
                g, t = rep[i].grad, rep[i]
                if g is None:  # a stand-in; row-sparse with no rows where the key's gradients are (earlier, or another replica's now)
                    sparse = i in self._sparse or any(getattr(r[i].grad, "is_sparse", False) for r in self._reps)
                    g = torch.sparse_coo_tensor(t.new_zeros((1, 0), dtype=torch.long), t.new_zeros((0, *t.shape[1:])), t.shape) if sparse else torch.zeros_like(t)
                grads[-1].append(g)
        return which, grads

    def _next_step(self) -> None:
        self._sparse.update(i for rep in self._reps for i, t in enumerate(rep) if t.grad is not None and t.grad.is_sparse)
        self._pushed, self._ready, self._cut = [False] * len(self._keys), [0] * len(self._keys), False
        self._steps += 1
        self._queued = False  # (a backward that failed dropped its callback)
        if self._called is not None:  # the first step
            if torch.overrides._get_current_function_mode_stack()[-1:] == [self._first_reads]:  # type: ignore[no-untyped-call]
                self._first_reads.__exit__(None, None, None)  # type: ignore[no-untyped-call]  # (a forward cut short by KeyboardInterrupt)
            for i, running in self._first_reads.first.items():  # its first read's innermost forward of a module that holds it waits, else the outermost
                m = next((m for m in running[::-1] if any(self._where.get(id(p)) == i for p in self._called[m].parameters())), running[0])
                self._reads.setdefault(m, []).append(i)
            waited = {self._where.get(id(t)) for m in self._called.values() for t in m._parameters.values()}.union(self._first_reads.first)
            self._eager, self._called = [i for i in range(len(self._keys)) if i not in waited], None
            self._after_forward.remove()

    def step(self, batch_size: float, ignore_stale_grad: bool = False) -> None:
        """Sum the gradients over devices and workers, scale by ``1/batch_size`` (this worker's
        batch), update; block until every replica holds the new weights (with overlap: until the
        pulls are sent). A parameter without a gradient is an error unless ``ignore_stale_grad``."""
        t0, self._cut = timeline.now(), True
        scale = self._set_scale(batch_size)
        if not self._update_on_kvstore:
            self.allreduce_grads(ignore_stale_grad)
            self.update(batch_size)  # MXNet's step: allreduce_grads, then update
            return
        assert self._kv is not None
        self._send_bucket()
        edited, self._versions = [self._keys[i] for i, v in self._versions.items() if self._stamps(i, grads=True) != v], {}
        if moved := [self._keys[i] for i, v in self._seen.items() if i not in self._inflight and v != self._stamps(i)]:
            raise TrainerError(f"the weights of {moved[:3]} were changed since the Trainer last pulled them (load_state_dict, copy_, or in "
                               "forward, as nn.Embedding(max_norm=...) does?): with update_on_kvstore the store holds the weights and its next "
                               "pull would undo the change: load weights before making the Trainer (pskv.checkpoint.load_weights), or pass "
                               "update_on_kvstore=False; weights changed and copied back since (an evaluation with others): trainer.pull_weights() "
                               "once they are back, before the next backward")
        if edited:
            raise TrainerError(f"the gradients of {edited[:3]} changed after backward pushed them (with overlap they leave during backward): "
                               "clip with the optimizer's clip_gradient (on the servers), or change them with update_on_kvstore=False "
                               "between allreduce_grads() and update(), or pass overlap=False")
        rest, grads = self._unsent(ignore_stale_grad)
        rescale = scale if self._held else None
        if rest:  # the store's calls run under torch.no_grad()
            self._kv.push([self._keys[i] for i in rest], grads, wait=not self._overlap, _held=self._held, _rescale=scale if self._async else None)
        if self._overlap:  # runs of keys in layer order: a layer's forward waits only for its run's pull
            for run in self._runs:
                handle = self._kv._checked(None, [(self._metas[i], [rep[i] for rep in self._reps]) for i in run], -run[0], rescale=rescale)
                self._inflight.update(dict.fromkeys(run, handle))
                if run is self._runs[0]:  # the next forward's first wait: its pull leaves now, while the rest are queued
                    self._kv._hurry()
        else:
            self._kv.pull(self._keys, [list(ts) for ts in zip(*self._reps)], _rescale=rescale)
            self._landed(range(len(self._keys)))
        self._optimizer.num_update = max(self._optimizer.num_update, (self._steps + 1) * self._pace)  # (dist_async: workers at one pace)
        self._next_step()
        for i in self._eager:
            if i in self._inflight:
                self._wait(i)
        timeline.span("step", t0)

    def allreduce_grads(self, ignore_stale_grad: bool = False) -> None:
        """Replace every replica's gradient by the sum over devices and workers."""
        if self._update_on_kvstore:
            raise TrainerError("allreduce_grads() needs update_on_kvstore=False (the store runs the optimizer otherwise)")
        self._cut = True
        rest, grads = self._unsent(ignore_stale_grad)
        with torch.no_grad():
            if self._kv is not None and rest:
                keys = [self._keys[i] for i in rest]
                self._kv.push(keys, grads)
                self._kv.pull(keys, grads, ignore_sparse=False)
            self.synchronize()  # the sums of what backward pushed (with overlap)
        for i, gs in zip(rest, grads):  # a pushed stand-in for a missing grad becomes the grad (none pushed: none)
            for params, g in zip(self._params, gs):
                for p in (params[j] for j in self._members[i] if params[j].grad is None and self._kv is not None):
                    p.grad = self._views[id(p)][1] if self._views else g
        self._next_step()

    def update(self, batch_size: float) -> None:
        """Apply the optimizer to the (already summed) gradients, scaled by ``1/batch_size``."""
        if self._update_on_kvstore:
            raise TrainerError("update() needs update_on_kvstore=False (the store runs the optimizer otherwise)")
        self._set_scale(batch_size)
        for p in self._params[0]:  # (flat keys: a gradient replaced since allreduce_grads into its run's)
            self._gathered(p)
        with torch.no_grad():
            which = [i for i, t in enumerate(self._reps[0]) if t.grad is not None]
            first = [self._reps[0][i] for i in which]
            self._optimizer.update_all(which, [t.grad for t in first], first)  # type: ignore[misc]
            for rep in self._reps[1:]:
                for i, t in zip(which, first):
                    rep[i].copy_(t)

    def save_states(self, path: Union[str, Path]) -> None:
        """Write the optimizer's states (from the servers when they run it) to ``path``."""
        self.synchronize()
        if self._update_on_kvstore and self._kv is not None:
            self._kv.save_optimizer_states(path)
        else:
            optim.save_states(path, self._optimizer.state_dict(), dict(enumerate(self._keys)))

    def load_states(self, path: Union[str, Path]) -> None:
        """Restore states written by :meth:`save_states` (to the servers when they run the optimizer)."""
        self.synchronize()
        try:
            if self._update_on_kvstore and self._kv is not None:
                self._kv.load_optimizer_states(path)
                self._optimizer.num_update = int(optim.load_states(path).get("num_update", 0))
            else:
                self._optimizer.load_state_dict(optim.load_states(path), weights=dict(enumerate(self._reps[0])))
        except OptimizerError as exc:
            mine, other = ("runs of parameters (flat keys)", "a key per parameter") if self._views else ("one per parameter", "runs of parameters (flat keys)")
            raise OptimizerError(f"{exc} (this Trainer's store keys are {mine}; states saved with {other} do not fit them: "
                                 "docs/DESIGN.md, 'Flat keys')") from exc
        self._steps = self._optimizer.num_update // self._pace  # the schedule goes on from the saved step
