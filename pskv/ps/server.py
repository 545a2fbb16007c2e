"""A server: holds some parts of the keys, merges pushes, runs the optimizer, answers pulls.

Each key is cut into parts (:mod:`pskv.ps.partition`); a server keeps the parts placed on it,
each as a flat tensor viewed as ``rows x row_numel`` (so row-sparse pushes and pulls index rows).

- **init**: every worker sends INIT for every part; rank 0's carries the value. Requests on a
  part whose value has not arrived yet wait for it (deadline ``PSKV_TIMEOUT``).
- **push and pull come in batches**: one message per server per call, an index frame listing
  its parts (ps-lite's KVPairs). Answers are gathered while a batch of incoming messages is
  handled and leave as one message per request.
- **dist_sync**: a part's round completes when one push from *each distinct worker* is queued;
  a worker's second push waits in its queue for the next round. Then the pushes are summed and
  the optimizer runs (or the sum replaces the value, made in place in one pass). A pull carries
  how many pushes its worker has issued and is answered once that many rounds are complete.
- **dist_async**: each push is applied on arrival; it needs an optimizer.
- **Shared memory** (same host): a push names a slot of the worker's arena and is acknowledged
  once merged (until then the worker must not reuse the slot); values live in our arenas and a
  pull is answered with the slot, which the worker copies from.
- Every request is checked before anything is applied; a bad one gets an ERROR reply naming
  what was wrong, never a crash. A pull waiting past ``PSKV_TIMEOUT`` is answered with an error
  naming the workers whose push is missing; a worker that finishes while a round still needs it
  fails that round at once.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections import deque
from collections.abc import Iterable
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
from . import shm, trace
from .message import (
    Flag,
    Message,
    Type,
    error_reply,
    frame_tensor,
    pack_index,
    tensor_frame,
    torch_dtype,
    unpack_index,
)
from .node import JobEnv, Node
from .van import Van

PART_BITS = 20  # optimizer state key = key << PART_BITS | part
_TX, _RX = b"/tx".hex(), b"/rx".hex()  # how a worker's two connections end, as peer names


@dataclass
class _Wait:
    """A request waiting for something; ``index`` is its entry in a batched request (-1: whole)."""

    peer: str
    msg: Message
    index: int = -1
    need: int = 0  # pulls: the round to wait for
    shm: bool = False  # pulls: the worker reads the value from our shared memory
    since: float = field(default_factory=time.monotonic)

    @property
    def request(self) -> tuple[str, int]:
        return (self.peer, self.msg.req_id)


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
    slot: Optional[tuple[int, int]] = None  # (arena fd, offset) when the value is in shared memory
    scratch: Optional[Tensor] = None  # where a round's pushes are summed before the optimizer runs
    declared: set[int] = field(default_factory=set)
    waiting: list[_Wait] = field(default_factory=list)  # whole requests, until the value arrives
    rounds: int = 0
    # worker rank -> its pushes not merged yet: (gradient, the entry to acknowledge once merged)
    queued: dict[int, deque[tuple[Tensor, Optional[_Wait]]]] = field(default_factory=dict)
    pulls: list[_Wait] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.numel // self.row_numel if self.row_numel else 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def opt_key(self) -> int:
        return self.key << PART_BITS | self.part

    def __str__(self) -> str:
        return f"key {self.name} part {self.part}"


class _Outbox:
    """Answers to batched requests, gathered while a batch of messages is handled.

    Each request gets one message per flush: its index lists the entries answered, as
    ``(entry, fd, offset, bytes)`` (fd -1: the bytes are the next payload frame).
    Acknowledgements of pushes leave before pulled data.
    """

    def __init__(self) -> None:
        self._out: dict[tuple[str, int], tuple[Message, list[tuple[int, int, int, int]], list[Any]]] = {}

    def add(self, w: _Wait, fd: int = -1, offset: int = 0, nbytes: int = 0, frame: Any = None) -> None:
        entry = self._out.setdefault(w.request, (w.msg, [], []))
        entry[1].append((w.index, fd, offset, nbytes))
        if frame is not None:
            entry[2].append(frame)

    def drop(self, request: tuple[str, int]) -> None:
        self._out.pop(request, None)

    def take(self) -> list[tuple[str, Message]]:
        out = []
        for (peer, _), (req, rows, frames) in self._out.items():
            kind = Type.OK if req.type == Type.PUSH else Type.DATA
            out.append((peer, req.reply(kind, flags=Flag.BATCH, frames=[pack_index(rows, 4), *frames])))
        self._out.clear()
        out.sort(key=lambda pm: pm[1].type != Type.OK)
        return out


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
        self.shm = shm.mode() != "0"
        self.arenas = shm.Arenas()
        self.maps = shm.Mappings()
        self.outbox = _Outbox()

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
        trace.start(f"server-{self.rank}")
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
                self._flush()
        finally:
            self.van.close(linger=2.0)
        self.say(f"exiting with status {self.status}")
        return self.status

    def _flush(self) -> None:
        out = self.outbox.take()
        for peer, msg in out:
            self._reply(peer, msg)
        if out:
            trace.event(f"answered {len(out)} requests")

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
            self._fail_request(peer, msg, exc)
        except Exception as exc:  # a bug must not take the server down; the worker sees it
            traceback.print_exc()
            self._fail_request(peer, msg, ClusterError(f"{self.name} failed on {msg}: {exc!r}"))

    def _reply(self, peer: str, msg: Message) -> None:
        # a worker sends requests on one connection (".../tx") and reads answers on another
        if peer.endswith(_TX):
            peer = peer[: -len(_TX)] + _RX
        try:
            self.van.send(peer, msg)
        except Exception as exc:
            print(f"pskv {self.name}: could not answer {peer}: {exc}", file=sys.stderr, flush=True)

    def _fail_request(self, peer: str, msg: Message, exc: BaseException) -> None:
        """Answer the whole request with an error and forget every entry of it still waiting."""
        request = (peer, msg.req_id)
        self.outbox.drop(request)
        for p in self.parts.values():
            p.pulls = [w for w in p.pulls if w.request != request]
            p.waiting = [w for w in p.waiting if w.request != request]
            for q in p.queued.values():
                for i, (g, ack) in enumerate(q):
                    if ack is not None and ack.request == request:
                        q[i] = (g, None)  # still merged if its round comes; nobody waits for it
        self._reply(peer, error_reply(msg, exc))

    def _control(self, msg: Message) -> None:
        if msg.type == Type.SHUTDOWN:
            self.status = 0
        elif msg.type == Type.WORKER_LEFT:
            self.left.add(msg.a)
            for p in list(self.parts.values()):
                self._fail_blocked(p)
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
        elif t == Type.PUSH and msg.flags & Flag.BATCH:
            self._push_batch(peer, rank, msg)
        elif t == Type.PUSH:
            self._push_one(peer, rank, msg)
        elif t == Type.PULL:
            self._pull_batch(peer, msg)
        elif t == Type.ROW_PULL:
            self._row_pull(peer, msg)
        elif t == Type.SET_OPTIMIZER:
            self._set_optimizer(msg)
            self._reply(peer, msg.reply(Type.OK))
        elif t == Type.GET_STATES:
            self._get_states(peer, msg)
        elif t == Type.SET_STATES:
            self._set_states(msg)
            self._reply(peer, msg.reply(Type.OK))
        elif t == Type.SHM_PROBE:
            self._shm_probe(peer, rank, msg)
        elif t == Type.HELLO:
            self._reply(peer, msg.reply(Type.OK))
        else:
            raise ProtocolError(f"a server does not handle {t.name}")

    def _part(self, key: int, part: int) -> _Part:
        p = self.parts.get((key, part))
        if p is None:
            raise KeyNotInitializedError(f"key {key} part {part} was never initialised on {self.name}")
        return p

    def _held(self, peer: str, msg: Message, parts: Iterable[_Part]) -> bool:
        """Hold the request until worker 0's init value of every part has arrived."""
        for p in parts:
            if p.value is None:
                p.waiting.append(_Wait(peer, msg))
                return True
        return False

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
            p.value = self._storage(p)
            p.value.view(-1).copy_(frame_tensor(msg.frames[0], dtype, numel))
            self._reply(peer, msg.reply(Type.OK))
            held, p.waiting = p.waiting, []
            for w in held:  # other workers' INITs are answered; their pushes and pulls run now
                if w.msg.type == Type.INIT:
                    self._reply(w.peer, w.msg.reply(Type.OK))
                else:
                    self._dispatch(w.peer, w.msg)
        elif p.value is None:
            p.waiting.append(_Wait(peer, msg))
        else:
            self._reply(peer, msg.reply(Type.OK))

    def _storage(self, p: _Part) -> Tensor:
        """Room for a part's value: in shared memory (so pulls are answered with a header), else private."""
        if not self.shm:
            return torch.empty(p.rows, p.row_numel, dtype=p.dtype)
        arena, offset = self.arenas.slot(p.nbytes)
        p.slot = (arena.fd, offset)
        return arena.tensor(offset, p.numel, p.dtype).view(p.rows, p.row_numel)

    def _shm_probe(self, peer: str, rank: int, msg: Message) -> None:
        """Map the worker's arena (checking its token) and tell it where ours is."""
        meta = msg.meta or {}
        if not self.shm:
            raise ProtocolError(f"{self.name} does not use shared memory (PSKV_SHM=0)")
        pid = self.workers[rank].get("pid")
        if meta.get("pid") != pid:
            raise ProtocolError(f"worker {rank} probed with pid {meta.get('pid')}, but registered pid {pid}")
        self.maps.map(int(meta["pid"]), int(meta["fd"]), bytes.fromhex(str(meta["token"])))
        arena = self.arenas.first()
        self._reply(peer, msg.reply(Type.OK, meta={"pid": os.getpid(), "fd": arena.fd, "token": arena.token.hex()}))

    # -- pushes -----------------------------------------------------------------------------------

    def _push_batch(self, peer: str, rank: int, msg: Message) -> None:
        """Dense pushes of many parts: ``(key, part, fd, offset, bytes)`` rows; fd -1: a payload frame."""
        if not msg.frames:
            raise ProtocolError("a batched push without its index")
        rows = unpack_index(msg.frames[0], 5)
        trace.event(f"push of {len(rows)} parts from worker {rank} arrives")
        parts = [self._part(r[0], r[1]) for r in rows]
        if self._held(peer, msg, parts):
            return
        payloads = iter(msg.frames[1:])
        grads = []
        for (_, _, fd, offset, nbytes), p in zip(rows, parts):  # check everything before applying anything
            if nbytes != p.nbytes:
                raise ProtocolError(f"{p}: a push of {nbytes} bytes, expected {p.nbytes}")
            if fd >= 0:
                if not self.shm:
                    raise ProtocolError(f"{self.name} does not use shared memory (PSKV_SHM=0)")
                g = self.maps.tensor(int(self.workers[rank]["pid"]), fd, offset, nbytes, p.dtype)
            else:
                frame = next(payloads, None)
                if frame is None:
                    raise ProtocolError(f"a batched push has fewer payload frames than parts ({len(rows)})")
                g = frame_tensor(frame, p.dtype, p.numel)
            grads.append(g.view(p.rows, p.row_numel))
        if next(payloads, None) is not None:
            raise ProtocolError("a batched push has more payload frames than parts")
        self._check_push(rank, parts)
        touched = []
        for i, ((_, _, fd, _, _), p, g) in enumerate(zip(rows, parts, grads)):
            w = _Wait(peer, msg, index=i)
            if p.mode == "async":
                assert p.value is not None
                apply_push(self.optimizer, p.opt_key, g, p.value)
                self.outbox.add(w)
                continue
            # a push in the worker's shared memory is acknowledged once merged: until then the
            # worker must not reuse its slot; a push that came in a frame is ours already
            p.queued.setdefault(rank, deque()).append((g, w if fd >= 0 else None))
            if fd < 0:
                self.outbox.add(w)
            touched.append(p)
        for p in touched:
            self._complete_rounds(p)
            self._fail_blocked(p)
        trace.event(f"push from worker {rank} merged where complete")

    def _check_push(self, rank: int, parts: Iterable[_Part]) -> None:
        for p in parts:
            if p.mode == "async" and self.optimizer is None:
                raise OptimizerRequiredError(
                    f"key {p.name}: dist_async applies pushes on the servers and needs an optimizer; call set_optimizer first"
                )
            if p.mode == "sync" and rank in self.left:
                raise NodeFailedError(f"worker {rank} pushed after it finished")

    def _push_one(self, peer: str, rank: int, msg: Message) -> None:
        """One part, row-sparse (``Flag.SPARSE``) or compressed (``Flag.COMPRESSED``)."""
        p = self._part(msg.key, msg.part)
        if self._held(peer, msg, [p]):
            return
        grad = self._decode_push(p, msg)
        self._check_push(rank, [p])
        assert p.value is not None
        if p.mode == "async":
            apply_push(self.optimizer, p.opt_key, grad, p.value)
        else:
            p.queued.setdefault(rank, deque()).append((grad, None))
        self._reply(peer, msg.reply(Type.OK))
        if p.mode == "sync":
            self._complete_rounds(p)
            self._fail_blocked(p)

    def _decode_push(self, p: _Part, msg: Message) -> Tensor:
        """The gradient of a single-part push: row-sparse or decoded, ``rows x row_numel``."""
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
                dense = codec.decode(frame_tensor(frame, codec.wire_dtype, codec.wire_numel(p.numel)), p.numel, p.dtype)
                total = dense if total is None else total.add_(dense)
            assert total is not None
            return total.view(p.rows, p.row_numel)
        raise ProtocolError(f"{p}: a single-part push must be sparse or compressed (dense pushes come in batches)")

    def _complete_rounds(self, p: _Part) -> None:
        workers = range(len(self.workers))
        done = False
        while all(p.queued.get(r) for r in workers):
            entries = [p.queued[r].popleft() for r in workers]
            self._merge_and_apply(p, [g for g, _ in entries])
            for _, ack in entries:
                if ack is not None:
                    self.outbox.add(ack)
            p.rounds += 1
            done = True
        if done:
            ready = [w for w in p.pulls if w.need <= p.rounds]
            p.pulls = [w for w in p.pulls if w.need > p.rounds]
            for w in ready:
                self._answer(p, w)

    def _merge_and_apply(self, p: _Part, grads: list[Tensor]) -> None:
        """Sum one push of every worker and apply it to the value (the optimizer or assignment)."""
        assert p.value is not None
        if any(g.is_sparse for g in grads):
            dense = [g for g in grads if not g.is_sparse]
            merged = _sum_sparse(grads) if not dense else torch.stack([g.to_dense() if g.is_sparse else g for g in grads]).sum(0)
            apply_push(self.optimizer, p.opt_key, merged, p.value)
            return
        if self.optimizer is None:  # the sum replaces the value: make it there, in one pass
            _sum_into(p.value, grads)
            return
        if p.scratch is None:
            p.scratch = torch.empty_like(p.value)
        # the optimizer works inside the scratch buffer: no full-size temporaries per round
        apply_push(self.optimizer, p.opt_key, _sum_into(p.scratch, grads), p.value, merged_is_scratch=True)

    # -- pulls ------------------------------------------------------------------------------------

    def _pull_batch(self, peer: str, msg: Message) -> None:
        """Pulls of many parts: ``(key, part, round, shm)`` rows."""
        if not msg.flags & Flag.BATCH or not msg.frames:
            raise ProtocolError("pulls come in batches, with an index")
        rows = unpack_index(msg.frames[0], 4)
        parts = [self._part(r[0], r[1]) for r in rows]
        if self._held(peer, msg, parts):
            return
        for (_, _, need, _), p in zip(rows, parts):
            blocker = None if p.mode == "async" or need <= p.rounds else self._blocker(p, need)
            if blocker:
                raise NodeFailedError(blocker)
        for i, ((_, _, need, want_shm), p) in enumerate(zip(rows, parts)):
            w = _Wait(peer, msg, index=i, need=need, shm=bool(want_shm))
            if p.mode == "async" or need <= p.rounds:
                self._answer(p, w)
            else:
                p.pulls.append(w)

    def _row_pull(self, peer: str, msg: Message) -> None:
        p = self._part(msg.key, msg.part)
        if self._held(peer, msg, [p]):
            return
        if len(msg.frames) != 1:
            raise ProtocolError(f"{p}: ROW_PULL carries one frame of row ids")
        w = _Wait(peer, msg, need=msg.a)
        if p.mode == "async" or msg.a <= p.rounds:
            self._answer(p, w)
            return
        blocker = self._blocker(p, msg.a)
        if blocker:
            raise NodeFailedError(blocker)
        p.pulls.append(w)

    def _answer(self, p: _Part, w: _Wait) -> None:
        assert p.value is not None
        if w.msg.type == Type.ROW_PULL:
            rows = frame_tensor(w.msg.frames[0], torch.int64)
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= p.rows):
                self._fail_request(w.peer, w.msg, ProtocolError(f"{p}: row ids outside [0, {p.rows})"))
                return
            self._reply(w.peer, w.msg.reply(Type.DATA, frames=[tensor_frame(p.value.index_select(0, rows))]))
        elif p.mode == "sync" and w.shm and p.slot is not None:
            # the worker copies the value out of our shared memory; it cannot change before this
            # worker pushes again, which it does only after it has read it
            self.outbox.add(w, p.slot[0], p.slot[1], p.nbytes)
        else:
            # sync: the value cannot change before this worker pushes again, which it does only
            # after this reply has arrived, so it is sent without a copy; async: a snapshot
            data = p.value.clone() if p.mode == "async" else p.value
            self.outbox.add(w, -1, 0, p.nbytes, tensor_frame(data))

    # -- rounds that cannot complete ------------------------------------------------------------

    def _reachable(self, p: _Part) -> Optional[int]:
        """How many rounds ``p`` can still complete when workers have left (None: no limit)."""
        if not self.left:
            return None
        return p.rounds + min(len(p.queued.get(r, ())) for r in self.left)

    def _blocker(self, p: _Part, need: int) -> Optional[str]:
        """Why round ``need`` of ``p`` can never complete (a worker finished), or None."""
        missing = [r for r in sorted(self.left) if len(p.queued.get(r, ())) < need - p.rounds]
        if not missing:
            return None
        who = ", ".join(f"worker {r}" for r in missing)
        return f"{who} finished (closed its store) without pushing key {p.name} for round {need - 1}; the round can never complete"

    def _fail_blocked(self, p: _Part) -> None:
        """Fail every pull and queued push of ``p`` that waits for a round that can never come."""
        limit = self._reachable(p)
        if limit is None:
            return
        for w in [w for w in p.pulls if w.need > limit]:
            self._fail_request(w.peer, w.msg, NodeFailedError(self._blocker(p, w.need) or "the round can never complete"))
        for q in p.queued.values():
            while len(q) > limit - p.rounds:
                _, ack = q.pop()
                if ack is not None:
                    need = p.rounds + len(q) + 1
                    self._fail_request(ack.peer, ack.msg, NodeFailedError(self._blocker(p, need) or "the round can never complete"))

    def _sweep(self, now: float) -> None:
        for p in list(self.parts.values()):
            for w in [w for w in p.pulls if now - w.since > self.timeout]:
                missing = [r for r in range(len(self.workers)) if len(p.queued.get(r, ())) < w.need - p.rounds]
                got = [r for r in range(len(self.workers)) if r not in missing]
                exc = DeadlineExceeded(
                    f"{self.name}: the pull of key {p.name} (part {p.part}) waited {now - w.since:.0f} s "
                    f"(PSKV_TIMEOUT={self.timeout:g}) for round {w.need - 1}: workers {missing} have not pushed "
                    f"key {p.name} in that round (pushed: {got})"
                )
                self._fail_request(w.peer, w.msg, exc)
            for w in [w for w in p.waiting if now - w.since > self.timeout]:
                exc = DeadlineExceeded(
                    f"{self.name}: key {p.name} (part {p.part}) has no value after {now - w.since:.0f} s "
                    f"(PSKV_TIMEOUT={self.timeout:g}): worker 0 sends the init value and has not; "
                    f"workers that called init: {sorted(p.declared)}"
                )
                self._fail_request(w.peer, w.msg, exc)

    def _fail_everything(self, exc: Exception) -> None:
        victims: dict[tuple[str, int], _Wait] = {}
        for p in self.parts.values():
            acks = [ack for q in p.queued.values() for _, ack in q if ack is not None]
            for w in [*p.pulls, *p.waiting, *acks]:
                victims.setdefault(w.request, w)
            p.pulls, p.waiting = [], []
            p.queued.clear()
        for w in victims.values():
            self.outbox.drop(w.request)
            self._reply(w.peer, error_reply(w.msg, exc))

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


def _sum_into(out: Tensor, grads: list[Tensor]) -> Tensor:
    """``out = sum(grads)`` without temporaries."""
    if len(grads) == 1:
        out.copy_(grads[0])
    else:
        torch.add(grads[0], grads[1], out=out)
        for g in grads[2:]:
            out.add_(g)
    return out


def _sum_sparse(grads: list[Tensor]) -> Tensor:
    idx = torch.cat([g._indices() for g in grads], dim=1)
    val = torch.cat([g._values() for g in grads], dim=0)
    return torch.sparse_coo_tensor(idx, val, grads[0].shape, check_invariants=False).coalesce()
