"""A server: the loop and the transport around its :class:`~pskv.ps.rounds.Rounds` (docs/DESIGN.md). A bad
request gets an ERROR naming what was wrong and changes nothing; a bug never takes the server down."""

from __future__ import annotations

import cmath
import contextlib
import math
import sys
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor

from .. import config
from ..compression import Codec
from ..errors import ClusterError, NodeFailedError, NonFiniteError, OptimizerError, ProtocolError, PSKVError
from ..ops import outside
from . import shm, timeline
from .message import (
    ANSWER,
    PULL,
    PUSH,
    Message,
    PushKind,
    Type,
    bits_float,
    error_reply,
    frame_json,
    frame_tensor,
    json_frame,
    tensor_frame,
    torch_dtype,
)
from .node import JobEnv, Node, failure, host_identity, say
from .rounds import Answer, InitEntry, Part, PullEntry, PushEntry, Rounds
from .van import PeerGone


@dataclass(eq=False)
class _Request:
    route: str  # where its answers go
    msg: Message
    shm: list[bool] = field(default_factory=list)  # per entry: answer a value with its shared-memory slot
    failed: bool = False


class _Frames:
    """The payload frames of a request, taken in order as its table or metadata announces them. As
    a context it checks that every frame was taken, and makes a malformed field a ProtocolError."""

    def __init__(self, msg: Message):
        self._it, self.what = iter(msg.frames), msg.type.name

    def take(self) -> Any:
        if (frame := next(self._it, None)) is None:
            raise ProtocolError(f"a {self.what} has fewer payload frames than it announces")
        return frame

    def __enter__(self) -> _Frames:
        return self

    def __exit__(self, kind: Any, exc: Optional[BaseException], tb: Any) -> None:
        if isinstance(exc, (KeyError, TypeError, ValueError)) and not isinstance(exc, PSKVError):  # typed errors stay typed
            raise ProtocolError(f"a {self.what} with malformed metadata: {exc!r}") from None
        if exc is None and next(self._it, None) is not None:
            raise ProtocolError(f"a {self.what} has more payload frames than it announces")


def _rescale(row: Any) -> Optional[float]:
    """A PUSH or PULL row's rescale (0: none), a finite float."""
    rescale = bits_float(row.rescale) if row.rescale else None
    if rescale is not None and not math.isfinite(rescale):
        raise ProtocolError(f"a row with rescale {rescale}")
    return rescale


class Server(Node):
    """One server process (or thread, in tests); :meth:`run` returns the exit status."""

    def __init__(self, env: JobEnv):
        super().__init__(env)
        self.status: Optional[int] = None
        self.shm = config.shm() != "0"
        self.shared = shm.Shared()
        self.ranks: dict[str, int] = {}  # connection -> the worker that said HELLO on it
        self.reply_to: dict[str, str] = {}  # connection -> where the answers to its requests go
        self.routes: dict[int, str] = {}  # worker -> the connection it reads answers from
        self.rounds = Rounds(env.num_workers, config.timeout(), self._storage if self.shm else None)
        self.nonfinite, self.skipped = config.nonfinite(), 0  # what a NaN/Inf push meets; how many were skipped
        self._outbox: dict[_Request, tuple[list[tuple[int, int, int, int]], list[Any]]] = {}

    def run(self) -> int:
        endpoint = self.env.reachable(self.van.listen(self.env.listen_endpoint(), config.max_frame_bytes()))
        try:
            backlog = self.join(endpoint)
        except PSKVError as exc:
            print(f"pskv server: {exc}", file=sys.stderr, flush=True)
            self.van.close(linger=0)
            return 1
        if not self.env.inproc:
            torch.set_num_threads(config.server_threads(sum(n.get("shm_host") == host_identity() for n in [*self.workers, *self.servers])))
        say(self.name, f"serving on {endpoint} ({len(self.workers)} workers, {len(self.servers)} servers, {torch.get_num_threads()} threads)")
        timeline.start("server", self.rank)
        next_sweep = 0.0
        try:
            while self.status is None:
                for peer, msg in backlog or self.van.recv(0.2):
                    self._dispatch(peer, msg)
                    self.beat(time.monotonic())  # (a batch of big requests, many keys each, may outlast PSKV_HEARTBEAT_TIMEOUT)
                backlog = []
                now = time.monotonic()
                try:
                    self.tick(now)
                except NodeFailedError as exc:
                    self._stop(exc)
                if now >= next_sweep:
                    self._deliver(self.rounds.expire(now))
                    next_sweep = now + 0.5
                self._flush()
        finally:
            self.van.close(linger=2.0)
        say(self.name, f"exiting with status {self.status}")
        return self.status

    def _stop(self, exc: NodeFailedError) -> None:
        self._deliver(self.rounds.fail_all(exc))
        self._flush()
        print(f"pskv {self.name}: {exc}", file=sys.stderr, flush=True)
        self.status = 1

    def _dispatch(self, peer: str, msg: Message | ProtocolError | PeerGone) -> None:
        if isinstance(msg, PeerGone):  # a worker's end is the scheduler's to judge
            if not peer.startswith("client:") and self.status is None:
                self._stop(self.lost(peer))
        elif isinstance(msg, ProtocolError):
            self.van.post(peer, error_reply(None, msg))
        elif peer == "scheduler":
            self.last_heard = time.monotonic()
            self._control(msg)
        else:
            req = _Request(self.reply_to.get(peer, peer), msg)
            try:
                self._request(peer, req)
            except PSKVError as exc:
                self._fail(req, exc)
            except Exception as exc:  # a bug must not take the server down; the worker sees it
                traceback.print_exc()
                self._fail(req, ClusterError(f"{self.name} failed on {msg}: {exc!r}"))

    def _control(self, msg: Message) -> None:
        if msg.type == Type.SHUTDOWN:
            self.status = 0
        elif msg.type == Type.WORKER_LEFT:  # finished, or lost with the job going on without it
            rank, lost = int((msg.meta or {})["rank"]), bool((msg.meta or {}).get("lost"))
            self._deliver(self.rounds.lose(rank) if lost else self.rounds.finish(rank))
        elif msg.type == Type.WORKER_BACK:
            for rank in (msg.meta or {})["ranks"]:
                self.rounds.rejoin(int(rank))
            self.van.post("scheduler", msg.reply(Type.OK))
        elif msg.type == Type.NODE_FAILED:
            self._stop(failure(msg))

    def _fail(self, req: _Request, exc: BaseException) -> None:
        """Answer the whole request with an error; later answers to it are dropped."""
        if not req.failed:
            req.failed = True
            self._outbox.pop(req, None)
            self.van.post(req.route, error_reply(req.msg, exc))

    def _deliver(self, answers: list[Answer], now: bool = False) -> None:
        """Gather the engine's answers into the outbox: one message per request per batch (``now``: sent at once)."""
        for a in answers:
            req: _Request = a.req
            if a.error is not None:
                self._fail(req, a.error)
            if req.failed:  # (then its other answers are dropped)
                continue
            rows, frames = self._outbox.setdefault(req, ([], []))
            if a.value is None:
                rows.append((a.entry, -1, 0, 0))
            elif a.part is not None and a.part.home is not None and req.shm[a.entry]:
                rows.append((a.entry, *a.part.home, a.part.nbytes))  # the worker copies it out of our shared memory
            else:  # a sync value goes without a copy (docs/DESIGN.md, "Two data paths")
                rows.append((a.entry, -1, 0, a.value.numel() * a.value.element_size()))
                frames.append(tensor_frame(a.value))
        if now:
            self._flush()

    def _flush(self) -> None:
        t0 = timeline.now()
        out = sorted(self._outbox.items(), key=lambda item: any(r[3] for r in item[1][0]))  # acknowledgements first
        self._outbox.clear()
        for req, (rows, frames) in out:
            kind = Type.DATA if any(nbytes for *_, nbytes in rows) else Type.OK
            self.van.post(req.route, req.msg.reply(kind, frames=[ANSWER.pack(rows), *frames]))
        if out:
            timeline.span("answer", t0, requests=len(out))

    def _request(self, peer: str, req: _Request) -> None:
        msg, meta = req.msg, req.msg.meta or {}
        if msg.type == Type.HELLO:
            return self._hello(peer, req)
        if (rank := self.ranks.get(peer)) is None:
            wrong = f": this is {self.name}, not the scheduler (check DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT)" if msg.type == Type.REGISTER else ""
            raise ProtocolError(f"a {msg.type.name} on a connection that has not said HELLO{wrong}")
        t0 = timeline.now()
        if msg.type == Type.INIT:
            self._deliver(self.rounds.init(req, rank, str(meta.get("mode")), self._init_entries(msg)))
        elif msg.type == Type.PUSH:
            try:
                pushes = self._push_entries(msg, rank, req)
                self._deliver(self.rounds.push(req, rank, pushes))  # merges and updates the rounds it completes
            except (NonFiniteError, OptimizerError):  # a well-formed push refused for its values
                with contextlib.suppress(PSKVError, IndexError):
                    self.rounds.refused(rank, PUSH.unpack(msg.frames[0]))
                raise
            timeline.span(f"PUSH from worker {rank}", t0, parts=len(pushes))
        elif msg.type == Type.PULL:
            pulls = self._pull_entries(msg, req)
            self._deliver(self.rounds.pull(req, rank, pulls, early=partial(self._deliver, now=True)))  # first parts first
            timeline.span(f"PULL from worker {rank}", t0, parts=len(pulls))
        elif msg.type == Type.SET_OPTIMIZER:
            self.rounds.set_optimizer(meta.get("optimizer"), bool(meta.get("keep_states")))
            self.van.post(req.route, msg.reply(Type.OK))
        elif msg.type == Type.GET_STATES:
            self._get_states(req)
        elif msg.type == Type.SET_STATES:
            self._set_states(msg)
            self.van.post(req.route, msg.reply(Type.OK))
        elif msg.type == Type.SHM_PROBE:  # map the worker's arena (checking its token), tell it where ours is
            if not self.shm:
                raise ProtocolError(f"{self.name} does not use shared memory (PSKV_SHM=0)")
            self.shared.accept(meta, int(self.workers[rank]["pid"]))
            self.van.post(req.route, msg.reply(Type.OK, meta=self.shared.probe()))
        else:
            raise ProtocolError(f"a server does not handle {msg.type.name}")

    def _hello(self, peer: str, req: _Request) -> None:
        meta, proven = req.msg.meta or {}, self.van.who(peer)
        if proven is not None and proven[0] != "worker":
            raise ProtocolError(f"HELLO from a {proven[0]}; only workers talk to servers")
        rank = meta.get("rank") if proven is None else proven[1]  # with a job secret: the rank its connection proved
        if not isinstance(rank, int) or not 0 <= rank < len(self.workers):
            raise ProtocolError(f"HELLO from a worker of rank {rank!r}; the job has {len(self.workers)} workers")
        if meta.get("answers"):
            self.routes[rank] = peer
        elif rank not in self.routes:
            raise ProtocolError(f"worker {rank} must say HELLO on its answer connection first")
        self.ranks[peer] = rank
        req.route = self.reply_to[peer] = self.routes[rank]
        self.van.post(req.route, req.msg.reply(Type.OK))

    def _init_entries(self, msg: Message) -> list[InitEntry]:
        with _Frames(msg) as frames:  # worker 0's INIT brings a value per part
            entries = [InitEntry(int(key), int(index), str(name), torch_dtype(dtype), int(numel), int(row_numel), None)
                       for key, index, dtype, numel, row_numel, _row_sparse, name in (msg.meta or {})["parts"]]
            return [e._replace(value=frame_tensor(frames.take(), e.dtype, e.numel)) if msg.frames else e for e in entries]

    def _push_entries(self, msg: Message, rank: int, req: _Request) -> list[PushEntry]:
        """Decode every part of a push (checked, nothing applied): gradients as ``rows x row_numel``."""
        entries = []
        asked = (msg.meta or {}).get("nonfinite")  # the pushing worker's PSKV_NONFINITE, if it set one
        with _Frames(msg) as frames:
            for row in PUSH.unpack(frames.take()):
                p = self.rounds.part(row.key, row.part)
                grad = self._finite(self._gradient(p, row, [frames.take() for _ in range(row.frames)], rank, msg), p, rank, asked)
                entries.append(PushEntry(p, row.round, grad, row.fd >= 0, bool(row.held), bool(row.reply), _rescale(row)))
                req.shm.append(row.fd >= 0)  # a worker that pushes through shared memory reads its answers there
        return entries

    def _gradient(self, p: Part, row: Any, payload: list[Any], rank: int, msg: Message) -> Tensor:
        if row.kind == PushKind.DENSE and row.fd >= 0 and not payload:
            if not self.shm:
                raise ProtocolError(f"{self.name} does not use shared memory (PSKV_SHM=0)")
            return self.shared.tensor(int(self.workers[rank]["pid"]), row.fd, row.offset, p.nbytes, p.dtype).view(p.rows, p.row_numel)
        if row.kind == PushKind.DENSE and len(payload) == 1:
            return frame_tensor(payload[0], p.dtype, p.numel).view(p.rows, p.row_numel)
        if row.kind == PushKind.SPARSE and len(payload) == 2:
            ids = frame_tensor(payload[0], torch.int64)
            if outside(ids, p.rows):
                raise ProtocolError(f"{p}: pushed row ids outside [0, {p.rows})")
            values = frame_tensor(payload[1], p.dtype, ids.numel() * p.row_numel).view(-1, p.row_numel)
            return torch.sparse_coo_tensor(ids.unsqueeze(0), values, (p.rows, p.row_numel), check_invariants=False)
        if row.kind == PushKind.COMPRESSED and payload:
            codec = Codec.create((msg.meta or {}).get("codec", {}))
            total = torch.zeros(p.numel, dtype=p.dtype)
            for frame in payload:
                total.add_(codec.decode(frame_tensor(frame, codec.wire_dtype, codec.wire_numel(p.numel)), p.numel, p.dtype))
            return total.view(p.rows, p.row_numel)
        raise ProtocolError(f"{p}: a push of kind {row.kind} with {len(payload)} frames")

    def _finite(self, grad: Tensor, p: Part, rank: int, asked: Any) -> Tensor:
        """``grad``, unless it holds NaN or Inf: then an error, or zeros (``PSKV_NONFINITE``: ours, or the pushing worker's)."""
        values, policy = grad._values() if grad.is_sparse else grad, asked if asked in ("skip", "allow") else self.nonfinite
        if policy == "allow" or not (values.is_floating_point() or values.is_complex()):
            return grad
        if cmath.isfinite(values.sum().item()) or bool(torch.isfinite(values).all()):  # a sum can overflow alone; .item(): 1/3 the cost of torch.isfinite
            return grad
        if policy == "error":
            raise NonFiniteError(f"worker {rank} pushed NaN or Inf to {p} ({self.name}); PSKV_NONFINITE=skip pushes such gradients "
                                 "as zeros, =allow as they are (fp16 loss scaling needs it: pskv launch --env PSKV_NONFINITE:allow)")
        self.skipped += 1
        if self.skipped & (self.skipped - 1) == 0:  # the 1st, 2nd, 4th, ...
            print(f"pskv {self.name}: worker {rank} pushed NaN or Inf to {p}; pushed as zeros ({self.skipped} so far)", file=sys.stderr, flush=True)
        if grad.is_sparse:
            return torch.sparse_coo_tensor(grad._indices(), torch.zeros_like(values), grad.shape, check_invariants=False)
        return torch.zeros(p.rows, p.row_numel, dtype=p.dtype)

    def _pull_entries(self, msg: Message, req: _Request) -> list[PullEntry]:
        entries = []
        with _Frames(msg) as frames:
            for row in PULL.unpack(frames.take()):
                wanted = frame_tensor(frames.take(), torch.int64) if row.rows == 1 else None
                entries.append(PullEntry(self.rounds.part(row.key, row.part), row.round, wanted, _rescale(row), bool(row.mirror), row.rows == 2))
                req.shm.append(bool(row.shm))
        return entries

    def _storage(self, p: Part) -> Tensor:
        """Room for a part's value in shared memory: pulls are answered with its slot."""
        arena, offset = self.shared.slot(p.nbytes)
        p.home = (arena.fd, offset)
        return arena.tensor(offset, p.numel, p.dtype).view(p.rows, p.row_numel)

    def _get_states(self, req: _Request) -> None:
        opt, states = self.rounds.optimizer, self.rounds.states()
        parts = [{"key": p.key, "part": p.index, "step": st.step, "names": sorted(st.tensors)} for p, st in states]
        frames: list[Any] = [tensor_frame(st.tensors[n].contiguous().clone()) for _, st in states for n in sorted(st.tensors)]
        meta = {"optimizer": opt.describe() if opt else None, "num_update": opt.num_update if opt else 0}
        self.van.post(req.route, req.msg.reply(Type.DATA, meta=meta, frames=[json_frame(parts), *frames]))  # (a table in the meta: at most 1 MB)

    def _set_states(self, msg: Message) -> None:
        meta = msg.meta or {}
        desc = meta.get("optimizer")
        entries = []
        with _Frames(msg) as frames:
            if not isinstance(desc, dict) or not isinstance(table := frame_json(frames.take()), list):
                raise ProtocolError("SET_STATES needs an optimizer description and a list of parts")
            for e in table:
                p = self.rounds.part(int(e["key"]), int(e["part"]))
                entries.append((p, int(e["step"]), {str(n): frame_tensor(frames.take(), p.dtype, p.numel) for n in e["names"]}))
            num_update = int(meta.get("num_update", 0))
        self.rounds.load_states(desc, num_update, entries)
