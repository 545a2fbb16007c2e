"""``dist_sync``, ``dist_device_sync``, ``dist_async``: the store backed by parameter servers.

The worker cuts every key into parts (:mod:`pskv.ps.partition`) and talks to the servers that
hold them through a :class:`~pskv.ps.client.WorkerClient`:

- ``init``: every worker sends INIT for every part, worker 0 with the value; ``init`` returns
  when the servers hold worker 0's value, so every worker pulls the same initial weights.
- ``push``: device lists are summed (on the CPU; on the first tensor's device for
  ``dist_device_sync``) into a buffer of the store's own, whose parts are queued for the servers
  without further copies; ``push`` returns once queued. With gradient compression each device
  value is encoded with its own residual instead and the servers sum the decoded values.
- ``pull``: each part's answer is copied straight into ``out`` by the I/O thread; ``pull``
  returns when every part has arrived. A pull sees the round of this worker's latest push.
- The optimizer runs on the servers; its description travels, never code.

A process whose ``DMLC_ROLE`` is ``server`` or ``scheduler`` serves instead (see :func:`create_dist`).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from .. import config, errors
from ..compression import Compressor
from ..ops import reduce_values, write_rows
from ..optim import Optimizer
from ..ps import shm, trace
from ..ps.client import WorkerClient
from ..ps.message import Flag, Message, Type, dtype_name, frame_tensor, pack_index, tensor_frame, unpack_index
from ..ps.node import JobEnv, host_identity
from ..ps.partition import Part, place
from ..ps.tracker import Request
from .base import KeyMeta, KVStore


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
    """The dense parts of one push call bound for one server."""

    __slots__ = ("borrowed", "frames", "nbytes", "rows", "slots")

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int, int, int]] = []  # key, part, fd (-1: a frame), offset, bytes
        self.frames: list[Any] = []
        self.slots: list[tuple[int, int]] = []  # parts whose shared slot this batch uses
        self.nbytes = 0
        self.borrowed = False  # some frames point into the caller's tensors


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
        self._parts: dict[int, list[Part]] = {}
        self._pushes: dict[tuple[int, int], int] = {}
        self._chunk = config.chunk_bytes()
        self._batch = config.batch_bytes()
        self._arenas = shm.Arenas()
        self._maps = shm.Mappings()
        self._slots: dict[tuple[int, int], tuple[shm.Arena, int, Tensor]] = {}  # part -> its push slot
        self._last_shm_push: dict[tuple[int, int], Request] = {}
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

    def _server(self, p: Part) -> str:
        return f"server {p.server}"

    def _probe_shm(self) -> set[int]:
        """The servers this worker exchanges data with through shared memory (``PSKV_SHM``)."""
        want = shm.mode()
        if want == "0":
            return set()
        mine = host_identity()
        arena = self._arenas.first()
        ok: set[int] = set()
        for s, info in enumerate(self._client.servers):
            if not mine or info.get("shm_host") != mine:
                if want == "1":
                    raise errors.ClusterError(f"PSKV_SHM=1, but server {s} ({info.get('hostname')}) cannot share memory with this worker")
                continue
            answer: list[Message] = []
            probe = Message(Type.SHM_PROBE, meta={"pid": os.getpid(), "fd": arena.fd, "token": arena.token.hex()})
            req = self._client.submit(f"server {s}", probe, "shared-memory probe", on_reply=answer.append)
            try:
                self._client.wait([req])
                meta = answer[0].meta or {}
                if meta.get("pid") != info.get("pid"):
                    raise errors.ProtocolError(f"server {s} answered the probe from pid {meta.get('pid')}")
                self._maps.map(int(meta["pid"]), int(meta["fd"]), bytes.fromhex(str(meta["token"])))
                ok.add(s)
            except (errors.ProtocolError, KeyError, ValueError) as exc:
                if want == "1":
                    raise errors.ClusterError(f"PSKV_SHM=1, but shared memory with server {s} failed: {exc}") from None
        return ok

    # -- init / push / pull -----------------------------------------------------------------------

    def _init_impl(self, items: list[tuple[KeyMeta, Tensor]]) -> None:
        self._client.check()
        reqs: list[Request] = []
        mode = "async" if self._async else "sync"
        for meta, value in items:
            row_numel = max(1, meta.row_numel) if meta.shape else 1
            chunk = self._chunk // meta.dtype.itemsize if self._chunk else None
            parts = place(meta.id, meta.numel, self.num_servers, self._bound, row_numel=row_numel, chunk=chunk)
            self._parts[meta.id] = parts
            flat = None
            if self.rank == 0:
                dense = value.detach().to_dense() if value.is_sparse else value.detach()
                flat = dense.to("cpu").contiguous().view(-1)
            for p in parts:
                info = {
                    "dtype": dtype_name(meta.dtype),
                    "numel": p.numel,
                    "row_numel": row_numel,
                    "mode": mode,
                    "name": repr(meta.key),
                    "row_sparse": meta.row_sparse,
                }
                frames: list[Any] = [tensor_frame(flat[p.start : p.stop])] if flat is not None else []
                msg = Message(Type.INIT, key=meta.id, part=p.index, meta=info, frames=frames)
                reqs.append(self._client.submit(self._server(p), msg, f"init of {meta}", wake=False))
        self._client.flush()
        self._client.wait(reqs)

    def _push_impl(self, items: list[tuple[KeyMeta, list[Tensor]]], priority: int) -> None:
        self._client.check()
        if self._async and self._optimizer is None:
            raise errors.OptimizerRequiredError(
                "dist_async applies each push on the servers, so it needs an optimizer: call set_optimizer first"
            )
        trace.event("push starts")
        batches: dict[int, _Batch] = {}  # server -> the dense parts for it not sent yet
        sent: list[Callable[[float], bool]] = []  # frames that point into the caller's tensors
        for meta, values in items:
            comp = self._compressor
            if comp is not None and not any(v.is_sparse for v in values):
                self._push_compressed(meta, values, comp, priority)
            elif any(v.is_sparse for v in values):
                merged = reduce_values(values, torch.device("cpu"))
                for p in self._parts[meta.id]:
                    self._send_push(meta, p, self._sparse_frames(meta, p, merged), Flag.SPARSE, None, priority)
            else:
                self._push_dense(meta, values, batches, sent)
        for server in list(batches):
            self._send_batch(server, batches.pop(server), sent)
        self._client.flush()
        trace.event("push copied and sent")
        # the caller may change its tensors once push returns: wait until zmq has the bytes
        deadline = time.monotonic() + self._client.tracker.timeout
        for wait in sent:
            while not wait(0.25):
                self._client.check()
                if time.monotonic() > deadline:
                    raise errors.DeadlineExceeded("push: the bytes were not handed to the network within PSKV_TIMEOUT")

    def _send_batch(self, server: int, b: _Batch, sent: list[Callable[[float], bool]]) -> None:
        """One message with the parts of ``b``: headers of shared slots, or frames."""
        msg = Message(Type.PUSH, flags=Flag.BATCH, frames=[pack_index(b.rows, 5), *b.frames])
        what = f"push of {len(b.rows)} parts"
        req = self._client.send_now(server, msg, what, waited=False, entries=len(b.rows), sent=sent if b.borrowed else None)
        for where in b.slots:
            self._last_shm_push[where] = req

    def _push_dense(self, meta: KeyMeta, values: list[Tensor], batches: dict[int, _Batch], sent: list[Callable[[float], bool]]) -> None:
        """Add ``meta``'s parts to the per-server batches (summed into shared slots, or as frames),
        sending a TCP server's batch whenever it holds ``PSKV_BATCH_BYTES``."""
        if self._on_device and len(values) > 1 and values[0].device.type != "cpu":
            values = [reduce_values(values, values[0].device)]  # sum on the device, copy once
        flats = [v.detach().reshape(-1) for v in values]
        merged: Optional[Tensor] = None
        # one contiguous CPU tensor goes on the wire as it is: no copy (push waits until sent)
        borrow = len(values) == 1 and values[0].device.type == "cpu" and values[0].is_contiguous()
        for p in self._parts[meta.id]:
            where = (meta.id, p.index)
            b = batches.setdefault(p.server, _Batch())
            nbytes = p.numel * meta.dtype.itemsize
            self._pushes[where] = self._pushes.get(where, 0) + 1
            if p.server not in self._shm_servers:  # a server elsewhere: the bytes go in a frame
                if borrow:
                    frame = flats[0][p.start : p.stop]
                    b.borrowed = True
                else:
                    if merged is None:
                        merged = reduce_values(values, torch.device("cpu")).reshape(-1)
                    frame = merged[p.start : p.stop]
                b.rows.append((meta.id, p.index, -1, 0, nbytes))
                b.frames.append(tensor_frame(frame))
            else:
                earlier = self._last_shm_push.get(where)
                if earlier is not None and not earlier.done.is_set():
                    self._client.wait([earlier])  # the server still reads the slot (its round is open)
                if where not in self._slots:
                    arena, offset = self._arenas.slot(nbytes)
                    self._slots[where] = (arena, offset, arena.tensor(offset, p.numel, meta.dtype))
                arena, offset, slot = self._slots[where]
                slot.copy_(flats[0][p.start : p.stop])
                for f in flats[1:]:
                    slot.add_(f[p.start : p.stop].to("cpu"))
                b.rows.append((meta.id, p.index, arena.fd, offset, nbytes))
                b.slots.append(where)
                continue
            # TCP: the server sums one batch while the next is on the wire. Shared memory: every
            # stage is a pass over memory, so overlapping them only makes the passes compete for
            # the memory bus and the cores; the parts go in one message per server per call.
            b.nbytes += nbytes
            if b.nbytes >= self._batch:
                self._send_batch(p.server, batches.pop(p.server), sent)

    def _sparse_frames(self, meta: KeyMeta, p: Part, merged: Tensor) -> list[Any]:
        row_numel = max(1, meta.row_numel)
        r0, r1 = p.start // row_numel, p.stop // row_numel
        rows, vals = merged.indices()[0], merged.values().reshape(-1, row_numel)
        sel = (rows >= r0) & (rows < r1)
        return [tensor_frame((rows[sel] - r0).contiguous()), tensor_frame(vals[sel].contiguous())]

    def _push_compressed(self, meta: KeyMeta, values: list[Tensor], comp: Compressor, priority: int) -> None:
        codec = comp.codec
        flats = [v.detach().reshape(-1) for v in values]
        residuals = [comp.residual(meta.id, i, f) for i, f in enumerate(flats)]
        for p in self._parts[meta.id]:
            frames = [
                tensor_frame(codec.encode(f[p.start : p.stop], r[p.start : p.stop]).to("cpu").contiguous())
                for f, r in zip(flats, residuals)
            ]
            self._send_push(meta, p, frames, Flag.COMPRESSED, {"codec": codec.describe()}, priority)

    def _send_push(self, meta: KeyMeta, p: Part, frames: list[Any], flags: Flag, info: Optional[dict[str, Any]], priority: int) -> None:
        """A single-part push (row-sparse or compressed)."""
        self._pushes[(meta.id, p.index)] = self._pushes.get((meta.id, p.index), 0) + 1
        msg = Message(Type.PUSH, key=meta.id, part=p.index, flags=flags, meta=info, frames=frames)
        self._client.submit(self._server(p), msg, f"push of {meta}", priority=priority, waited=False, wake=False)

    def _pull_impl(self, items: list[tuple[KeyMeta, list[Tensor]]], priority: int) -> None:
        self._client.check()
        copies: list[tuple[Tensor, list[Tensor]]] = []
        rows: dict[int, list[tuple[int, int, int, int]]] = {}
        dsts: dict[int, list[tuple[Tensor, torch.dtype]]] = {}
        for meta, outs in items:
            first = outs[0]
            direct = not first.is_sparse and first.device.type == "cpu" and first.is_contiguous()
            buf = first if direct else torch.empty(meta.shape, dtype=meta.dtype)
            flat = buf.detach().view(-1)  # filled by the I/O thread, where grad mode is on
            for p in self._parts[meta.id]:
                shm_ok = int(p.server in self._shm_servers)
                rows.setdefault(p.server, []).append((meta.id, p.index, self._pushes.get((meta.id, p.index), 0), shm_ok))
                dsts.setdefault(p.server, []).append((flat[p.start : p.stop], meta.dtype))
            copies.append((buf, outs[1:] if direct else outs))
        reqs: list[Request] = []
        for server, server_rows in rows.items():
            fill = self._filler(server, dsts[server])
            msg = Message(Type.PULL, flags=Flag.BATCH, frames=[pack_index(server_rows, 4)])
            what = f"pull of {len(server_rows)} parts"
            if server in self._shm_servers:  # a header each way; the I/O thread copies the bytes
                reqs.append(self._client.send_now(server, msg, what, fill, entries=len(server_rows)))
            else:  # bytes on the wire: queued by priority
                reqs.append(self._client.submit(f"server {server}", msg, what, fill, priority, wake=False, entries=len(server_rows)))
        self._client.flush()
        trace.event("pull sent")
        self._client.wait(reqs)
        trace.event("pull complete")
        for buf, outs in copies:
            for o in outs:
                o.copy_(buf.to_sparse(1) if o.is_sparse else buf)

    def _filler(self, server: int, dsts: list[tuple[Tensor, torch.dtype]]) -> Any:
        """The I/O thread's copy of a (partial) batched answer into the pull's outputs."""
        pid = int(self._client.servers[server]["pid"])

        def fill(msg: Message) -> None:
            frames = iter(msg.frames[1:])
            for index, fd, offset, nbytes in unpack_index(msg.frames[0], 4):
                dst, dtype = dsts[index]
                if fd >= 0:
                    dst.copy_(self._maps.tensor(pid, fd, offset, nbytes, dtype))
                else:
                    dst.copy_(frame_tensor(next(frames), dtype, dst.numel()))

        return fill

    def _row_sparse_pull_impl(self, items: list[tuple[KeyMeta, list[Tensor], list[Tensor]]], priority: int) -> None:
        self._client.check()
        reqs: list[Request] = []
        results: list[tuple[KeyMeta, list[Tensor], list[Tensor], Tensor, Tensor]] = []
        for meta, outs, row_lists in items:
            row_numel = max(1, meta.row_numel)
            wanted = torch.unique(torch.cat(row_lists))
            data = torch.empty(len(wanted), row_numel, dtype=meta.dtype)
            for p in self._parts[meta.id]:
                r0, r1 = p.start // row_numel, p.stop // row_numel
                where = torch.nonzero((wanted >= r0) & (wanted < r1)).view(-1)
                if not where.numel():
                    continue

                def fill(
                    msg: Message, where: Tensor = where, n: int = len(where) * row_numel, data: Tensor = data, dtype: torch.dtype = meta.dtype
                ) -> None:
                    data.index_copy_(0, where, frame_tensor(msg.frames[0], dtype, n).view(len(where), -1))

                local = (wanted[where] - r0).contiguous()
                msg = Message(
                    Type.ROW_PULL, key=meta.id, part=p.index, a=self._pushes.get((meta.id, p.index), 0), frames=[tensor_frame(local)]
                )
                reqs.append(self._client.submit(self._server(p), msg, f"row_sparse_pull of {meta}", fill, priority, wake=False))
            results.append((meta, outs, row_lists, wanted, data))
        self._client.flush()
        self._client.wait(reqs)
        for meta, outs, row_lists, wanted, data in results:
            for out, rows in zip(outs, row_lists):
                pos = torch.searchsorted(wanted, rows)
                write_rows(out, rows, data[pos].view(len(rows), *meta.shape[1:]))

    # -- optimizer ------------------------------------------------------------------------------

    def _to_servers(self, make: Any, what: str) -> list[Request]:
        reqs = [self._client.submit(f"server {s}", make(s), what, wake=False) for s in range(self.num_servers)]
        self._client.flush()
        return reqs

    def _set_optimizer_impl(self, optimizer: Optimizer) -> None:
        self._client.check()
        keep = optimizer is self._optimizer  # the same object again: new hyperparameters, same states
        desc = {"optimizer": optimizer.describe(), "keep_states": keep}
        self._client.wait(self._to_servers(lambda s: Message(Type.SET_OPTIMIZER, meta=desc), "set_optimizer"))
        self._optimizer = optimizer

    def _optimizer_state(self) -> dict[str, Any]:
        self._client.check()
        answers: list[Message] = []
        reqs = self._to_servers(lambda s: Message(Type.GET_STATES), "save_optimizer_states")
        for r in reqs:
            r.on_reply = answers.append
        self._client.wait(reqs)
        by_id = {m.id: m for m in self._keys.values()}
        pieces: dict[int, dict[int, tuple[int, dict[str, Tensor]]]] = {}
        desc = None
        num_update = 0
        for ans in answers:
            meta = ans.meta or {}
            desc = desc or meta.get("optimizer")
            num_update = max(num_update, int(meta.get("num_update", 0)))
            frames = list(ans.frames)
            for e in meta.get("parts", []):
                key = by_id.get(int(e["key"]))
                if key is None:
                    continue
                n = self._parts[key.id][int(e["part"])].numel
                tensors = {str(name): frame_tensor(frames.pop(0), key.dtype, n).clone() for name in e["names"]}
                pieces.setdefault(key.id, {})[int(e["part"])] = (int(e["step"]), tensors)
        if desc is None:
            raise errors.OptimizerError("no optimizer is set on the servers; call set_optimizer first")
        keys: dict[int, dict[str, Any]] = {}
        for kid, parts in pieces.items():
            meta_k = by_id[kid]
            order = sorted(parts)
            if order != list(range(len(self._parts[kid]))):
                continue  # a key no push has updated yet on some server: no state to save
            names = sorted(parts[0][1])
            keys[kid] = {
                "step": parts[0][0],
                "tensors": {n: torch.cat([parts[i][1][n] for i in order]).view(meta_k.shape) for n in names},
            }
        return {"optimizer": desc, "num_update": num_update, "keys": keys}

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        self._client.check()
        desc = state["optimizer"]
        if self._optimizer is not None and self._optimizer.name != desc.get("name"):
            raise errors.OptimizerError(f"the file holds {desc.get('name')!r} states but the store's optimizer is {self._optimizer.name!r}")
        per_server: dict[int, tuple[list[dict[str, Any]], list[Any]]] = {s: ([], []) for s in range(self.num_servers)}
        by_id = {m.id: m for m in self._keys.values()}
        for kid, entry in state["keys"].items():
            meta = by_id.get(int(kid))
            if meta is None:
                continue
            names = sorted(entry["tensors"])
            flats = {n: entry["tensors"][n].to("cpu", meta.dtype).contiguous().view(-1) for n in names}
            for p in self._parts[meta.id]:
                entries, frames = per_server[p.server]
                entries.append({"key": meta.id, "part": p.index, "step": int(entry["step"]), "names": names})
                frames += [tensor_frame(flats[n][p.start : p.stop]) for n in names]
        reqs = self._to_servers(
            lambda s: Message(
                Type.SET_STATES,
                meta={"optimizer": desc, "num_update": int(state["num_update"]), "parts": per_server[s][0]},
                frames=per_server[s][1],
            ),
            "load_optimizer_states",
        )
        self._client.wait(reqs)
        if self._optimizer is None:
            self._optimizer = Optimizer.from_description(desc)

    # -- the rest -------------------------------------------------------------------------------

    def _barrier_impl(self) -> None:
        self._client.check()
        self._client.barrier("worker")

    def _allgather_impl(self, value: Any) -> list[Any]:
        self._client.check()
        return self._client.allgather(value)

    def _close_impl(self) -> None:
        atexit.unregister(self._atexit)
        self._client.close()
