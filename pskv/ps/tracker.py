"""Requests a worker has sent and not yet seen answered, each with a deadline.

The client opens a :class:`Request` when it sends a message; the I/O thread closes it when the
answer arrives, running the request's ``on_reply`` there (e.g. copying pulled bytes into place).
A batched request (INIT, PUSH, PULL: one row per part) is answered part by part and completes
when every part is. User threads :meth:`Tracker.wait` on requests. Nothing waits forever: a
request past its deadline fails with a :class:`~pskv.errors.DeadlineExceeded` that says what
was asked of whom. A push that fails makes the next call on the store fail (nobody waits on
pushes), and any wait in progress too, since the round it waits for may never come.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Optional

from ..errors import DeadlineExceeded, PSKVError, deadline, from_reply
from .message import ANSWER, Message, Type

OnReply = Callable[[Message], None]
BATCHED = (Type.INIT, Type.PUSH, Type.PULL)  # answered part by part, with ANSWER rows


class Request:
    """One outstanding request. ``done`` is set when answered or failed."""

    __slots__ = ("deadline", "done", "error", "kind", "on_reply", "peer", "remaining", "req_id", "sent", "what")

    def __init__(self, req_id: int, kind: Type, what: str, peer: str, on_reply: Optional[OnReply], deadline: float, entries: int):
        self.req_id = req_id
        self.kind = kind
        self.what = what
        self.peer = peer
        self.on_reply = on_reply
        self.deadline = deadline
        self.remaining = entries
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.sent: Optional[Callable[[float], bool]] = None  # true once the payload buffers may be reused


class Tracker:
    """Thread-safe table of open requests."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._lock = threading.Lock()
        self._open: dict[int, Request] = {}
        self._next = 1
        self._failed_pushes: list[BaseException] = []

    def open(self, kind: Type, what: str, peer: str, on_reply: Optional[OnReply] = None, entries: int = 1) -> Request:
        """A new request; a batched one (``entries`` parts) completes when every part is answered."""
        with self._lock:
            req = Request(self._next, kind, what, peer, on_reply, time.monotonic() + self.timeout, entries)
            self._next += 1
            self._open[req.req_id] = req
            return req

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def answer(self, msg: Message) -> None:
        """Handle an answer to an open request (I/O thread); unknown ids are ignored.

        An ERROR fails the whole request; an answer to a batched request covers the parts its
        ANSWER rows list.
        """
        with self._lock:
            req = self._open.get(msg.req_id)
            if req is None:
                return
            if msg.type != Type.ERROR and req.kind in BATCHED and msg.frames:
                req.remaining -= ANSWER.count(msg.frames[0])
            else:
                req.remaining = 0
            if req.remaining <= 0:
                del self._open[msg.req_id]
        try:
            if msg.type == Type.ERROR:
                raise from_reply(msg.meta, f"{req.what}: ")
            if req.on_reply is not None:
                req.on_reply(msg)
        except BaseException as exc:
            with self._lock:
                self._open.pop(msg.req_id, None)
            self._finish(req, exc)
            return
        if req.remaining <= 0:
            self._finish(req, None)

    def _finish(self, req: Request, exc: Optional[BaseException]) -> None:
        req.error = exc
        if exc is not None and req.kind == Type.PUSH:
            with self._lock:
                self._failed_pushes.append(exc)
        req.done.set()

    def fail(self, req: Request, exc: BaseException) -> None:
        """Fail one request (e.g. its message could not be sent)."""
        with self._lock:
            self._open.pop(req.req_id, None)
        self._finish(req, exc)

    def fail_all(self, exc: BaseException) -> None:
        """Fail every open request."""
        with self._lock:
            victims = list(self._open.values())
            self._open.clear()
        for r in victims:
            self._finish(r, exc)

    def expire(self, now: float) -> None:
        """Fail requests past their deadline (I/O thread, periodically)."""
        with self._lock:
            late = [r for r in self._open.values() if r.deadline < now]
            for r in late:
                del self._open[r.req_id]
        for r in late:
            self._finish(r, deadline(r.what, self.timeout, "PSKV_TIMEOUT plus a margin", self.timeout, f"an answer from {r.peer}"))

    def wait(self, reqs: Iterable[Request]) -> None:
        """Block until every request is answered; raise the first error among them."""
        first: Optional[BaseException] = None
        for r in reqs:
            while not r.done.wait(0.25):
                self.raise_failed_push()  # it may be why this answer is not coming
                if time.monotonic() > r.deadline + 5.0:  # the I/O thread is gone; do not hang
                    raise DeadlineExceeded(f"{r.what}: no answer from {r.peer} and the I/O thread stopped expiring requests")
            if r.error is not None and first is None:
                first = r.error
        if first is not None:
            if isinstance(first, PSKVError):
                raise type(first)(str(first)) from first
            raise first

    def raise_failed_push(self) -> None:
        """Raise the error of a push that failed since the last call, if any."""
        with self._lock:
            exc = self._failed_pushes.pop(0) if self._failed_pushes else None
        if exc is not None:
            raise exc
