"""Requests a worker has sent and not yet seen answered, each with a deadline.

The I/O thread opens a :class:`Request` when it queues a message and closes it when the answer
arrives (running the request's ``on_reply`` there, e.g. copying pulled bytes into place). User
threads :meth:`Tracker.wait` on requests. Nothing waits forever: a request past its deadline
is failed with a :class:`~pskv.errors.DeadlineExceeded` that says what was asked of whom.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Optional

from ..errors import DeadlineExceeded, PSKVError
from .message import Flag, Message, Type, unpack_index
from .node import raise_error_reply

OnReply = Callable[[Message], None]
_INDEX_COLS = 4  # answers to batched requests index their parts as (entry, fd, offset, bytes)


class Request:
    """One outstanding request. ``done`` is set when answered or failed."""

    __slots__ = ("deadline", "done", "error", "on_reply", "peer", "remaining", "req_id", "waited", "what")

    def __init__(self, req_id: int, what: str, peer: str, on_reply: Optional[OnReply], deadline: float, waited: bool, entries: int = 1):
        self.req_id = req_id
        self.remaining = entries  # a batched request is answered part by part
        self.what = what
        self.peer = peer
        self.on_reply = on_reply
        self.deadline = deadline
        self.waited = waited  # someone will wait() on it; otherwise errors are deferred
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


class Tracker:
    """Thread-safe table of open requests."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._lock = threading.Lock()
        self._open: dict[int, Request] = {}
        self._next = 1
        self.deferred: list[BaseException] = []  # errors of requests nobody waits for

    def open(self, what: str, peer: str, on_reply: Optional[OnReply] = None, waited: bool = True, entries: int = 1) -> Request:
        """A new request; a batched one (``entries`` parts) completes when every part is answered."""
        with self._lock:
            req = Request(self._next, what, peer, on_reply, time.monotonic() + self.timeout, waited, entries)
            self._next += 1
            self._open[req.req_id] = req
            return req

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def answer(self, msg: Message) -> None:
        """Handle an answer to an open request (I/O thread). Unknown ids are ignored.

        A batched answer (``Flag.BATCH``) covers some parts of its request; the request completes
        when all are answered. An ERROR fails the whole request.
        """
        with self._lock:
            req = self._open.get(msg.req_id)
            if req is None:
                return
            parts = len(unpack_index(msg.frames[0], _INDEX_COLS)) if msg.flags & Flag.BATCH and msg.type != Type.ERROR and msg.frames else req.remaining
            req.remaining -= parts
            if req.remaining <= 0 or msg.type == Type.ERROR:
                del self._open[msg.req_id]
                last = True
            else:
                last = False
        try:
            if msg.type == Type.ERROR:
                raise_error_reply(msg, f"{req.what}: ")
            if req.on_reply is not None:
                req.on_reply(msg)
        except BaseException as exc:
            with self._lock:
                self._open.pop(msg.req_id, None)
            self._finish(req, exc)
            return
        if last:
            self._finish(req, None)

    def _finish(self, req: Request, exc: Optional[BaseException]) -> None:
        req.error = exc
        if exc is not None and not req.waited:
            with self._lock:
                self.deferred.append(exc)
        req.done.set()

    def fail(self, req_id: int, exc: BaseException) -> None:
        """Fail one request (e.g. its message could not be sent)."""
        with self._lock:
            req = self._open.pop(req_id, None)
        if req is not None:
            self._finish(req, exc)

    def fail_all(self, exc: BaseException, peer: Optional[str] = None) -> None:
        """Fail every open request (to ``peer`` only, if given)."""
        with self._lock:
            victims = [r for r in self._open.values() if peer is None or r.peer == peer]
            for r in victims:
                del self._open[r.req_id]
        for r in victims:
            self._finish(r, exc)

    def expire(self, now: float) -> None:
        """Fail requests past their deadline (I/O thread, periodically)."""
        with self._lock:
            late = [r for r in self._open.values() if r.deadline < now]
            for r in late:
                del self._open[r.req_id]
        for r in late:
            self._finish(
                r,
                DeadlineExceeded(f"{r.what}: {r.peer} did not answer within {self.timeout:g} s (PSKV_TIMEOUT plus a margin)"),
            )

    def wait(self, reqs: Iterable[Request]) -> None:
        """Block until every request is answered; raise the first error among them."""
        first: Optional[BaseException] = None
        for r in reqs:
            while not r.done.wait(0.25):
                # a push that failed on a server may be why this answer is not coming: say so now
                late = self.take_deferred()
                if late is not None:
                    raise late
                if time.monotonic() > r.deadline + 5.0:  # the I/O thread is gone; do not hang
                    raise DeadlineExceeded(f"{r.what}: no answer from {r.peer} and the I/O thread stopped expiring requests")
            if r.error is not None and first is None:
                first = r.error
        if first is not None:
            if isinstance(first, PSKVError):
                raise type(first)(str(first)) from first
            raise first

    def take_deferred(self) -> Optional[BaseException]:
        with self._lock:
            if not self.deferred:
                return None
            exc = self.deferred.pop(0)
            return exc
