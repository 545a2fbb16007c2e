"""``dist_sync``, ``dist_device_sync``, ``dist_async``: the store backed by parameter servers.

The worker cuts every key into parts (:mod:`pskv.ps.partition`) and sends each server one
message per call listing its parts (over TCP, a push goes out every ``PSKV_BATCH_BYTES``, so
the server merges the first parts while the rest are on the wire):

- ``init``: every worker declares every part, worker 0 with the value; ``init`` returns when the
  servers hold worker 0's value, so every worker pulls the same initial weights.
- ``push``: device lists are summed (on the CPU; on the first tensor's device for
  ``dist_device_sync``) into this worker's shared-memory slot of the part when the server is on
  this host, else sent as frames, without a copy when one CPU tensor is pushed (``push`` then
  returns once the bytes are sent). With gradient compression each device value is encoded with
  its own residual and the server sums the decoded values; row-sparse values travel as rows.
- ``pull``: each part's answer is copied straight into ``out`` by the I/O thread; ``pull``
  returns when every part has arrived, as of the round of this worker's latest push.
- The optimizer runs on the servers; its description travels, never code.

A process whose ``DMLC_ROLE`` is ``server`` or ``scheduler`` serves instead (see :func:`create_dist`).
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from .. import config, errors
from ..ops import reduce_values, write_rows
from ..optim import Optimizer
from ..ps import shm, trace
from ..ps.client import WorkerClient
from ..ps.message import ANSWER, PULL, PUSH, Message, PushKind, Type, dtype_name, frame_tensor, tensor_frame
from ..ps.node import JobEnv, host_identity
from ..ps.partition import Part, place
from ..ps.tracker import Request
from .base import KeyMeta, KVStore

Sink = Union[Tensor, Callable[[Tensor], None]]  # where a pulled part goes: a tensor to copy into, or a function


def create_dist(name: str, environ: Optional[dict[str, str]] = None) -> KVStore:
    """The ``dist_*`` store of this process, or, for a server/scheduler process, serve and exit."""
    env = JobEnv.from_environ(environ)
    if env.role != "worker":
        from ..ps import serve

        sys.exit(serve(env))
    return DistStore(name, env)


def _close_at_exit(ref: weakref.ReferenceType[DistStore]) -> None:
    store = ref()
    if store is not None:
        try:
            store.close()
        except Exception as exc:  # exiting anyway; say why the job may see this worker as failed
            print(f"pskv: closing the store at exit failed: {exc}", file=sys.stderr)


class _Batch:
    """The rows and payload frames of one message for one server."""

    __slots__ = ("frames", "nbytes", "rows", "sinks", "slots")

    def __init__(self) -> None:
        self.rows: list[Any] = []
        self.frames: list[Any] = []
        self.sinks: list[tuple[Sink, torch.dtype]] = []  # pulls: where each row's answer goes
        self.slots: list[tuple[int, int]] = []  # pushes: the parts whose shared slot it uses
        self.nbytes = 0


class DistStore(KVStore):
    """A worker's view of the parameter servers. Thread-safe like every store (one call at a time)."""

    def __init__(self, type_name: str, env: JobEnv):
        super().__init__(type_name)
        self._async = type_name == "dist_async"
        self._on_device = type_name == "dist_device_sync"
        self._client = WorkerClient(env)
        self._client.start()
        trace.start(f"worker-{self._client.rank}")
        self._bound = config.bigarray_bound()
        self._chunk = config.chunk_bytes()
        self._batch_bytes = config.batch_bytes()
        self._parts: dict[int, list[Part]] = {}
        self._round_sent: dict[tuple[int, int], int] = {}  # (key, part) -> the round of our latest push of it
        self._shared = shm.Shared()
        self._slots: dict[tuple[int, int], tuple[shm.Arena, int, Tensor]] = {}  # (key, part) -> its push slot
        self._slot_push: dict[tuple[int, int], Request] = {}  # the push that may still read a slot
        self._atexit = atexit.register(_close_at_exit, weakref.ref(self))
        try:
            self._shm_servers = self._probe_shm()
        except BaseException:
            self.close()
            raise

    @property
    def rank(self) -> int:
        return self._client.rank

    @property
    def num_workers(self) -> int:
        return self._client.num_workers

    @property
    def num_servers(self) -> int:
        """How many servers hold the keys."""
        return self._client.num_servers

    def _probe_shm(self) -> set[int]:
        """The servers this worker exchanges data with through shared memory (``PSKV_SHM``)."""
        want = shm.mode()
        if want == "0":
            return set()
        ok: set[int] = set()
        for s, info in enumerate(self._client.servers):
            try:
                if not host_identity() or info.get("shm_host") != host_identity():
                    raise errors.ProtocolError(f"server {s} ({info.get('hostname')}) is on another host")
                answer: list[Message] = []
                probe = Message(Type.SHM_PROBE, meta=self._shared.probe())
                self._client.wait([self._client.send(s, probe, "shared-memory probe", answer.append)])
                self._shared.accept(answer[0].meta or {}, int(info["pid"]))
                ok.add(s)
            except errors.ProtocolError as exc:
                if want == "1":
                    raise errors.ClusterError(f"PSKV_SHM=1, but shared memory with server {s} failed: {exc}") from None
        return ok

    def _send(self, server: int, msg: Message, what: str, on_reply: Optional[Callable[[Message], None]] = None) -> Request:
        return self._client.send(server, msg, what, on_reply)

    # -- init / push / pull -----------------------------------------------------------------------

    def _init_impl(self, items: list[tuple[KeyMeta, Tensor]]) -> None:
        self._client.check()
        batches: dict[int, _Batch] = {}
        for meta, value in items:
            row_numel = max(1, meta.row_numel) if meta.shape else 1
            chunk = self._chunk // meta.dtype.itemsize if self._chunk else None
            self._parts[meta.id] = place(meta.id, meta.numel, self.num_servers, self._bound, row_numel=row_numel, chunk=chunk)
            flat = None
            if self.rank == 0:  # worker 0's value is everyone's
                dense = value.detach().to_dense() if value.is_sparse else value.detach()
                flat = dense.to("cpu").contiguous().view(-1)
            for p in self._parts[meta.id]:
                b = batches.setdefault(p.server, _Batch())
                b.rows.append([meta.id, p.index, dtype_name(meta.dtype), p.numel, row_numel, meta.row_sparse, repr(meta.key)])
                if flat is not None:
                    b.frames.append(tensor_frame(flat[p.start : p.stop]))
        mode = "async" if self._async else "sync"
        reqs = [
            self._send(s, Message(Type.INIT, meta={"mode": mode, "parts": b.rows}, frames=b.frames), f"init of {len(b.rows)} parts")
            for s, b in batches.items()
        ]
        self._client.wait(reqs)

    def _push_impl(self, items: list[tuple[KeyMeta, list[Tensor]]], priority: int) -> None:
        self._client.check()
        if self._async and self._optimizer is None:
            raise errors.OptimizerRequiredError(
                "dist_async applies each push on the servers, so it needs an optimizer: call set_optimizer first"
            )
        trace.event("push starts")
        batches: dict[int, _Batch] = {}  # server -> the parts for it not sent yet
        sent: list[Request] = []  # pushes with frames, which may point into the caller's tensors
        for meta, values in items:
            for p, row, frames in self._push_parts(meta, values):
                b = batches.setdefault(p.server, _Batch())
                b.rows.append(row)
                b.frames += frames
                if not frames:  # in our shared memory: the server reads it from there
                    b.slots.append((meta.id, p.index))
                    continue
                # TCP: the server sums one batch while the next is on the wire. Shared memory:
                # every stage is a pass over memory, so overlapping them only makes the passes
                # compete for the memory bus and the cores; the parts go in one message.
                b.nbytes += p.numel * meta.dtype.itemsize
                if b.nbytes >= self._batch_bytes:
                    sent.append(self._send_push(p.server, batches.pop(p.server)))
        for s, b in batches.items():
            req = self._send_push(s, b)
            if b.frames:
                sent.append(req)
        trace.event("push copied and sent")
        self._client.wait_sent(sent)  # the caller may change its tensors once push returns

    def _send_push(self, server: int, b: _Batch) -> Request:
        meta = {"codec": self._compressor.codec.describe()} if self._compressor is not None else None
        req = self._send(server, Message(Type.PUSH, meta=meta, frames=[PUSH.pack(b.rows), *b.frames]), f"push of {len(b.rows)} parts")
        for where in b.slots:
            self._slot_push[where] = req
        return req

    def _push_parts(self, meta: KeyMeta, values: list[Tensor]) -> list[tuple[Part, list[int], list[Any]]]:
        """Each part of one key's push: its PUSH row and payload frames (none through shared memory)."""
        out = []
        sparse = any(v.is_sparse for v in values)
        if sparse:
            merged = reduce_values(values, torch.device("cpu"))
            ids, vals = merged.indices()[0], merged.values().reshape(len(merged.indices()[0]), -1)
        elif self._compressor is not None:
            codec = self._compressor.codec
            flats = [v.detach().reshape(-1) for v in values]
            residuals = [self._compressor.residual(meta.id, i, f) for i, f in enumerate(flats)]
        else:
            if self._on_device and len(values) > 1 and values[0].device.type != "cpu":
                values = [reduce_values(values, values[0].device)]  # sum on the device, copy once
            flats = [v.detach().reshape(-1) for v in values]
            # one contiguous CPU tensor goes on the wire as it is: no copy (push waits until sent)
            borrow = len(values) == 1 and values[0].device.type == "cpu" and values[0].is_contiguous()
            merged_flat: Optional[Tensor] = flats[0] if borrow else None
        for p in self._parts[meta.id]:
            where = (meta.id, p.index)
            round_ = self._round_sent[where] = self._round_sent.get(where, 0) + 1
            if sparse:
                r0, r1 = p.start // max(1, meta.row_numel), p.stop // max(1, meta.row_numel)
                sel = (ids >= r0) & (ids < r1)
                frames = [tensor_frame((ids[sel] - r0).contiguous()), tensor_frame(vals[sel].contiguous())]
                out.append((p, [meta.id, p.index, round_, PushKind.SPARSE, 2, -1, 0], frames))
            elif self._compressor is not None:
                frames = [tensor_frame(codec.encode(f[p.start : p.stop], r[p.start : p.stop]).to("cpu").contiguous()) for f, r in zip(flats, residuals)]
                out.append((p, [meta.id, p.index, round_, PushKind.COMPRESSED, len(frames), -1, 0], frames))
            elif p.server in self._shm_servers:
                earlier = self._slot_push.get(where)
                if earlier is not None and not earlier.done.is_set():
                    self._client.wait([earlier])  # the server still reads the slot (its round is open)
                if where not in self._slots:
                    arena, offset = self._shared.slot(p.numel * meta.dtype.itemsize)
                    self._slots[where] = (arena, offset, arena.tensor(offset, p.numel, meta.dtype))
                arena, offset, slot = self._slots[where]
                slot.copy_(flats[0][p.start : p.stop])
                for f in flats[1:]:
                    slot.add_(f[p.start : p.stop].to("cpu"))
                out.append((p, [meta.id, p.index, round_, PushKind.DENSE, 0, arena.fd, offset], []))
            else:
                if merged_flat is None:
                    merged_flat = reduce_values(values, torch.device("cpu")).reshape(-1)
                out.append((p, [meta.id, p.index, round_, PushKind.DENSE, 1, -1, 0], [tensor_frame(merged_flat[p.start : p.stop])]))
        return out

    def _pull_impl(self, items: list[tuple[KeyMeta, list[Tensor]]], priority: int) -> None:
        self._client.check()
        copies: list[tuple[Tensor, list[Tensor]]] = []
        batches: dict[int, _Batch] = {}
        for meta, outs in items:
            first = outs[0]
            direct = not first.is_sparse and first.device.type == "cpu" and first.is_contiguous()
            buf = first if direct else torch.empty(meta.shape, dtype=meta.dtype)
            flat = buf.detach().view(-1)  # filled by the I/O thread, where grad mode is on
            for p in self._parts[meta.id]:
                self._add_pull(batches, meta, p, flat[p.start : p.stop])
            copies.append((buf, outs[1:] if direct else outs))
        self._pull(batches)
        for buf, outs in copies:
            for o in outs:
                o.copy_(buf.to_sparse(1) if o.is_sparse else buf)

    def _add_pull(self, batches: dict[int, _Batch], meta: KeyMeta, p: Part, sink: Sink, rows: Optional[Tensor] = None) -> None:
        b = batches.setdefault(p.server, _Batch())
        shm_ok = rows is None and p.server in self._shm_servers
        b.rows.append((meta.id, p.index, self._round_sent.get((meta.id, p.index), 0), int(shm_ok), int(rows is not None)))
        b.sinks.append((sink, meta.dtype))
        if rows is not None:
            b.frames.append(tensor_frame(rows))

    def _pull(self, batches: dict[int, _Batch]) -> None:
        """Send the pulls and wait until every answer has been copied to its sink."""
        reqs = []
        for server, b in batches.items():
            msg = Message(Type.PULL, frames=[PULL.pack(b.rows), *b.frames])
            reqs.append(self._send(server, msg, f"pull of {len(b.rows)} parts", self._filler(server, b.sinks)))
        trace.event("pull sent")
        self._client.wait(reqs)
        trace.event("pull complete")

    def _filler(self, server: int, sinks: list[tuple[Sink, torch.dtype]]) -> Callable[[Message], None]:
        """The I/O thread's copy of a (partial) answer into the pull's sinks."""
        pid = int(self._client.servers[server]["pid"])

        def fill(msg: Message) -> None:
            frames = iter(msg.frames[1:])
            for row in ANSWER.unpack(msg.frames[0]):
                sink, dtype = sinks[row.entry]
                if row.fd >= 0:
                    src = self._shared.tensor(pid, row.fd, row.offset, row.nbytes, dtype)
                else:
                    src = frame_tensor(next(frames), dtype)
                if isinstance(sink, Tensor):
                    sink.copy_(src)
                else:
                    sink(src)

        return fill

    def _row_sparse_pull_impl(self, items: list[tuple[KeyMeta, list[Tensor], list[Tensor]]], priority: int) -> None:
        self._client.check()
        batches: dict[int, _Batch] = {}
        results: list[tuple[KeyMeta, list[Tensor], list[Tensor], Tensor, Tensor]] = []
        for meta, outs, row_lists in items:
            row_numel = max(1, meta.row_numel)
            wanted = torch.unique(torch.cat(row_lists))
            data = torch.empty(len(wanted), row_numel, dtype=meta.dtype)
            for p in self._parts[meta.id]:
                r0, r1 = p.start // row_numel, p.stop // row_numel
                where = torch.nonzero((wanted >= r0) & (wanted < r1)).view(-1)
                if where.numel():
                    sink = lambda src, where=where, data=data: data.index_copy_(0, where, src.view(len(where), -1))  # noqa: E731
                    self._add_pull(batches, meta, p, sink, (wanted[where] - r0).contiguous())
            results.append((meta, outs, row_lists, wanted, data))
        self._pull(batches)
        for meta, outs, row_lists, wanted, data in results:
            for out, rows in zip(outs, row_lists):
                pos = torch.searchsorted(wanted, rows)
                write_rows(out, rows, data[pos].view(len(rows), *meta.shape[1:]))

    # -- optimizer ------------------------------------------------------------------------------

    def _to_servers(self, make: Callable[[int], Message], what: str, on_reply: Optional[Callable[[Message], None]] = None) -> None:
        self._client.check()
        self._client.wait([self._send(s, make(s), what, on_reply) for s in range(self.num_servers)])

    def _set_optimizer_impl(self, optimizer: Optimizer) -> None:
        keep = optimizer is self._optimizer  # the same object again: new hyperparameters, same states
        desc = {"optimizer": optimizer.describe(), "keep_states": keep}
        self._to_servers(lambda s: Message(Type.SET_OPTIMIZER, meta=desc), "set_optimizer")
        self._optimizer = optimizer

    def _optimizer_state(self) -> dict[str, Any]:
        answers: list[Message] = []
        self._to_servers(lambda s: Message(Type.GET_STATES), "save_optimizer_states", answers.append)
        by_id = {m.id: m for m in self._keys.values()}
        pieces: dict[int, dict[int, tuple[int, dict[str, Tensor]]]] = {}
        desc = None
        num_update = 0
        for ans in answers:
            meta = ans.meta or {}
            desc = desc or meta.get("optimizer")
            num_update = max(num_update, int(meta.get("num_update", 0)))
            frames = iter(ans.frames)
            for e in meta.get("parts", []):
                key = by_id[int(e["key"])]
                n = self._parts[key.id][int(e["part"])].numel
                tensors = {str(name): frame_tensor(next(frames), key.dtype, n).clone() for name in e["names"]}
                pieces.setdefault(key.id, {})[int(e["part"])] = (int(e["step"]), tensors)
        if desc is None:
            raise errors.OptimizerError("no optimizer is set on the servers; call set_optimizer first")
        keys: dict[int, dict[str, Any]] = {}
        for kid, parts in pieces.items():
            if sorted(parts) != list(range(len(self._parts[kid]))):
                continue  # a key no push has updated yet on some server: no state to save
            names = sorted(parts[0][1])
            shape = by_id[kid].shape
            keys[kid] = {"step": parts[0][0], "tensors": {n: torch.cat([parts[i][1][n] for i in sorted(parts)]).view(shape) for n in names}}
        return {"optimizer": desc, "num_update": num_update, "keys": keys}

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        desc = state["optimizer"]
        if self._optimizer is not None and self._optimizer.name != desc.get("name"):
            raise errors.OptimizerError(f"the file holds {desc.get('name')!r} states but the store's optimizer is {self._optimizer.name!r}")
        per_server: dict[int, tuple[list[dict[str, Any]], list[Any]]] = {s: ([], []) for s in range(self.num_servers)}
        by_id = {m.id: m for m in self._keys.values()}
        opt = self._optimizer or Optimizer.from_description(desc)
        for kid, entry in state["keys"].items():
            meta = by_id.get(int(kid))
            if meta is None:
                continue
            opt.check_state(meta.key, entry["tensors"], torch.empty(meta.shape, device="meta"))  # here, before any server changes
            names = sorted(entry["tensors"])
            flats = {n: entry["tensors"][n].to("cpu", meta.dtype).contiguous().view(-1) for n in names}
            for p in self._parts[meta.id]:
                entries, frames = per_server[p.server]
                entries.append({"key": meta.id, "part": p.index, "step": int(entry["step"]), "names": names})
                frames += [tensor_frame(flats[n][p.start : p.stop]) for n in names]

        def message(s: int) -> Message:
            meta = {"optimizer": desc, "num_update": int(state["num_update"]), "parts": per_server[s][0]}
            return Message(Type.SET_STATES, meta=meta, frames=per_server[s][1])

        self._to_servers(message, "load_optimizer_states")
        if self._optimizer is None:
            self._optimizer = Optimizer.from_description(desc)

    # -- the rest -------------------------------------------------------------------------------

    def _barrier_impl(self) -> None:
        self._client.check()
        self._client.barrier("worker")

    def _allgather_impl(self, value: Any) -> list[Any]:
        self._client.check()
        return self._client.barrier("worker", value)

    def _close_impl(self) -> None:
        atexit.unregister(self._atexit)
        self._client.close()
