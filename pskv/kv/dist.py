"""``dist_sync``, ``dist_device_sync``, ``dist_async``: a worker's store, backed by parameter servers.
Each key is cut into parts (:mod:`pskv.ps.partition`); a call queues a row per part for each server's
next INIT, PUSH or PULL message (docs/DESIGN.md: the rounds, data paths, pipeline and GPU path)."""

from __future__ import annotations

import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import Tensor

from .. import config, errors
from ..compression import Compressor
from ..ops import reduce_values, write_rows
from ..optim import Optimizer
from ..ps import message as wire
from ..ps import serve, timeline
from ..ps.client import WorkerClient
from ..ps.message import Message, PushKind, Type, dtype_name, float_bits, frame_tensor, tensor_frame
from ..ps.node import JobEnv
from ..ps.partition import Part, place
from ..ps.tracker import Handle, Sink
from .base import Group, KeyMeta, KVStore

_made: Optional[weakref.ref[DistStore]] = None  # this process's store: a worker has one place in its job


def create_dist(name: str) -> KVStore:
    """The ``dist_*`` store of this process, or, for a server/scheduler process, serve and exit."""
    global _made
    env = JobEnv.from_environ()
    if env.role != "worker":
        sys.exit(serve(env))
    if _made is not None and (made := _made()) is not None and not made._closed:
        raise errors.KVStoreError(f"this process already has a dist store ({made.type!r}, worker {made.rank}); a worker has one "
                                  "place in the job: use that store (e.g. pskv.Trainer(params, ..., kvstore=kv))")
    if _made is not None:
        raise errors.StoreClosedError("this process's dist store was closed, and its place in the job with it: a worker makes one dist store")
    store = DistStore(name, env)
    _made = weakref.ref(store)
    return store


def _close(client: WorkerClient, leaving: list[BaseException], pid: int) -> None:
    if os.getpid() != pid:  # a child forked by the worker (os.fork) exits: the store, its sockets and threads are its parent's
        return
    # what this process dies of: what left the store's with block, or Python's record of an uncaught exception (a prompt's: of any error)
    exc = leaving[0] if leaving else None if hasattr(sys, "ps1") else getattr(sys, "last_value", None)
    try:
        client.close(traceback.format_exception_only(exc)[-1].strip()[:2000] if exc is not None else None)
    except Exception as exc:  # exiting anyway; say why the job may see this worker as failed
        print(f"pskv: while closing the store: {exc}", file=sys.stderr)


class DistStore(KVStore):
    """A worker's view of the parameter servers. Thread-safe like every store (one call at a time)."""

    def __init__(self, type_name: str, env: JobEnv):
        super().__init__(type_name)
        self._async = type_name == "dist_async"
        self._client = WorkerClient(env)
        # a store that is dropped, or alive at exit, is closed: the job learns this worker is done
        self._leaving: list[BaseException] = []  # what left its with block, if anything did
        self._barrier = threading.Lock()
        self._slots: dict[tuple[int, int], tuple[Tensor, tuple[int, int]]] = {}  # (key, part) -> push slot, (fd, offset)
        self._closer = weakref.finalize(self, _close, self._client, self._leaving, os.getpid())
        try:
            self._client.start()
        except BaseException as exc:
            self._leaving.append(exc)  # (joined, then failed: the job hears why, not that it finished)
            self.close()
            raise
        timeline.start("worker", self._client.rank)
        self.rejoined = self._client.rejoined
        self._bound = config.bigarray_bound()
        self._chunk = config.chunk_bytes(self._client.across_hosts)
        self._parts: dict[int, list[Part]] = {}
        self._round_sent: dict[tuple[int, int], int] = {}  # (key, part) -> the round of our latest push of it
        self._before_push: dict[tuple[int, int], Handle] = {}  # (key, part) -> the call to wait for (_rounds)
        self._slot_busy: dict[tuple[int, int], Handle] = {}  # (key, part) -> the push still in its shared-memory slot
        self._streams: dict[tuple[torch.device, bool], Any] = {}  # side CUDA streams per device: copies to the host, from it

    @property
    def rank(self) -> int:
        return self._client.rank

    @property
    def num_workers(self) -> int:
        return len(self._client.workers)

    @property
    def num_servers(self) -> int:
        """How many servers hold the keys."""
        return len(self._client.servers)

    @property
    def _shm_servers(self) -> set[int]:
        return self._client.shm_servers

    def _done(self, handle: Handle, wait: bool) -> Optional[Handle]:
        """Send what the call queued: now, and wait for it; or soon, and return its handle."""
        if not wait:
            self._client.flush(soon=True)
            return handle
        self._client.flush()
        with self._unlocked():
            handle.wait()
        return None

    def _init_impl(self, items: list[tuple[KeyMeta, Tensor]]) -> None:
        self._client.check()
        batches: dict[int, list[tuple[list[Any], list[Any]]]] = {}  # server -> its INIT messages' rows and frames
        room: dict[int, int] = {}  # bytes of metadata the last of them still takes (a row per part: many keys need several)
        limit = self._client.data.max_frame  # the servers' (checked here, by every worker alike: worker 0's INIT would be refused, the others' wait)
        for meta, value in items:
            try:
                dtype = dtype_name(meta.dtype)
            except errors.ProtocolError as exc:
                raise errors.InvalidValueError(f"{meta}: {exc}") from None
            name = repr(meta.key)
            if (size := 100 + len(name) * (2 if name.isascii() else 12)) > wire.MAX_META // 8:  # the most its row adds (JSON escapes); room for errors naming it
                raise errors.KeyTypeError(f"key {name:.80}...: a name of {len(name)} characters is too long to travel to the servers")
            chunk = self._chunk // meta.dtype.itemsize if self._chunk else None
            self._parts[meta.id] = place(meta.id, meta.numel, self.num_servers, self._bound, row_numel=meta.row_numel, chunk=chunk)
            if limit and (most := max(p.numel for p in self._parts[meta.id]) * meta.dtype.itemsize) > limit:
                raise errors.KVStoreError(f"{meta}: a part of {most} bytes (rows of shape {tuple(meta.shape[1:])} are not cut) is over "
                                          f"PSKV_MAX_MESSAGE_BYTES={limit}; set it to at least {most} on every node (0: no limit)")
            # worker 0's value is everyone's (to_dense: a no-op on a dense value)
            flat = value.detach().to_dense().to("cpu").contiguous().view(-1) if self.rank == 0 else None
            for p in self._parts[meta.id]:
                for s in self._client.holders(p.server):  # and its backup (PSKV_REPLICAS)
                    if room.get(s, 0) < size:
                        batches.setdefault(s, []).append(([], []))
                        room[s] = wire.MAX_META - 1024
                    room[s] -= size
                    rows, frames = batches[s][-1]
                    rows.append([meta.id, p.index, dtype, p.numel, meta.row_numel, meta.row_sparse, name])
                    if flat is not None:
                        frames.append(tensor_frame(flat[p.start : p.stop]))
        head = {"mode": "async" if self._async else "sync"}
        self._client.wait([self._client.send(s, Message(Type.INIT, meta={**head, "parts": rows}, frames=frames), f"init of {len(rows)} parts")
                           for s, messages in batches.items() for rows, frames in messages])

    def _push_impl(self, items: list[Group], priority: int, wait: bool, held: bool, rescale: Optional[float]) -> Optional[Handle]:
        t0 = timeline.now()
        handle = self._queue_push(items, self._client.handle(), None, wait, int(held), priority, rescale)
        timeline.span("push (copy in, queue)", t0, keys=len(items))
        if wait:  # the caller may change its tensors once push returns: wait until zmq has the bytes
            self._client.wait_sent(handle)
            return None
        return self._done(handle, False)

    def _pushpull_impl(self, items: list[Group], outs: list[Group], priority: int, wait: bool) -> Optional[Handle]:
        """One request: push rows answered with the value once their round is complete (docs/DESIGN.md)."""
        handle, bufs = self._sinks(outs)
        return self._done(self._queue_push(items, handle, bufs, wait, 0, priority), wait)

    def _queue_push(self, items: list[Group], handle: Handle, bufs: Optional[list[Tensor]], borrow: bool, held: int, priority: int,
                    rescale: Optional[float] = None) -> Handle:
        """Queue the PUSH rows of ``items``; with ``bufs`` (pushpull), answered with the parts' values. GPU values:
        one :meth:`_copy` to their page-locked slots, which their rows wait for (docs/DESIGN.md, "GPU data path")."""
        self._client.check()
        if self._async and self._optimizer is None:
            raise errors.OptimizerRequiredError("dist_async applies each push on the servers, so it needs an "
                                                "optimizer: call set_optimizer first")
        def put(meta: KeyMeta, p: Part, row: list[int], frames: list[Any], entry: Any, ready: Any = None) -> None:
            nbytes = p.numel * meta.dtype.itemsize if frames else 0
            self._client.queue(p.server, Type.PUSH, row, frames, entry, nbytes, ready, priority)
            if bufs is not None or ready is not None:  # its answer, or its page-locked slot, is in use until done
                self._before_push[(meta.id, p.index)] = handle
            elif not frames:  # through our shared-memory slot, which the server reads until the round merges
                self._slot_busy[(meta.id, p.index)] = handle

        staged: dict[torch.device, list[tuple[Tensor, Tensor]]] = {}  # per GPU: (slot, piece) to copy
        waiting = []  # the GPU values' rows, queued once their copy is
        tail = [held, int(bufs is not None), 0 if rescale is None else float_bits(rescale)]  # every row's held, reply, rescale
        for i, (meta, values) in enumerate(items):
            for p, row, frames, gpu in self._push_parts(meta, values, borrow, tail, staged):
                entry = (handle, None, None) if bufs is None else (handle, self._sink(handle, meta, bufs[i], p), meta.dtype)
                if gpu is None:  # queued now: a full batch leaves while the next keys are copied
                    put(meta, p, row, frames, entry)
                else:
                    waiting.append((gpu, meta, p, row, frames, entry))
        ready = {}
        for device, pairs in staged.items():  # after what the caller's stream has queued (the gradients)
            self._stream(device, True).wait_stream(torch.cuda.current_stream(device))
            ready[device] = self._copy(device, True, [slot for slot, _ in pairs], [piece for _, piece in pairs])
        for gpu, meta, p, row, frames, entry in waiting:
            put(meta, p, row, frames, entry, ready[gpu])
        return handle

    def _copy(self, device: torch.device, to_host: bool, dsts: list[Tensor], srcs: list[Tensor]) -> Any:
        """Copy ``srcs`` to ``dsts`` in one call on ``device``'s side stream for that direction; the
        copy's CUDA event (the GPU tensors' memory is not reused before it has passed)."""
        stream = self._stream(device, to_host)
        with torch.cuda.stream(stream):
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        for t in srcs if to_host else dsts:
            t.record_stream(stream)
        return done

    def _push_parts(self, meta: KeyMeta, values: list[Tensor], borrow: bool, tail: list[int],
                    staged: dict[torch.device, list[tuple[Tensor, Tensor]]]) -> list[tuple[Part, list[int], list[Any], Optional[torch.device]]]:
        """Each part of one key's push: its PUSH row, payload frames (none through shared memory) and,
        for a GPU value, its device (the part is added to ``staged``, to be copied to its page-locked
        slot). ``borrow``: one contiguous CPU tensor goes on the wire as it is; ``tail``: the rows' held, reply, rescale."""
        rounds = list(self._rounds(meta))  # waits for earlier pulls first
        if len(values) > 1 and any(v.is_sparse != values[0].is_sparse for v in values):  # dense and row-sparse: their
            values = [reduce_values(values, values[0].device)]  # dense sum, as the local store pushes
        sparse = values[0].is_sparse
        comp = None if sparse or not meta.dtype.is_floating_point else self._compressor  # (integers travel as they are)
        gpu = not sparse and comp is None and values[0].is_cuda
        if sparse:
            merged = reduce_values(values, torch.device("cpu"))
            ids, vals = merged.indices()[0], merged.values().reshape(merged._nnz(), meta.row_numel if meta.numel else 0)
        elif comp is not None:
            flats = [v.reshape(-1) for v in values]
            residuals = [comp.residual(meta.id, i, f) for i, f in enumerate(flats)]
        else:
            if len(values) > 1 and (gpu or (self._on_device and values[0].device.type != "cpu")):
                values = [reduce_values(values, values[0].device)]  # sum on the device, copy once
            # one part: the tensors go as they are, no flat views (each op costs)
            flats = values if len(rounds) == 1 else [v.reshape(-1) for v in values]
            one = borrow and len(values) == 1 and values[0].device.type == "cpu" and values[0].is_contiguous()
            merged_flat: Optional[Tensor] = values[0].view(-1) if one else None
        out = []
        for p, round_, busy in rounds:
            kind, home, frames = PushKind.DENSE, (-1, 0), []  # home: the (fd, offset) of our shared-memory slot
            shm = p.server in self._client.shm_servers
            if sparse:
                r0, r1 = p.start // meta.row_numel, p.stop // meta.row_numel
                i0, i1 = torch.searchsorted(ids, torch.tensor([r0, r1])).tolist()  # its run of the (coalesced: sorted) ids
                kind, frames = PushKind.SPARSE, [tensor_frame(ids[i0:i1] - r0), tensor_frame(vals[i0:i1].contiguous())]
            elif comp is not None:
                kind = PushKind.COMPRESSED
                frames = [tensor_frame(comp.codec.encode(f[p.start : p.stop], r[p.start : p.stop]).to("cpu").contiguous()) for f, r in zip(flats, residuals)]
            elif gpu or (shm and not busy):  # summed into our slot: shared memory, or pinned memory for a GPU value
                slot, home = self._slot(meta, p, gpu)
                if gpu:  # (one value: summed on the device above)
                    staged.setdefault(values[0].device, []).append((slot, self._piece(meta, flats[0], p)))
                else:
                    slot.copy_(self._piece(meta, flats[0], p))
                    for f in flats[1:]:
                        slot.add_(self._piece(meta, f, p).to("cpu"))
                frames = [] if shm else [tensor_frame(slot)]
            else:
                if merged_flat is None:
                    merged_flat = reduce_values(values, torch.device("cpu")).reshape(-1)
                frames = [tensor_frame(merged_flat[p.start : p.stop])]
            out.append((p, [meta.id, p.index, round_, kind, len(frames), *home, *tail], frames, values[0].device if gpu else None))
        for p, round_, _ in rounds:
            self._round_sent[(meta.id, p.index)] = round_
        return out

    def _rounds(self, meta: KeyMeta) -> Iterator[tuple[Part, int, bool]]:
        """Each part, the round this push makes it, once its earlier pull (or push from a page-locked slot) is
        done, and whether its shared-memory slot is still read by an earlier push (then the value goes by TCP)."""
        for p in self._parts[meta.id]:
            where = (meta.id, p.index)
            earlier = self._before_push.pop(where, None)
            if earlier is not None and not earlier.finished:
                try:
                    earlier.wait()  # sends what is queued first; copies its answers
                except errors.PSKVError as exc:  # its own failure, said before, is its caller's (wait() raises a
                    if earlier.error is None or exc is earlier.error or str(exc) != str(earlier.error):  # copy); the job's,
                        raise  # or a refused push's not said yet (the object itself), is this call's too
            if earlier is not None:  # its answers are read from the server's memory, which our push lets it change
                for copied, _ in earlier.copies:
                    copied.synchronize()
                earlier.copies = []  # done: the other keys of that call need not wait for them again
            if where in self._slot_busy and self._slot_busy[where].finished:
                del self._slot_busy[where]
            if busy := where in self._slot_busy:  # its last push may still be queued (a blocking one returns before it is sent): it
                self._client.flush()  # leaves first, on its own, or a refusal of it would fail this one too (an ERROR fails a whole message)
            yield p, self._round_sent.get(where, 0) + 1, busy  # (counted once the rows are made)

    def _slot(self, meta: KeyMeta, p: Part, gpu: bool) -> tuple[Tensor, tuple[int, int]]:
        """The host memory a part is pushed from, made once, and its (fd, offset): our shared memory
        when the server is on this host (registered with CUDA for a GPU value), else pinned memory."""
        where = (meta.id, p.index)
        if where not in self._slots:
            if p.server in self._client.shm_servers:
                arena, offset = self._client.shared.slot(p.numel * meta.dtype.itemsize)
                if gpu:
                    self._client.shared.pin(arena.mm)
                slot, home = arena.tensor(offset, p.numel, meta.dtype), (arena.fd, offset)
            else:
                slot, home = torch.empty(p.numel, dtype=meta.dtype, pin_memory=True), (-1, 0)
            self._slots[where] = (slot.view(meta.shape) if len(self._parts[meta.id]) == 1 else slot, home)
        return self._slots[where]

    def _piece(self, meta: KeyMeta, t: Tensor, p: Part) -> Tensor:
        """Part ``p``'s elements of ``t``: ``t`` itself when the key has one part (a flat view costs an op)."""
        return t if len(self._parts[meta.id]) == 1 else t.view(-1)[p.start : p.stop]

    def _stream(self, device: torch.device, to_host: bool) -> Any:
        """A side CUDA stream of ``device`` for copies to the host or from it, made once."""
        if (device, to_host) not in self._streams:
            self._streams[device, to_host] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return self._streams[device, to_host]

    def _sinks(self, items: list[Group]) -> tuple[Handle, list[Tensor]]:
        """A handle for pulling ``items``, and per key where its parts' answers go: the first output when
        it is contiguous on the CPU or a GPU (:meth:`_sink`), else a new buffer; the handle's wait copies to the rest."""
        bufs: list[Tensor] = []
        copies: list[tuple[Tensor, list[Tensor]]] = []  # (buffer, the outputs it is copied to)
        def finish() -> None:  # in the caller's thread, once every part has arrived
            with torch.no_grad():  # a handle's wait may run where autograd records (the Trainer's forward pre-hook)
                if handle.staged:
                    self._copy_in(handle)
                for buf, outs in copies:
                    rows = buf[:, -1].nonzero()[:, 0] if any(o.is_sparse for o in outs) else None  # present rows (see _sinks)
                    buf = buf if rows is None else buf[:, :-1].reshape(outs[0].shape)
                    for o in outs:
                        write_rows(o, rows, buf[rows]) if rows is not None and o.is_sparse else o.copy_(buf, non_blocking=o.is_cuda)
        gpus: set[torch.device] = set()
        for meta, outs in items:
            first = outs[0]
            sparse = first.is_sparse or any(o.is_sparse for o in outs[1:])
            if not sparse and first.device.type in ("cpu", "cuda") and first.is_contiguous():
                bufs.append(first)
                if len(outs) > 1:
                    copies.append((first, outs[1:]))
                if first.is_cuda and first.device not in gpus:  # its copies wait for what the caller's stream has queued (may read it)
                    self._stream(first.device, False).wait_stream(torch.cuda.current_stream(first.device))
                    self._client.shared.pin_peers()
                    gpus.add(first.device)
            else:  # a row-sparse out: each row, and a last column saying whether it is present (PULL's rows 2)
                bufs.append(torch.empty((meta.numel // meta.row_numel, meta.row_numel + 1) if sparse else meta.shape, dtype=meta.dtype))
                copies.append((bufs[-1], outs))
        # (finish reads the handle: its staged answers); nothing to finish: no finish, fewer objects alive per call in flight
        handle = self._client.handle(finish if copies or gpus else None)
        if gpus:
            handle.staged = []
        return handle, bufs

    def _sink(self, handle: Handle, meta: KeyMeta, buf: Tensor, p: Part) -> Sink:
        """Where part ``p`` of a pull into ``buf`` goes: its piece of ``buf``; on a GPU, the answer is staged where it
        arrived and ``handle.wait()`` copies all of them (:meth:`_copy_in`; docs/DESIGN.md, "GPU data path")."""
        piece = self._piece(meta, buf, p) if buf.shape == meta.shape else buf[p.start // meta.row_numel : p.stop // meta.row_numel]
        if not piece.is_cuda:
            return piece
        return lambda src: handle.staged.append((piece, src.view(piece.shape)))  # type: ignore[union-attr]  # (a list: _sinks)

    def _copy_in(self, handle: Handle) -> None:
        """Copy a pull's staged answers to their GPU pieces, one call per GPU, and make the caller's
        stream wait for them (their events stay in ``handle.copies`` for later waits)."""
        staged, handle.staged = handle.staged, []
        for device in {piece.device for piece, _ in staged}:
            pairs = [(piece, src) for piece, src in staged if piece.device == device]
            copied = self._copy(device, False, [piece for piece, _ in pairs], [src for _, src in pairs])
            handle.copies = [*handle.copies, (copied, device)]
            copied.wait(torch.cuda.current_stream(device))  # (that GPU's stream: an output on another than the current one)

    def _pull_impl(self, items: list[Group], priority: int, wait: bool, rescale: Optional[float]) -> Optional[Handle]:
        self._client.check()
        handle, bufs = self._sinks(items)
        bits = 0 if rescale is None else float_bits(rescale)
        for (meta, _), buf in zip(items, bufs):
            for p in self._parts[meta.id]:
                self._queue_pull(handle, meta, p, self._sink(handle, meta, buf, p), rescale_bits=bits, priority=priority, present=buf.shape != meta.shape)
        return self._done(handle, wait)

    def _queue_pull(self, handle: Handle, meta: KeyMeta, p: Part, sink: Sink, rows: Optional[Tensor] = None, rescale_bits: int = 0,
                    priority: int = 0, present: bool = False) -> None:
        where = (meta.id, p.index)
        shm_ok = rows is None and p.server in self._client.shm_servers
        row = (meta.id, p.index, self._round_sent.get(where, 0), int(shm_ok), 2 if present else int(rows is not None), rescale_bits, 0)
        self._client.queue(p.server, Type.PULL, row, [] if rows is None else [tensor_frame(rows)], (handle, sink, meta.dtype), priority=priority)
        self._before_push[where] = handle

    def _row_sparse_pull_impl(self, items: list[tuple[KeyMeta, list[Tensor], list[Tensor]]], priority: int) -> None:
        self._client.check()
        handle = self._client.handle()
        results: list[tuple[list[Tensor], list[Tensor], Tensor, Tensor]] = []
        queued = False  # (no row wanted: nothing to wait for)
        for meta, outs, row_lists in items:
            wanted = torch.unique(torch.cat(row_lists))
            data = torch.empty(len(wanted), *meta.shape[1:], dtype=meta.dtype)  # (rows of no elements: shape (n, 0))
            for p in self._parts[meta.id]:
                r0, r1 = p.start // meta.row_numel, p.stop // meta.row_numel
                i0, i1 = torch.searchsorted(wanted, torch.tensor([r0, r1])).tolist()  # its rows of the (sorted) wanted
                if i1 > i0:
                    self._queue_pull(handle, meta, p, data[i0:i1], (wanted[i0:i1] - r0).contiguous(), priority=priority)
                    queued = True
            results.append((outs, row_lists, wanted, data))
        if queued:
            self._done(handle, True)
        for outs, row_lists, wanted, data in results:
            for out, rows in zip(outs, row_lists):
                pos = torch.searchsorted(wanted, rows)
                write_rows(out, rows, data[pos])

    def _to_servers(self, make: Callable[[int], Message], what: str, on_reply: Optional[Callable[[Message], None]] = None) -> None:
        self._client.check()
        self._client.wait([self._client.send(s, make(s), what, on_reply) for s in self._client.live_servers()])

    def _set_optimizer_impl(self, optimizer: Optimizer) -> None:
        keep = optimizer is self._optimizer  # the same object again: new hyperparameters, same states
        desc = {"optimizer": optimizer.describe(), "keep_states": keep}
        self._to_servers(lambda s: Message(Type.SET_OPTIMIZER, meta=desc), "set_optimizer")

    def _optimizer_state(self) -> dict[str, Any]:
        answers: list[Message] = []
        self._to_servers(lambda s: Message(Type.GET_STATES), "save_optimizer_states", answers.append)
        descs = [a.meta["optimizer"] for a in answers if a.meta and a.meta.get("optimizer")]
        if not descs:
            raise errors.OptimizerError("no optimizer is set on the servers; call set_optimizer first")
        by_id = {m.id: m for m in self._keys.values()}
        pieces: dict[int, dict[int, tuple[int, dict[str, Tensor]]]] = {}  # key -> part -> (step, tensors)
        for ans in answers:
            frames = iter(ans.frames)
            for e in wire.frame_json(next(frames)):  # (the parts' table)
                meta, part = by_id[int(e["key"])], int(e["part"])
                n = self._parts[meta.id][part].numel
                pieces.setdefault(meta.id, {})[part] = (int(e["step"]), {str(name): frame_tensor(next(frames), meta.dtype, n) for name in e["names"]})
        keys: dict[int, dict[str, Any]] = {}
        for kid, parts in pieces.items():
            if len(parts) == len(self._parts[kid]):  # else some server has no state yet
                tensors = {n: torch.cat([parts[i][1][n] for i in range(len(parts))]).view(by_id[kid].shape) for n in sorted(parts[0][1])}
                keys[kid] = {"step": parts[0][0], "tensors": tensors}
        num_update = max(int((a.meta or {}).get("num_update", 0)) for a in answers)
        return {"optimizer": descs[0], "num_update": num_update, "keys": keys}

    def _load_optimizer_state(self, state: dict[str, Any], optimizer: Optimizer) -> None:
        batches: dict[int, tuple[list[Any], list[Any]]] = {s: ([], []) for s in range(self.num_servers)}
        by_id = {m.id: m for m in self._keys.values()}
        for kid, entry in state["keys"].items():
            meta = by_id.get(int(kid))
            if meta is None:
                continue
            optimizer.check_state(meta.key, entry["tensors"], torch.empty(meta.shape, device="meta"))  # here, before any server changes
            names, step = sorted(entry["tensors"]), int(entry["step"])
            flats = {n: entry["tensors"][n].to("cpu", meta.dtype).contiguous().view(-1) for n in names}
            for p in self._parts[meta.id]:
                for s in self._client.holders(p.server):
                    batches[s][0].append({"key": meta.id, "part": p.index, "step": step, "names": names})
                    batches[s][1].extend(tensor_frame(flats[n][p.start : p.stop]) for n in names)
        head = {"optimizer": state["optimizer"], "num_update": int(state["num_update"])}
        self._to_servers(lambda s: Message(Type.SET_STATES, meta=head, frames=[wire.json_frame(batches[s][0]), *batches[s][1]]),
                         "load_optimizer_states")

    def _set_compression_impl(self, compressor: Compressor) -> None:
        self._client.push_meta["codec"] = compressor.codec.describe()

    def _hurry(self) -> None:
        self._client.hurry()

    def _barrier_impl(self, *value: Any) -> list[Any]:
        self._client.check()
        with self._unlocked(), self._barrier:  # (this worker's barriers one at a time: the scheduler keeps one a worker)
            return self._client.barrier("worker", *value)

    def _close_impl(self) -> None:
        self._closer()
        self._slots.clear()  # (views of the arenas)

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        self._leaving += [exc] if exc is not None else []
        self.close()
