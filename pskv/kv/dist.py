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
import sys
import weakref
from typing import Any, Optional

import torch
from torch import Tensor

from .. import config, errors
from ..compression import Compressor
from ..ops import reduce_values, write_rows
from ..optim import Optimizer
from ..ps.client import WorkerClient
from ..ps.message import Flag, Message, Type, dtype_name, frame_tensor, tensor_frame
from ..ps.partition import Part, place
from ..ps.postoffice import JobEnv
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


class DistStore(KVStore):
    """A worker's view of the parameter servers. Thread-safe like every store (one call at a time)."""

    def __init__(self, type_name: str, env: JobEnv):
        super().__init__(type_name)
        self._async = type_name == "dist_async"
        self._on_device = type_name == "dist_device_sync"
        self._client = WorkerClient(env)
        self._client.start()
        self._bound = config.bigarray_bound()
        self._parts: dict[int, list[Part]] = {}
        self._pushes: dict[tuple[int, int], int] = {}
        self._atexit = atexit.register(_close_at_exit, weakref.ref(self))

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

    # -- init / push / pull -----------------------------------------------------------------------

    def _init_impl(self, items: list[tuple[KeyMeta, Tensor]]) -> None:
        self._client.check()
        reqs: list[Request] = []
        mode = "async" if self._async else "sync"
        for meta, value in items:
            row_numel = max(1, meta.row_numel) if meta.shape else 1
            parts = place(meta.id, meta.numel, self.num_servers, self._bound, row_numel=row_numel)
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
        for meta, values in items:
            comp = self._compressor
            if comp is not None and not any(v.is_sparse for v in values):
                self._push_compressed(meta, values, comp, priority)
                continue
            device = values[0].device if self._on_device else torch.device("cpu")
            merged = reduce_values(values, device).to("cpu")
            for p in self._parts[meta.id]:
                if merged.is_sparse:
                    frames = self._sparse_frames(meta, p, merged)
                    flags = Flag.SPARSE
                else:
                    frames = [tensor_frame(merged.view(-1)[p.start : p.stop])]
                    flags = Flag.NONE
                self._send_push(meta, p, frames, flags, None, priority)
        self._client.flush()

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
        self._pushes[(meta.id, p.index)] = self._pushes.get((meta.id, p.index), 0) + 1
        msg = Message(Type.PUSH, key=meta.id, part=p.index, flags=flags, meta=info, frames=frames)
        self._client.submit(self._server(p), msg, f"push of {meta}", priority=priority, waited=False, wake=False)

    def _pull_impl(self, items: list[tuple[KeyMeta, list[Tensor]]], priority: int) -> None:
        self._client.check()
        reqs: list[Request] = []
        copies: list[tuple[Tensor, list[Tensor]]] = []
        for meta, outs in items:
            first = outs[0]
            direct = not first.is_sparse and first.device.type == "cpu" and first.is_contiguous()
            buf = first if direct else torch.empty(meta.shape, dtype=meta.dtype)
            flat = buf.detach().view(-1)  # filled by the I/O thread, where grad mode is on
            for p in self._parts[meta.id]:
                dst = flat[p.start : p.stop]

                def fill(msg: Message, dst: Tensor = dst, n: int = p.numel, dtype: torch.dtype = meta.dtype) -> None:
                    dst.copy_(frame_tensor(msg.frames[0], dtype, n))

                msg = Message(Type.PULL, key=meta.id, part=p.index, a=self._pushes.get((meta.id, p.index), 0))
                reqs.append(self._client.submit(self._server(p), msg, f"pull of {meta}", fill, priority, wake=False))
            copies.append((buf, outs[1:] if direct else outs))
        self._client.flush()
        self._client.wait(reqs)
        for buf, outs in copies:
            for o in outs:
                o.copy_(buf.to_sparse(1) if o.is_sparse else buf)

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

    def _close_impl(self) -> None:
        atexit.unregister(self._atexit)
        self._client.close()
