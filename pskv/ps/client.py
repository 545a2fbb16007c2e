"""The worker's side: requests (a whole message, or a row per part queued for each server's next PUSH
or PULL) and their answers (docs/DESIGN.md, "Threads of a worker")."""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple, Optional, cast

import torch

from .. import config
from ..errors import (
    ClusterError,
    DeadlineExceeded,
    NodeFailedError,
    NonFiniteError,
    OptimizerError,
    ProtocolError,
    PSKVError,
    StoreClosedError,
)
from . import shm, timeline
from .message import PULL, PUSH, Message, PushKind, Type
from .node import JobEnv, Node, failure, host_identity, say
from .tracker import BATCHED, Both, Entry, Handle, OnReply, Request, Tracker
from .van import PeerGone, PeerUnreachable, Van

SCHEDULER = -1  # ``send``'s destination for the scheduler; servers are 0 .. S-1
# rows queued without waiting leave once none was added for FLUSH_IDLE s, and at most FLUSH_DELAY s
# after the first: a burst of calls shares messages, and a lone call is not held back
FLUSH_IDLE = 0.0002
FLUSH_DELAY = 0.002
NOTHING: Any = object()  # a barrier that carries no value
Sent = Callable[[float], bool]  # wait(timeout): true once a message's payload buffers may be reused


class Queued(NamedTuple):  # a part's row waiting for its message
    row: Sequence[int]
    frames: Sequence[Any]
    entry: Entry  # the call it serves
    ready: Any  # a CUDA event its bytes wait for
    nbytes: int
    priority: int
    seq: int  # its place in the queue


def _by_priority(batch: list[Queued]) -> list[Queued]:
    """``batch`` in the order to send: the highest priority first, then as queued; a part's later row
    never goes before its earlier one (rounds reach a server in order), so it takes that one's priority if lower."""
    batch.sort(key=lambda q: q.seq)
    lowest: dict[tuple[int, int], int] = {}  # a part's priority so far
    order = []
    for q in batch:
        part = (q.row[0], q.row[1])
        lowest[part] = min(q.priority, lowest.get(part, q.priority))
        order.append((-lowest[part], q.seq, q))
    return [q for *_, q in sorted(order, key=lambda o: o[:2])]


def _fold(batches: dict[tuple[int, Type], list[Queued]], again: Callable[[int, Queued, BaseException], bool]) -> None:
    """A whole pull of a part that goes with a plain push of it (``kv.push`` then ``kv.pull``) rides on that push's
    row, in place: the push is answered with the part's value, as ``pushpull``'s (one request and one answer, not two)."""
    for (server, kind), pulls in batches.items():
        pushes = batches.get((server, Type.PUSH), []) if kind == Type.PULL else []
        plain = {(q.row[0], q.row[1], q.row[2]): i for i, q in enumerate(pushes) if not (q.row[3] == PushKind.SPARSE or any(q.row[7:9]))}
        if not plain:
            continue
        kept = []  # (filtered in one pass: thousands of keys may be pushed and pulled in one flush)
        for q in pulls:
            if any(q.row[4:7]) or (i := plain.pop((q.row[0], q.row[1], q.row[2]), None)) is None:  # (rows, rescale, mirror: none)
                kept.append(q)
                continue
            push = pushes[i]
            both = cast(Handle, Both(push.entry[0], q.entry[0], partial(again, server, q)))
            pushes[i] = push._replace(row=(*push.row[:8], 1, push.row[9]), entry=(both, *q.entry[1:]))
        pulls[:] = kept


class WorkerClient(Node):
    """A worker's connection to the job. Every method may be called from any thread."""

    def __init__(self, env: JobEnv):
        super().__init__(env)
        self.data = Van("worker")  # the connections to the servers (``self.van`` has the scheduler's)
        self._receiving = threading.Lock()  # held by the thread that receives the servers' answers
        self.tracker = Tracker(config.timeout() + max(5.0, 0.1 * config.timeout()), self._pump)
        self.shared = shm.Shared()
        self.shm_servers: set[int] = set()
        policy = config.nonfinite()  # a setting of this worker's own goes with its pushes (pskv train --amp fp16 under pskv launch)
        self.push_meta: dict[str, Any] = {"nonfinite": policy} if policy != "error" else {}  # of every PUSH (and the codec)
        self._pending: dict[tuple[int, Type], list[Queued]] = {}  # (server, PUSH or PULL) -> rows not sent yet
        self._pending_bytes: dict[int, int] = {}
        self._queued_rows = 0  # rows ever queued: their order among equal priorities
        self._in_flight: dict[int, deque[tuple[Sent, int]]] = {}  # server -> pushes zmq has not sent yet, their bytes
        self._held_until: Optional[float] = None  # rows wait for a window: the I/O thread tries again then
        self._first_queued: Optional[float] = None  # rows queued without waiting: the first's time
        self._last_queued = 0.0
        self._dozing = True  # the I/O thread sleeps long (no rows queued lately): wake it for new ones
        self._queued: list[tuple[str, Message, Request]] = []  # for the scheduler, sent by the I/O thread
        self._lock = threading.RLock()  # the queued rows and the connections
        self._sending = threading.Lock()  # held by the one thread that flushes
        self._thread: Optional[threading.Thread] = None
        self._stop = self._finishing = False
        self.replicas = config.replicas()
        self.lost_servers: set[int] = set()  # their parts are served by their backups (PSKV_REPLICAS)
        self._cut: dict[str, Any] = {}  # group -> its barrier cut short (an interrupt) as it waited: see barrier

    def start(self) -> None:
        """Join the job, start the I/O thread, say HELLO, share memory with servers on this host (``PSKV_SHM``)."""
        try:
            early = self.join(None)
        except BaseException:  # refused, or no node table: this client is done
            self.van.close(linger=0)
            self.data.close(linger=0)
            raise
        self.lost_servers = {s for s, info in enumerate(self.servers) if info.get("lost")}
        self._batch_bytes, self._window = config.batch_bytes(self.across_hosts), config.window_bytes(self.across_hosts)
        limits = [int(info.get("max_frame", config.max_frame_bytes())) for info in self.servers]  # (each server's own PSKV_MAX_MESSAGE_BYTES)
        self.data.identity, self.data.max_frame = ("worker", self.rank), min([n for n in limits if n > 0], default=0)
        sndbuf = self._window // 2 if self._window < config.KERNEL_SNDBUF else 0  # (the kernel doubles it)
        for s, info in enumerate(self.servers):
            self.data.connect(f"server {s}", info["endpoint"])
            self.data.connect(f"server {s}/tx", info["endpoint"], receive=False, sndbuf=sndbuf)  # (pushes go on this one)
        for _, msg in early:  # (the scheduler's news: the servers' connections are new)
            self._control(msg)
        self._thread = threading.Thread(target=self._loop, name=f"pskv-worker-{self.rank}-io", daemon=True)
        self._thread.start()
        for answers in (True, False):  # the answer connection first: answers to the other go there
            self.wait([self.send(s, Message(Type.HELLO, meta={"rank": self.rank, "answers": answers}), "hello") for s in self.live_servers()])
        want = "0" if self.replicas else config.shm()  # (a backup gets every push: over TCP)
        for s, info in enumerate(self.servers if want != "0" else []):
            try:
                if not host_identity() or info.get("shm_host") != host_identity():
                    raise ProtocolError(f"server {s} ({info.get('hostname')}) is on another host")
                answer: list[Message] = []
                self.wait([self.send(s, Message(Type.SHM_PROBE, meta=self.shared.probe()), "shared-memory probe", answer.append)])
                self.shared.accept(answer[0].meta or {}, int(info["pid"]))
                self.shm_servers.add(s)
            except ProtocolError as exc:
                if want == "1":
                    raise ClusterError(f"PSKV_SHM=1, but shared memory with server {s} failed: {exc}") from None
        say(self.name, f"joined: {len(self.workers)} workers, {len(self.servers)} servers; shared memory with servers {sorted(self.shm_servers)}")

    def send(self, to: int, msg: Message, what: str, on_reply: Optional[OnReply] = None) -> Handle:
        """Send one whole message to server ``to`` (or :data:`SCHEDULER`), after the rows queued before it (a push
        that returned before its rows left: :meth:`wait_sent`); ``what`` names it in errors."""
        self._check_open()
        if self._pending or self._sending.locked():  # rows queued, or being sent by the I/O thread: they go first
            self.flush()
        handle = Handle(self.tracker)
        parts = len((msg.meta or {}).get("parts", [])) if msg.type in BATCHED else 1  # INIT: answered part by part
        handle._left = parts  # (a batch's rows are counted as they are queued)
        peer = "scheduler" if to == SCHEDULER else f"server {to}"
        req = self.tracker.open(msg, what, peer, [(handle, None, None)] * parts, on_reply)
        if to == SCHEDULER:
            with self._lock:  # the I/O thread owns that connection: it sends what is queued
                self._queued.append((peer, msg, req))
            self.van.wake()
        elif msg.type == Type.HELLO and (msg.meta or {}).get("answers"):
            with self._receiving:  # on the answer connection, owned by whoever receives
                self._transmit(peer, msg, req)
        else:
            self._transmit(f"{peer}/tx", msg, req)
        return handle

    def holders(self, server: int) -> list[int]:
        """The live servers that keep ``server``'s parts, the one that answers first: it and its backups,
        the next ``PSKV_REPLICAS`` servers of the ring, which get every push too (docs/DESIGN.md)."""
        if not self.replicas:  # (every row asks: the ring is of one then)
            return [] if server in self.lost_servers else [server]
        n = len(self.servers)
        ring = [(server + i) % n for i in range(min(self.replicas, n - 1) + 1)]
        return [s for s in ring if s not in self.lost_servers]

    def live_servers(self) -> list[int]:
        return [s for s in range(len(self.servers)) if s not in self.lost_servers]

    def _failover(self, lost: int) -> None:
        """Server ``lost`` is gone: what was queued for it, or sent and not answered, goes to its next
        live backup as pulls (the backups got the pushes)."""
        with self._lock:
            self.lost_servers.add(lost)
            rows = [(kind, q.row, q.frames, q.entry) for kind in (Type.PUSH, Type.PULL) for q in self._pending.pop((lost, kind), [])]
            self._pending_bytes.pop(lost, None)  # (its rows go to the backup below)
        for req in self.tracker.take(f"server {lost}"):
            if req.rows is None:  # a whole message (HELLO, INIT, SET_STATES...): the backup got its own
                for entry in filter(None, req.entries):
                    entry[0]._settle()
            rows += [(req.kind, row, frames, entry) for (row, frames), entry in zip(req.rows or [], req.entries) if entry is not None]
        for kind, row, frames, entry in rows:
            if (kind == Type.PUSH and not row[8]) or (kind == Type.PULL and row[6]):  # a push (its copy went to the backup), a mirror pull
                continue
            pull = (*row[:3], 0, row[4], row[5], 0) if kind == Type.PULL else (*row[:3], 0, 0, 0, 0)
            self.queue(lost, Type.PULL, pull, frames if kind == Type.PULL else [], entry)
        self.flush()
        for *_, entry in rows:  # each was counted when queued, and again if queued here: let go of it once
            entry[0]._settle()

    def queue(self, server: int, kind: Type, row: Sequence[int], frames: Sequence[Any], entry: Entry, nbytes: int = 0, ready: Any = None,
              priority: int = 0) -> None:
        """Add a part's ``row`` and ``frames`` to ``server``'s next ``kind`` message, sent by :meth:`flush`
        (after the CUDA event ``ready``) or once the queued bytes reach ``PSKV_BATCH_BYTES``. With a
        replica, a push and a pull's rescale go to the backup too (acknowledged, not answered)."""
        self._check_open()
        with self._lock:
            for i, s in enumerate(self.holders(server)):
                if i:
                    if kind == Type.PULL and not row[5]:
                        break  # a pull without a rescale: the backup has nothing to learn from it
                    row = (*row[:8], 0, row[9]) if kind == Type.PUSH else (*row[:3], 0, row[4], row[5], 1)  # (no reply)
                    entry = (entry[0], None, None)  # acknowledged: nothing to copy
                self._queued_rows += 1
                entry[0]._left += 1  # counted now, not once sent: a call is not done while a row of it waits to be sent
                entry[0]._done = entry[0].error is not None  # (an earlier row of this call answered already)
                self._pending.setdefault((s, kind), []).append(Queued(row, frames, entry, ready, nbytes, priority, self._queued_rows))
                self._pending_bytes[s] = self._pending_bytes.get(s, 0) + nbytes
            full = self._pending_bytes.get(server, 0) >= self._batch_bytes
        if full and ready is not None:  # the I/O thread waits for the GPU's copy, not the caller (backward)
            self.hurry()
        elif full:
            self.flush([server])

    def hurry(self) -> None:
        """The rows queued so far leave now, from the I/O thread (which waits for their GPU copies, not the caller)."""
        self._first_queued = -math.inf  # due now
        self.van.wake()

    def flush(self, servers: Optional[Sequence[int]] = None, soon: bool = False) -> None:
        """Send the queued rows of ``servers`` (all by default): PUSH, then PULL messages, the highest priority first;
        pushes only while the server's connection holds less than ``PSKV_WINDOW_BYTES`` not sent yet (the rest wait:
        docs/DESIGN.md, "Priority and a window"); ``soon``: the I/O thread will (rows queued meanwhile join them)."""
        if soon:
            self._last_queued = time.monotonic()
            if self._first_queued is None:
                self._first_queued = self._last_queued
                if self._dozing:
                    self.van.wake()
            return
        with self._sending:  # one flush at a time
            with self._lock:
                if servers is None:
                    self._first_queued = None
                # PUSH before PULL; a server's pushes stay queued, untouched, while its window is full
                rooms = {k: self._room(k[0]) if k[1] == Type.PUSH else math.inf for k in self._pending if servers is None or k[0] in servers}
                batches = [(k, self._pending.pop(k), room) for k, room in sorted(rooms.items()) if room > 0]
                for (server, _), batch, _ in batches:
                    self._pending_bytes[server] -= sum(q.nbytes for q in batch)
                if not self.replicas:
                    _fold(dict(((s, kind), b) for (s, kind), b, _ in batches), self._pull_again)
                # the parts of pushes that wait: their pulls wait behind them (a pull sees the earlier pushes)
                waiting = {s: {(q.row[0], q.row[1]) for q in rows} for (s, kind), rows in self._pending.items() if kind == Type.PUSH and self._window}
            held = []
            for (server, kind), batch, room in batches:  # (a server's PUSH comes before its PULL)
                now: list[Queued] = []
                later: list[Queued] = []
                for q in batch:
                    (later if kind == Type.PULL and (q.row[0], q.row[1]) in waiting.get(server, ()) else now).append(q)
                rest = self._send(server, kind, _by_priority(now), room) + later
                if kind == Type.PUSH:
                    waiting.setdefault(server, set()).update((q.row[0], q.row[1]) for q in rest)
                held += [((server, kind), rest)] if rest else []
            with self._lock:
                for k, rest in held:  # back in the queue, before the rows queued meanwhile
                    self._pending[k] = rest + self._pending.get(k, [])
                    self._pending_bytes[k[0]] += sum(q.nbytes for q in rest)
                held_back = self._window and any(kind == Type.PUSH for _, kind in self._pending)
                self._held_until = time.monotonic() + FLUSH_DELAY / 2 if held_back else None
            if held_back and self._dozing:
                self.van.wake()

    def _pull_again(self, server: int, q: Queued, error: BaseException) -> bool:
        """A pull that rode on a push the server refused for its values (``_fold``) goes on its own, as it would have
        (that round skipped): queued again, true; false for another error, or once the store is closed or failed."""
        if not isinstance(error, (NonFiniteError, OptimizerError)) or self._stop or self.tracker.fatal is not None:
            return False
        self.queue(server, Type.PULL, q.row, q.frames, q.entry, priority=q.priority)
        self.flush(soon=True)
        return True

    def _room(self, server: int) -> float:
        """Bytes of pushes ``server``'s connection takes now: ``PSKV_WINDOW_BYTES`` less those zmq has not sent."""
        if not self._window:
            return math.inf
        sent = self._in_flight.setdefault(server, deque())
        while sent and sent[0][0](0):
            sent.popleft()
        return self._window - sum(n for _, n in sent)

    def _send(self, server: int, kind: Type, batch: list[Queued], room: float) -> list[Queued]:
        """Send ``batch`` to ``server`` in messages of about ``PSKV_BATCH_BYTES`` while ``room`` lasts; the rows left."""
        while batch and room > 0:
            size = n = 0
            while n < len(batch) and size < self._batch_bytes:  # (as queue() sends: once the bytes reach a batch)
                size, n = size + batch[n].nbytes, n + 1
            room -= size
            waiter = self._message(server, kind, batch[:n])
            batch = batch[n:]
            if waiter is not None and self._window:
                self._in_flight[server].append((waiter, size))
        return batch

    def _message(self, server: int, kind: Type, batch: list[Queued]) -> Optional[Sent]:
        """Send one message of ``batch``'s rows to ``server``; the wait for zmq to be done with its bytes."""
        for q in batch:
            if q.ready is not None:
                q.ready.synchronize()  # a copy from a GPU into the bytes to send (rows may be queued meanwhile)
        frames = [f for q in batch for f in q.frames]
        table = (PUSH if kind == Type.PUSH else PULL).pack([q.row for q in batch])
        msg = Message(kind, meta=(self.push_meta or None) if kind == Type.PUSH else None, frames=[table, *frames])
        what = "push and pull" if kind == Type.PUSH and any(q.row[8] for q in batch) else kind.name.lower()  # (rows with reply: pushpull's, or a pull rode)
        req = self.tracker.open(msg, f"{what} of {len(batch)} parts", f"server {server}", [q.entry for q in batch])
        req.rows = [(q.row, q.frames) for q in batch] if self.replicas else None  # sent again on a failover
        if server in self.shm_servers:  # answers may be slots of its shared memory
            pid = int(self.servers[server]["pid"])
            req.shared = lambda row, dtype, pid=pid: self.shared.tensor(pid, row.fd, row.offset, row.nbytes, dtype)
        t0 = timeline.now()
        waiter = self._transmit(f"server {server}/tx", msg, req, track=kind == Type.PUSH and bool(frames))
        timeline.span(f"send {kind.name}", t0, server=server, parts=len(batch))
        if waiter is not None:  # (zmq never lets go of the bytes for a lost server: nothing to wait for)
            sent = lambda t: server in self.lost_servers or waiter(t)  # noqa: E731
            for handle in {id(q.entry[0]): q.entry[0] for q in batch}.values():
                handle.sent = [*handle.sent, sent]
        return waiter

    def _transmit(self, peer: str, msg: Message, req: Request, track: bool = False) -> Optional[Sent]:
        """Send ``msg`` to ``peer`` (the scheduler, or a server's connection); ``req`` fails if it cannot go."""
        try:
            with self._lock:
                return (self.van if peer == "scheduler" else self.data).send(peer, msg, track=track)
        except (PeerUnreachable, ProtocolError) as exc:
            self.tracker.close(req, exc)
            return None

    def _pump(self, timeout: float) -> None:
        """Receive and handle answers for up to ``timeout`` s, unless another thread does (it handles ours too)."""
        if not self._receiving.acquire(timeout=timeout):
            return
        try:
            if self.data.closed:
                time.sleep(timeout)
                return
            interrupted: Optional[BaseException] = None
            with torch.no_grad():  # pulled values go into tensors that may require grad
                for peer, msg in self.data.recv(timeout):
                    if isinstance(msg, Exception):  # (the servers' connections are not watched: no PeerGone)
                        print(f"pskv worker {self.rank}: dropped a malformed message from {peer}: {msg}", file=sys.stderr)
                        continue
                    t0 = timeline.now()
                    try:
                        self.tracker.answer(msg)
                    except BaseException as exc:  # an interrupt (KeyboardInterrupt): the other answers taken are read first
                        interrupted = exc
                    timeline.span(f"answer from {peer}", t0, bytes=sum(len(f) for f in msg.frames[1:]))
            if interrupted is not None:
                raise interrupted
        finally:
            self._receiving.release()

    def _check_open(self) -> None:
        if self._stop:
            raise StoreClosedError("the store's connection to the job is closed")
        if self.tracker.fatal is not None:
            self.check()

    def handle(self, finish: Optional[Callable[[], None]] = None) -> Handle:
        """A handle for a call whose rows are about to be queued (waiting on it flushes them)."""
        return Handle(self.tracker, finish, self.flush)

    def check(self) -> None:
        """Raise the job's fatal error, or the error of an earlier push, if any."""
        self.tracker.raise_failure()

    def wait(self, handles: Sequence[Handle]) -> None:
        """Block until every call is done; raise the first error (or the job's)."""
        for h in handles:
            h.wait()

    def wait_sent(self, handle: Handle) -> None:
        """Block until the payload buffers of ``handle``'s pushes may be reused (zmq has the bytes); its
        rows that wait for a window are sent first. Rows whose bytes are in our shared memory (copied, not from a
        GPU) leave soon instead: a pull that follows may ride on them (:func:`_fold`)."""
        with self._sending, self._lock:  # (not while a flush, the I/O thread's, has taken its rows and not sent them)
            framed = any(q.frames or q.ready is not None for rows in self._pending.values() for q in rows if q.entry[0] is handle)
        if not framed and not handle.sent and not self._window:  # (a window may hold them back: a whole message would overtake them)
            return self.flush(soon=True)
        self.flush()
        until = time.monotonic() + self.tracker.timeout
        while True:
            for waiter in handle.sent:
                while not waiter(0.25) and time.monotonic() < until:
                    self.check()
            with self._sending, self._lock:  # (not between a flush taking rows and sending them)
                if not any(q.entry[0] is handle for rows in self._pending.values() for q in rows) and all(w(0) for w in handle.sent):
                    return
            if time.monotonic() > until:
                raise DeadlineExceeded("push: the bytes were not handed to the network within PSKV_TIMEOUT")
            time.sleep(FLUSH_IDLE)  # (the I/O thread sends them as the window opens)

    def barrier(self, group: str = "worker", value: Any = NOTHING) -> list[Any]:
        """Block until every node of ``group`` reaches it; every member's JSON ``value``, by rank ([]: none). A call cut
        short (an interrupt) as it waited is this worker's arrival still: its next one of ``group`` is that barrier."""
        got: list[dict[str, Any]] = []  # the answer's meta
        cut = self._cut.pop(group, None)  # (handle, got, request id, the one it replaced) of the call cut short
        meta = {"group": group, **({} if value is NOTHING else {"value": value}), **({"replaces": cut[2]} if cut else {})}
        handle = self.send(SCHEDULER, msg := Message(Type.BARRIER, meta=meta), f"barrier of the {group}s", lambda m: got.append(m.meta or {}))
        try:
            handle.wait()
        except BaseException:
            if handle.error is None:  # an interrupt, before its answer or after (its own error ends it: the next call is a new barrier)
                self._cut[group] = (handle, got, msg.req_id, cut)
            raise
        while got[0].get("earlier") and cut is not None:  # the one it replaced was answered first (released): that answer is this call's
            handle, got, _, cut = cut
            handle.wait()
        return list(got[0].get("values", []))

    def close(self, failed: Optional[str] = None) -> None:
        if self._thread is None or self._stop:
            return
        try:
            if self.tracker.fatal is None:
                self.flush()
                until = time.monotonic() + self.tracker.timeout
                # (a worker that failed says so at once: its place in the job ends, whatever its calls in flight wait for)
                while not failed and (len(self.tracker) or self._pending) and time.monotonic() < until and self.tracker.fatal is None:
                    self._pump(0.05)
                self._finishing = True  # (the scheduler may close our connection from now on: not a failure)
                done = self.send(SCHEDULER, Message(Type.FINALIZE, meta={"failed": failed} if failed else None), f"worker {self.rank} finishing")
                until = time.monotonic() + 10.0
                while not done._done and time.monotonic() < until:  # answered by the I/O thread
                    time.sleep(0.005)
        finally:
            self._stop = True
            self.van.wake()
            self._thread.join(timeout=15.0)
            with self._receiving:
                self.data.close(linger=2.0)
                self.shared.close()
                self.shared = shm.Shared()  # the arenas, ours and the servers' we mapped, go now (not with the store)
        if self.tracker.fatal is None:  # a push refused since the last call: this call is the next
            self.tracker.raise_failure()

    def _loop(self) -> None:
        """The I/O thread: the scheduler's connection, heartbeats, deadlines, rows queued without waiting."""
        try:
            while not self._stop:
                self._send_queued()
                first, now = self._first_queued, time.monotonic()
                # while calls come (rows queued in the last 50 ms), look often instead of being woken
                self._dozing = now - self._last_queued > 0.05 and self._held_until is None
                dues = [] if self._held_until is None else [self._held_until]  # (rows that wait for a window)
                if first is not None:
                    dues.append(min(first + FLUSH_DELAY, self._last_queued + FLUSH_IDLE))
                timeout = (0.25 if self._dozing else FLUSH_DELAY) if not dues else max(0.0, min(dues) - now)
                for peer, msg in self.van.recv(timeout):
                    if isinstance(msg, PeerGone):
                        if not (self._finishing and peer == "scheduler"):
                            self.tracker.fail_all(self.lost(peer))
                    elif not isinstance(msg, ProtocolError):
                        self.last_heard = time.monotonic()
                        self._control(msg)
                now = time.monotonic()
                self.tick(now)
                self.tracker.expire(now)
        except BaseException as exc:
            self.tracker.fail_all(exc if isinstance(exc, PSKVError) else ClusterError(f"the worker's I/O thread failed: {exc!r}"))
        finally:
            self._send_queued()
            self.van.close(linger=2.0)

    def _send_queued(self) -> None:
        first, held, now = self._first_queued, self._held_until, time.monotonic()
        if (first is not None and now >= min(first + FLUSH_DELAY, self._last_queued + FLUSH_IDLE)) or (held is not None and now >= held):
            self.flush()
        with self._lock:
            queued, self._queued = self._queued, []
        for peer, msg, req in queued:
            self._transmit(peer, msg, req)

    def _control(self, msg: Message) -> None:
        if msg.type == Type.NODE_FAILED:
            self.tracker.fail_all(failure(msg))
        elif msg.type == Type.SERVER_LOST:
            self._failover(int((msg.meta or {})["rank"]))
        elif msg.type == Type.SHUTDOWN:
            self.tracker.fail_all(NodeFailedError("the scheduler shut the job down"))
        elif msg.type in (Type.OK, Type.ERROR, Type.DATA):
            self.tracker.answer(msg)
            self.data.wake()  # a thread waiting for it polls the servers' connections
