"""What a worker is waiting for: requests sent and not yet answered, and the store calls
(:class:`Handle`) they serve, each with a deadline.

A data request (PUSH or PULL to one server) carries the rows of many store calls; its answers
list the rows answered so far, and each row completes its part of the call that queued it
(pulled bytes are copied into place there, on the I/O thread). Other requests (INIT, barriers,
optimizer) complete as a whole and run their ``on_reply``. Nothing waits forever: a request
past its deadline fails with a :class:`~pskv.errors.DeadlineExceeded` that says what was asked
of whom. A push that fails makes the next call on the store fail (nobody need wait on pushes),
and any wait in progress too, since the round it waits for may never come.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

from ..errors import DeadlineExceeded, PSKVError, deadline, from_reply
from .message import ANSWER, Message, Type, frame_tensor

OnReply = Callable[[Message], None]
Sink = Union[Any, Callable[[Any], None]]  # a tensor to copy a pulled part into, or a function of it


class Handle:
    """A store call in flight (``push``/``pull``/``pushpull`` with ``wait=False``).

    :meth:`wait` blocks until every part of the call is done, then raises its error if it
    failed; :meth:`done` says whether it is done. Thread-safe.

    >>> h = kv.pull(key, out, wait=False)
    >>> ...                 # compute while the parts arrive
    >>> h.wait()            # out holds the value
    """

    def __init__(self, tracker: Optional[Tracker] = None, finish: Optional[Callable[[], None]] = None, flush: Optional[Callable[[], Any]] = None):
        self._tracker = tracker
        self._flush = flush  # sends what is still queued, so that waiting for it makes sense
        self._left = 0
        self._done = tracker is None  # no event to block on: a waiting thread receives the answers itself
        self.error: Optional[BaseException] = None
        self._finish = finish  # runs once, in the caller's thread, when the wait succeeds

    def done(self) -> bool:
        """True once every part is done (or the call failed); handles the answers that arrived."""
        if not self._done and self._tracker is not None:
            self._tracker._pump(0.0)
        return self._done

    def wait(self) -> None:
        """Block until done; raise the call's error. Deadlines as for every call (``PSKV_TIMEOUT``)."""
        if self._tracker is not None:
            if self._flush is not None and not self.done():
                self._flush()
            self._tracker.wait([self])
        if self.error is not None:
            raise type(self.error)(str(self.error)) if isinstance(self.error, PSKVError) else self.error
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def _add(self) -> None:
        self._left += 1  # under the tracker's lock, before the part can be answered

    def _settle(self, error: Optional[BaseException] = None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self._left -= 1
        if self._left <= 0 or error is not None:
            self._done = True


Entry = tuple[Handle, Optional[Sink], Any]  # the call a row serves, where its answer goes, and its dtype


class Request:
    """One outstanding request: a data request's rows (``entries``) or a whole message."""

    __slots__ = ("deadline", "done", "entries", "error", "kind", "on_reply", "peer", "remaining", "req_id", "shared", "what")

    def __init__(self, req_id: int, kind: Type, what: str, peer: str, deadline: float, on_reply: Optional[OnReply], entries: list[Entry]):
        self.req_id = req_id
        self.kind = kind
        self.what = what
        self.peer = peer
        self.deadline = deadline
        self.on_reply = on_reply
        self.entries: list[Optional[Entry]] = list(entries)  # None once answered
        self.remaining = len(entries) or 1
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.shared: Optional[Callable[[Any, Any, Any], Any]] = None  # (ANSWER row, dtype, shape) -> the part in the server's shared memory

    @property
    def handles(self) -> list[Handle]:
        return [e[0] for e in self.entries if e is not None]


class Tracker:
    """Thread-safe table of open requests."""

    def __init__(self, timeout: float, alive: Callable[[], Optional[BaseException]], pump: Callable[[float], None]):
        self.timeout = timeout
        self._alive = alive  # the job's fatal error, if any: every wait raises it
        self._pump = pump  # receives and handles answers for up to the given time (the waiting thread does)
        self._lock = threading.Lock()
        self._open: dict[int, Request] = {}
        self._next = 1
        self._failed_pushes: list[BaseException] = []

    def open(self, kind: Type, what: str, peer: str, on_reply: Optional[OnReply] = None, entries: Iterable[Entry] = ()) -> Request:
        """A new request; one with ``entries`` completes when every row is answered."""
        with self._lock:
            req = Request(self._next, kind, what, peer, time.monotonic() + self.timeout, on_reply, list(entries))
            for handle, _, _ in req.entries:  # type: ignore[misc]
                handle._add()
            self._next += 1
            self._open[req.req_id] = req
            return req

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def answer(self, msg: Message) -> None:
        """Handle an answer (I/O thread); unknown request ids are ignored.

        An ERROR fails the whole request; an answer to a data request completes the rows its
        ANSWER table lists, copying pulled parts into their sinks.
        """
        with self._lock:
            req = self._open.get(msg.req_id)
        if req is None:
            return
        try:
            if msg.type == Type.ERROR:
                raise from_reply(msg.meta, f"{req.what}: ")
            if not req.entries:
                if req.on_reply is not None:
                    req.on_reply(msg)
                self._close(req, None)
                return
            frames = iter(msg.frames[1:])
            for row in ANSWER.unpack(msg.frames[0]):
                entry = req.entries[row.entry]
                if entry is None:
                    continue
                handle, sink, dtype = entry
                if callable(sink):
                    sink(frame_tensor(next(frames), dtype))
                elif sink is not None:  # a tensor: the part's bytes, viewed in its shape, are copied into it
                    shared = row.fd >= 0 and req.shared is not None
                    sink.copy_(req.shared(row, dtype, sink.shape) if shared else frame_tensor(next(frames), dtype).view(sink.shape))  # type: ignore[misc]
                req.entries[row.entry] = None
                req.remaining -= 1
                handle._settle()
            if req.remaining <= 0:
                self._close(req, None)
        except BaseException as exc:
            self._close(req, exc)

    def _close(self, req: Request, exc: Optional[BaseException]) -> None:
        with self._lock:
            if self._open.pop(req.req_id, None) is None:
                return
        req.error = exc
        if exc is not None:
            if req.kind == Type.PUSH:
                with self._lock:
                    self._failed_pushes.append(exc)
            for handle in req.handles:
                handle._settle(exc)
        req.done.set()

    def fail(self, req: Request, exc: BaseException) -> None:
        """Fail one request (e.g. its message could not be sent)."""
        self._close(req, exc)

    def fail_all(self, exc: BaseException) -> None:
        """Fail every open request."""
        with self._lock:
            victims = list(self._open.values())
        for r in victims:
            self._close(r, exc)

    def expire(self, now: float) -> None:
        """Fail requests past their deadline (I/O thread, periodically)."""
        with self._lock:
            late = [r for r in self._open.values() if r.deadline < now]
        for r in late:
            self._close(r, deadline(r.what, self.timeout, "PSKV_TIMEOUT plus a margin", self.timeout, f"an answer from {r.peer}"))

    def wait(self, waits: Iterable[Union[Request, Handle]]) -> None:
        """Block until every request or handle is done; raise the first request's error, else the
        job's fatal error or a failed push's, if any."""
        first: Optional[BaseException] = None
        until = time.monotonic() + self.timeout + 5.0
        for r in waits:
            done = r.done.is_set if isinstance(r, Request) else lambda r=r: r._done
            while not done():
                self._pump(0.05)
                if done():
                    break
                self.raise_failure()  # it may be why this answer is not coming
                if time.monotonic() > until:  # the I/O thread is gone; do not hang
                    raise DeadlineExceeded("no answer within PSKV_TIMEOUT plus a margin, and the I/O thread stopped expiring requests")
            if isinstance(r, Request) and r.error is not None and first is None:
                first = r.error
        if first is not None:
            if isinstance(first, PSKVError):
                raise type(first)(str(first)) from first
            raise first
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raise the job's fatal error, or the error of a push that failed since the last call, if any."""
        fatal = self._alive()
        if fatal is not None:
            raise type(fatal)(str(fatal)) if isinstance(fatal, PSKVError) else fatal
        with self._lock:
            exc = self._failed_pushes.pop(0) if self._failed_pushes else None
        if exc is not None:
            raise exc
