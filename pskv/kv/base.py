"""The store API that every type shares: keys, argument checks, the public methods; its hooks are the
in-process stores ``local`` and ``device``, and :mod:`pskv.kv.dist` replaces them. Everything a user can get
wrong is checked here, before the ``_..._impl`` hooks run, so a rejected call changes nothing."""

from __future__ import annotations

import builtins
import contextlib
import functools
import itertools
import json
import math
import numbers
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Optional, TypeVar, Union, cast

import torch
from torch import Tensor

from .. import errors
from ..compression import Compressor
from ..ops import outside, reduce_values, write_rows
from ..optim import Optimizer, apply_push, load_states, save_states, updatable
from ..ps.message import MAX_META
from ..ps.tracker import Handle

Key = Union[int, str]
KeyArg = Union[Key, Sequence[Key]]
ValueArg = Union[Tensor, Sequence[Any]]


def _priority(priority: object) -> int:
    if not isinstance(priority, numbers.Integral):
        raise errors.KVStoreError(f"priority must be a whole number (higher goes first), got {priority!r}")
    return int(priority)


@dataclass(frozen=True)
class KeyMeta:
    """What a store knows about a key from its ``init``."""

    key: Key  # as the user wrote it
    id: int  # the int key itself, or the init order of a str key
    shape: torch.Size
    dtype: torch.dtype
    row_sparse: bool  # initialised with a row-sparse value

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        """Elements per row (the first dimension's); 1 for a scalar or an empty row."""
        return max(1, self.numel // self.shape[0]) if len(self.shape) and self.shape[0] else 1

    def __str__(self) -> str:
        return f"key {self.key!r}"


Group = tuple[KeyMeta, list[Tensor]]  # a validated key and its tensors (values or outputs)
F = TypeVar("F", bound=Callable[..., Any])


def _locked(method: F) -> F:
    """A public call: under the store's lock and ``torch.no_grad()``, on an open store."""
    @functools.wraps(method)
    def call(self: KVStore, *args: Any, **kwargs: Any) -> Any:
        with self._lock, torch.no_grad():
            if self._closed:
                raise errors.StoreClosedError(f"the {self.type!r} store was closed")
            return method(self, *args, **kwargs)
    return call  # type: ignore[return-value]


class KVStore:
    """A key-value store for parameters (keys and values: docs/SPEC.md, sections 1-2). Create one
    with :func:`pskv.kv.create`. Every public method takes the store's lock, so threads may share a
    store (one call at a time; a dist store's call lets go of it while it waits for the others). Itself the in-process store: calls are synchronous, each returns when
    done; ``device`` sums on the device of the first pushed tensor and keeps each value (and runs the
    optimizer) on the device it was initialised on, ``local`` uses the CPU."""

    rejoined = False  # a worker restarted in a lost one's place (pskv launch --max-restarts): see allgather

    def __init__(self, type_name: str):
        self.type = type_name  # e.g. "local" or "dist_sync"
        self._keys: dict[Key, KeyMeta] = {}
        self._key_kind: Optional[builtins.type] = None
        self._optimizer: Optional[Optimizer] = None
        self._described: Optional[dict[str, Any]] = None  # the optimizer's description as last set (what the servers run)
        self._compressor: Optional[Compressor] = None
        self._closed = False
        self._lock = threading.RLock()
        self._on_device = type_name in ("device", "dist_device_sync")
        self._values: dict[int, Tensor] = {}  # an in-process store's values
        self._present: dict[int, Optional[Tensor]] = {}  # rows of its last row-sparse push summed without an optimizer

    @property
    def rank(self) -> int:
        """This worker's rank, ``0 .. num_workers - 1`` (0 for in-process stores)."""
        return 0

    @property
    def num_workers(self) -> int:
        """How many workers push to this store (1 for in-process stores)."""
        return 1

    def __repr__(self) -> str:
        return f"<pskv KVStore {self.type!r} rank {self.rank}/{self.num_workers}, {len(self._keys)} keys>"

    def _check_key(self, key: object, kind: Optional[builtins.type] = None) -> Key:
        kind = kind or self._key_kind
        if type(key) is not int and isinstance(key, numbers.Integral) and not isinstance(key, bool):  # (an int skips the costly ABC check)
            key = int(key)  # numpy's integers and the like
        if type(key) is int:
            if not 0 <= key < 2**62:
                raise errors.KeyTypeError(f"int keys must be in [0, 2**62), got {key}")
        elif not isinstance(key, str):
            raise errors.KeyTypeError(f"keys must be int or str, got {type(key).__name__} {key!r:.80}")
        if kind is not None and type(key) is not kind:
            raise errors.KeyTypeError(f"key {key!r} is a {type(key).__name__}, but this store's keys are "
                                      f"{kind.__name__}s (one store never mixes int and str keys)")
        return key

    @staticmethod
    def _pairs(key: KeyArg, value: Any, what: str) -> list[tuple[Any, list[Tensor]]]:
        """``[(key, [tensor, ...]), ...]`` from a key or list of keys and the matching values."""
        if isinstance(key, (list, tuple)):
            if not isinstance(value, (list, tuple)):
                raise errors.ValueCountError(f"{len(key)} keys were given but {what} is not a list")
            if len(value) != len(key):
                raise errors.ValueCountError(f"{len(key)} keys were given with {len(value)} {what} entries")
            if not key:
                raise errors.ValueCountError("an empty list of keys")
            return [(k, KVStore._tensors(k, v, what)) for k, v in zip(key, value)]
        return [(key, KVStore._tensors(key, value, what))]

    @staticmethod
    def _tensors(key: object, value: Any, what: str) -> list[Tensor]:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if not items:
            raise errors.ValueCountError(f"key {key!r}: an empty list of {what}s")
        for v in items:
            if not isinstance(v, Tensor):
                raise errors.InvalidValueError(f"key {key!r}: {what} must be a torch.Tensor, got {type(v).__name__}")
            if v.layout not in (torch.strided, torch.sparse_coo):
                raise errors.InvalidValueError(f"key {key!r}: {what} has unsupported layout {v.layout}")
            if v.is_sparse and v.sparse_dim() != 1:
                raise errors.SparseError(f"key {key!r}: a sparse {what} must be row-sparse "
                                         f"(sparse_dim() == 1), got sparse_dim() == {v.sparse_dim()}")
            if v.is_meta:
                raise errors.InvalidValueError(f"key {key!r}: {what} is on the meta device, which holds no data")
            if v.is_sparse and outside(rows := v._indices(), v.shape[0]):  # torch does not check them unless asked
                raise errors.SparseError(f"key {key!r}: a sparse {what} has row indices outside [0, {v.shape[0]}): "
                                         f"min {int(rows.min())}, max {int(rows.max())}")
        return items

    @staticmethod
    def _check_like(meta: KeyMeta, ts: list[Tensor], what: str) -> None:
        for t in ts:
            if t.shape != meta.shape:
                raise errors.ShapeMismatchError(f"{meta}: {what} has shape {tuple(t.shape)} but the key was "
                                                f"initialised with shape {tuple(meta.shape)}")
            if t.dtype != meta.dtype:
                raise errors.DTypeMismatchError(f"{meta}: {what} has dtype {t.dtype} but the key was initialised with dtype {meta.dtype}")
            if what == "out" and not t.is_sparse and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
                raise errors.InvalidValueError(f"{meta}: an out whose elements share memory (expanded: a stride of 0) cannot "
                                               "hold a value; pull into a tensor of its own (.clone())")
            if what == "out" and t.is_inference() and not torch.is_inference_mode_enabled():
                raise errors.InvalidValueError(f"{meta}: an out made under torch.inference_mode() can be written only inside it; "
                                               "pull there, or into a tensor made outside it")

    def _finite(self, groups: list[Group]) -> list[Group]:
        """A push's groups; with 1bit compression, NaN or Inf in any key is an error before any goes."""
        comp = self._compressor
        if comp is not None and comp.codec.type == "1bit":
            for meta, values in groups:
                comp.codec.check([v for v in values if not v.is_sparse and v.is_floating_point()], meta)
        return groups

    def _grouped(self, key: KeyArg, value: Any, what: str, join: bool = True) -> list[Group]:
        """Validated ``(meta, tensors)`` per distinct key in first-seen order; ``join=False``: per key."""
        groups: dict[int, Group] = {}
        for i, (k_raw, ts) in enumerate(self._pairs(key, value, what)):
            k = self._check_key(k_raw)
            meta = self._keys.get(k)
            if meta is None:
                raise errors.KeyNotInitializedError(f"key {k!r} has not been initialised; call init({k!r}, value) first")
            self._check_like(meta, ts, what)
            groups.setdefault(meta.id if join else i, (meta, []))[1].extend(ts)
        if what == "out":  # two keys' outs in one memory: which value it ends with would depend on which answer came last
            spans = [(t.data_ptr(), t.data_ptr() + t.nbytes, m) for m, ts in groups.values() for t in ts if not t.is_sparse and t.is_contiguous()]
            for (_, end, a), (start, _, b) in itertools.pairwise(sorted(spans, key=lambda span: span[:2])):
                if start < end and a is not b:
                    raise errors.InvalidValueError(f"{b}: its out shares memory with the out of {a} in this call; give each key its own")
        return list(groups.values())

    @_locked
    def init(self, key: KeyArg, value: ValueArg) -> None:
        """Create ``key`` with ``value`` (a tensor; of a list of device copies the first is used).
        Every worker inits the same keys in the same order; a second init of a key is an error."""
        kind = self._key_kind
        new: dict[Key, tuple[KeyMeta, Tensor]] = {}
        for k_raw, ts in self._pairs(key, value, "value"):
            k, v = self._check_key(k_raw, kind), ts[0]
            kind = kind or type(k)
            if k in self._keys or k in new:
                raise errors.DuplicateInitError(f"key {k!r} was already initialised")
            kid = k if isinstance(k, int) else len(self._keys) + len(new)  # a str key's id: its init order
            new[k] = (KeyMeta(k, kid, v.shape, v.dtype, v.is_sparse), v)
        self._init_impl(list(new.values()))
        self._key_kind = kind
        self._keys.update((k, meta) for k, (meta, _) in new.items())

    @_locked
    def push(self, key: KeyArg, value: ValueArg, priority: int = 0, wait: bool = True, *, _held: bool = False,
             _rescale: Optional[float] = None) -> Optional[Handle]:
        """Push ``value`` (a tensor or a list of per-device tensors, summed) to ``key`` (docs/SPEC.md,
        section 2). ``wait=False`` returns a :class:`~pskv.ps.tracker.Handle`; a push that fails makes
        the next call fail. ``_held``, ``_rescale`` (its update's, not the optimizer's): for the Trainer (docs/DESIGN.md, "Held rounds")."""
        handle = self._push_impl(self._finite(self._grouped(key, value, "pushed value")), _priority(priority), wait, _held, _rescale)
        return None if wait else handle or Handle()

    @_locked
    def _checked(self, push: Optional[list[Group]], pull: Optional[list[Group]], priority: int, held: bool = False,
                 rescale: Optional[float] = None) -> Handle:
        """The Trainer's calls without waiting, of its own parameters and their gradients, checked once when it
        was made (the checks were a fifth of a push's time per key): a push, a pull, or both (a pushpull). Shapes
        and dtypes are still compared (``param.data = ...`` may change them; a copy would convert or broadcast)."""
        for groups, what in ((push, "pushed value"), (None if pull is push else pull, "pulled parameter")):  # (a pushpull into its values: once)
            for meta, ts in groups or ():
                self._check_like(meta, ts, what)
        if push is not None and pull is not None:
            handle = self._pushpull_impl(self._finite(push), pull, priority, False)
        elif push is not None:
            handle = self._push_impl(self._finite(push), priority, False, held, None)
        else:
            handle = self._pull_impl(cast(list[Group], pull), priority, False, rescale)
        return handle or Handle()

    @_locked
    def pull(self, key: KeyArg, out: ValueArg, priority: int = 0, ignore_sparse: bool = True,
             wait: bool = True, *, _rescale: Optional[float] = None) -> Optional[Handle]:
        """Copy the value of ``key``, as of every earlier push of this caller, into ``out`` (a tensor
        or a list; each gets the value; sparse ones: docs/SPEC.md, "Row-sparse"). ``wait=False``
        returns a :class:`~pskv.ps.tracker.Handle`; use ``out`` after its ``wait()``."""
        kept: list[Group] = []
        skipped: list[Key] = []
        for meta, outs in self._grouped(key, out, "out"):
            dense_outs = [o for o in outs if not o.is_sparse]
            if meta.row_sparse and dense_outs:
                raise errors.SparseError(f"{meta} is row-sparse; pull it with row_sparse_pull(key, out, row_ids), not into a dense out")
            if ignore_sparse and len(dense_outs) < len(outs):
                skipped.append(meta.key)
                outs = dense_outs
            if outs:
                kept.append((meta, outs))
        if skipped:
            # stacklevel: the caller of pull, past the lock's wrapper
            warnings.warn(f"pull skipped the row-sparse outputs of key(s) {skipped} (ignore_sparse=True); "
                          "use row_sparse_pull to fetch rows", UserWarning, stacklevel=3)
        handle = self._pull_impl(kept, _priority(priority), wait, _rescale) if kept else None
        return None if wait else handle or Handle()

    @_locked
    def pushpull(self, key: KeyArg, value: ValueArg, out: Optional[ValueArg] = None, priority: int = 0,
                 wait: bool = True) -> Optional[Handle]:
        """``push(key, value)`` then ``pull(key, out)``; with ``out=None`` the result goes into
        ``value``. ``wait=False``: both are sent without waiting; the handle is the pull's."""
        target = value if out is None else out
        groups = self._finite(self._grouped(key, value, "pushed value"))
        outs = self._grouped(key, target, "out")  # check outputs before pushing
        for meta, os in outs:
            if meta.row_sparse or any(o.is_sparse for o in os):  # (it pushed, then failed or skipped the pull)
                raise errors.SparseError(f"{meta}: pushpull pulls whole dense values; for row-sparse keys or outputs, push, "
                                         "then row_sparse_pull(key, out, row_ids)")
        handle = self._pushpull_impl(groups, outs, _priority(priority), wait)
        return None if wait else handle or Handle()

    @_locked
    def broadcast(self, key: KeyArg, value: ValueArg, out: ValueArg, priority: int = 0) -> None:
        """``init(key, value)`` then ``pull(key, out)``: every worker gets rank 0's value."""
        for (k, vals), (_, outs) in zip(self._pairs(key, value, "value"), self._pairs(key, out, "out")):
            self._check_like(KeyMeta(k, 0, vals[0].shape, vals[0].dtype, vals[0].is_sparse), outs, "out")
        self.init(key, value)
        self.pull(key, out, priority)

    @_locked
    def row_sparse_pull(self, key: KeyArg, out: ValueArg, row_ids: ValueArg, priority: int = 0) -> None:
        """Copy only rows ``row_ids`` (1-D, any order, repeats allowed) of ``key`` into ``out``: a
        sparse ``out`` holds exactly those rows, a dense one those and every other row zero. With a
        list of outputs, ``row_ids`` is one tensor for all or a list with one per output."""
        groups: list[tuple[KeyMeta, list[Tensor], list[Tensor]]] = []
        for (meta, outs), (_, rids) in zip(self._grouped(key, out, "out", join=False), self._pairs(key, row_ids, "row_ids")):
            rids = rids * len(outs) if len(rids) == 1 else rids
            if len(rids) != len(outs):
                raise errors.ValueCountError(f"{meta}: {len(outs)} outputs but {len(rids)} row_ids")
            groups.append((meta, outs, [self._check_rows(meta, r) for r in rids]))
        self._row_sparse_pull_impl(groups, _priority(priority))

    @staticmethod
    def _check_rows(meta: KeyMeta, rows: Tensor) -> Tensor:
        if rows.is_sparse or rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
            raise errors.SparseError(f"{meta}: row_ids must be a 1-D integer tensor, got {rows.dtype} of shape {tuple(rows.shape)}")
        if not meta.shape:
            raise errors.SparseError(f"{meta}: a scalar has no rows")
        rows = rows.detach().to("cpu", torch.int64)
        if outside(rows, meta.shape[0]):
            raise errors.SparseError(f"{meta}: row_ids must be in [0, {meta.shape[0]}), got min {int(rows.min())}, max {int(rows.max())}")
        return cast(Tensor, torch.unique(rows))  # sorted

    @_locked
    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Run ``optimizer`` on every push from now on (on the servers for dist types)."""
        if not isinstance(optimizer, Optimizer):
            raise errors.OptimizerError("set_optimizer takes a pskv.optim.Optimizer "
                                        f"(pskv.optim.create(...)), got {type(optimizer).__name__}")
        self._set_optimizer_impl(optimizer)
        desc = optimizer.describe()
        if optimizer is not self._optimizer and self._optimizer is not None:  # as on the servers: the same description
            same = self._described == desc  # (as last set, not as changed since) again changes nothing, another starts afresh
            optimizer.states, optimizer.num_update = (self._optimizer.states, self._optimizer.num_update) if same else ({}, 0)
        self._optimizer, self._described = optimizer, desc

    @_locked
    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress pushed gradients, e.g. ``{"type": "2bit", "threshold": 0.5}`` (see :mod:`pskv.compression`);
        the same codec again changes nothing (its residuals are kept), another starts afresh."""
        new = Compressor(compression_params)
        if self._compressor is not None and self._compressor.codec.describe() == new.codec.describe():
            return
        self._compressor = new
        self._set_compression_impl(self._compressor)

    @_locked
    def save_optimizer_states(self, fname: Union[str, Path], dump_optimizer: bool = False) -> None:
        """Write every key's optimizer state (from the servers for dist types) and the optimizer's
        description to ``fname`` (``dump_optimizer``: MXNet's, accepted and ignored)."""
        save_states(fname, self._optimizer_state(), {m.id: m.key for m in self._keys.values()})

    @_locked
    def load_optimizer_states(self, fname: Union[str, Path]) -> None:
        """Restore states written by :meth:`save_optimizer_states` (to the servers for dist types);
        a store without an optimizer installs the file's."""
        state = load_states(fname)
        desc = state["optimizer"]
        if self._optimizer is not None and self._optimizer.name != desc.get("name"):
            raise errors.OptimizerError(f"the file holds {desc.get('name')!r} states but the store's "
                                        f"optimizer is {self._optimizer.name!r}")
        names, ids = state.get("key_names") or {}, {m.key: m.id for m in self._keys.values()}
        if names:  # by the keys' names: they may have been initialised in another order (a key not in the file starts afresh)
            state = {**state, "keys": {ids[names[k]]: v for k, v in state["keys"].items() if names.get(k) in ids}}
        optimizer = self._optimizer or Optimizer.from_description(desc)
        self._load_optimizer_state(state, optimizer)
        self._described = self._described or optimizer.describe()
        self._optimizer = optimizer

    @_locked
    def barrier(self) -> None:
        """Block until every worker reaches its barrier (a no-op for in-process stores)."""
        self._barrier_impl()

    def allgather(self, value: Any) -> list[Any]:
        """Every worker's ``value`` (small and JSON-able, e.g. metrics; tensors are pushed and
        pulled), by rank: a barrier that carries it. In-process stores return ``[value]``. A worker
        that ``rejoined`` waits in its first allgather for the others' next one, where it is admitted:
        every round must be complete there (each worker pulled what it pushed)."""
        try:
            size = len(json.dumps(value, separators=(",", ":"), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise errors.InvalidValueError(f"allgather takes JSON values (numbers, strings, lists, dicts): {exc}") from None
        if size > (most := (MAX_META - 1024) // self.num_workers - 1):  # (else the scheduler cannot send the answer: a wait of PSKV_TIMEOUT)
            raise errors.InvalidValueError(f"allgather: a value of {size} bytes of JSON; with {self.num_workers} workers each may have at most "
                                           f"{most} (one answer carries every worker's, at most {MAX_META} bytes): push and pull tensors instead")
        return _locked(type(self)._barrier_impl)(self, value)  # the value is checked first, then as any call

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        """The store's lock let go while a call waits for the other workers, so that this worker's other threads may
        call meanwhile (one waiting with it held could wait for a push that another thread of it could not make)."""
        saved = cast(Any, self._lock)._release_save()  # (as threading.Condition.wait does, however deep it is held)
        try:
            yield
        finally:
            cast(Any, self._lock)._acquire_restore(saved)

    def close(self) -> None:
        """Release the store; later calls raise :class:`~pskv.errors.StoreClosedError`. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._close_impl()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, exc_type: Optional[builtins.type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()

    # The hooks, here those of the in-process stores: they get validated arguments. With ``wait``
    # False, push and pull return a handle instead of blocking (or None: done already).

    def _device(self, value: Tensor) -> torch.device:
        """Where a key's initial value is kept, or a push whose first tensor is ``value`` is summed."""
        return value.device if self._on_device else torch.device("cpu")

    def _init_impl(self, items: list[tuple[KeyMeta, Tensor]]) -> None:
        for meta, v in items:
            self._values[meta.id] = v.detach().to(self._device(v), copy=True).to_dense()  # a no-op if dense

    def _push_impl(self, items: list[Group], priority: int, wait: bool, held: bool, rescale: Optional[float]) -> Optional[Handle]:
        for meta, values in items:
            if self._optimizer is not None:  # (before the residual changes)
                updatable(meta.dtype, meta)
            comp = self._compressor if meta.dtype.is_floating_point else None  # (integers travel as they are)
            if comp is not None:  # dense and row-sparse values: their dense sum is encoded, as dist stores do
                values = [reduce_values(values, values[0].device)] if len({v.is_sparse for v in values}) > 1 else values
                values = [v if v.is_sparse else comp.codec.roundtrip(v, comp.residual(meta.id, i, v))
                          for i, v in enumerate(values)]
            stored = self._values[meta.id]
            merged = reduce_values(values, self._device(values[0])).to(stored.device)
            self._present[meta.id] = apply_push(self._optimizer, meta.id, merged, stored, merged_is_scratch=True, rescale=rescale)  # merged is ours
        return None

    def _pull_impl(self, items: list[Group], priority: int, wait: bool, rescale: Optional[float]) -> Optional[Handle]:
        for meta, outs in items:
            stored = self._values[meta.id]
            for out in outs:
                if out.is_sparse and (rows := self._present.get(meta.id)) is not None:  # the rows pushed (dist: rounds.Part.present)
                    write_rows(out, rows, stored.index_select(0, rows))
                else:
                    out.copy_(stored.to_sparse(1) if out.is_sparse else stored)
        return None

    def _pushpull_impl(self, items: list[Group], outs: list[Group], priority: int, wait: bool) -> Optional[Handle]:
        """Push ``items`` and pull into ``outs`` (dense) as one operation; here: push, then pull."""
        self._push_impl(items, priority, wait, False, None)
        return self._pull_impl(outs, priority, wait, None)

    def _row_sparse_pull_impl(self, items: list[tuple[KeyMeta, list[Tensor], list[Tensor]]], priority: int) -> None:
        for meta, outs, rows in items:
            stored = self._values[meta.id]
            for out, r in zip(outs, rows):
                write_rows(out, r, stored.index_select(0, r.to(stored.device)))

    def _set_optimizer_impl(self, optimizer: Optimizer) -> None:
        """Called before ``self._optimizer`` is set to ``optimizer``; the dist client tells the servers."""

    def _set_compression_impl(self, compressor: Compressor) -> None:
        """Called after ``self._compressor`` is set; the dist client tells the servers."""

    def _hurry(self) -> None:
        """What calls without waiting queued leaves now, not with the next batch (the Trainer's first layers); here nothing queues."""

    def _optimizer_state(self) -> dict[str, Any]:
        if self._optimizer is None:
            raise errors.OptimizerError("no optimizer is set on this store; call set_optimizer first")
        return self._optimizer.state_dict()

    def _load_optimizer_state(self, state: dict[str, Any], optimizer: Optimizer) -> None:
        """Load ``state`` into ``optimizer`` (the store's, or a new one from the file's description)."""
        optimizer.load_state_dict(state, weights=self._values)

    def _barrier_impl(self, *value: Any) -> list[Any]:
        """A barrier of the workers, carrying ``value`` if given: every worker's, by rank (here: one)."""
        return list(value)

    def _close_impl(self) -> None:
        """In-process stores hold nothing that needs releasing."""
