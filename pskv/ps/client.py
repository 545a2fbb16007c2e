"""The worker's side of the parameter-server system: one call to send a request, one I/O thread.

:class:`WorkerClient` joins the job and connects to every server twice: the calling thread sends
requests on one connection per server (no queue, no wake-up), while the I/O thread owns the
other, on which the answers come back. At start each connection says HELLO with the worker's
rank, the answer connection first, so the server knows where to send answers. The I/O thread
matches answers to open requests (:mod:`pskv.ps.tracker`) and runs their ``on_reply`` (pulled
bytes are copied into place there), heartbeats the scheduler, sends the requests queued for the
connections it owns (to the scheduler; the first HELLOs), and fails requests past their deadline.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Optional

from .. import config
from ..errors import (
    ClusterError,
    DeadlineExceeded,
    NodeFailedError,
    ProtocolError,
    PSKVError,
    StoreClosedError,
)
from .message import PULL, PUSH, Message, Type
from .node import JobEnv, Node, failure
from .tracker import OnReply, Request, Tracker
from .van import PeerUnreachable, Van

SCHEDULER = -1  # ``send``'s destination for the scheduler; servers are 0 .. S-1
NOTHING: Any = object()  # a barrier that carries no value


class WorkerClient(Node):
    """A worker's connection to the job. :meth:`send` (one thread at a time per server, the
    store's lock) and :meth:`wait` may be called from any thread."""

    def __init__(self, env: JobEnv, van: Optional[Van] = None):
        super().__init__(env, van)
        self.tracker = Tracker(config.timeout() + max(5.0, 0.1 * config.timeout()))
        self._queued: list[tuple[str, Message, Request]] = []  # for the connections the I/O thread owns
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self.fatal: Optional[BaseException] = None

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def num_servers(self) -> int:
        return len(self.servers)

    def start(self) -> None:
        """Join the job (blocks until every node registered), start the I/O thread, say HELLO."""
        self.join(None)
        if not self.servers:
            self.van.close(linger=0)
            raise ClusterError(
                "this job has no servers (DMLC_NUM_SERVER=0); start it with `pskv launch -s 1` or more, "
                "or use a local store"
            )
        for s in range(self.num_servers):
            self.van.connect(f"server {s}", self.servers[s]["endpoint"])
            self.van.connect(f"server {s}/tx", self.servers[s]["endpoint"], receive=False)
        self._thread = threading.Thread(target=self._loop, name=f"pskv-worker-{self.rank}-io", daemon=True)
        self._thread.start()
        for answers in (True, False):  # the answer connection first: answers to the other go there
            self.wait([self.send(s, Message(Type.HELLO, meta={"rank": self.rank, "answers": answers}), "hello") for s in range(self.num_servers)])

    def send(self, to: int, msg: Message, what: str, on_reply: Optional[OnReply] = None) -> Request:
        """Send ``msg`` to server ``to`` (or :data:`SCHEDULER`); returns its request to wait on.

        ``what`` names the request in errors. ``on_reply(answer)`` runs on the I/O thread for
        each answer (a batched request gets one per group of parts answered). A request with
        payload frames gets ``sent``: a wait for the moment its buffers may be reused.
        """
        if self._stop:
            raise StoreClosedError("the store's connection to the job is closed")
        if self.fatal is not None:
            self.check()
        peer = "scheduler" if to == SCHEDULER else f"server {to}"
        entries = 1
        if msg.type == Type.INIT:
            entries = len((msg.meta or {})["parts"])
        elif msg.type in (Type.PUSH, Type.PULL):
            entries = (PUSH if msg.type == Type.PUSH else PULL).count(msg.frames[0])
        req = self.tracker.open(msg.type, what, peer, on_reply, entries)
        msg.req_id = req.req_id
        if to == SCHEDULER or (msg.type == Type.HELLO and (msg.meta or {}).get("answers")):
            with self._lock:  # the I/O thread owns these connections: it sends what is queued
                self._queued.append((peer, msg, req))
            self.van.wake()
            return req
        try:
            with self._lock:  # a push returns before its answer: it learns when its bytes are sent
                req.sent = self.van.send(f"{peer}/tx", msg, track=msg.type == Type.PUSH)
        except PeerUnreachable as exc:
            self.tracker.fail(req, exc)
        return req

    # -- user side ----------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise the job's fatal error, or the error of an earlier push, if any."""
        if self.fatal is not None:
            raise type(self.fatal)(str(self.fatal)) if isinstance(self.fatal, PSKVError) else self.fatal
        self.tracker.raise_failed_push()

    def wait(self, reqs: list[Request]) -> None:
        """Block until every request is answered; raise the first error (or the job's)."""
        self.tracker.wait(reqs)
        self.check()

    def wait_sent(self, reqs: list[Request]) -> None:
        """Block until the payload buffers of these pushes may be reused (zmq has the bytes)."""
        until = time.monotonic() + self.tracker.timeout
        for req in reqs:
            while req.sent is not None and not req.sent(0.25):
                self.check()
                if time.monotonic() > until:
                    raise DeadlineExceeded("push: the bytes were not handed to the network within PSKV_TIMEOUT")

    def barrier(self, group: str = "worker", value: Any = NOTHING) -> list[Any]:
        """Block until every node of ``group`` reaches a barrier. A barrier may carry a small
        JSON ``value``; it returns every member's value, by rank ([] when none carried one)."""
        got: list[Any] = []
        meta = {"group": group} if value is NOTHING else {"group": group, "value": value}
        req = self.send(SCHEDULER, Message(Type.BARRIER, meta=meta), f"barrier of the {group}s", lambda m: got.extend((m.meta or {}).get("values", [])))
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
                self.send(SCHEDULER, Message(Type.FINALIZE), f"worker {self.rank} finishing").done.wait(10.0)
        finally:
            self._stop = True
            self.van.wake()
            self._thread.join(timeout=15.0)

    # -- I/O thread -----------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._send_queued()
                for peer, msg in self.van.recv(0.25):
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
        with self._lock:
            queued, self._queued = self._queued, []
        for peer, msg, req in queued:
            try:
                self.van.send(peer, msg)
            except PeerUnreachable as exc:
                self.tracker.fail(req, exc)

    def _control(self, msg: Message) -> None:
        if msg.type == Type.NODE_FAILED:
            self._die(failure(msg))
        elif msg.type == Type.SHUTDOWN:
            self._die(NodeFailedError("the scheduler shut the job down"))
        elif msg.type in (Type.OK, Type.ERROR, Type.DATA):
            self.tracker.answer(msg)

    def _die(self, exc: BaseException) -> None:
        if self.fatal is None:
            self.fatal = exc
        self.tracker.fail_all(exc)
