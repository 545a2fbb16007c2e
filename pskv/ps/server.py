"""A server: holds some parts of the keys, merges pushes, runs the optimizer, answers pulls.

Each key is cut into parts (:mod:`pskv.ps.partition`); a server keeps the parts placed on it,
each as a flat tensor viewed as ``rows x row_numel`` (so row-sparse pushes and pulls index rows).

- **init**: every worker sends INIT for every part; rank 0's carries the value. Requests on a
  part whose value has not arrived yet wait for it (deadline ``PSKV_TIMEOUT``).
- **dist_sync**: a part's round completes when one push from *each distinct worker* is queued;
  a worker's second push waits in its queue for the next round. Then the pushes are summed and
  the optimizer runs (or the sum replaces the value). A PULL carries how many pushes its worker
  has issued and is answered once that many rounds are complete.
- **dist_async**: each push is applied on arrival; it needs an optimizer.
- Every request is checked; a bad one gets an ERROR reply naming what was wrong, never a crash.
- A pull waiting past ``PSKV_TIMEOUT`` is answered with an error that names the workers whose
  push is missing; a worker that finishes while a round still needs it fails that round at once.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from .. import config
from ..compression import Codec
from ..errors import (
    ClusterError,
    DeadlineExceeded,
    DuplicateInitError,
    KeyNotInitializedError,
    NodeFailedError,
    OptimizerError,
    OptimizerRequiredError,
    ProtocolError,
    PSKVError,
    ShapeMismatchError,
)
from ..optim import KeyState, Optimizer, apply_push
from .message import Flag, Message, Type, error_reply, frame_tensor, tensor_frame, torch_dtype
from .postoffice import JobEnv, Node
from .van import Van

PART_BITS = 20  # optimizer state key = key << PART_BITS | part


@dataclass
class _Waiting:
    peer: str
    msg: Message
    since: float = field(default_factory=time.monotonic)


@dataclass
class _Part:
    key: int
    part: int
    name: str
    dtype: torch.dtype
    numel: int
    row_numel: int
    row_sparse: bool
    mode: str  # "sync" | "async"
    value: Optional[Tensor] = None  # rows x row_numel
    declared: set[int] = field(default_factory=set)
    waiting: list[_Waiting] = field(default_factory=list)  # until the value arrives
    rounds: int = 0
    queued: dict[int, deque[Tensor]] = field(default_factory=dict)  # worker rank -> pushes
    pulls: list[_Waiting] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.numel // self.row_numel if self.row_numel else 0

    @property
    def opt_key(self) -> int:
        return self.key << PART_BITS | self.part

    def __str__(self) -> str:
        return f"key {self.name} part {self.part}"


def server_threads() -> int:
    """``PSKV_SERVER_THREADS``: torch threads a server uses for sums and updates."""
    default = max(1, min(4, (os.cpu_count() or 2) // 2))
    return max(1, config.getenv("PSKV_SERVER_THREADS", default))


class Server(Node):
    """One server process (or thread, in tests); :meth:`run` returns the exit status."""

    def __init__(self, env: JobEnv, van: Optional[Van] = None):
        super().__init__(env, van)
        self.parts: dict[tuple[int, int], _Part] = {}
        self.optimizer: Optional[Optimizer] = None
        self.left: set[int] = set()
        self.status: Optional[int] = None
        self.timeout = config.timeout()
        self._next_sweep = 0.0

    # -- loop -------------------------------------------------------------------------------------

    def run(self) -> int:
        endpoint = self.van.listen(self.env.listen_endpoint())
        try:
            self.join(endpoint)
        except PSKVError as exc:
            print(f"pskv server: {exc}", file=sys.stderr, flush=True)
            self.van.close(linger=0)
            return 1
        if not self.env.inproc:
            torch.set_num_threads(server_threads())
        self.say(f"serving on {endpoint} ({len(self.workers)} workers, {len(self.servers)} servers)")
        backlog = self.early
        self.early = []
        try:
            while self.status is None:
                batch = backlog or self.van.recv(0.2)
                backlog = []
                for peer, msg in batch:
                    self._dispatch(peer, msg)
                now = time.monotonic()
                try:
                    self.tick(now)
                except NodeFailedError as exc:
                    self._fail_everything(exc)
                    print(f"pskv {self.name}: {exc}", file=sys.stderr, flush=True)
                    self.status = 1
                if now >= self._next_sweep:
                    self._sweep(now)
                    self._next_sweep = now + 0.5
        finally:
            self.van.close(linger=2.0)
        self.say(f"exiting with status {self.status}")
        return self.status

    def _dispatch(self, peer: str, msg: Message | ProtocolError) -> None:
        if isinstance(msg, ProtocolError):
            self._reply(peer, Message(Type.ERROR, meta={"kind": "ProtocolError", "message": str(msg)}))
            return
        if peer == "scheduler":
            self.heard_from_scheduler()
            self._control(msg)
            return
        try:
            self._request(peer, msg)
        except PSKVError as exc:
            self._reply(peer, error_reply(msg, exc))
        except Exception as exc:  # a bug must not take the server down; the worker sees it
            traceback.print_exc()
            self._reply(peer, error_reply(msg, ClusterError(f"{self.name} failed on {msg}: {exc!r}")))

    def _reply(self, peer: str, msg: Message) -> None:
        try:
            self.van.send(peer, msg)
        except Exception as exc:
            print(f"pskv {self.name}: could not answer {peer}: {exc}", file=sys.stderr, flush=True)

    def _control(self, msg: Message) -> None:
        if msg.type == Type.SHUTDOWN:
            self.status = 0
        elif msg.type == Type.WORKER_LEFT:
            self.left.add(msg.a)
            for p in self.parts.values():
                self._fail_blocked_pulls(p)
        elif msg.type == Type.NODE_FAILED:
            exc = NodeFailedError(self.failure_text(msg))
            self._fail_everything(exc)
            print(f"pskv {self.name}: {exc}", file=sys.stderr, flush=True)
            self.status = 1

    def _worker_rank(self, peer: str) -> int:
        ident = self.van.peer_identity(peer)
        role, _, rank = ident.partition(":")
        if role != "worker" or not rank.isdigit() or int(rank) >= len(self.workers):
            raise ProtocolError(f"requests come from workers; got one from {ident!r}")
        return int(rank)

    # -- requests ---------------------------------------------------------------------------------

    def _request(self, peer: str, msg: Message) -> None:
        rank = self._worker_rank(peer)
        t = msg.type
        if t == Type.INIT:
            self._init(peer, rank, msg)
        elif t in (Type.PUSH, Type.PULL, Type.ROW_PULL):
            p = self._part(msg)
            if p.value is None:
                p.waiting.append(_Waiting(peer, msg))
            elif t == Type.PUSH:
                self._push(peer, rank, p, msg)
            else:
                self._pull(peer, rank, p, msg)
        elif t == Type.SET_OPTIMIZER:
            self._set_optimizer(msg)
            self._reply(peer, msg.reply(Type.OK))
        elif t == Type.GET_STATES:
            self._get_states(peer, msg)
        elif t == Type.SET_STATES:
            self._set_states(msg)
            self._reply(peer, msg.reply(Type.OK))
        else:
            raise ProtocolError(f"a server does not handle {t.name}")

    def _part(self, msg: Message) -> _Part:
        p = self.parts.get((msg.key, msg.part))
        if p is None:
            raise KeyNotInitializedError(f"key {msg.key} part {msg.part} was never initialised on {self.name}")
        return p

    def _init(self, peer: str, rank: int, msg: Message) -> None:
        meta = msg.meta or {}
        try:
            dtype = torch_dtype(meta.get("dtype"))
            numel, row_numel = int(meta["numel"]), int(meta["row_numel"])
            mode, name = str(meta["mode"]), str(meta.get("name", msg.key))
            row_sparse = bool(meta.get("row_sparse", False))
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad INIT metadata {meta!r:.200}: {exc!r}") from None
        if mode not in ("sync", "async") or numel < 0 or row_numel < 1 or (numel and numel % row_numel):
            raise ProtocolError(f"bad INIT for key {name}: mode {mode!r}, numel {numel}, row_numel {row_numel}")
        p = self.parts.get((msg.key, msg.part))
        if p is None:
            p = self.parts[(msg.key, msg.part)] = _Part(msg.key, msg.part, name, dtype, numel, row_numel, row_sparse, mode)
        elif (p.dtype, p.numel, p.row_numel, p.mode) != (dtype, numel, row_numel, mode):
            raise ShapeMismatchError(
                f"key {name} part {msg.part}: worker {rank} initialised it as {numel} x {dtype} ({mode}), "
                f"another worker as {p.numel} x {p.dtype} ({p.mode}); every worker must create the same "
                "store type and init the same keys in the same order"
            )
        if rank in p.declared:
            raise DuplicateInitError(f"key {name} was already initialised by worker {rank}")
        p.declared.add(rank)
        if msg.frames:
            if rank != 0:
                raise ProtocolError(f"key {name}: only worker 0 sends the init value")
            p.value = frame_tensor(msg.frames[0], dtype, numel).clone().view(p.rows, row_numel)
            self._reply(peer, msg.reply(Type.OK))
            held, p.waiting = p.waiting, []
            for w in held:  # other workers' INITs are answered; their pushes and pulls run now
                if w.msg.type == Type.INIT:
                    self._reply(w.peer, w.msg.reply(Type.OK))
                else:
                    self._dispatch(w.peer, w.msg)
        elif p.value is None:
            p.waiting.append(_Waiting(peer, msg))
        else:
            self._reply(peer, msg.reply(Type.OK))

    def _decode_push(self, p: _Part, msg: Message) -> Tensor:
        """The pushed gradient of ``p``: dense ``rows x row_numel`` or row-sparse of that shape."""
        if msg.flags & Flag.SPARSE:
            if len(msg.frames) != 2:
                raise ProtocolError(f"{p}: a sparse push has 2 frames, got {len(msg.frames)}")
            rows = frame_tensor(msg.frames[0], torch.int64)
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= p.rows):
                raise ProtocolError(f"{p}: pushed row ids outside [0, {p.rows})")
            vals = frame_tensor(msg.frames[1], p.dtype, rows.numel() * p.row_numel).view(-1, p.row_numel)
            return torch.sparse_coo_tensor(rows.unsqueeze(0), vals, (p.rows, p.row_numel), check_invariants=False)
        if msg.flags & Flag.COMPRESSED:
            codec = Codec.create((msg.meta or {}).get("codec", {}))
            if not msg.frames:
                raise ProtocolError(f"{p}: a compressed push without payload")
            total: Optional[Tensor] = None
            for frame in msg.frames:
                wire = frame_tensor(frame, codec.wire_dtype, codec.wire_numel(p.numel))
                dense = codec.decode(wire, p.numel, p.dtype)
                total = dense if total is None else total.add_(dense)
            assert total is not None
            return total.view(p.rows, p.row_numel)
        if len(msg.frames) != 1:
            raise ProtocolError(f"{p}: a dense push has 1 frame, got {len(msg.frames)}")
        return frame_tensor(msg.frames[0], p.dtype, p.numel).view(p.rows, p.row_numel)

    def _push(self, peer: str, rank: int, p: _Part, msg: Message) -> None:
        grad = self._decode_push(p, msg)
        assert p.value is not None
        if p.mode == "async":
            if self.optimizer is None:
                raise OptimizerRequiredError(
                    f"key {p.name}: dist_async applies pushes on the servers and needs an optimizer; call set_optimizer first"
                )
            apply_push(self.optimizer, p.opt_key, grad, p.value)
            self._reply(peer, msg.reply(Type.OK))
            return
        if rank in self.left:
            raise NodeFailedError(f"worker {rank} pushed after it finished")
        p.queued.setdefault(rank, deque()).append(grad)
        self._reply(peer, msg.reply(Type.OK))
        self._complete_rounds(p)

    def _complete_rounds(self, p: _Part) -> None:
        workers = range(len(self.workers))
        done = False
        while all(p.queued.get(r) for r in workers):
            grads = [p.queued[r].popleft() for r in workers]
            dense = [g for g in grads if not g.is_sparse]
            if len(grads) == 1 or not dense:
                merged = grads[0] if len(grads) == 1 else _sum_sparse(grads)
            else:
                merged = torch.add(dense[0], dense[1]) if len(dense) > 1 else dense[0].clone()
                for g in dense[2:]:
                    merged.add_(g)
                for g in grads:
                    if g.is_sparse:
                        merged.add_(g)
            assert p.value is not None
            apply_push(self.optimizer, p.opt_key, merged, p.value)
            p.rounds += 1
            done = True
        if done:
            ready = [w for w in p.pulls if w.msg.a <= p.rounds]
            p.pulls = [w for w in p.pulls if w.msg.a > p.rounds]
            for w in ready:
                self._answer_pull(w.peer, p, w.msg)

    def _pull(self, peer: str, rank: int, p: _Part, msg: Message) -> None:
        if p.mode == "async" or msg.a <= p.rounds:
            self._answer_pull(peer, p, msg)
            return
        w = _Waiting(peer, msg)
        blocker = self._blocker(p, msg.a)
        if blocker:
            raise NodeFailedError(blocker)
        p.pulls.append(w)

    def _answer_pull(self, peer: str, p: _Part, msg: Message) -> None:
        assert p.value is not None
        if msg.type == Type.ROW_PULL:
            if len(msg.frames) != 1:
                raise ProtocolError(f"{p}: ROW_PULL carries one frame of row ids")
            rows = frame_tensor(msg.frames[0], torch.int64)
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= p.rows):
                raise ProtocolError(f"{p}: row ids outside [0, {p.rows})")
            data = p.value.index_select(0, rows)
        else:
            # sync: the value cannot change before this worker pushes again, which it does only
            # after this reply has arrived, so it is sent without a copy; async: a snapshot
            data = p.value.clone() if p.mode == "async" else p.value
        self._reply(peer, msg.reply(Type.DATA, frames=[tensor_frame(data)]))

    # -- rounds that cannot complete ------------------------------------------------------------

    def _blocker(self, p: _Part, need: int) -> Optional[str]:
        """Why round ``need`` of ``p`` can never complete (a worker finished), or None."""
        missing = [r for r in sorted(self.left) if len(p.queued.get(r, ())) < need - p.rounds]
        if not missing:
            return None
        who = ", ".join(f"worker {r}" for r in missing)
        return f"{who} finished (closed its store) without pushing key {p.name} for round {need - 1}; the round can never complete"

    def _fail_blocked_pulls(self, p: _Part) -> None:
        keep = []
        for w in p.pulls:
            blocker = self._blocker(p, w.msg.a)
            if blocker:
                self._reply(w.peer, error_reply(w.msg, NodeFailedError(blocker)))
            else:
                keep.append(w)
        p.pulls = keep

    def _sweep(self, now: float) -> None:
        for p in self.parts.values():
            keep = []
            for w in p.pulls:
                if now - w.since > self.timeout:
                    need = w.msg.a
                    missing = [r for r in range(len(self.workers)) if len(p.queued.get(r, ())) < need - p.rounds]
                    got = [r for r in range(len(self.workers)) if r not in missing]
                    exc = DeadlineExceeded(
                        f"{self.name}: the pull of key {p.name} (part {p.part}) waited {now - w.since:.0f} s "
                        f"(PSKV_TIMEOUT={self.timeout:g}) for round {need - 1}: workers {missing} have not pushed "
                        f"key {p.name} in that round (pushed: {got})"
                    )
                    self._reply(w.peer, error_reply(w.msg, exc))
                else:
                    keep.append(w)
            p.pulls = keep
            held = []
            for w in p.waiting:
                if now - w.since > self.timeout:
                    exc = DeadlineExceeded(
                        f"{self.name}: key {p.name} (part {p.part}) has no value after {now - w.since:.0f} s "
                        f"(PSKV_TIMEOUT={self.timeout:g}): worker 0 sends the init value and has not; "
                        f"workers that called init: {sorted(p.declared)}"
                    )
                    self._reply(w.peer, error_reply(w.msg, exc))
                else:
                    held.append(w)
            p.waiting = held

    def _fail_everything(self, exc: Exception) -> None:
        for p in self.parts.values():
            for w in p.pulls + p.waiting:
                self._reply(w.peer, error_reply(w.msg, exc))
            p.pulls, p.waiting = [], []

    # -- optimizer ------------------------------------------------------------------------------

    def _set_optimizer(self, msg: Message) -> None:
        meta = msg.meta or {}
        new = Optimizer.from_description(meta.get("optimizer", {}))
        cur = self.optimizer
        if cur is None or (cur.name != new.name and not meta.get("keep_states")):
            self.optimizer = new
        elif cur.describe() == new.describe():
            return
        elif meta.get("keep_states"):
            if cur.name != new.name:
                raise OptimizerError(f"cannot change optimizer {cur.name!r} to {new.name!r} and keep its states")
            new.states, new.num_update = cur.states, cur.num_update
            self.optimizer = new
        else:
            self.optimizer = new

    def _get_states(self, peer: str, msg: Message) -> None:
        opt = self.optimizer
        parts: list[dict[str, Any]] = []
        frames = []
        if opt is not None:
            for p in self.parts.values():
                st = opt.states.get(p.opt_key)
                if st is None:
                    continue
                names = sorted(st.tensors)
                parts.append({"key": p.key, "part": p.part, "step": st.step, "names": names})
                frames += [tensor_frame(st.tensors[n].contiguous().clone()) for n in names]
        meta = {"optimizer": opt.describe() if opt else None, "num_update": opt.num_update if opt else 0, "parts": parts}
        self._reply(peer, msg.reply(Type.DATA, meta=meta, frames=frames))

    def _set_states(self, msg: Message) -> None:
        meta = msg.meta or {}
        desc = meta.get("optimizer")
        if not isinstance(desc, dict):
            raise OptimizerError("SET_STATES without an optimizer description")
        if self.optimizer is None:
            self.optimizer = Optimizer.from_description(desc)
        elif self.optimizer.name != desc.get("name"):
            raise OptimizerError(f"the states are for {desc.get('name')!r} but the servers run {self.optimizer.name!r}")
        entries = meta.get("parts", [])
        frames = list(msg.frames)
        if not isinstance(entries, list):
            raise ProtocolError("SET_STATES parts must be a list")
        new: dict[int, KeyState] = {}
        for e in entries:
            p = self.parts.get((int(e["key"]), int(e["part"])))
            if p is None:
                raise KeyNotInitializedError(f"optimizer states for key {e['key']} part {e['part']}, which this server does not hold")
            tensors = {}
            for n in e["names"]:
                if not frames:
                    raise ProtocolError("SET_STATES has fewer frames than state tensors")
                tensors[str(n)] = frame_tensor(frames.pop(0), p.dtype, p.numel).clone().view(p.rows, p.row_numel)
            new[p.opt_key] = KeyState(int(e["step"]), tensors)
        if frames:
            raise ProtocolError("SET_STATES has more frames than state tensors")
        self.optimizer.states.update(new)
        self.optimizer.num_update = max(self.optimizer.num_update, int(meta.get("num_update", 0)))


def _sum_sparse(grads: list[Tensor]) -> Tensor:
    idx = torch.cat([g.indices() for g in grads], dim=1)
    val = torch.cat([g.values() for g in grads], dim=0)
    return torch.sparse_coo_tensor(idx, val, grads[0].shape, check_invariants=False).coalesce()
