"""The worker's side of the parameter-server system: requests to servers and the scheduler.

:class:`WorkerClient` joins the job, connects to every server, and runs one I/O thread that owns
all sockets: it sends queued requests in priority order (higher first), receives answers and
runs their ``on_reply`` (pulled bytes are copied into place there), sends heartbeats, and fails
requests past their deadline. User threads only queue requests and wait on them.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Optional

from .. import config
from ..errors import ClusterError, NodeFailedError, ProtocolError, PSKVError, StoreClosedError
from .message import Message, Type
from .node import JobEnv, Node
from .tracker import OnReply, Request, Tracker
from .van import PeerUnreachable, Van


class WorkerClient(Node):
    """A worker's connection to the job. :meth:`submit` and :meth:`wait` are thread-safe."""

    def __init__(self, env: JobEnv, van: Optional[Van] = None):
        super().__init__(env, van)
        self.tracker = Tracker(config.timeout() + max(5.0, 0.1 * config.timeout()))
        self._queue: list[tuple[int, int, str, Message]] = []
        self._queue_lock = threading.Lock()
        self._seq = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self.fatal: Optional[BaseException] = None
        self._barriers = itertools.count()

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def num_servers(self) -> int:
        return len(self.servers)

    def start(self) -> None:
        """Join the job (blocks until every node registered) and start the I/O thread."""
        self.join(None)
        if not self.servers:
            self.van.close(linger=0)
            raise ClusterError(
                "this job has no servers (DMLC_NUM_SERVER=0); start it with `pskv launch -s 1` or more, "
                "or use a local store"
            )
        nonce = uuid.uuid4().hex[:12]
        for s in self.servers:
            # answers come back on the I/O thread's connection; requests leave from the caller's
            base = f"worker:{self.rank}/{nonce}"
            self.van.connect(f"server {s['rank']}", s["endpoint"], identity=f"{base}/rx")
            self.van.connect(f"server {s['rank']}/tx", s["endpoint"], identity=f"{base}/tx", receive=False)
        self._thread = threading.Thread(target=self._loop, name=f"pskv-worker-{self.rank}-io", daemon=True)
        self._thread.start()
        hellos = [self.submit(f"server {s['rank']}", Message(Type.HELLO), "hello") for s in self.servers]
        self.wait(hellos)  # now every server can route answers to this worker

    def send_now(
        self,
        server: int,
        msg: Message,
        what: str,
        on_reply: Optional[OnReply] = None,
        waited: bool = True,
        entries: int = 1,
        sent: Optional[list[Callable[[float], bool]]] = None,
    ) -> Request:
        """Send a request to ``server`` from the calling thread (no queue, no wake-up).

        For the data path: one calling thread at a time (the store's lock). The answer arrives
        on the I/O thread, which runs ``on_reply``. With ``sent``, a ``wait(timeout)`` is appended
        to it that tells when the payload buffers may be reused.
        """
        if self._stop:
            raise StoreClosedError("the store's connection to the job is closed")
        if self.fatal is not None:
            self.check()
        req = self.tracker.open(what, f"server {server}", on_reply, waited, entries)
        msg.req_id = req.req_id
        try:
            waiter = self.van.send(f"server {server}/tx", msg, track=sent is not None)
            if sent is not None and waiter is not None:
                sent.append(waiter)
        except PeerUnreachable as exc:
            self.tracker.fail(req.req_id, exc)
        return req

    # -- user side ----------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise the job's fatal error, or the error of an earlier push, if any."""
        if self.fatal is not None:
            raise type(self.fatal)(str(self.fatal)) if isinstance(self.fatal, PSKVError) else self.fatal
        exc = self.tracker.take_deferred()
        if exc is not None:
            raise exc

    def submit(
        self,
        peer: str,
        msg: Message,
        what: str,
        on_reply: Optional[OnReply] = None,
        priority: int = 0,
        waited: bool = True,
        wake: bool = True,
        entries: int = 1,
    ) -> Request:
        """Queue ``msg`` for ``peer`` ("server 0", "scheduler"); returns its request to wait on."""
        if self._stop:
            raise StoreClosedError("the store's connection to the job is closed")
        if self.fatal is not None:
            self.check()
        req = self.tracker.open(what, peer, on_reply, waited, entries)
        msg.req_id = req.req_id
        with self._queue_lock:
            heapq.heappush(self._queue, (-priority, next(self._seq), peer, msg))
        if wake:
            self.van.wake()
        return req

    def flush(self) -> None:
        """Wake the I/O thread to send what :meth:`submit` queued with ``wake=False``.

        Only when something is queued: a needless wake-up costs a context switch, which on a
        machine with fewer cores than processes lands in the middle of the caller's copies.
        """
        with self._queue_lock:
            pending = bool(self._queue)
        if pending:
            self.van.wake()

    def wait(self, reqs: list[Request]) -> None:
        self.tracker.wait(reqs)
        self.check()

    def barrier(self, group: str = "worker") -> None:
        """Block until every node of ``group`` reaches a barrier."""
        req = self.submit("scheduler", Message(Type.BARRIER, a=next(self._barriers), meta={"group": group}), f"barrier of the {group}s")
        self.wait([req])

    def allgather(self, value: Any) -> list[Any]:
        """A worker barrier that carries ``value`` (JSON): every worker's value, by rank."""
        got: list[Any] = []
        meta = {"group": "worker", "value": value}
        req = self.submit(
            "scheduler",
            Message(Type.BARRIER, a=next(self._barriers), meta=meta),
            "allgather of the workers",
            on_reply=lambda msg: got.extend((msg.meta or {}).get("values", [])),
        )
        self.wait([req])
        return got

    def close(self) -> None:
        """Wait for outstanding requests, tell the scheduler this worker is done, stop the I/O thread."""
        if self._thread is None or self._stop:
            return
        try:
            if self.fatal is None:
                deadline = time.monotonic() + self.tracker.timeout
                while len(self.tracker) and time.monotonic() < deadline and self.fatal is None:
                    time.sleep(0.002)
                done = self.submit("scheduler", Message(Type.FINALIZE), f"worker {self.rank} finishing")
                done.done.wait(10.0)
        finally:
            self._stop = True
            self.van.wake()
            self._thread.join(timeout=15.0)

    # -- I/O thread -----------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._send_queued()
                for peer, msg in self.van.recv(0.05 if self._queue else 0.25):
                    if isinstance(msg, ProtocolError):
                        print(f"pskv worker {self.rank}: dropped a malformed message from {peer}: {msg}", file=sys.stderr)
                    elif peer == "scheduler":
                        self.heard_from_scheduler()
                        self._control(msg)
                    else:
                        self.tracker.answer(msg)
                now = time.monotonic()
                self.tick(now)
                self.tracker.expire(now)
        except BaseException as exc:
            self._die(exc if isinstance(exc, PSKVError) else ClusterError(f"the worker's I/O thread failed: {exc!r}"))
        finally:
            self._send_queued()
            self.van.close(linger=2.0)

    def _send_queued(self) -> None:
        while True:
            with self._queue_lock:
                if not self._queue:
                    return
                _, _, peer, msg = heapq.heappop(self._queue)
            try:
                self.van.send(peer, msg)
            except PeerUnreachable as exc:
                self.tracker.fail(msg.req_id, exc)

    def _control(self, msg: Message) -> None:
        if msg.type == Type.NODE_FAILED:
            self._die(NodeFailedError(self.failure_text(msg)))
        elif msg.type == Type.SHUTDOWN:
            self._die(NodeFailedError("the scheduler shut the job down"))
        elif msg.type in (Type.OK, Type.ERROR, Type.DATA):
            self.tracker.answer(msg)

    def _die(self, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
        self.tracker.fail_all(exc)
